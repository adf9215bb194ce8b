"""Benchmark: the learner's train step on one GPU, tokens/s, TFLOP/s, kernels busy and peak memory by shape.

    python tools/bench/learner_gpu.py [--shapes 151936:8x2048:16384,16384:8x2048:16384] [--steps 5]
        [--recipe gsm8k_qwen2_gpu] [--busy-steps 3] [--profile] [override ...]

Each shape is ``vocab:rows x seq_len:micro_batch_tokens``. Builds the recipe's model (default
``gsm8k_qwen2_gpu``: Qwen2-1.5B shape, bf16, random weights; ``--recipe gsm8k_qwen3_moe_gpu``: the
Qwen3-30B-A3B layer shape cut to 4 layers) with that vocabulary, and times ``Learner.train_step``
(one forward + backward over every micro-batch and the optimizer step: the learner's step at
mini_batches = ppo_epochs = 1) on synthetic GRPO rows of prompt + response tokens. Extra arguments
are config overrides applied to every shape (e.g. ``model.num_layers=8``). Prints, per shape:
seconds per step (median of --steps after two warm-ups), tokens/s, TFLOP/s, the share of the step
the GPU's kernels are busy and the peak of torch's allocated memory over the timed steps.

FLOP per step = 6 · N_active · T + 3 · Σ_rows L · heads · (d_qk + d_v) · s²: three times (forward
+ backward) the forward's 2 · N_active · T of the matmul weights a token multiplies plus causal
attention (QKᵀ and PV, 2 · s² · d each per head and layer forward, half of it masked; with
d_qk = d_v = d this is 6 · L · d_attn · s² per row). N_active (tools/bench/model_size.py): per
layer the attention projections and the MLP, plus the LM head V · d (the embedding lookup is no
matmul). For a dense model that is every linear weight; in an MoE layer it is the router, the
top_k routed experts' three matmuls each (not all E) and the shared expert if any. So for MoE
the column is active TFLOP/s: the arithmetic the routed tokens do, not what all experts hold.
Under LoRA (``lora.rank`` > 0, e.g. ``--recipe gsm8k_qwen3_14b_lora_gpu``) the frozen base still
runs its forward and passes gradients back through every layer, but computes no weight gradient:
4 · N_active · T, plus 6 · N_lora · T for the adapters (model_size.lora_params) and the same
attention. With ``learner.recompute_activations=true`` the recomputed forward is not counted
(model FLOPs, not hardware FLOPs). The footer prints the parameters the optimizer trains.

Kernels busy (``--busy-steps`` steps under torch.profiler, 0 skips it): the union of the CUDA
kernels' time intervals per step (overlaps counted once, memory copies left out) over the
median step's wall time measured without the profiler.
``--profile``: those steps' kernel time by kind (GEMM, attention, optimizer, element-wise/other)
and the heaviest kernels.

One learner lives at a time: before building the next shape's, the previous one (model,
optimizer, gradient buffers) is dropped (``drop_autograd_leftovers`` breaks the one reference
cycle the garbage collector cannot see), collected and the CUDA cache emptied; the allocated
memory before each build is printed to show it.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_size import active_matmul_params, attention_flops, lora_params, matmul_params  # noqa: E402,F401

ON_GPU = torch.cuda.is_available()


def parse_shape(text: str) -> Tuple[int, int, int, int]:
    vocab, rows_seq, budget = text.split(":")
    rows, seq = rows_seq.split("x")
    return int(vocab), int(rows), int(seq), int(budget)


def step_flops(m, vocab: int, rows: int, seq: int, lora=None) -> float:
    """FLOPs of one train step over ``rows`` rows of ``seq`` tokens (see the module docstring).
    ``lora``: a LoraConfig; with rank > 0 the base is frozen (no weight gradients) and the
    adapters train."""
    tokens, attention = rows * seq, 3 * rows * attention_flops(m, seq)
    if lora is None or not lora.rank:
        return 6 * active_matmul_params(m, vocab) * tokens + attention
    adapters = lora_params(m, lora.rank, lora.targets)
    return 4 * active_matmul_params(m, vocab) * tokens + 6 * adapters * tokens + attention


def trained_params(learner) -> int:
    """Parameters the optimizer updates: every one, or the adapters alone under LoRA."""
    return sum(p.numel() for p in learner.module.parameters() if p.requires_grad)


def batch(rng: random.Random, rows: int, seq: int, vocab: int):
    from megatron_rl.learner.train_batch import TrainBatch
    from megatron_rl.types import Trajectory

    prompt_len = seq // 4
    out, advantages = [], []
    for i in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        response = [rng.randrange(vocab) for _ in range(seq - prompt_len)]
        out.append(Trajectory(f"p{i // 8}", i % 8, prompt, response, [-2.0] * len(response), [0] * len(response),
                              "length"))
        advantages.append(rng.gauss(0.0, 1.0))
    return TrainBatch.of(out, advantages=[[a] * len(t.response_ids) for t, a in zip(out, advantages)])


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if ON_GPU else 0.0


def drop_autograd_leftovers(learner) -> None:
    """Let a dropped learner be collected. A tensor a module keeps from its last forward with its
    autograd graph (megatron-core's MoE token dispatcher keeps ``probs``: SequentialMLP experts,
    ``model.moe_grouped_experts=false``; seen on a CPU) holds, through that C++
    graph, the parameters' gradient-accumulator nodes, whose hooks close over the DDP module: a
    cycle Python's garbage collector cannot see, which keeps the whole model, its gradient
    buffers and its optimizer alive."""
    for model in (learner.model, learner.ref_model):
        for module in model.modules() if model is not None else ():
            for owner in (module, *(v for v in vars(module).values()
                                    if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)))):
                for name, value in list(vars(owner).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(owner, name, None)


def release_memory() -> None:
    """Return what dropped learners held to the device: collect the cycles that keep a model
    alive (its config points at the optimizer's loss scaler, DDP hooks at its buffers), empty
    megatron-core's global scratch buffer, then the CUDA caching allocator's cache."""
    gc.collect()
    from megatron.core import parallel_state

    scratch = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if scratch is not None:
        scratch.buffer.clear()
    if ON_GPU:
        torch.cuda.empty_cache()


def timed_steps(learner, batches: Sequence) -> List[float]:
    """Seconds of each train step after the first two (warm-ups: compilation, allocator)."""
    times = []
    for i, b in enumerate(batches):
        if i == 2 and ON_GPU:
            torch.cuda.reset_peak_memory_stats()
        synchronize()
        start = time.perf_counter()
        learner.train_step(b, 1.0, lr=1e-6)
        synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_events(prof) -> List:
    """The profiler's CUDA kernel events: device events other than memory copies and the
    device-side spans of user annotations."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith("Memcpy")]


def kernel_breakdown(events: Sequence) -> Dict[str, float]:
    """Kernel µs by kind."""
    kinds = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for evt in events:
        t = evt.time_range.end - evt.time_range.start
        name = evt.name.lower()
        if any(k in name for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "ampere_", "cublas")):
            kinds["gemm"] += t
        elif "flash" in name or "fmha" in name or "attention" in name:
            kinds["attention"] += t
        elif "adam" in name or "multi_tensor" in name:
            kinds["optimizer"] += t
        else:
            kinds["other"] += t
    return kinds


