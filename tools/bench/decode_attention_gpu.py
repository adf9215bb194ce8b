"""Benchmark: a decode step's attention on one GPU, the Triton kernel against torch's fused kernel.

    python tools/bench/decode_attention_gpu.py [--rows 64,256] [--slots 640,768] [--layers 28]
        [--configs 64x4x2,128x4x3,64x4x2x256]

Qwen2-1.5B's attention shape (2 key groups of 6 query heads, head dim 128, bf16). Per (rows,
width): the new token at slot width - 68 (the slots after it masked, as in the engine's static
width), ``--layers`` calls replayed from one CUDA graph; milliseconds per step for
``models/decode_attention.py``'s kernels and for ``scaled_dot_product_attention`` with the same
additive mask, and the bandwidth each reaches on the bytes a step must read (keys and values of
the seen slots). First, each kernel's largest error against float64 attention. ``--configs``:
Triton launch choices to compare, each BLOCKxWARPSxSTAGES[xPROGRAMS] (slots per key block, warps
per program, pipelined loads, and the programs the slot slicing aims for: at 256 rows of 2 key
groups a target of 512 or fewer keeps one slice, which skips the combining launch), one column
each; the module's defaults when not given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GROUPS, PER_GROUP, DIM, SCALE = 2, 6, 128, 128 ** -0.5


def inputs(rows: int, width: int, current: int, cache: torch.Tensor):
    q = torch.randn(rows, GROUPS, PER_GROUP, DIM, device="cuda", dtype=torch.bfloat16)
    key, value = cache[0, :rows, :, :width], cache[1, :rows, :, :width]
    masked = torch.zeros(rows, 1, 1, width, dtype=torch.bool, device="cuda")
    masked[..., current + 1:] = True
    bias = torch.zeros(masked.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(masked, float("-inf"))
    return q, key, value, masked, bias


def step_ms(fn, layers: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def triton_configs(spec: str, module) -> dict:
    """{column name: (block, warps, stages, target programs)} from ``--configs``; the module's
    own when empty or not given."""
    default = (module.BLOCK_SLOTS, module.SPLIT_WARPS, module.SPLIT_STAGES, module.TARGET_PROGRAMS)
    if not spec:
        return {"triton": default}
    configs = {}
    for c in spec.split(","):
        given = tuple(int(x) for x in c.split("x"))
        configs[f"t{c}"] = given + default[len(given):]
    return configs


def with_config(config, fn):
    """``fn`` run with decode_attention's launch constants set to ``config`` (block, warps, stages,
    target programs)."""
    from megatron_rl.models import decode_attention as da

    def run(*args):
        da.BLOCK_SLOTS, da.SPLIT_WARPS, da.SPLIT_STAGES, da.TARGET_PROGRAMS = config
        return fn(*args)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--slots", default="640,768")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--configs", default="", help="Triton launch choices, BLOCKxWARPSxSTAGES[xPROGRAMS],...")
    args = parser.parse_args()
    from megatron_rl.models import decode_attention as da
    from megatron_rl.models.decode_attention import decode_attention, triton_available

    assert triton_available(), "needs a GPU and triton"
    rows_list = [int(r) for r in args.rows.split(",")]
    widths = [int(w) for w in args.slots.split(",")]
    cache = torch.randn(2, max(rows_list), GROUPS, max(widths) + 64, DIM, device="cuda", dtype=torch.bfloat16)
    kernels = {name: with_config(config, lambda q, k, v, b: decode_attention(q, k, v, b, SCALE))
               for name, config in triton_configs(args.configs, da).items()}
    kernels["sdpa"] = lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=SCALE)
    q, key, value, masked, bias = inputs(rows_list[0], widths[0], widths[0] - 68, cache)
    scores = torch.matmul(q.double(), key.double().transpose(-1, -2)) * SCALE
    exact = torch.matmul(torch.softmax(scores.masked_fill(masked, float("-inf")), -1), value.double())
    for name, fn in kernels.items():
        print(f"{name}: max |error| vs float64 {(fn(q, key, value, bias).double() - exact).abs().max().item():.2e}")
    print(f"\n{'rows':>5} {'slots':>6} {'seen':>5} " + " ".join(f"{n + ' ms':>10} {n + ' TB/s':>12}" for n in kernels))
    for rows in rows_list:
        for width in widths:
            current = width - 68
            q, key, value, _, bias = inputs(rows, width, current, cache)
            needed = 2 * rows * GROUPS * (current + 1) * DIM * 2 * args.layers / 1e9  # GB per step
            cells = []
            for fn in kernels.values():
                ms = step_ms(lambda: fn(q, key, value, bias), args.layers)
                cells.append(f"{ms:>10.3f} {needed / ms:>12.2f}")
            print(f"{rows:>5} {width:>6} {current + 1:>5} " + " ".join(cells))
    print(f"({args.layers} layers per step, {torch.cuda.get_device_name()})")


if __name__ == "__main__":
    main()
