"""Benchmark: one decode step of the embedded engine, Megatron's attention vs the engine's.

    python tools/bench/engine_decode.py [--rows 152] [--windows 20,100,200] [--threads 1]
        [--layers 2] [--hidden 64] [--heads 4] [--groups 2] [--ffn 256]

Builds the model twice from one config, with Megatron's static-batching attention (the learner's
layers; keys re-rotated, repeated per head and transposed every step) and with the engine's
(``build_gpt_model(kv_attention=True)``: keys rotated once when written, batched matmuls per key
group), prefills ``--rows`` rows to each window length and times decode steps. Prints ms per step
and µs per row for both, and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def step_ms(model, rows: int, window: int, steps: int = 20) -> float:
    from megatron_rl.models.gpt import model_device
    from megatron_rl.rollout.embedded.generator import KVCachedGenerator
    from megatron_rl.types import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 8)
    gen = KVCachedGenerator(model, rows, window + steps + 8, model_device())
    gen.prefill([[1] * window] * rows, params)
    for _ in range(3):
        gen.decode(params)
    start = time.perf_counter()
    for _ in range(steps):
        gen.decode(params)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=152)
    parser.add_argument("--windows", default="20,100,200")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.models.gpt import build_gpt_model

    init_model_parallel()
    windows = [int(w) for w in args.windows.split(",")]
    cfg = ModelConfig(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.heads, num_query_groups=args.groups,
                      ffn_hidden_size=args.ffn, max_position_embeddings=2 * max(windows) + 64)
    megatron = build_gpt_model(cfg, 16).eval()
    engine = build_gpt_model(cfg, 16, kv_attention=True).eval()
    engine.load_state_dict(megatron.state_dict())
    print(f"rows={args.rows} threads={args.threads} layers={args.layers} hidden={args.hidden} "
          f"heads={args.heads} groups={args.groups}")
    print(f"{'window':>7} {'megatron ms':>12} {'engine ms':>10} {'megatron us/row':>16} {'engine us/row':>14} {'ratio':>6}")
    for window in windows:
        a, b = step_ms(megatron, args.rows, window), step_ms(engine, args.rows, window)
        print(f"{window:>7} {a:>12.2f} {b:>10.2f} {a / args.rows * 1e3:>16.1f} {b / args.rows * 1e3:>14.1f} {a / b:>5.1f}x")


if __name__ == "__main__":
    main()