def profile_steps(learner, b, steps: int, show: bool, top: int = 12) -> float:
    """Kernel-busy milliseconds per step over ``steps`` train steps under torch.profiler; with
    ``show``, the kernel time by kind and the heaviest kernels (per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            learner.train_step(b, 1.0, lr=1e-6)
        synchronize()
    events = kernel_events(prof)
    busy_ms = union_length((e.time_range.start, e.time_range.end) for e in events) / steps / 1e3
    if show:
        kinds = kernel_breakdown(events)
        print("    kernels ms per step: " + " ".join(f"{k}={v / steps / 1e3:.1f}" for k, v in kinds.items()))
        by_name: Dict[str, List[float]] = {}
        for e in events:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"    {sum(ts) / steps / 1e3:8.2f} ms {len(ts) // steps:6d}x {name[:100]}")
    return busy_ms


def shape_line(vocab: int, rows: int, seq: int, budget: int, rest: str) -> str:
    return f"{vocab:>7} {rows:>4}x{seq:<5} {budget:>7} {rest}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="151936:8x2048:16384,16384:8x2048:16384")
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--busy-steps", type=int, default=3,
                        help="steps profiled for the kernels-busy column (0: no profiling)")
    parser.add_argument("--profile", action="store_true", help="kernel time by kind and the heaviest kernels")
    args, overrides = parser.parse_known_args()

    from megatron_rl.checks import load_config
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.parallel import init_model_parallel

    rows_out: List[str] = []
    trained: Dict[int, int] = {}  # by vocabulary: parameters the optimizer updates
    learner, built_for = None, None
    for text in args.shapes.split(","):
        vocab, rows, seq, budget = parse_shape(text)
        cfg = load_config(args.recipe, [f"model.max_position_embeddings={max(seq, 1024)}", "trainer.progress=false",
                                        f"learner.micro_batch_tokens={budget}", *overrides])
        init_model_parallel(1, 1, seed=cfg.trainer.seed)
        key = (vocab, cfg.model.max_position_embeddings)
        if key != built_for:  # a new model: nothing of the previous one may stay on the device
            if learner is not None:
                drop_autograd_leftovers(learner)
            learner, built_for = None, None
            release_memory()
            print(f"{text}: {allocated_gib():.2f} GiB allocated before building its learner", flush=True)
            learner, built_for = Learner(cfg, vocab_size=vocab), key
            trained[vocab] = trained_params(learner)
        learner.cfg.learner.micro_batch_tokens = budget
        rng = random.Random(0)
        batches = [batch(rng, rows, seq, vocab) for _ in range(2 + args.steps)]
        try:
            times = timed_steps(learner, batches)
            sec = statistics.median(times)
            busy_ms: Optional[float] = None
            if args.busy_steps > 0 and ON_GPU:
                busy_ms = profile_steps(learner, batches[-1], args.busy_steps, args.profile)
        except torch.OutOfMemoryError as exc:
            rows_out.append(shape_line(vocab, rows, seq, budget, f" out of memory: {str(exc).splitlines()[0][:80]}"))
            print(rows_out[-1], flush=True)
            drop_autograd_leftovers(learner)  # its state after a failed step is no use to the next shape
            learner, built_for = None, None
            continue
        tokens = rows * seq
        tflops = step_flops(cfg.model, vocab, rows, seq, cfg.lora) / sec / 1e12
        peak = torch.cuda.max_memory_allocated() / 2**30 if ON_GPU else 0.0
        busy = "n/a" if busy_ms is None else f"{busy_ms:.0f}"
        share = "n/a" if busy_ms is None else f"{100 * busy_ms / (1e3 * sec):.0f}%"
        rows_out.append(shape_line(vocab, rows, seq, budget, f"{sec:>8.3f} {tokens / sec:>10.0f} {tflops:>8.1f} "
                                                             f"{busy:>10} {share:>6} {peak:>8.1f}"))
        print(rows_out[-1], flush=True)
    m = cfg.model
    device = torch.cuda.get_device_name() if ON_GPU else "CPU"
    print(f"\nlearner train_step, {args.recipe} shape, {m.dtype}, one device ({device}); {' '.join(overrides)}")
    vocabs = sorted({parse_shape(text)[0] for text in args.shapes.split(",")})
    counts = ", ".join(f"{active_matmul_params(m, v) / 1e9:.3f} B of {matmul_params(m, v) / 1e9:.3f} B at vocab {v}"
                       for v in vocabs)
    lora = cfg.lora
    if lora.rank:
        adapters = lora_params(m, lora.rank, lora.targets)
        frozen = ", ".join(f"{active_matmul_params(m, v) / 1e9:.3f} B at vocab {v}" for v in vocabs)
        print(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: TFLOP/s = (4·N·T + 6·N_lora·T + causal "
              f"attention) / step time; the frozen base's forward and input gradients, the adapters' forward "
              f"and both gradients; N_lora = {adapters:,}, N{'_active' if m.num_experts else ''} = "
              f"{frozen}")
    elif m.num_experts:
        print(f"MoE: TFLOP/s are active TFLOP/s = (6·N_active·T + causal attention) / step time; N_active = per "
              f"layer attention + router + top-{m.moe_router_topk} of {m.num_experts} experts (3 matmuls each)"
              f"{' + shared expert' if m.moe_shared_expert_ffn_hidden_size else ''}, + LM head: {counts}")
    else:
        counts = ", ".join(f"{matmul_params(m, v) / 1e9:.3f} B at vocab {v}" for v in vocabs)
        print(f"TFLOP/s = (6·N·T + causal attention) / step time; N = every linear weight + LM head: {counts}")
    if cfg.learner.recompute_activations:
        print("learner.recompute_activations=true: the recomputed forward runs but is not counted in TFLOP/s")
    print("trained parameters (requires_grad): "
          + ", ".join(f"{n:,} at vocab {v}" for v, n in trained.items()))
    print("kernels busy: union of CUDA kernel time per profiled step, share of the median step's wall time")
    print(f"{'vocab':>7} {'rows x seq':>10} {'budget':>7} {'s/step':>8} {'tokens/s':>10} {'TFLOP/s':>8} "
          f"{'kernels ms':>10} {'busy':>6} {'peak GiB':>8}")
    for line in rows_out:
        print(line)


if __name__ == "__main__":
    main()
