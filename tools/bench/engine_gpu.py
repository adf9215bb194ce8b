"""Benchmark: the embedded engine against transformers' ``generate`` on one GPU, same model.

    python tools/bench/engine_gpu.py [--batches 64,256] [--prompt-len 512] [--new-tokens 256]
        [--vocab 151936] [--skip-hf] [--gap-rows 16] [--graphs on,off] [--profile]
        [--decode-attention sdpa,efficient,triton,matmul] [--warmup-tokens 4] [--width-step 256]

One random-weight Hugging Face Qwen2 model of ``gsm8k_qwen2_gpu``'s shape (Qwen2-1.5B: 28 layers,
hidden 1536, GQA 12/2) in bf16 is built with transformers; its weights are pushed into the
embedded engine (Megatron GPTModel, KV cache), so both serve the same model. Both get the same
prompts (random ids, --prompt-len each) and sample at T = 1 with no top-k/top-p and no stop token,
so every request generates exactly --new-tokens tokens. Per batch size: the engine's tokens/s
(all requests submitted at once, after a warm-up of the same batch for 4 tokens; decode steps
replayed from CUDA graphs, ``--graphs on``, or launched eagerly, ``off``), its prefill seconds and
decode milliseconds per step, ``generate``'s tokens/s (the faster of two calls over the whole
batch, each after a short warm-up call; each call's rate is listed below the table), the ratio to
it and, ``vs 1st``, to the first call's rate (what one call of ``generate`` per run gives; the
second has run 1.4–3.4× faster here); then the roofline (``roofline_seconds``: the chip's
datasheet peaks, no kernel can beat it) and the engine's share of it. ``--profile``: the
prefill's and the decode step's kernel time and heaviest kernels, per batch.
``--decode-attention``: the decode step's attention kernel(s);
``--width-step``: the graphs' attention-width bucket; ``--warmup-tokens``: the warm-up's length
(as long as the run: every graph the run needs is captured before it is timed).
Then the engine/learner logprob gap in bf16: a learner with the same weights recomputes the
logprobs of --gap-rows of the engine's sampled responses; mean and max |difference| per token.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner_gpu import matmul_params  # noqa: E402 - the sibling benchmark's parameter count

# An H200's datasheet peaks: dense bf16 matmuls and HBM3e bandwidth. The roofline column uses them.
PEAK_TFLOPS = 989.0
PEAK_TBS = 4.8


def roofline_seconds(m, vocab: int, batch: int, prompt_len: int, new_tokens: int, tflops: float = PEAK_TFLOPS,
                     tbs: float = PEAK_TBS, dtype_bytes: int = 2) -> float:
    """A lower bound on one batch's time (prefill, then ``new_tokens`` decode steps): the prefill's
    matmuls and causal attention at ``tflops`` (the LM head runs on the last token only), then per
    decode step the slower of its matmuls at ``tflops`` and reading their weights at ``tbs``, plus
    reading every row's cached keys and values at ``tbs``."""
    flops, bandwidth = tflops * 1e12, tbs * 1e12
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    weights = matmul_params(m, vocab)
    layers = weights - vocab * m.hidden_size
    attention = 2 * m.num_layers * m.num_attention_heads * hd * prompt_len ** 2  # per row: QK and PV, causal
    prefill = (2 * layers * prompt_len + attention) * batch / flops
    step = max(2 * weights * batch / flops, weights * dtype_bytes / bandwidth)
    kv_per_token = m.num_layers * 2 * m.num_query_groups * hd * dtype_bytes
    cached = batch * kv_per_token * (new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2)
    return prefill + new_tokens * step + cached / bandwidth


