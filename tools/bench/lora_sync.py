"""LoRA weight sync to the embedded engine: adapter-only (applied unmerged) against merged weights.

    python tools/bench/lora_sync.py                                   # tiny_cpu in bf16, on this CPU
    python tools/bench/lora_sync.py model.hidden_size=512 model.ffn_hidden_size=1536 model.num_layers=4 \
        model.num_attention_heads=8 model.num_query_groups=2 model.max_position_embeddings=64 \
        --vocab 2048 --rows 32 --new-tokens 32                      # docs/lora.md's CPU figures
    python tools/bench/lora_sync.py --recipe gsm8k_qwen2_gpu --vocab 151936 --rank 16 --prompt-len 256

One random-weight model of the recipe's shape (extra arguments are config overrides) with LoRA
adapters on every projection: A at its init, B drawn with std --b-std (B starts at zero in
training; a trained B is of this order). Two embedded engines serve it: one carries the adapters
(``lora.sync=adapters``: the first push sends the frozen base and the adapters, later pushes the
adapters alone), the other takes the merged weights (W + (alpha / rank)·B·A in fp32, rounded to
model.dtype). Printed: bytes and seconds of each kind of push (the median of --pushes), then each
engine's logprob gap to the learner, which recomputes the logprobs of the engine's own sampled
responses (--rows prompts of --prompt-len random ids, --new-tokens each at T = 1): mean and max
|difference| per token. In bf16 the unmerged engine runs the learner's own arithmetic; the merged
one rounds W + s·B·A to bf16 first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _gap(learner, trajs) -> Tuple[float, float]:
    ours = learner.compute_logprobs(trajs, 1.0)
    gaps = [abs(e - o) for t, row in zip(trajs, ours) for e, o in zip(t.logprobs, row)]
    return sum(gaps) / len(gaps), max(gaps)


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny_cpu")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--b-std", type=float, default=0.01)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--pushes", type=int, default=5)
    args, overrides = parser.parse_known_args(argv)

    import torch

    from megatron_rl.checks import load_config
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.learner.worker import LearnerWorker
    from megatron_rl.models.lora import is_adapter_name
    from megatron_rl.rollout.embedded import EmbeddedEngine, engine_options
    from megatron_rl.api.engine import whole_response
    from megatron_rl.types import SamplingParams
    from megatron_rl.weights.adapter_sync import AdapterTransport

    cfg = load_config(args.recipe, ["trainer.progress=false", f"model.dtype={args.dtype}", f"lora.rank={args.rank}",
                                    f"lora.alpha={args.alpha}", f"data.max_prompt_tokens={args.prompt_len}",
                                    f"rollout.max_new_tokens={args.new_tokens}", *overrides])
    init_model_parallel(1, 1, seed=0)
    worker = LearnerWorker(cfg, args.vocab, pad_id=0)
    learner = worker.learner
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.module.named_parameters():
            if name.endswith(".lora_b"):
                p.copy_(args.b_std * torch.randn(p.shape, generator=gen))
    adapters = sum(p.numel() for n, p in learner.module.named_parameters() if is_adapter_name(n))
    prompts = torch.randint(1, args.vocab, (args.rows, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, stream=False)

    def synced() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    async def sample(engine, tag: str):
        return await asyncio.gather(*(whole_response(engine.generate(f"{tag}{i}", p, params))
                                      for i, p in enumerate(prompts)))

    async def run():
        options = engine_options(cfg)
        unmerged = EmbeddedEngine(cfg.model, args.vocab, cfg.rollout.max_batch_size, seed=3, lora=cfg.lora, **options)
        merged = EmbeddedEngine(cfg.model, args.vocab, cfg.rollout.max_batch_size, seed=3, **options)
        transport, rows = AdapterTransport([unmerged], None, 600.0, worker=worker), {}
        for version in range(args.pushes + 1):
            synced()
            metrics = (await transport.push(version)).as_dict()
            synced()
            rows.setdefault("base + adapters" if version == 0 else "adapters alone", []).append(
                (metrics["sync/bytes"], metrics["sync/seconds"]))
        for version in range(args.pushes):
            synced()
            start = time.perf_counter()  # the merge and the HF names counted, as in the adapter pushes
            tensors = list(learner.export_hf_weights())
            await merged.swap_weights(tensors, version)
            synced()
            seconds = time.perf_counter() - start
            rows.setdefault("merged (every push)", []).append(
                (float(sum(t.numel() * t.element_size() for _, t in tensors)), seconds))
        chunks = {"unmerged": await sample(unmerged, "u"), "merged": await sample(merged, "m")}
        await unmerged.shutdown()
        await merged.shutdown()
        return rows, chunks

    rows, chunks = asyncio.run(run())
    m = cfg.model
    print(f"{args.recipe}: {m.num_layers} layers, hidden {m.hidden_size}, {args.dtype}; LoRA rank {args.rank} on "
          f"{', '.join(cfg.lora.targets)}: {adapters / 1e6:.2f} M adapter parameters; device "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print(f"{'push':<22}{'MB':>10}{'ms (median)':>14}")
    for name, values in rows.items():
        print(f"{name:<22}{values[0][0] / 1e6:>10.3f}{statistics.median(s for _, s in values) * 1e3:>14.1f}")
    from megatron_rl.types import Trajectory

    print(f"engine vs learner logprobs over {args.rows} x {args.new_tokens} sampled tokens:")
    for name, done in chunks.items():
        trajs = [Trajectory("p", i, p, c.token_ids, c.logprobs, c.versions, c.finish_reason)
                 for i, (p, c) in enumerate(zip(prompts, done))]
        mean, worst = _gap(learner, trajs)
        print(f"  {name:<10} mean {mean:.2e}  max {worst:.2e}")


if __name__ == "__main__":
    main()
