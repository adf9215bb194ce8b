"""Benchmark: the embedded engine against transformers' ``generate`` on one GPU, same model.

    python tools/bench/engine_gpu.py [--batches 64,256] [--prompt-len 512] [--new-tokens 256]
        [--recipe gsm8k_qwen2_gpu | --preset qwen3-30b-a3b] [--vocab 151936] [--skip-hf] [--hf-calls 2]
        [--gap-rows 16] [--graphs on,off] [--profile] [--decode-attention sdpa,efficient,triton,matmul]
        [--warmup-tokens 4] [--width-step 256] [override ...]

One random-weight model of the recipe's shape (default ``gsm8k_qwen2_gpu``: Qwen2-1.5B, 28 layers,
hidden 1536, GQA 12/2; ``--recipe gsm8k_qwen3_moe_gpu``: the Qwen3-30B-A3B layer shape cut to 4
layers; ``--preset``: a whole MoE model, see PRESETS; extra arguments are config overrides, e.g.
``model.num_layers=24``) in bf16 is built with transformers; its weights are pushed into the
embedded engine (Megatron GPTModel, KV cache), so both serve the same model. Both get the same
prompts (random ids, --prompt-len each) and sample at T = 1 with no top-k/top-p and no stop token,
so every request generates exactly --new-tokens tokens. Per batch size: the engine's tokens/s
(all requests submitted at once, after a warm-up of the same batch for 4 tokens; decode steps
replayed from CUDA graphs, ``--graphs on``, or launched eagerly, ``off``), its prefill seconds and
decode milliseconds per step, ``generate``'s tokens/s (the faster of --hf-calls calls over the whole
batch, each after a short warm-up call; each call's rate is listed below the table), the ratio to
it and, ``vs 1st``, to the first call's rate (what one call of ``generate`` per run gives; the
second has run 1.4–3.4× faster here); then the roofline (``roofline_seconds``: an H200's
datasheet peaks, no kernel can beat it) and the engine's share of it, and its share of the same
roofline at the peaks ``measure_peaks`` measures on this card first (a large bf16 matmul's rate and
a large copy's bandwidth; on a CPU an H200's measured peaks stand in). ``--repeats N``: N batches
timed after the warm-up, the median one in the table. ``--profile``: the
prefill's and the decode step's kernel time and heaviest kernels, per batch, and the decode step's
kernels by kind (``kernel_kind``: matmul, attention, norm, residual add, activation, rotation
and cache store, sampling, copy, other) with launches and microseconds per launch.
``--decode-attention``: the decode step's attention kernel(s);
``--width-step``: the graphs' attention-width bucket; ``--warmup-tokens``: the warm-up's length
(as long as the run: every graph the run needs is captured before it is timed).
Then the engine/learner logprob gap in bf16: a learner with the same weights recomputes the
logprobs of --gap-rows of the engine's sampled responses; mean and max |difference| per token
(skipped, with the reason, when the learner would not fit beside the engine). For a mixture of
experts whose engine records its routing (``rollout.record_routing``), twice: with the learner's
own routing and replaying the engine's (``algo.routing_replay``), with the share of the engine's
choices the learner's routers make themselves (``moe/router_agreement``).

Mixture of experts: transformers 5 keeps a layer's experts fused in memory (``mlp.experts.
gate_up_proj`` E × 2I × H, gate rows first; ``mlp.experts.down_proj`` E × H × I); the engine takes
per-expert Hugging Face names as checkpoints store them, so ``per_expert_hf_tensors`` splits them
(views, no copy). For MoE models the bench also prints the decode-step bound
(``moe_decode_bound``): per step the bytes of the routed experts the batch touches (the expected
distinct experts per layer, E · (1 − (1 − k/E)^B) for B rows choosing k of E, i.e. every expert once
B · k ≫ E), the attention, router, shared-expert and LM-head weights, and the KV cache (mean over
the steps), read at the 4.3 TB/s measured on an H200; and the engine's share of it, by decode
step time and by tokens/s.

Memory: transformers' model and the engine are never on the GPU together. transformers' model is
built and timed first; its weights then move to host memory (the bf16 model once: 61 GB for the
whole Qwen3-30B-A3B, whose loading into the engine needs another ~40 GB of host memory while the
experts' gate and up matrices are joined) and it is freed before the first engine is built; each
engine is shut down and freed before the next. Allocated GPU memory is printed at each stage.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_gpu import drop_autograd_leftovers, release_memory  # noqa: E402 - the sibling benchmark's
from megatron_rl.models import decode_attention as _decode_attention  # noqa: E402
from model_size import (active_matmul_params, attention_flops, decode_weight_params, expert_params,  # noqa: E402
                        experts_touched, kv_bytes_per_token, matmul_params, moe_layers)

# An H200's datasheet peaks: dense bf16 matmuls and HBM3e bandwidth. The roofline column uses them.
PEAK_TFLOPS = 989.0
PEAK_TBS = 4.8
# An H200's measured peaks, the way ``measure_peaks`` measures them: HBM bandwidth (a large
# device-to-device copy) and the dense bf16 matmul rate (large cuBLAS GEMMs). The engine bench
# measures the card it runs on instead; the other benches take these as defaults.
MEASURED_TBS = 4.3
MEASURED_TFLOPS = 803.0
ON_GPU = torch.cuda.is_available()

# Whole models by name: (recipe, overrides, vocabulary), with their bf16 sizes. The engine's KV cache
# holds max_batch × 2 × (prompt + new tokens + 8) slots: at batch 256, 512 + 256 tokens, 39 GB for
# Qwen3-30B-A3B (100 GB with its weights), 78 GB for Qwen1.5-MoE-A2.7B, 13 GB for the Mixtral cut.
PRESETS: Dict[str, Tuple[str, List[str], int]] = {
    # Qwen3-30B-A3B: 48 layers, 30.5 B parameters, 61 GB in bf16.
    "qwen3-30b-a3b": ("gsm8k_qwen3_moe_gpu", ["model.num_layers=48"], 151936),
    # Qwen1.5-MoE-A2.7B (qwen2_moe): 24 layers, 60 experts top-4 of FFN 1408 and a gated shared
    # expert of 5632, softmax before top-k; 14.3 B parameters, 29 GB.
    "qwen1.5-moe-a2.7b": ("gsm8k_qwen2_gpu", [
        "model.family=qwen2_moe", "model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16",
        "model.num_query_groups=16", "model.ffn_hidden_size=5632", "model.num_experts=60", "model.moe_router_topk=4",
        "model.moe_ffn_hidden_size=1408", "model.moe_shared_expert_ffn_hidden_size=5632",
        "model.moe_shared_expert_gate=true", "model.moe_norm_topk_prob=false", "model.tie_word_embeddings=false"],
        151936),
    # Mixtral-8x7B's layer shape (8 experts top-2 of FFN 14336, GQA 32/8) cut to 8 of its 32
    # layers: 11.9 B parameters, 24 GB (the whole 46.7 B model would not pass through host memory).
    "mixtral-8x7b-8l": ("gsm8k_qwen2_gpu", [
        "model.family=mixtral", "model.num_layers=8", "model.hidden_size=4096", "model.num_attention_heads=32",
        "model.num_query_groups=8", "model.ffn_hidden_size=14336", "model.num_experts=8", "model.moe_router_topk=2",
        "model.norm_epsilon=1e-5", "model.tie_word_embeddings=false"], 32000),
    # DeepSeek-V2-Lite's shape with DeepSeek-V3's routing (deepseek_v3 family): multi-head latent
    # attention (kv latent 512, no query latent), 27 layers, the first dense, 64 experts top-6 of
    # FFN 1408 plus 2 shared, sigmoid routing with a score-correction bias; 15.7 B parameters, 31 GB.
    # Megatron's MLA caches whole per-head keys and values (276 KB per token): run it at --batches 64
    # (a 27 GB cache; batch 256 would need 110 GB beside the weights).
    "deepseek-v2-lite": ("gsm8k_qwen2_gpu", [
        "model.family=deepseek_v3", "model.num_layers=27", "model.hidden_size=2048", "model.num_attention_heads=16",
        "model.num_query_groups=16", "model.ffn_hidden_size=10944", "model.kv_lora_rank=512",
        "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=128", "model.num_experts=64",
        "model.moe_router_topk=6", "model.moe_ffn_hidden_size=1408", "model.moe_shared_expert_ffn_hidden_size=2816",
        "model.moe_layer_pattern=[0" + ",1" * 26 + "]", "model.moe_router_score_function=sigmoid",
        "model.moe_router_expert_bias=true", "model.moe_router_num_groups=1", "model.moe_router_group_topk=1",
        "model.moe_router_topk_scaling_factor=1.0", "model.tie_word_embeddings=false"], 102400),
}


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def device_memory(stage: str) -> None:
    """Print the GPU memory torch has allocated at ``stage``."""
    if ON_GPU:
        print(f"[memory] {stage}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)


def event_seconds(fn: Callable[[], object], calls: int, tries: int = 3, warmups: int = 1) -> float:
    """Seconds per call of ``fn`` on the GPU: after ``warmups`` calls, the best of ``tries``
    timings (CUDA events) of ``calls`` calls in a row."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return min(times)