def engine_run(engine, prompts: List[List[int]], new_tokens: int, weights,
               warmup_tokens: int = 4) -> Tuple[float, list]:
    from megatron_rl.rollout.embedded.engine import EngineStats
    from megatron_rl.types import SamplingParams

    async def go():
        params = SamplingParams(max_new_tokens=new_tokens, stream=False)
        await engine.pause()
        await engine.update_weights(weights, version=1)
        await engine.resume()
        # Warm-up at the measured batch: kernels compiled, the decode graph of this batch captured.
        warm = SamplingParams(max_new_tokens=warmup_tokens, stream=False)
        await asyncio.gather(*(engine.generate_n([f"warm{i}"], p, warm) for i, p in enumerate(prompts)))
        engine.stats = EngineStats()  # the table's prefill and step times are the measured run's

        async def one(i, ids):
            tokens, logprobs = [], []
            async for chunk in engine.generate(f"r{i}", ids, params):
                tokens += chunk.token_ids
                logprobs += chunk.logprobs
            return tokens, logprobs

        torch.cuda.synchronize()
        start = time.perf_counter()
        out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    return asyncio.run(go())


def use_decode_attention(name: str) -> None:
    """sdpa: torch's fused kernel, whichever backend it picks (cuDNN on an H200); efficient: the
    same with cuDNN's backend off (the memory-efficient kernel); triton: the split-key kernel of
    models/decode_attention.py; matmul: two batched matmuls."""
    from megatron_rl.models.kv_attention import CachedKVAttention

    CachedKVAttention.decode_kernel = name if name in ("matmul", "triton") else "sdpa"
    torch.backends.cuda.enable_cudnn_sdp(name != "efficient")


