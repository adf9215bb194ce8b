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
fastest per matmul, which it names; checked against the fp32 reference first), and with
``--bmm-splits`` cuBLAS's own kernels made split-K: the K range cut into pieces, one batched
matmul into fp32 partials, and the split-K reduce kernel.
The bound: the slower of the FLOPs at ``--tflops`` and the weight, input and output bytes at
``--tbs`` (the H200's measured peaks). The last line: the step's matmuls summed, per library.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention_gpu import step_ms  # noqa: E402 - the sibling benchmark's graph timer
from engine_gpu import MEASURED_TBS, MEASURED_TFLOPS  # noqa: E402 - the engine bench's measured peaks
from splitk_matmul import SplitConfig, bmm_splitk_matmul, splitk_matmul, splitk_reference  # noqa: E402


def shapes(hidden: int, heads: int, groups: int, head_dim: int, ffn: int, vocab: int,
           layers: int) -> List[Tuple[str, int, int, bool, int]]:
    """(name, out features, in features, residual added in the matmul, calls per step) of one
    decode step's matmuls. ``fc2+act`` is the down projection with SwiGLU before it: the BLAS
    columns time megatron-core's compiled SwiGLU kernel and the matmul, split-K its gated load;
    the step's sum counts it in place of ``fc2`` (0 calls: shown, not summed)."""
    return [("qkv", (heads + 2 * groups) * head_dim, hidden, False, layers),
            ("o_proj", hidden, heads * head_dim, True, layers),
            ("fc1", 2 * ffn, hidden, False, layers),
            ("fc2", hidden, ffn, True, 0),
            ("fc2+act", hidden, ffn, True, layers),
            ("lm_head", vocab, hidden, False, 1)]


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """megatron-core's SwiGLU (fused_bias_swiglu.swiglu), compiled as its jit_fuser compiles it."""
    gate, up = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(gate) * up


def graph_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Microseconds per call of ``fn``, ``repeats`` calls captured in one CUDA graph."""
    return 1e3 * step_ms(fn, repeats) / repeats


def bound_us(rows: int, out: int, inp: int, tflops: float, tbs: float) -> float:
    flops = 2 * rows * out * inp
    moved = 2 * (out * inp + rows * inp + rows * out)
    return 1e6 * max(flops / (tflops * 1e12), moved / (tbs * 1e12))


def fastest_us(x: torch.Tensor, weights: List[torch.Tensor], residual, gated: bool, repeats: int,
               candidates: Dict[str, Callable]) -> Tuple[float, str]:
    """The fastest candidate's microseconds per call and its name. Each candidate,
    ``(x, weight, residual, gated) -> out``, is first checked against the fp32 reference (bf16
    rounding apart), then timed cycling through ``weights``."""
    expected = splitk_reference(x, weights[0], residual, gated).float()
    timed = []
    for name, candidate in candidates.items():
        got = candidate(x, weights[0], residual, gated).float()
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error < 1e-2, f"{name}: relative error {error:.2e}"
        weight = itertools.cycle(weights)
        timed.append((graph_us(lambda: candidate(x, next(weight), residual, gated), repeats), name))
    return min(timed)


def split_candidates(x: torch.Tensor, out_features: int, configs: List[SplitConfig]) -> Dict[str, Callable]:
    """The Triton split-K kernels at each configuration, sharing one fp32 workspace."""
    workspace = torch.empty(max(c.split for c in configs) * x.size(0) * out_features, dtype=torch.float32,
                            device=x.device)
    return {str(c): lambda x, w, r, gated, c=c: splitk_matmul(x, w, r, c, workspace, gated) for c in configs}


def bmm_split_candidates(in_features: int, splits: List[int]) -> Dict[str, Callable]:
    """cuBLAS split-K (bmm into fp32 partials, then the reduce kernel) at each split dividing K."""
    return {f"split {split}": lambda x, w, r, gated, split=split: bmm_splitk_matmul(x, w, r, split, gated)
            for split in splits if in_features % split == 0}


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
    parser.add_argument("--bmm-splits", default="", help="cuBLAS split-K by a batched matmul into fp32 partials: "
                                                         "the splits to try, comma-separated (e.g. 2,3,4)")
    parser.add_argument("--tflops", type=float, default=MEASURED_TFLOPS)
    parser.add_argument("--tbs", type=float, default=MEASURED_TBS)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    torch.manual_seed(0)
    libraries = args.libraries.split(",")
    columns = (libraries + (["compiled"] if args.compile else []) + (["splitk"] if args.splitk else [])
               + (["bmm-split"] if args.bmm_splits else []))
    bmm_splits = [int(v) for v in args.bmm_splits.split(",") if v]
    configs = [SplitConfig.parse(c) for c in args.splitk.split(",") if c]
    activation = torch.compile(swiglu, dynamic=False)
    print(f"{'rows':>5} {'matmul':>8} {'out x in':>14} {'bound us':>9} "
          + " ".join(f"{c + ' us':>12} {'of bound':>8}" for c in columns))
    for rows in (int(r) for r in args.rows.split(",")):
        totals: Dict[str, float] = {c: 0.0 for c in columns}
        total_bound = 0.0
        for name, out, inp, residual, calls in shapes(args.hidden, args.heads, args.groups, args.head_dim,
                                                      args.ffn, args.vocab, args.layers):
            repeats = args.layers if name != "lm_head" else 4
            # One weight per layer, as in the model: the same weight in every call would stay in L2.
            weights = [torch.randn(out, inp, device="cuda", dtype=torch.bfloat16) * inp ** -0.5
                       for _ in range(repeats)]
            gated = name == "fc2+act"
            x = torch.randn(rows, 2 * inp if gated else inp, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(rows, out, device="cuda", dtype=torch.bfloat16)

            def call(weight=itertools.cycle(weights), x=x):
                a = activation(x) if gated else x
                return torch.addmm(res, a, next(weight).t()) if residual else torch.mm(a, next(weight).t())
            bound = bound_us(rows, out, inp, args.tflops, args.tbs)
            total_bound += calls * bound
            cells = []
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                us = graph_us(call, repeats)
                totals[library] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}%")
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.compile:  # for fc2+act: inductor's SwiGLU kernel, then its autotuned matmul
                compiled = torch.compile((lambda r, a, w: torch.addmm(r, a, w.t())) if residual
                                         else (lambda r, a, w: torch.mm(a, w.t())),
                                         mode="max-autotune-no-cudagraphs", dynamic=False)
                weight = itertools.cycle(weights)
                us = graph_us(lambda: compiled(res, activation(x) if gated else x, next(weight)), repeats)
                totals["compiled"] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}%")
            if configs:
                us, best = fastest_us(x, weights, res if residual else None, gated, repeats,
                                      split_candidates(x, out, configs))
                totals["splitk"] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}% ({best})")
            if bmm_splits:
                us, best = fastest_us(x, weights, res if residual else None, gated, repeats,
                                      bmm_split_candidates(inp, bmm_splits))
                totals["bmm-split"] += calls * us
                cells.append(f"{us:>12.2f} {100 * bound / us:>7.0f}% ({best})")
            print(f"{rows:>5} {name:>8} {f'{out}x{inp}':>14} {bound:>9.2f} " + " ".join(cells), flush=True)
        print(f"{rows:>5} {'step':>8} {'':>14} {total_bound / 1e3:>8.3f}m "
              + " ".join(f"{totals[c] / 1e3:>11.3f}m {100 * total_bound / totals[c]:>7.0f}%" for c in columns))
    print(f"(microseconds per call, m = milliseconds per step of {args.layers} layers + the LM head; "
          f"bound at {args.tflops} TFLOP/s and {args.tbs} TB/s; {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