def measure_peaks(repeats: int = 20) -> Tuple[float, float]:
    """This GPU's (TFLOP/s, TB/s): the best of three timings of ``repeats`` 8192 x 8192 x 8192
    bf16 matmuls, and of ``repeats`` copies of 4 GiB (each byte read once and written once)."""
    def matmul_tflops() -> float:
        a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return 2 * 8192**3 / event_seconds(lambda: a @ b, repeats) / 1e12

    def copy_tbs() -> float:
        source = torch.empty(2**30, device="cuda", dtype=torch.float32)
        target = torch.empty_like(source)
        return 2 * source.numel() * 4 / event_seconds(lambda: target.copy_(source), repeats) / 1e12

    peaks = matmul_tflops(), copy_tbs()
    release_memory()
    return peaks


def roofline_seconds(m, vocab: int, batch: int, prompt_len: int, new_tokens: int, tflops: float = PEAK_TFLOPS,
                     tbs: float = PEAK_TBS, dtype_bytes: int = 2) -> float:
    """A lower bound on one batch's time (prefill, then ``new_tokens`` decode steps): the prefill's
    matmuls and causal attention at ``tflops`` (the LM head runs on the last token only), then per
    decode step the slower of its matmuls at ``tflops`` and reading their weights at ``tbs``, plus
    reading every row's cached keys and values at ``tbs``. For MoE the matmuls are the active
    ones (a token's top-k experts) and the weights read are those the step's rows reach
    (``decode_weight_params``)."""
    flops, bandwidth = tflops * 1e12, tbs * 1e12
    active = active_matmul_params(m, vocab)
    layers = active - vocab * m.hidden_size
    prefill = (2 * layers * prompt_len + attention_flops(m, prompt_len)) * batch / flops
    step = max(2 * active * batch / flops, decode_weight_params(m, vocab, batch) * dtype_bytes / bandwidth)
    cached = batch * kv_bytes_per_token(m, dtype_bytes) * (new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2)
    return prefill + new_tokens * step + cached / bandwidth


