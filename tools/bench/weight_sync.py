"""Weight-sync benchmark: seconds and GB/s to push a sharded learner's weights (gathered over TP,
walked over PP stages, HF-named, bucketed) to rollout engines on other ranks, on this machine.

    python tools/bench/weight_sync.py                                  # ~106M-parameter model, TP=2 -> 1 engine
    python tools/bench/weight_sync.py --tp 1 --pp 2 --engines 2 --buckets 16,64,256
    python tools/bench/weight_sync.py --hidden 1536 --layers 28 --ffn 8960 --vocab 151936 --heads 12 --groups 2
    python tools/bench/weight_sync.py --tp 2 --engines 0      # gather + pack only (no engine rank)

Every rank is a spawned process on this machine (gloo on CPU, NCCL when CUDA is present; one GPU
per rank). The learner side is a bare Megatron GPTModel at the given layout (no optimizer: the
sync reads weights only); engines receive into fresh buffers (loading them into an engine model
is not counted). Each bucket size is timed over --repeats syncs after one warm-up; the table
gives the median, measured on the engine (first header received to last bucket unpacked) and on
the stage-0 source (first gather to last broadcast); on GPUs each side synchronises its device
before reading the clock. ``--engines 0`` times the learner side alone (TP/PP gathers, HF names,
packing; the broadcasts go to a group of the source only), e.g. a TP=2 learner on a 2-GPU machine,
where an engine on a third GPU is not available.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Dict, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.launch.groups import init_split_parallel_state
    from megatron_rl.learner.parallel import init_distributed
    from megatron_rl.models.gpt import build_gpt_model, padded_vocab_size
    from megatron_rl.weights.sync import SyncTopology, build_sync_groups, receive_weights, send_weights

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed()
    learners = args.tp * args.pp
    role = init_split_parallel_state(learners, args.tp, args.pp)
    groups = build_sync_groups(SyncTopology(tuple(s * args.tp for s in range(args.pp)), tuple(range(learners, world))))
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_query_groups=args.groups, ffn_hidden_size=args.ffn, dtype=args.dtype,
                      max_position_embeddings=128)
    vocab = padded_vocab_size(args.vocab, args.tp)
    module = build_gpt_model(cfg, vocab, tp=args.tp, pp=args.pp) if role == "learner" else None
    params = sum(p.numel() for p in module.parameters()) if module is not None else 0
    timings: Dict[int, List[float]] = {}
    nbytes = 0
    for mb in args.buckets:
        timings[mb] = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            dist.barrier(group=dist.group.WORLD)
            start = time.perf_counter()
            if role == "learner":
                stats = send_weights(module, cfg, groups, version=i, bucket_bytes=mb << 20)
            else:
                _, tensors, stats = receive_weights(groups)
                del tensors
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the last bucket's copies may still be queued
            seconds = time.perf_counter() - start
            if stats is not None:
                nbytes = stats.bytes
            if i:
                timings[mb].append(seconds)
    results.put((rank, role, params, nbytes, timings))
    dist.destroy_process_group()


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256],
                   help="bucket sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import multiprocessing as mp

    world = args.tp * args.pp + args.engines
    gpus = _gpu_count()
    if gpus and world > gpus:
        # NCCL needs a GPU per rank (two ranks on one device are refused).
        p.error(f"learner tp*pp={args.tp * args.pp} + {args.engines} engine(s) = {world} ranks, but this machine has "
                f"{gpus} GPU(s); lower --engines (0 times the learner side alone) or use a bigger machine")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, results), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    out = []
    deadline = time.monotonic() + 1800
    while len(out) < world:
        if any(proc.exitcode not in (None, 0) for proc in procs) or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            print("weight_sync: a rank failed or the run took over 30 min", file=sys.stderr)
            return 1
        try:
            out.append(results.get(timeout=1.0))
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
            pass
    for proc in procs:
        proc.join(timeout=30)
    out.sort()
    nbytes = max(o[3] for o in out)
    params = nbytes // (4 if args.dtype == "fp32" else 2)  # what one sync carries: the full model
    engine = next((o for o in out if o[1] == "engine"), None)
    source = out[0]
    print(f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, vocab {args.vocab}, {args.dtype}; "
          f"{params / 1e6:.1f}M parameters; {nbytes / 1e6:.1f} MB per sync")
    device = _device_name()
    print(f"layout: learner tp={args.tp} pp={args.pp} -> {args.engines} engine(s); world {world} on "
          f"{device} ({'NCCL' if _cuda() else 'gloo'})")
    print(f"{'bucket MiB':>10}  {'engine s':>9}  {'engine GB/s':>11}  {'source s':>9}  {'source GB/s':>11}")
    for mb in args.buckets:
        s = statistics.median(source[4][mb])
        if engine is None:
            print(f"{mb:>10}  {'-':>9}  {'-':>11}  {s:>9.3f}  {nbytes / s / 1e9:>11.3f}")
            continue
        e = statistics.median(engine[4][mb])
        print(f"{mb:>10}  {e:>9.3f}  {nbytes / e / 1e9:>11.3f}  {s:>9.3f}  {nbytes / s / 1e9:>11.3f}")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, one GPU per rank"
    return f"{os.cpu_count()} CPU cores"


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
