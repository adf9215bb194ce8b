"""Supervised fine-tuning (algo.name=sft): the rows' own responses trained with the response-token
NLL, through the same trainer, checkpoints and resume as RL; its checkpoint starts an RL run.

On tiny_cpu's digit task a row's response is its answer (the digits sorted) and <eos>."""

import json
import subprocess
import sys

import pytest
import torch

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.types import Trajectory

from batches import advantaged

SFT = ["algo.name=sft", "algo.group_size=1", "algo.groups_per_batch=16", "learner.mini_batches=1", "algo.entropy_coef=0",
       "scheduler.max_staleness=0", "trainer.progress=false", "learner.lr_warmup_steps=0",
       "learner.lr_decay_style=constant"]


def _run(run_dir, *overrides):
    cmd = [sys.executable, "-m", "megatron_rl.main", f"trainer.run_dir={run_dir}", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], result.stderr


def test_sft_loss_is_the_response_token_nll(megatron_world):
    """The step's loss is the mean negative log-likelihood of the response tokens under the
    weights before the update, computed here in float64 from the model's logits."""
    from megatron_rl.learner.learner import Learner, forward_logits
    from megatron_rl.learner.train_batch import TrainBatch

    cfg = load_config("tiny_cpu", SFT)
    learner = Learner(cfg, 16)
    trajs = [Trajectory("p", i, [1, 4 + i, 5], [6 + i % 3, 7, 2][: 1 + i % 3], [0.0] * (1 + i % 3),
                        [0] * (1 + i % 3), "stop") for i in range(6)]
    nll, count = 0.0, 0
    with torch.no_grad():
        for t in trajs:
            tokens = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(forward_logits(learner.module, tokens)[0].double(), dim=-1)
            p = len(t.prompt_ids)
            for k, token in enumerate(t.response_ids):
                nll -= logp[p - 1 + k, token].item()
                count += 1
    batch = TrainBatch.of(trajs, advantages=[[1.0] * len(t.response_ids) for t in trajs])
    metrics = learner.train_step(batch, 1.0, lr=1e-3)
    assert metrics["train/loss"] == pytest.approx(nll / count, rel=1e-5)
    assert "train/behav_logprob_gap" not in metrics  # SFT samples carry no engine logprobs
    after = learner.train_step(batch, 1.0, lr=1e-3)
    assert after["train/loss"] < metrics["train/loss"]


def test_sft_resumes_exactly(tmp_path):
    reference, _ = _run(tmp_path / "ref", *SFT, "trainer.total_steps=6", "trainer.checkpoint_interval=3")
    _run(tmp_path / "run", *SFT, "trainer.total_steps=3", "trainer.checkpoint_interval=3")
    resumed, log = _run(tmp_path / "run", *SFT, "trainer.total_steps=6", "trainer.checkpoint_interval=3")
    assert "resumed from" in log
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(reference, resumed):
        for key in ("train/loss", "train/grad_norm", "train/entropy", "response/length_mean"):
            assert a[key] == b[key], (a["step"], key)


def test_an_sft_checkpoint_starts_rl_through_model_path(tmp_path):
    """40 SFT steps on sorted digits, then RL from its checkpoint: the first RL batch already
    earns far more reward than RL's first batch from scratch (same seed, same prompts)."""
    rows, _ = _run(tmp_path / "sft", *SFT, "trainer.total_steps=40", "learner.lr=3e-3")
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), losses
    rl = ["trainer.total_steps=1", "scheduler.max_staleness=0", "trainer.progress=false",
          "trainer.save_final_checkpoint=false"]
    scratch, _ = _run(tmp_path / "scratch", *rl)
    tuned, _ = _run(tmp_path / "rl", *rl, f"model.path={tmp_path / 'sft' / 'checkpoints' / 'step_40'}")
    print(f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}; RL step-1 reward from scratch "
          f"{scratch[0]['reward/mean']:.3f}, from the SFT checkpoint {tuned[0]['reward/mean']:.3f}")
    assert tuned[0]["reward/mean"] > scratch[0]["reward/mean"] + 0.2


def test_sft_config_is_checked():
    with pytest.raises(ConfigError, match="algo.name=sft trains on each row's own response once: set algo.group_size=1"):
        load_config("tiny_cpu", ["algo.name=sft"])
    with pytest.raises(ConfigError, match="correction.\\* weighs sampled tokens"):
        load_config("tiny_cpu", [*SFT, "correction.reject=token"])
