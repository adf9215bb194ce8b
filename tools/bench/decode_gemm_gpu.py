"""Benchmark: a decode step's matmuls on one GPU, each against its bound, by BLAS library.

    python tools/bench/decode_gemm_gpu.py [--rows 256] [--libraries cublas,cublaslt] [--compile]

At decode a matmul has one row per running request (256 at the engine's batch) against a whole
weight: too few rows for cuBLAS's large tiles to fill 132 streaming multiprocessors, so a
1536 × 1536 projection takes a few microseconds where its bytes and FLOPs need about one. Per
matmul of Qwen2-1.5B's decode step (``--hidden`` etc. for another shape), ``--layers`` calls of
it replayed from one CUDA graph: microseconds per call for each BLAS library torch can prefer
(``torch.backends.cuda.preferred_blas_library``), with the residual added in the matmul
(``addmm``, what models/residual_in_matmul.py does for the output and down projections) where the
engine does that, with ``--compile`` inductor's autotuned Triton matmul (minutes of tuning), and
with ``--splitk`` the split-K candidate of splitk_matmul.py at each configuration given (the
fastest per matmul, which it names; checked against the fp32 reference first).
The bound: the slower of the FLOPs at ``--tflops`` and the weight, input and output bytes at
``--tbs`` (the H200's measured peaks). The last line: the step's matmuls summed, per library.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention_gpu import step_ms  # noqa: E402 - the sibling benchmark's graph timer
from engine_gpu import MEASURED_TBS, MEASURED_TFLOPS  # noqa: E402 - the engine bench's measured peaks
from splitk_matmul import SplitConfig, splitk_matmul, splitk_reference  # noqa: E402


def shapes(hidden: int, heads: int, groups: int, head_dim: int, ffn: int, vocab: int) -> List[Tuple[str, int, int, bool, int]]:
    """(name, out features, in features, residual added in the matmul, calls per step) of one
    decode step's matmuls."""
    return [("qkv", (heads + 2 * groups) * head_dim, hidden, False, 1),
            ("o_proj", hidden, heads * head_dim, True, 1),
            ("fc1", 2 * ffn, hidden, False, 1),
            ("fc2", hidden, ffn, True, 1),
            ("lm_head", vocab, hidden, False, 0)]


def graph_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Microseconds per call of ``fn``, ``repeats`` calls captured in one CUDA graph."""
    return 1e3 * step_ms(fn, repeats) / repeats


def bound_us(rows: int, out: int, inp: int, tflops: float, tbs: float) -> float:
    flops = 2 * rows * out * inp
    moved = 2 * (out * inp + rows * inp + rows * out)
    return 1e6 * max(flops / (tflops * 1e12), moved / (tbs * 1e12))


def split_us(x: torch.Tensor, weight: torch.Tensor, residual, configs, repeats: int):
    """The fastest split-K configuration's microseconds per call, and the configuration. Each is
    first checked against the fp32 reference (bf16 rounding apart)."""
    expected = splitk_reference(x, weight, residual).float()
    workspace = torch.empty(max(c.split for c in configs) * x.size(0) * weight.size(0), dtype=torch.float32,
                            device=x.device)
    timed = []
    for config in configs:
        got = splitk_matmul(x, weight, residual, config, workspace).float()
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error < 1e-2, f"split-K {config}: relative error {error:.2e}"
        timed.append((graph_us(lambda: splitk_matmul(x, weight, residual, config, workspace), repeats), str(config)))
    return min(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="256")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--libraries", default="cublas,cublaslt")
    parser.add_argument("--compile", action="store_true", help="also inductor's max-autotune Triton matmul")
    parser.add_argument("--splitk", default="", help="split-K configurations BMxBNxBKxSPLITxWARPSxSTAGES, "
                                                     "comma-separated (e.g. 128x128x64x6x4x4): the fastest per matmul")
    parser.add_argument("--tflops", type=float, default=MEASURED_TFLOPS)
    parser.add_argument("--tbs", type=float, default=MEASURED_TBS)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    torch.manual_seed(0)
    libraries = args.libraries.split(",")
    columns = libraries + (["compiled"] if args.compile else []) + (["splitk"] if args.splitk else [])
    configs = [SplitConfig.parse(c) for c in args.splitk.split(",") if c]
    print(f"{'rows':>5} {'matmul':>8} {'out x in':>14} {'bound us':>9} "
          + " ".join(f"{c + ' us':>12} {'of bound':>8}" for c in columns))
    for rows in (int(r) for r in args.rows.split(",")):
        totals: Dict[str, float] = {c: 0.0 for c in columns}
        total_bound = 0.0
        for name, out, inp, residual, per_layer in shapes(args.hidden, args.heads, args.groups, args.head_dim,
                                                          args.ffn, args.vocab):
            weight = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * inp ** -0.5
            x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(rows, out, device="cuda", dtype=torch.bfloat16)
            call = (lambda: torch.addmm(res, x, weight.t())) if residual else (lambda: torch.mm(x, weight.t()))
            calls = args.layers * per_layer or 1
            repeats = args.layers if per_layer else 4
            bound = bound_us(rows, out, inp, args.tflops, args.tbs)
            total_bound += calls * bound
            cells = []
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                us = graph_us(call, repeats)
                totals[library] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}%")
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.compile:
                compiled = torch.compile((lambda r, a, w: torch.addmm(r, a, w.t())) if residual
                                         else (lambda r, a, w: torch.mm(a, w.t())),
                                         mode="max-autotune-no-cudagraphs", dynamic=False)
                us = graph_us(lambda: compiled(res, x, weight), repeats)
                totals["compiled"] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}%")
            if configs:
                us, best = split_us(x, weight, res if residual else None, configs, repeats)
                totals["splitk"] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}% ({best})")
            print(f"{rows:>5} {name:>8} {f'{out}x{inp}':>14} {bound:>9.2f} " + " ".join(cells), flush=True)
        print(f"{rows:>5} {'step':>8} {'':>14} {total_bound / 1e3:>8.3f}m "
              + " ".join(f"{totals[c] / 1e3:>11.3f}m {100 * total_bound / totals[c]:>7.0f}%" for c in columns))
    print(f"(microseconds per call, m = milliseconds per step of {args.layers} layers + the LM head; "
          f"bound at {args.tflops} TFLOP/s and {args.tbs} TB/s; {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