@dataclass
class DecodeBound:
    """One MoE decode step's lower bound and what it reads."""
    experts_per_layer: float  # expected distinct routed experts per MoE layer
    expert_bytes: float       # their weights, all MoE layers
    other_bytes: float        # attention, router, shared experts, dense layers, LM head
    kv_bytes: float           # cached keys and values, mean over the steps
    seconds: float

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.seconds


def moe_decode_bound(m, vocab: int, batch: int, prompt_len: int, new_tokens: int, tbs: float = MEASURED_TBS,
                     tflops: float = PEAK_TFLOPS, dtype_bytes: int = 2) -> DecodeBound:
    """Per decode step of ``batch`` rows: reading the weights the step touches and the KV cache
    (at a mean of prompt_len + (new_tokens - 1) / 2 cached tokens per row) at ``tbs``, or the
    active matmuls at ``tflops`` if slower."""
    touched = experts_touched(m, batch)
    expert_bytes = sum(moe_layers(m)) * touched * expert_params(m) * dtype_bytes
    other_bytes = decode_weight_params(m, vocab, batch) * dtype_bytes - expert_bytes
    kv_bytes = batch * kv_bytes_per_token(m, dtype_bytes) * (prompt_len + (new_tokens - 1) / 2)
    seconds = max((expert_bytes + other_bytes + kv_bytes) / (tbs * 1e12),
                  2 * active_matmul_params(m, vocab) * batch / (tflops * 1e12))
    return DecodeBound(touched, expert_bytes, other_bytes, kv_bytes, seconds)


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")


def per_expert_hf_tensors(named: Iterable[Tuple[str, torch.Tensor]], m) -> Iterator[Tuple[str, torch.Tensor]]:
    """A transformers model's tensors under the names its checkpoints use, which the engine takes:
    a layer's fused experts (``gate_up_proj`` E × 2I × H with the gate rows first, ``down_proj``
    E × H × I) split into each expert's gate, up and down matrices (views, no copy), and the router
    under the family's checkpoint name (Mixtral's ``block_sparse_moe``). Other tensors, and experts
    already stored one by one, pass unchanged."""
    from megatron_rl.models.families import get_family
    from megatron_rl.models.hf_names import _MOE_HF

    naming = get_family(m.family).moe_naming
    if naming is None:
        yield from named
        return
    router, gate, up, down = _MOE_HF[naming]
    for name, tensor in named:
        fused, routed = _FUSED_EXPERTS.match(name), _ROUTER.match(name)
        if fused:
            layer, which = fused.groups()
            if tensor.dim() != 3 or tensor.shape[1 if which == "down_proj" else 2] != m.hidden_size:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not the layout this bench splits "
                                 f"(E x 2I x H or E x H x I with H = {m.hidden_size})")
            for e in range(tensor.shape[0]):
                if which == "down_proj":
                    yield f"{layer}.{down.format(e=e)}", tensor[e]
                else:
                    half = tensor.shape[1] // 2
                    yield f"{layer}.{gate.format(e=e)}", tensor[e, :half]
                    yield f"{layer}.{up.format(e=e)}", tensor[e, half:]
        elif routed:
            yield f"{routed.group(1)}.{router}", tensor
        else:
            yield name, tensor


def build_hf_model(m, vocab: int):
    """transformers' model of ``m``'s shape with random weights, built on the GPU directly (a 30 B
    model initialised on the host would take minutes and its size in host memory)."""
    import transformers

    from megatron_rl.models.hf_config import hf_config_from_model

    hf_dict = hf_config_from_model(m, vocab)
    hf_cfg = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    dtype = torch.bfloat16 if m.dtype == "bf16" else torch.float32
    with torch.device("cuda" if ON_GPU else "cpu"):
        return transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()


