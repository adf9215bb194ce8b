"""Teachers for on-policy distillation tests: tiny_cpu-shaped models trained in a few learner
steps to prefer one kind of answer, exported as Hugging Face directories."""

from pathlib import Path

import torch

from megatron_rl.checks import load_config
from megatron_rl.data.build import build_tokenizer
from megatron_rl.models.convert import export_hf_checkpoint
from megatron_rl.models.pretrained import vocab_size_for
from megatron_rl.types import Trajectory

from batches import advantaged


def digit_teacher(path: Path, stops: bool, steps: int = 12) -> Path:
    """An HF directory at ``path`` of tiny_cpu's shape whose model answers any digit prompt with
    <eos> at once (``stops``) or, the other way round, with digits and never <eos> first."""
    from megatron_rl.learner.learner import Learner

    cfg = load_config("tiny_cpu", ["trainer.progress=false"])
    tokenizer = build_tokenizer(cfg)
    vocab = vocab_size_for(cfg.model, tokenizer.vocab_size)
    learner = Learner(cfg, vocab, pad_id=tokenizer.pad_id)
    gen = torch.Generator().manual_seed(0)
    trajs, advantages = [], []
    for i in range(16):
        prompt = tokenizer.prompt_ids("".join(str(d) for d in torch.randint(0, 10, (4,), generator=gen).tolist()) + "=")
        stop = i % 2 == 0
        response = [tokenizer.eos_id] if stop else tokenizer.encode(str(1000 + i))[:3]
        trajs.append(Trajectory("t", i, prompt, response, [-2.0] * len(response), [0] * len(response), "stop"))
        advantages.append(1.0 if stop == stops else -1.0)
    for _ in range(steps):
        learner.train_step(advantaged(trajs, advantages), 1.0, lr=1e-2)
    first = learner.compute_logprobs([trajs[0]], 1.0)[0][0]  # log p(<eos> first)
    assert (first > -0.1) if stops else (first < -3.0), first
    path.mkdir(parents=True, exist_ok=True)
    export_hf_checkpoint(learner.export_hf_weights(), cfg.model, vocab, path)
    return path