def profile_decode(engine, prompts: List[List[int]], steps: int = 8, top: int = 8) -> None:
    """Wall and kernel time of the engine's decode step (graph replay, sampling, host sync) at
    this batch, and its heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rl.types import SamplingParams

    gen = engine._gen
    params = SamplingParams(max_new_tokens=3 * steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.prefill(prompts, params)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    print(f"prefill of {len(prompts)} rows: kernels {sum(e.device_time_total for e in events) / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / 1e3:8.2f} ms {e.count:5d}x {e.key[:110]}")
    for _ in range(2):
        gen.decode(params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        gen.decode(params)
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            gen.decode(params)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    kernel_ms = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"decode step at {len(prompts)} rows: wall {wall * 1e3:.2f} ms, kernels {kernel_ms:.2f} ms "
          f"(graphs: {sorted(getattr(gen._static, 'graphs', {}))})")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / steps / 1e3:7.3f} ms/step {e.count // steps:5d}x {e.key[:110]}")


def hf_run(model, prompts: List[List[int]], new_tokens: int, runs: int = 2) -> List[float]:
    """Seconds of each of ``runs`` ``generate`` calls. The first is the slower: on an H200 at batch
    256 one call measured 2,160-3,549 tokens/s, the faster of two 4,886-5,527; the table takes
    the fastest."""
    return [_hf_once(model, prompts, new_tokens) for _ in range(runs)]


def _hf_once(model, prompts: List[List[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None,
                  attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--recipe", default="gsm8k_qwen2_gpu")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--gap-rows", type=int, default=16)
    parser.add_argument("--decode-attention", default="sdpa",
                        help="sdpa | efficient | triton | matmul (comma-separated to compare): the decode step's attention")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="tokens per request of the warm-up batch (--new-tokens: every width's graph captured)")
    parser.add_argument("--width-step", type=int, default=0,
                        help="attention width bucket of the decode graphs (0: decode_graphs.WIDTH_STEP)")
    parser.add_argument("--profile", action="store_true", help="profile the decode step at each batch")
    parser.add_argument("--profile-top", type=int, default=8, help="kernels listed per profiled batch")
    parser.add_argument("--graphs", default="on", help="on | off | on,off: decode steps from CUDA graphs or eager")
    args = parser.parse_args()
    if args.width_step:
        from megatron_rl.rollout.embedded import decode_graphs

        decode_graphs.WIDTH_STEP = args.width_step

    import transformers

    from megatron_rl.config import load_config
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.models.hf_config import hf_config_from_model
    from megatron_rl.rollout.embedded import EmbeddedEngine

    cfg = load_config(args.recipe, ["trainer.progress=false",
                                    f"model.max_position_embeddings={args.prompt_len + args.new_tokens + 8}"])
    init_model_parallel(1, 1, seed=0)
    torch.manual_seed(0)
    hf_dict = hf_config_from_model(cfg.model, args.vocab)
    hf_cfg = transformers.AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).cuda().eval()
    weights = [(k, v.detach()) for k, v in hf_model.state_dict().items()]
    rng = random.Random(0)
    rows, notes = [], []
    gap_out = None
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        results = []
        variants = [(g, a) for g in args.graphs.split(",") for a in args.decode_attention.split(",")]
        for graphs, attention in variants:
            use_decode_attention(attention)
            engine = EmbeddedEngine(cfg.model, args.vocab, max_batch_size=batch, seed=0, cuda_graphs=graphs == "on")
            took, out = engine_run(engine, prompts, args.new_tokens, weights, args.warmup_tokens)
            tokens = sum(len(t) for t, _ in out)
            assert tokens == batch * args.new_tokens, tokens
            st = engine.stats
            if args.profile:
                profile_decode(engine, prompts, top=args.profile_top)
            results.append((f"{graphs}/{attention}", tokens / took, st.prefill_s + st.admit_s,
                            1e3 * st.decode_s / max(st.decode_steps, 1)))
            if gap_out is None:
                gap_out = (engine, prompts, out)
            else:
                asyncio.run(engine.shutdown())
                del engine
            torch.cuda.empty_cache()
        hf_tps = hf_first = float("nan")
        if not args.skip_hf:
            rates = [batch * args.new_tokens / took for took in hf_run(hf_model, prompts, args.new_tokens)]
            hf_tps, hf_first = max(rates), rates[0]
            notes.append(f"generate at batch {batch}, tokens/s per call: " + ", ".join(f"{r:,.0f}" for r in rates))
        roofline_tps = batch * args.new_tokens / roofline_seconds(cfg.model, args.vocab, batch, args.prompt_len,
                                                                  args.new_tokens)
        for graphs, engine_tps, prefill_s, step_ms in results:
            rows.append(f"{batch:>6} {args.prompt_len:>7} {args.new_tokens:>5} {graphs:>15} {engine_tps:>12.0f} "
                        f"{prefill_s:>9.2f} {step_ms:>8.2f} {hf_tps:>14.0f} {engine_tps / hf_tps:>7.2f}x "
                        f"{engine_tps / hf_first:>7.2f}x "
                        f"{roofline_tps:>13.0f} {100 * engine_tps / roofline_tps:>5.0f}%")
            print(rows[-1], flush=True)
    del hf_model
    torch.cuda.empty_cache()

    gap_line = "no gap measured"
    if gap_out is not None and args.gap_rows:
        from megatron_rl.learner.learner import Learner
        from megatron_rl.types import Trajectory

        engine, prompts, out = gap_out
        learner = Learner(cfg, vocab_size=args.vocab)
        learner.module.load_state_dict(engine.model.state_dict(), strict=False)
        asyncio.run(engine.shutdown())
        trajs = [Trajectory(f"p{i}", 0, prompts[i], out[i][0], out[i][1], [1] * len(out[i][0]), "length")
                 for i in range(min(args.gap_rows, len(out)))]
        mine = learner.compute_logprobs(trajs, 1.0)
        gaps = [abs(a - b) for t, lp in zip(trajs, mine) for a, b in zip(t.logprobs, lp)]
        gap_line = (f"engine/learner bf16 logprob gap over {len(gaps)} sampled tokens: mean {statistics.mean(gaps):.4f}, "
                    f"median {statistics.median(gaps):.4f}, max {max(gaps):.3f}")

    print(f"\nembedded engine vs transformers {transformers.__version__} generate, {args.recipe} shape, vocab "
          f"{args.vocab}, bf16, T=1, no stop token ({torch.cuda.get_device_name()})")
    print(f"{'batch':>6} {'prompt':>7} {'new':>5} {'graphs/decode':>15} {'engine tok/s':>12} {'prefill s':>9} "
          f"{'ms/step':>8} {'generate tok/s':>14} {'ratio':>8} {'vs 1st':>8} {'roofline tok/s':>13} {'of it':>6}")
    for line in rows:
        print(line)
    for line in notes:
        print(line)
    print(gap_line)


if __name__ == "__main__":
    main()