def weights_to_host(hf_model, m) -> List[Tuple[str, torch.Tensor]]:
    """The model's tensors in host memory under checkpoint names, one tensor moved at a time."""
    return list(per_expert_hf_tensors(((k, v.detach().to("cpu")) for k, v in hf_model.state_dict().items()), m))


def engine_run(engine, prompts: List[List[int]], new_tokens: int, weights: Optional[Sequence[Tuple[str, torch.Tensor]]],
               warmup_tokens: int = 4, host_profile: bool = False, repeats: int = 1) -> Tuple[float, list]:
    """Push ``weights`` (None: keep the engine's own random ones), warm up at this batch, then
    time ``repeats`` batches of ``prompts``: (the median batch's seconds, [(tokens, logprobs,
    routed experts or None)] per prompt of it); the engine's stats are the median batch's.
    ``host_profile``: then ``profile_host`` (its batches leave the stats as they were)."""
    from megatron_rl.rollout.embedded.engine import EngineStats
    from megatron_rl.api.engine import whole_response
    from megatron_rl.types import SamplingParams

    async def go():
        params = SamplingParams(max_new_tokens=new_tokens, stream=False)
        if weights is not None:
            await engine.pause()
            await engine.update_weights(weights, version=1)
            await engine.resume()
        # Warm-up at the measured batch: kernels compiled, the decode graph of this batch captured.
        warm = SamplingParams(max_new_tokens=warmup_tokens, stream=False)
        await asyncio.gather(*(engine.generate_n([f"warm{i}"], p, warm) for i, p in enumerate(prompts)))

        async def one(i, ids):
            response = await whole_response(engine.generate(f"r{i}", ids, params))
            return response.token_ids, response.logprobs, response.routed_experts

        runs = []
        for repeat in range(repeats):
            engine.stats = EngineStats()  # the table's prefill and step times are the measured run's
            collections = GarbageCollections()
            synchronize()
            start = time.perf_counter()
            out = await asyncio.gather(*(one(f"{repeat}-{i}", p) for i, p in enumerate(prompts)))
            synchronize()
            took = time.perf_counter() - start
            collections.close()
            print(f"measured batch {repeat + 1} of {repeats}: {took:.3f} s; {collections}", flush=True)
            runs.append((took, out, engine.stats))
        runs.sort(key=lambda run: run[0])
        if repeats > 1:
            print(f"measured batches: median {runs[len(runs) // 2][0]:.3f} s, fastest {runs[0][0]:.3f} s, "
                  f"slowest {runs[-1][0]:.3f} s", flush=True)
        took, out, engine.stats = runs[len(runs) // 2]
        if host_profile:
            stats = engine.stats
            await profile_host(engine, prompts, params)
            engine.stats = stats
        return took, out

    return asyncio.run(go())


def use_decode_attention(name: str) -> None:
    """sdpa: torch's fused kernel, whichever backend it picks (cuDNN on an H200); efficient: the
    same with cuDNN's backend off (the memory-efficient kernel); triton: the split-key kernel of
    models/decode_attention.py, ``triton:N`` with its slicing aiming at N programs (at most rows x
    key groups: one slice, no combining launch), ``triton:BLOCKxWARPSxSTAGES[xPROGRAMS]`` with
    those launch constants too (decode_attention_gpu.py's ``--configs`` form); matmul: two
    batched matmuls."""
    from megatron_rl.models.kv_attention import CachedKVAttention

    name, _, launch = name.partition(":")
    CachedKVAttention.decode_kernel = name if name in ("matmul", "triton") else "sdpa"
    torch.backends.cuda.enable_cudnn_sdp(name != "efficient")
    given = tuple(int(v) for v in launch.split("x")) if launch else ()
    if len(given) == 1:  # N: the target programs alone
        given = DEFAULT_ATTENTION_LAUNCH[:3] + given
    (_decode_attention.BLOCK_SLOTS, _decode_attention.SPLIT_WARPS, _decode_attention.SPLIT_STAGES,
     _decode_attention.TARGET_PROGRAMS) = given + DEFAULT_ATTENTION_LAUNCH[len(given):]


# decode_attention's launch constants as the module sets them: block, warps, stages, target programs.
DEFAULT_ATTENTION_LAUNCH = (_decode_attention.BLOCK_SLOTS, _decode_attention.SPLIT_WARPS,
                            _decode_attention.SPLIT_STAGES, _decode_attention.TARGET_PROGRAMS)


# A kernel's kind from its name, first match wins (names seen in an H200 profile: cuBLAS's nvjet /
# xmma / cutlass GEMMs and its split-K reduction, torch's element-wise functors, our Triton kernels).
KERNEL_KINDS = (
    ("attention", r"attention_(split|combine)_kernel|flash|fmha|cudnn|efficient_attention"),
    ("sampling", r"sample_(chunk|pick)_kernel|exponential|argmax|log_?softmax|logsumexp"),
    ("rotation+store", r"rope_store_kernel|rotary|rope"),
    ("norm", r"rms_norm|layer_norm|RowwiseMoments"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|splitKreduce|cublas"),
    ("activation", r"silu|swiglu|glu|gelu"),
    ("residual add", r"CUDAFunctor_add|AddFunctor|add_kernel"),
    ("copy", r"copy|Memcpy|memcpy|cat_|CatArray"),
)


def kernel_kind(name: str) -> str:
    """Which kind of work a GPU kernel named ``name`` does (KERNEL_KINDS; "other" if none)."""
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def kinds_table(kernels: Sequence[Tuple[str, float, int]], steps: int) -> List[str]:
    """Per kind of kernel, from (name, microseconds in all, launches in all) over ``steps`` steps:
    milliseconds and launches per step, microseconds per launch, share of the step's kernel time."""
    totals: Dict[str, List[float]] = {}
    for name, micros, count in kernels:
        entry = totals.setdefault(kernel_kind(name), [0.0, 0])
        entry[0] += micros
        entry[1] += count
    step_us = sum(us for us, _ in totals.values()) or 1.0
    lines = [f"    {'kind':<15} {'ms/step':>8} {'launches':>8} {'us/launch':>9} {'share':>6}"]
    for kind, (micros, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {kind:<15} {micros / steps / 1e3:>8.3f} {count / steps:>8.0f} "
                     f"{micros / max(count, 1):>9.2f} {micros / step_us:>6.1%}")
    return lines


def profile_decode(engine, prompts: List[List[int]], steps: int = 8, top: int = 8) -> None:
    """Wall and kernel time of the engine's decode step (graph replay, sampling, host sync) at
    this batch, and its heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.types import SamplingParams

    gen = engine._gen
    params = SamplingParams(max_new_tokens=3 * steps)
    # Kernels on a GPU; on a CPU (a dry run of the bench) the profiler has no device to watch.
    activities = [ProfilerActivity.CUDA if ON_GPU else ProfilerActivity.CPU]
    synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        gen.prefill(prompts, params)
        synchronize()
    wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    print(f"prefill of {len(prompts)} rows: wall {wall * 1e3:.1f} ms (profiled), "
          f"kernels {sum(e.device_time_total for e in events) / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / 1e3:8.2f} ms {e.count:5d}x {e.key[:110]}")
    print(f"prefill of {len(prompts)} rows by kind of kernel:")
    for line in kinds_table([(e.key, e.device_time_total, e.count) for e in events], 1):
        print(line)
    for _ in range(2):
        gen.decode(params)
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        gen.decode(params)
    wall = (time.perf_counter() - start) / steps
    with profile(activities=activities) as prof:
        for _ in range(steps):
            gen.decode(params)
        synchronize()
    events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    kernel_ms = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"decode step at {len(prompts)} rows: wall {wall * 1e3:.2f} ms, kernels {kernel_ms:.2f} ms "
          f"(graphs: {sorted(getattr(gen._static, 'graphs', {}))})")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / steps / 1e3:7.3f} ms/step {e.count // steps:5d}x {e.key[:110]}")
    print(f"decode step at {len(prompts)} rows by kind of kernel:")
    for line in kinds_table([(e.key, e.device_time_total, e.count) for e in events], steps):
        print(line)


class GarbageCollections:
    """Python's cyclic garbage collections (any thread) while it is open, per generation: a full
    collection walks every object the process holds, which the event loop waits for."""

    def __init__(self):
        self.spent: Dict[int, List[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self.spent[info["generation"]].append(time.perf_counter() - self._started)

    def clear(self) -> None:
        for spent in self.spent.values():
            spent.clear()

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def __str__(self) -> str:
        return "garbage collections by generation: " + ", ".join(
            f"{gen}: {len(spent)} in {1e3 * sum(spent):.1f} ms" for gen, spent in self.spent.items())


async def profile_host(engine, prompts: List[List[int]], params, top: int = 25) -> None:
    """Where the host's time outside model calls goes: one more batch as the table times it, then
    one under cProfile, its functions by own time. On Python 3.12 the profile holds the compute
    thread's functions too (its waits on the GPU lead the list). cProfile slows Python, so its
    run is longer than the first."""
    import cProfile
    import pstats

    from megatron_rl.api.engine import whole_response
    from megatron_rl.rollout.embedded.engine import EngineStats

    profiler = cProfile.Profile()
    collections = GarbageCollections()
    for tag in ("again", "profiled"):
        engine.stats = EngineStats()
        collections.clear()
        synchronize()
        start = time.perf_counter()
        if tag == "profiled":
            profiler.enable()
        await asyncio.gather(*(whole_response(engine.generate(f"{tag}{i}", ids, params))
                               for i, ids in enumerate(prompts)))
        synchronize()
        took = time.perf_counter() - start
        profiler.disable()
        st = engine.stats
        print(f"host: batch {tag}: {took:.3f} s = prefill {st.prefill_s + st.admit_s:.3f} s + {st.decode_steps} "
              f"decode steps {st.decode_s:.3f} s + outside model calls {took - st.compute_s:.3f} s; {collections}",
              flush=True)
    collections.close()
    stats = pstats.Stats(profiler)
    rows = [(tt, ct, nc, f"{Path(fn).name}:{line} {name}") for (fn, line, name), (_, nc, tt, ct, _) in stats.stats.items()]
    print(f"host: the profiled batch's functions by own time (top {top}): own s, cumulative s, calls")
    for tt, ct, nc, where in sorted(rows, reverse=True)[:top]:
        print(f"    {tt:8.4f} {ct:8.4f} {nc:7d} {where[:100]}")


def hf_run(model, prompts: List[List[int]], new_tokens: int, runs: int = 2) -> List[float]:
    """Seconds of each of ``runs`` ``generate`` calls. The first is the slower: on an H200 at batch
    256 one call measured 2,160-3,549 tokens/s, the faster of two 4,886-5,527; the table takes
    the fastest."""
    return [_hf_once(model, prompts, new_tokens) for _ in range(runs)]


def _hf_once(model, prompts: List[List[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        synchronize()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - start


def parameter_count(m, vocab: int) -> int:
    """Matmul weights plus an untied embedding (norms are negligible)."""
    return matmul_params(m, vocab) + (0 if m.tie_word_embeddings else vocab * m.hidden_size)


def learner_does_not_fit(m, vocab: int) -> Optional[str]:
    """Why a learner for the logprob gap would not fit beside the engine, or None. Built, it holds
    10 bytes per parameter (bf16 weights, fp32 gradient buffer and main weights; Adam's moments
    come at the first optimizer step, which the gap does not take)."""
    if not ON_GPU:
        return None
    need = 10 * parameter_count(m, vocab) + 4 * 2**30
    free = torch.cuda.mem_get_info()[0]
    if need <= free:
        return None
    return (f"a learner of {parameter_count(m, vocab) / 1e9:.1f} B parameters needs ~{need / 1e9:.0f} GB, "
            f"{free / 1e9:.0f} GB are free beside the engine")


def bench_trajectories(prompts: List[List[int]], out: list, rows: int, routed: bool) -> list:
    """The first ``rows`` responses as trajectories, with the engine's recorded routing or without."""
    from megatron_rl.rollout.routed_experts import over_positions
    from megatron_rl.types import Trajectory

    return [Trajectory(f"p{i}", 0, prompts[i], tokens, logprobs, [1] * len(tokens), "length",
                       routed_experts=over_positions(routing, len(prompts[i]) + len(tokens)) if routed else None)
            for i, (tokens, logprobs, routing) in enumerate(out[:rows])]


def gap_line(what: str, trajs: Sequence, mine: Sequence[Sequence[float]], dtype: str) -> str:
    gaps = [abs(a - b) for t, lp in zip(trajs, mine) for a, b in zip(t.logprobs, lp)]
    return (f"engine/learner {dtype} logprob gap, {what}, over {len(gaps)} sampled tokens: mean "
            f"{statistics.mean(gaps):.4f}, median {statistics.median(gaps):.4f}, max {max(gaps):.3f}")


def logprob_gap(cfg, vocab: int, engine, prompts: List[List[int]], out: list, rows: int) -> List[str]:
    """The engine/learner logprob gap over ``rows`` of the engine's responses, as lines: with the
    learner's own routing and, for a mixture of experts whose engine recorded its routing, again
    replaying it (``algo.routing_replay``), with the share of the engine's choices the learner's
    routers make themselves. The learner is freed before returning."""
    from megatron_rl.learner.learner import Learner

    reason = learner_does_not_fit(cfg.model, vocab)
    if reason:
        return [f"engine/learner logprob gap not measured: {reason}"]
    learner = Learner(cfg, vocab_size=vocab)
    learner.module.load_state_dict(engine.model.state_dict(), strict=False)
    plain = bench_trajectories(prompts, out, rows, routed=False)
    lines = [gap_line("the learner's own routing", plain, learner.compute_logprobs(plain, 1.0), cfg.model.dtype)]
    if any(routing is not None for _, _, routing in out[:rows]):
        replayed = bench_trajectories(prompts, out, rows, routed=True)
        mine = learner.compute_logprobs(replayed, 1.0)
        agreement = learner.routing_stats.pop_metrics().get("moe/router_agreement", float("nan"))
        what = ("replaying the engine's routing" if learner.replay_routing else
                "the engine's routing recorded but not replayed (algo.routing_replay)")
        lines.append(gap_line(what, replayed, mine, cfg.model.dtype)
                     + f"; the learner's routers make {100 * agreement:.2f} % of the engine's choices")
    drop_autograd_leftovers(learner)
    learner = None
    release_memory()
    return lines


def moe_bound_line(m, vocab: int, batch: int, prompt_len: int, new_tokens: int, variant: str, engine_tps: float,
                   step_ms: float, dtype_bytes: int, tbs: float = MEASURED_TBS) -> str:
    """The MoE decode-step bound at this batch (memory read at ``tbs``) and the engine's share of
    it, as one line."""
    b = moe_decode_bound(m, vocab, batch, prompt_len, new_tokens, tbs=tbs, dtype_bytes=dtype_bytes)
    share = f"{100 * 1e3 * b.seconds / step_ms:.1f} %" if step_ms > 0 else "n/a (no decode step)"
    return (f"MoE decode bound, batch {batch} ({variant}): {b.experts_per_layer:.1f} of {m.num_experts} experts "
            f"per layer -> {b.expert_bytes / 1e9:.2f} GB of experts + {b.other_bytes / 1e9:.2f} GB of other weights "
            f"+ {b.kv_bytes / 1e9:.2f} GB of KV cache per step at {tbs:.2f} TB/s = {1e3 * b.seconds:.2f} ms "
            f"({b.tokens_per_s(batch):,.0f} tokens/s); engine {step_ms:.2f} ms/step = "
            f"{share} of it, {engine_tps:,.0f} tokens/s = "
            f"{100 * engine_tps / b.tokens_per_s(batch):.1f} % of its tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the preset's, else 151936)")
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a whole MoE model's shape (replaces --recipe)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers model: the engine keeps its own weights")
    parser.add_argument("--hf-calls", type=int, default=2, help="generate calls per batch")
    parser.add_argument("--gap-rows", type=int, default=16)
    parser.add_argument("--decode-attention", default="triton",
                        help="sdpa | efficient | triton | triton:PROGRAMS | triton:BLOCKxWARPSxSTAGES[xPROGRAMS] | "
                             "matmul (comma-separated to compare): the decode step's attention")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="tokens per request of the warm-up batch (--new-tokens: every width's graph captured)")
    parser.add_argument("--width-step", type=int, default=0,
                        help="attention width bucket of the decode graphs (0: decode_graphs.WIDTH_STEP)")
    parser.add_argument("--profile", action="store_true", help="profile the decode step at each batch")
    parser.add_argument("--profile-top", type=int, default=8, help="kernels listed per profiled batch")
    parser.add_argument("--host-profile", action="store_true",
                        help="after each run: one more batch timed, one under cProfile (the host's time)")
    parser.add_argument("--graphs", default="on", help="on | off | on,off: decode steps from CUDA graphs or eager")
    parser.add_argument("--repeats", type=int, default=1,
                        help="batches timed per engine after its warm-up: the table takes the median one")
    parser.add_argument("--sampler", default="fused",
                        help="fused | torch | fused,torch: plain sampling in Triton kernels "
                             "(rollout/sampling_kernel.py, on a GPU) or the compiled torch path")
    args, overrides = parser.parse_known_args()
    if args.width_step:
        from megatron_rl.rollout.embedded import decode_graphs

        decode_graphs.WIDTH_STEP = args.width_step

    import transformers

    from megatron_rl.checks import load_config
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.rollout import sampling_kernel
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.embedded.engine import engine_options

    recipe, preset_overrides, preset_vocab = PRESETS[args.preset] if args.preset else (args.recipe, [], 151936)
    vocab = args.vocab or preset_vocab
    overrides = [*preset_overrides, *overrides]
    cfg = load_config(recipe, ["trainer.progress=false", f"data.max_prompt_tokens={args.prompt_len}",
                               f"rollout.max_new_tokens={args.new_tokens}",
                               f"model.max_position_embeddings={args.prompt_len + args.new_tokens + 8}", *overrides])
    m = cfg.model
    dtype_bytes = 2 if m.dtype == "bf16" else 4
    batches = [int(b) for b in args.batches.split(",")]
    kv_gb = max(batches) * 2 * m.max_position_embeddings * kv_bytes_per_token(m, dtype_bytes) / 1e9
    print(f"model: {args.preset or recipe} {' '.join(overrides)}: {parameter_count(m, vocab) / 1e9:.2f} B parameters, "
          f"{parameter_count(m, vocab) * dtype_bytes / 1e9:.1f} GB of {m.dtype} weights; engine KV cache at batch "
          f"{max(batches)}: {kv_gb:.1f} GB; transformers' model, then each engine, one at a time", flush=True)
    if ON_GPU:  # the 'measured' roofline is this card's
        peak_tflops, peak_tbs = measure_peaks()
        peaks_said = f"this {torch.cuda.get_device_name()}'s measured peaks ({peak_tflops:.0f} TFLOP/s, {peak_tbs:.2f} TB/s)"
    else:
        peak_tflops, peak_tbs = MEASURED_TFLOPS, MEASURED_TBS
        peaks_said = f"an H200's measured peaks ({peak_tflops:.0f} TFLOP/s, {peak_tbs} TB/s), not this CPU's"
    print(f"roofline 'measured' at {peaks_said}", flush=True)
    init_model_parallel(1, 1, seed=0)
    torch.manual_seed(0)
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(b)] for b in batches}

    # transformers first; its weights then wait in host memory while the engines run.
    hf_rates: Dict[int, List[float]] = {}
    notes: List[str] = []
    weights = None
    if not args.skip_hf:
        hf_model = build_hf_model(m, vocab)
        device_memory("transformers' model built")
        experts = getattr(hf_model.config, "_experts_implementation", None)
        for batch in batches:
            hf_rates[batch] = [batch * args.new_tokens / took
                               for took in hf_run(hf_model, prompts[batch], args.new_tokens, args.hf_calls)]
            notes.append(f"generate at batch {batch}, tokens/s per call: "
                         + ", ".join(f"{r:,.0f}" for r in hf_rates[batch]))
            print(notes[-1], flush=True)
        if m.num_experts:
            notes.append(f"transformers' experts implementation: {experts}")
        weights = weights_to_host(hf_model, m)
        hf_model = None
        release_memory()
        device_memory("transformers' model freed, its weights in host memory")

    rows, moe_lines = [], []
    gap_lines = ["no gap measured" if args.gap_rows else "gap not asked for (--gap-rows 0)"]
    gap_done = not args.gap_rows
    for batch in batches:
        hf_tps, hf_first = (max(hf_rates[batch]), hf_rates[batch][0]) if batch in hf_rates else (float("nan"),) * 2
        roofline_tps = batch * args.new_tokens / roofline_seconds(m, vocab, batch, args.prompt_len, args.new_tokens,
                                                                  dtype_bytes=dtype_bytes)
        measured_tps = batch * args.new_tokens / roofline_seconds(m, vocab, batch, args.prompt_len, args.new_tokens,
                                                                  peak_tflops, peak_tbs, dtype_bytes)
        for graphs in args.graphs.split(","):
            for attention, sampler in itertools.product(args.decode_attention.split(","), args.sampler.split(",")):
                use_decode_attention(attention)
                sampling_kernel.ENABLED = sampler == "fused"
                options = {**engine_options(cfg), "cuda_graphs": graphs == "on"}
                engine = EmbeddedEngine(m, vocab, max_batch_size=batch, seed=0, **options)
                device_memory(f"engine for batch {batch} built")
                took, out = engine_run(engine, prompts[batch], args.new_tokens, weights, args.warmup_tokens,
                                       args.host_profile, args.repeats)
                tokens = sum(len(t) for t, _, _ in out)
                assert tokens == batch * args.new_tokens, tokens
                st = engine.stats
                print(f"batch {batch} run: {took:.3f} s = prefill and admissions {st.prefill_s + st.admit_s:.3f} s "
                      f"+ {st.decode_steps} decode steps {st.decode_s:.3f} s + outside model calls "
                      f"{took - st.compute_s:.3f} s (requests, recording, responses)", flush=True)
                device_memory(f"engine at batch {batch} after its run (KV cache, graphs)")
                if args.profile:
                    profile_decode(engine, prompts[batch], top=args.profile_top)
                if not gap_done:
                    gap_lines, gap_done = logprob_gap(cfg, vocab, engine, prompts[batch], out, args.gap_rows), True
                asyncio.run(engine.shutdown())
                engine = None
                release_memory()
                device_memory("engine shut down and freed")
                engine_tps, step_ms = tokens / took, 1e3 * st.decode_s / max(st.decode_steps, 1)
                variant = f"{graphs}/{attention}" + ("/torch" if sampler == "torch" else "")
                rows.append(f"{batch:>6} {args.prompt_len:>7} {args.new_tokens:>5} {variant:>15} {engine_tps:>12.0f} "
                            f"{st.prefill_s + st.admit_s:>9.2f} {step_ms:>8.2f} {hf_tps:>14.0f} "
                            f"{engine_tps / hf_tps:>7.2f}x {engine_tps / hf_first:>7.2f}x "
                            f"{roofline_tps:>13.0f} {100 * engine_tps / roofline_tps:>5.0f}% "
                            f"{100 * engine_tps / measured_tps:>7.1f}%")
                print(rows[-1], flush=True)
                if m.num_experts:
                    moe_lines.append(moe_bound_line(m, vocab, batch, args.prompt_len, args.new_tokens, variant,
                                                    engine_tps, step_ms, dtype_bytes, peak_tbs))
                    print(moe_lines[-1], flush=True)

    device = torch.cuda.get_device_name() if ON_GPU else "CPU"
    print(f"\nembedded engine vs transformers {transformers.__version__} generate, {args.preset or recipe} shape "
          f"{' '.join(overrides)}, vocab {vocab}, {m.dtype}, T=1, no stop token ({device}); roofline at "
          f"{PEAK_TFLOPS:.0f} TFLOP/s and {PEAK_TBS} TB/s (an H200's datasheet); 'measured': the same roofline at "
          f"{peaks_said}")
    print(f"{'batch':>6} {'prompt':>7} {'new':>5} {'graphs/decode':>15} {'engine tok/s':>12} {'prefill s':>9} "
          f"{'ms/step':>8} {'generate tok/s':>14} {'ratio':>8} {'vs 1st':>8} {'roofline tok/s':>13} {'of it':>6} "
          f"{'measured':>8}")
    for line in rows:
        print(line)
    for line in moe_lines + notes + gap_lines:
        print(line)


if __name__ == "__main__":
    main()
