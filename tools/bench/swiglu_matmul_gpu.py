"""Benchmark: the MLP's up projection and SwiGLU, cuBLAS plus the activation kernel vs one fused Triton matmul.

    python tools/bench/swiglu_matmul_gpu.py [--rows 256,8192,131072] [--configs 128x128x64g8w8s3,...]

The engine's MLP first matmul writes a [tokens, 2 · ffn] gate-and-up matrix and megatron-core's
compiled SwiGLU reads it back; swiglu_matmul.py's kernel writes only the activation's output.
Per token count (``--rows``: 256 is a decode step at the engine's batch, 131072 a prefill of 256
prompts of 512 tokens): microseconds
per call of cuBLAS's matmul alone, of the matmul and the activation (what the engine ran), and of
the fused kernel at each ``--configs`` entry (``TileConfig``'s form; ``t``: tensor-descriptor
loads), each checked against the unfused result first; the rate is the matmul's FLOPs over the
time. Counts of 4096 rows and under cycle through ``--layers`` weights inside one CUDA graph (a
decode step's weights are not in L2); larger ones time ``--calls`` calls with events.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_gemm_gpu import graph_us, swiglu  # noqa: E402 - the sibling benchmark's timer and activation
from engine_gpu import event_seconds  # noqa: E402 - the engine benchmark's event timer
from swiglu_matmul import DEFAULT_CONFIG, TileConfig, swiglu_matmul, swiglu_matmul_reference  # noqa: E402

DEFAULT_CONFIGS = ",".join(str(c) for c in [
    DEFAULT_CONFIG,
    TileConfig(128, 128, 64, 8, 8, 4), TileConfig(128, 128, 64, 8, 8, 3, True), TileConfig(128, 128, 64, 8, 8, 4, True),
    TileConfig(128, 64, 64, 8, 4, 4), TileConfig(128, 64, 64, 8, 4, 4, True), TileConfig(64, 128, 64, 8, 4, 4),
    TileConfig(128, 128, 32, 8, 8, 4), TileConfig(256, 64, 64, 8, 8, 3), TileConfig(256, 64, 64, 8, 8, 3, True),
    TileConfig(64, 64, 64, 8, 4, 4), TileConfig(64, 64, 128, 8, 4, 3)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256,8192,131072")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("swiglu_matmul_gpu.py needs a GPU")
    torch.manual_seed(0)
    act = torch.compile(swiglu)
    configs = [TileConfig.parse(c) for c in args.configs.split(",")]
    weights = [torch.randn(2 * args.ffn, args.hidden, device="cuda", dtype=torch.bfloat16) / args.hidden ** 0.5
               for _ in range(args.layers)]
    lines: List[str] = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * 2 * args.ffn * args.hidden
        small = rows <= 4096
        weight = itertools.cycle(weights)

        def timed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
            if small:
                return graph_us(lambda: fn(x, next(weight)), args.layers)
            return 1e6 * event_seconds(lambda: fn(x, weights[0]), args.calls, tries=1, warmups=2)

        def line(name: str, us: float, baseline: float) -> None:
            lines.append(f"{rows:>7} {name:>22} {us:>10.2f} {flops / us / 1e6:>8.0f} {baseline / us:>7.3f}x")
            print(lines[-1], flush=True)

        expected = swiglu_matmul_reference(x, weights[0]).float()
        matmul = timed(lambda x, w: x @ w.t())
        unfused = timed(lambda x, w: act(x @ w.t()))
        line("cuBLAS matmul alone", matmul, unfused)
        line("cuBLAS + SwiGLU", unfused, unfused)
        for config in configs:
            try:
                got = swiglu_matmul(x, weights[0], config).float()
                error = float((got - expected).abs().max() / expected.abs().max())
                assert error < 2e-2, f"relative error {error:.2e}"
                line(f"fused {config}", timed(lambda x, w, c=config: swiglu_matmul(x, w, c)), unfused)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit
                lines.append(f"{rows:>7} {'fused ' + str(config):>22} failed: {str(exc).splitlines()[0][:80]}")
                print(lines[-1], flush=True)
        x = expected = None
        torch.cuda.empty_cache()
    print(f"\nfc1 [2·{args.ffn}, {args.hidden}] + SwiGLU, bf16 ({torch.cuda.get_device_name()}); "
          f"'vs unfused': cuBLAS + SwiGLU's time over this one's")
    print(f"{'rows':>7} {'variant':>22} {'us/call':>10} {'TFLOP/s':>8} {'vs unfused':>8}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
