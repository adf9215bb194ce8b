"""Benchmark: a decode step's plain sampling (temperature only) on one GPU, the fused Triton kernels
against the compiled torch path, each against the bytes it must read.

    python tools/bench/sampling_gpu.py [--rows 64,256] [--vocab 151936] [--temperature 1.0]

Per row count: microseconds per call of ``rollout/sampling_kernel.py``'s two kernels (one read of
the logits for each chunk's max and sum, then per row one uniform and a walk of one chunk: the
inverse of the softmax's distribution) and of ``sampling.draw_tempered`` with the engine's
generator noise (what runs where triton does not), both replayed from one CUDA graph (``--calls``
calls each), and the time reading the bf16 logits once takes at ``--tbs``. The same seed draws
the same tokens whatever the kernels' chunking, up to the running sums' fp32 rounding at an
entry's boundary, so the last column counts the rows where the fused kernel's second call, at
half the chunk, drew the same token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention_gpu import step_ms  # noqa: E402 - the sibling benchmark's graph timer
from engine_gpu import MEASURED_TBS  # noqa: E402 - the engine bench's measured bandwidth

from megatron_rl.rollout import sampling, sampling_kernel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=20, help="calls per graph replay")
    parser.add_argument("--tbs", type=float, default=MEASURED_TBS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sampling_gpu.py needs a GPU")
    print(f"{'rows':>6} {'fused us':>9} {'torch us':>9} {'read us':>8} {'fused/read':>10} {'torch/fused':>11} "
          f"{'same draws':>10}")
    for rows in (int(r) for r in args.rows.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = (3 * torch.randn(rows, args.vocab, device="cuda", generator=gen)).to(torch.bfloat16)
        seed = torch.tensor([5], dtype=torch.int64, device="cuda")
        if not sampling_kernel.available(logits):
            sys.exit("the fused sampling kernel is not available here (triton missing or its check failed)")
        first, _ = sampling_kernel.sample(logits, args.temperature, seed)
        again, _ = sampling_kernel.sample(logits, args.temperature, seed, chunk=sampling_kernel.CHUNK // 2)
        fused = step_ms(lambda: sampling_kernel.sample(logits, args.temperature, seed), args.calls) / args.calls
        torch_path = step_ms(lambda: sampling.draw_tempered(logits, sampling.exponential_noise(logits, None),
                                                            args.temperature), args.calls) / args.calls
        read = logits.numel() * logits.element_size() / (args.tbs * 1e12) * 1e3
        print(f"{rows:>6} {1e3 * fused:>9.1f} {1e3 * torch_path:>9.1f} {1e3 * read:>8.1f} {fused / read:>9.1f}x "
              f"{torch_path / fused:>10.2f}x {int((first == again).sum()):>5}/{rows}")
    print(f"(microseconds per call, bf16 logits [rows, {args.vocab}], T = {args.temperature}; 'read': the logits' "
          f"bytes at {args.tbs} TB/s; {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
