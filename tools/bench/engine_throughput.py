"""Benchmark: generation throughput of the embedded engine and of vLLM, side by side.

    python tools/bench/engine_throughput.py [--requests 64] [--prompt-len 32] [--new-tokens 64]
        [--layers 4] [--hidden 256] [--heads 4] [--groups 2] [--vocab 512] [--threads 2]

Both engines serve the same random-init model (one Megatron learner's weights, HF-named, pushed to
each), the same prompts and the same sampling (T = 1, no stop token, so every request generates
exactly --new-tokens tokens). They run one after the other with --threads compute threads each
(vLLM: its engine-core process's OpenMP threads), after one warm-up request. Printed per engine:
requests, generated tokens, seconds, tokens/s. head_dim = hidden / heads must be one vLLM's CPU
attention accepts (64 here; 16 is rejected).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _engine_run(engine, prompts: List[List[int]], new_tokens: int) -> Tuple[int, float]:
    from megatron_rl.types import SamplingParams

    async def go():
        params = SamplingParams(max_new_tokens=new_tokens, stream=False)
        await engine.pause()
        await engine.update_weights(_WEIGHTS, version=1)
        await engine.resume()
        async for _ in engine.generate("warmup", prompts[0], SamplingParams(max_new_tokens=4, stream=False)):
            pass

        async def one(i, ids):
            n = 0
            async for chunk in engine.generate(f"r{i}", ids, params):
                n += len(chunk.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        took = time.perf_counter() - start
        await engine.shutdown()
        return sum(counts), took

    return asyncio.run(go())


_WEIGHTS: list = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="embedded,vllm", help="comma-separated subset to run")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from megatron_rl.config.schema import RootConfig
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(args.threads)
    init_model_parallel(1, 1, seed=0)
    cfg = RootConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups = args.layers, args.hidden, args.heads, args.groups
    m.ffn_hidden_size = 4 * args.hidden
    m.max_position_embeddings = args.prompt_len + args.new_tokens + 8
    learner = Learner(cfg, vocab_size=args.vocab)
    _WEIGHTS.extend((name, t.detach().clone()) for name, t in learner.export_hf_weights())
    del learner
    rng = random.Random(0)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]

    results = []
    for name in args.engines.split(","):
        if name == "embedded":
            engine = EmbeddedEngine(m, args.vocab, max_batch_size=args.requests, seed=0)
            label = "embedded (Megatron GPTModel, KV cache)"
        elif name == "vllm":
            from megatron_rl.rollout.vllm import VLLMEngine, vllm_import_error

            reason = vllm_import_error()
            if reason:
                print(f"vllm: skipped: {reason}")
                continue
            import vllm

            start = time.perf_counter()
            engine = VLLMEngine(m, args.vocab, max_batch_size=args.requests, seed=0, cpu_threads=args.threads)
            print(f"vLLM started in {time.perf_counter() - start:.1f} s", flush=True)
            label = f"vllm {vllm.__version__} (AsyncLLM, {'CPU' if not torch.cuda.is_available() else 'GPU'})"
        else:
            raise SystemExit(f"unknown engine {name!r}: choose embedded, vllm")
        tokens, took = _engine_run(engine, prompts, args.new_tokens)
        results.append((label, tokens, took))

    print(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.groups}, vocab {args.vocab}, "
          f"fp32; {args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new) tokens; "
          f"{args.threads} threads")
    print(f"{'engine':<44} {'requests':>8} {'tokens':>8} {'seconds':>8} {'tokens/s':>9}")
    for label, tokens, took in results:
        print(f"{label:<44} {args.requests:>8} {tokens:>8} {took:>8.2f} {tokens / took:>9.0f}")


if __name__ == "__main__":
    main()
