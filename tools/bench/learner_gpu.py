"""Benchmark: the learner's train step on one GPU, tokens/s, TFLOP/s and peak memory by shape.

    python tools/bench/learner_gpu.py [--shapes 151936:8x2048:16384,16384:8x2048:16384] [--steps 5]
        [--profile] [override ...]

Each shape is ``vocab:rows x seq_len:micro_batch_tokens``. Builds ``gsm8k_qwen2_gpu``'s model
(Qwen2-1.5B shape, bf16, random weights) with that vocabulary, and times ``Learner.train_step`` (one
forward + backward over every micro-batch and the optimizer step: the learner's step at
mini_batches = ppo_epochs = 1) on synthetic GRPO rows of prompt + response tokens. Prints, per
shape: seconds per step (median of --steps after two warm-ups), tokens/s, TFLOP/s and the peak of
torch's allocated memory over the timed steps.

FLOP per step = 6 · N · T + 6 · L · d_attn · Σ_rows s²: three times the forward's
2 · N · T of the matmul weights N (every layer's linear weights and the LM head, V · d; the
embedding lookup is no matmul) plus causal attention: QKᵀ and PV, 2 · s² · d_attn each per layer
forward, half of it masked, times three for forward + backward.
``--profile``: one more step under torch.profiler, kernel time by kind (GEMM, attention, optimizer,
element-wise/other).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_shape(text: str) -> Tuple[int, int, int, int]:
    vocab, rows_seq, budget = text.split(":")
    rows, seq = rows_seq.split("x")
    return int(vocab), int(rows), int(seq), int(budget)


def matmul_params(m, vocab: int) -> int:
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    attn = m.hidden_size * (m.num_attention_heads * hd + 2 * m.num_query_groups * hd) + m.num_attention_heads * hd * m.hidden_size
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    return m.num_layers * (attn + mlp) + vocab * m.hidden_size


def step_flops(m, vocab: int, rows: int, seq: int) -> float:
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    tokens = rows * seq
    attention = 6 * m.num_layers * m.num_attention_heads * hd * rows * seq * seq  # 3 x (2 x 2 s² d / 2)
    return 6 * matmul_params(m, vocab) * tokens + attention


def batch(rng: random.Random, rows: int, seq: int, vocab: int):
    from megatron_rl.types import Trajectory

    prompt_len = seq // 4
    out = []
    for i in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        response = [rng.randrange(vocab) for _ in range(seq - prompt_len)]
        out.append(Trajectory(f"p{i // 8}", i % 8, prompt, response, [-2.0] * len(response), [0] * len(response),
                              "length", advantage=rng.gauss(0.0, 1.0)))
    return out


def kernel_breakdown(prof) -> Dict[str, float]:
    kinds = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
            continue
        name = evt.key.lower()
        if any(k in name for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "ampere_", "cublas")):
            kinds["gemm"] += t
        elif "flash" in name or "fmha" in name or "attention" in name:
            kinds["attention"] += t
        elif "adam" in name or "multi_tensor" in name:
            kinds["optimizer"] += t
        else:
            kinds["other"] += t
    return {k: v / 1e3 for k, v in kinds.items()}  # ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="151936:8x2048:16384,16384:8x2048:16384")
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args, overrides = parser.parse_known_args()

    from megatron_rl.config import load_config
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.parallel import init_model_parallel

    rows_out: List[str] = []
    learners = {}
    for text in args.shapes.split(","):
        vocab, rows, seq, budget = parse_shape(text)
        cfg = load_config(args.recipe, [f"model.max_position_embeddings={max(seq, 1024)}", "trainer.progress=false",
                                        f"learner.micro_batch_tokens={budget}", *overrides])
        init_model_parallel(1, 1, seed=cfg.trainer.seed)
        key = (vocab, cfg.model.max_position_embeddings)
        if key not in learners:
            learners.clear()
            torch.cuda.empty_cache()
            learners[key] = Learner(cfg, vocab_size=vocab)
        learner = learners[key]
        learner.cfg.learner.micro_batch_tokens = budget
        rng = random.Random(0)
        batches = [batch(rng, rows, seq, vocab) for _ in range(2 + args.steps)]
        times = []
        try:
            for i, b in enumerate(batches):
                if i == 2:
                    torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
                start = time.perf_counter()
                learner.train_step(b, 1.0, lr=1e-6)
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - start)
        except torch.OutOfMemoryError as exc:
            rows_out.append(f"{vocab:>7} {rows:>4}x{seq:<5} {budget:>7}  out of memory: {str(exc).splitlines()[0][:80]}")
            print(rows_out[-1], flush=True)
            torch.cuda.empty_cache()
            continue
        sec = statistics.median(times)
        tokens = rows * seq
        tflops = step_flops(cfg.model, vocab, rows, seq) / sec / 1e12
        peak = torch.cuda.max_memory_allocated() / 2**30
        line = (f"{vocab:>7} {rows:>4}x{seq:<5} {budget:>7} {sec:>8.3f} {tokens / sec:>10.0f} {tflops:>8.1f} "
                f"{peak:>8.1f}")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                learner.train_step(batches[-1], 1.0, lr=1e-6)
                torch.cuda.synchronize()
            kinds = kernel_breakdown(prof)
            line += "  kernels ms: " + " ".join(f"{k}={v:.0f}" for k, v in kinds.items())
            top = sorted(prof.key_averages(), key=lambda e: -(getattr(e, "device_time_total", 0) or 0))[:12]
            for e in top:
                print(f"    {getattr(e, 'device_time_total', 0) / 1e3:8.1f} ms {e.count:6d}x {e.key[:100]}")
        rows_out.append(line)
        print(line, flush=True)
    print(f"\nlearner train_step, {args.recipe} shape, bf16, one GPU ({torch.cuda.get_device_name()}); "
          f"FLOP = 6·N·T + causal attention (see docstring); {' '.join(overrides)}")
    print(f"{'vocab':>7} {'rows x seq':>10} {'budget':>7} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'peak GiB':>8}")
    for line in rows_out:
        print(line)


if __name__ == "__main__":
    main()
