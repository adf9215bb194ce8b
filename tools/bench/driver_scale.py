"""Benchmark: the driver's own throughput and each learner rank's bytes as a job grows, simulated.

    python tools/bench/driver_scale.py [--engines 8,64,256] [--ranks 1,8,32] [--tokens 1M,16M,128M]
        [--steps 3] [--rows 8192] [--group-size 16] [--engine-hosts 2] [--broadcast]

Nothing here computes a model: **fake engines** (``InstantEngine``) answer each group at once with
fixed arrays of the asked length, served by the real engine server (rollout/serve.py) over real
TCP connections (``RemoteEngine``, several engines per host process); **fake learners** are the
ranks of a real gloo world that receive their data-parallel share through the real data path
(``LearnerGroup.train``: the announcement with the batch index, then each rank's rows packed
into one flat buffer, learner/group.py) and count it. The driver between them is the product's:
the prompt ledger and the staleness-bounded controller, the engine pool, the single-turn
workflow, the trained-batches log and ``LearnerGroup``. A step's batch has ``--rows`` sequences
(``--group-size`` per prompt) of tokens/rows tokens each, an eighth of them prompt.

Per configuration it prints the driver process's CPU seconds per step (every thread of it: event
loop, engine connections, learner thread; ``time.process_time``), the tokens of trajectories the
driver moved per second of that CPU, the wall seconds per step, prompts admitted per driver-CPU
second, and the bytes one learner rank received per step (the largest share) against the whole
batch, which every rank received when the driver broadcast it. ``--broadcast`` runs that former
path instead (``LearnerGroup.call("train", groups)``: the whole batch pickled to every rank).

What it leaves out: rewards (the fake workflow sets them; a real reward decodes each response
on the driver and scores it in worker processes), weight sync, and the learners' own
unpacking into Python lists (a rank counts the buffer it received). On a small machine the
engine hosts and learner ranks share the driver's cores, so wall time is pessimistic; the
driver's CPU seconds are its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_rl.learner.group import LearnerGroup, serve_learner  # noqa: E402
from megatron_rl.api.engine import RolloutEngine  # noqa: E402
from megatron_rl.types import GenerationChunk, SamplingParams  # noqa: E402

AUTHKEY = b"driver-scale-bench"


# ---------------------------------------------------------------------------- fake engines
class InstantEngine(RolloutEngine):
    """Answers every request at once with a copy of the same arrays of ``max_new_tokens`` tokens."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(requests=0, tokens=0, compute_s=0.0)
        self._answers: Dict[int, tuple] = {}

    def _answer(self, n: int) -> tuple:
        if n not in self._answers:
            rng = np.random.default_rng(n)
            self._answers[n] = (rng.integers(0, 150_000, n, dtype=np.int32),
                                rng.standard_normal(n).astype(np.float32), np.zeros(n, dtype=np.int32))
        return self._answers[n]

    def generate(self, request_id, prompt_ids, params):
        raise NotImplementedError("the driver's single-turn workflow asks for whole groups (generate_n)")

    def generate_n(self, request_ids, prompt_ids, params):
        ids, logprobs, versions = self._answer(params.max_new_tokens)
        self.stats.requests += len(request_ids)
        self.stats.tokens += len(request_ids) * len(ids)
        future = asyncio.get_running_loop().create_future()
        # A copy per response, as a real engine makes: one message then pickles every response's
        # bytes (shared arrays would be pickled once per group).
        future.set_result([GenerationChunk(rid, ids.copy(), logprobs.copy(), versions.copy(), "length")
                           for rid in request_ids])
        return future

    async def abort(self, request_ids=None) -> None:
        pass

    async def pause(self, mode: str = "keep") -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, named_tensors, version: int) -> None:
        pass

    def weight_version(self) -> int:
        return 0


def _host_engines(count: int, addresses) -> None:
    """An engine host process: ``count`` fake engines, each behind its own server and listener."""
    from megatron_rl.rollout.remote import EngineListener
    from megatron_rl.rollout.serve import EngineServer

    listeners = [EngineListener("127.0.0.1", AUTHKEY) for _ in range(count)]
    addresses.put([listener.address for listener in listeners])

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        conns = await asyncio.gather(*(loop.run_in_executor(None, listener.accept) for listener in listeners))
        await asyncio.gather(*(EngineServer(conn, InstantEngine()).run() for conn in conns))

    asyncio.run(serve_all())


# ---------------------------------------------------------------------------- fake learners
class CountingLearner:
    """A learner rank that receives its share through the real data path and counts it."""

    def __init__(self, rank: int, ranks: int):
        self.rank, self.ranks = rank, ranks
        self.cfg = SimpleNamespace(learner=SimpleNamespace(mini_batches=1))
        self.received_bytes = 0

    def replica(self):
        return self.rank, self.ranks

    def receive_rows(self, buffers):
        self.received_bytes += sum(a.nbytes for a in buffers.arrays.values())
        return buffers

    def train_share(self, rows, index, version: int, lr: float) -> Dict[str, float]:
        return {"rows": float(len(rows))}

    def train(self, groups, version: int, lr: float, teachers=None) -> Dict[str, float]:
        return {"rows": float(sum(len(g) for g in groups))}


def _learner_rank(rank: int, ranks: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    serve_learner(CountingLearner(rank, ranks), dist.group.WORLD)


# ---------------------------------------------------------------------------- the driver
def _prompts(prompt_len: int) -> Iterator:
    from megatron_rl.data.datasets import Prompt

    ids = list(range(1, prompt_len + 1))
    i = 0
    while True:
        yield Prompt(f"q{i}", "", ids, "0")
        i += 1


async def _drive(engines, learners: LearnerGroup, steps: int, groups: int, group_size: int, prompt_len: int,
                 new_tokens: int, broadcast: bool, run_dir: Path) -> List[Dict[str, float]]:
    from megatron_rl.rollout.pool import EnginePool
    from megatron_rl.rollout.workflow import single_turn_group
    from megatron_rl.scheduler.controller import AsyncController
    from megatron_rl.scheduler.ledger import PromptLedger
    from megatron_rl.scheduler.staleness import StalenessManager
    from megatron_rl.telemetry.metrics import TrainedBatches

    pool = EnginePool(engines) if len(engines) > 1 else engines[0]
    params = SamplingParams(max_new_tokens=new_tokens, stream=False)
    # The fake engines never change weights (every token is version 0): a staleness bound past the
    # last step keeps the controller from evicting them; one batch runs or waits at a time.
    ledger = PromptLedger(_prompts(prompt_len), StalenessManager(steps + 1, groups, groups), max_ahead_groups=groups)
    trained = TrainedBatches(run_dir, first_step=1)
    rng = np.random.default_rng(0)

    async def rollout(ticket):
        trajs = await single_turn_group(pool, ticket.prompt, params, [f"{ticket.index}-{i}" for i in range(group_size)])
        for traj in trajs:
            traj.reward = float(rng.random())  # stands in for the reward
        return trajs

    def train(finished, version: int) -> Dict[str, float]:
        batch = [g.trajectories for g in finished]
        if broadcast:
            out = learners.call("train", batch, version, 1e-6)
        else:
            out = learners.train(batch, version, 1e-6)
        trained.write(version + 1, version, finished)
        return out

    async def publish(version: int) -> None:
        pass

    rows: List[Dict[str, float]] = []
    last = [time.perf_counter(), time.process_time()]

    async def on_step(step: int, metrics: Dict[str, float], batch) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in batch for t in g.trajectories)
        row = {"wall_s": now - last[0], "cpu_s": cpu - last[1], "tokens": float(tokens), "prompts": float(len(batch)),
               "share_bytes": metrics.get("data/share_bytes_max", float("nan")),
               "batch_bytes": metrics.get("data/batch_bytes", float("nan"))}
        if broadcast:  # what the broadcast sent every rank: the pickled call
            row["share_bytes"] = row["batch_bytes"] = float(len(pickle.dumps(
                ("train", ([g.trajectories for g in batch], 0, 1e-6)), protocol=pickle.HIGHEST_PROTOCOL)))
        rows.append(row)
        last[0], last[1] = time.perf_counter(), time.process_time()

    with ThreadPoolExecutor(1, thread_name_prefix="learner") as executor:
        controller = AsyncController(ledger, rollout, train, publish, train_executor=executor)
        await controller.run(steps, on_step)
        await controller.drain()
    trained.close()
    for engine in engines:
        await engine.shutdown()
    return rows


def measure(engines: int, ranks: int, tokens: int, steps: int, rows: int, group_size: int, hosts: int,
            broadcast: bool) -> Dict[str, float]:
    """One configuration: start the engine hosts and learner ranks, drive ``steps`` steps, return
    the medians over the steps after the first (warm-up: connections, first allocations)."""
    from megatron_rl.rollout.remote import RemoteEngine

    ctx = mp.get_context("spawn")
    per_row = tokens // rows
    prompt_len = max(1, per_row // 8)
    new_tokens = per_row - prompt_len
    groups = rows // group_size
    addresses = ctx.Queue()
    hosts = min(hosts, engines)
    host_procs = [ctx.Process(target=_host_engines, args=(engines // hosts + (h < engines % hosts), addresses),
                              daemon=True) for h in range(hosts)]
    for proc in host_procs:
        proc.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    learner_procs = [ctx.Process(target=_learner_rank, args=(r, ranks, port), daemon=True) for r in range(1, ranks)]
    for proc in learner_procs:
        proc.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=ranks)
    try:
        clients = [RemoteEngine(address, AUTHKEY, rank=i)
                   for i, address in enumerate(a for _ in host_procs for a in addresses.get(timeout=120))]
        learners = LearnerGroup(CountingLearner(0, ranks), dist.group.WORLD, range(ranks))
        with tempfile.TemporaryDirectory() as run_dir:
            measured = asyncio.run(_drive(clients, learners, steps, groups, group_size, prompt_len, new_tokens,
                                          broadcast, Path(run_dir)))
        learners.close()
    finally:
        dist.destroy_process_group()
        for proc in learner_procs + host_procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    kept = measured[1:] or measured
    median = {key: float(np.median([m[key] for m in kept])) for key in kept[0]}
    median.update(engines=engines, ranks=ranks, rows=rows, steps=len(kept),
                  driver_tokens_per_cpu_s=median["tokens"] / max(median["cpu_s"], 1e-9),
                  prompts_per_cpu_s=median["prompts"] / max(median["cpu_s"], 1e-9))
    return median


def _count(text: str) -> int:
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="8,64,256")
    parser.add_argument("--ranks", default="1,8,32")
    parser.add_argument("--tokens", default="1M,16M,128M")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--engine-hosts", type=int, default=2)
    parser.add_argument("--broadcast", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'engines':>7} {'ranks':>5} {'tokens/step':>11} {'driver cpu s':>12} {'driver Mtok/cpu-s':>17} "
          f"{'wall s':>7} {'prompts/cpu-s':>13} {'MB/rank':>8} {'MB batch':>9}", flush=True)
    for tokens in (_count(t) for t in args.tokens.split(",")):
        for engines in (int(e) for e in args.engines.split(",")):
            for ranks in (int(r) for r in args.ranks.split(",")):
                m = measure(engines, ranks, tokens, args.steps, args.rows, args.group_size, args.engine_hosts,
                            args.broadcast)
                print(f"{engines:>7} {ranks:>5} {m['tokens'] / 1e6:>10.1f}M {m['cpu_s']:>12.2f} "
                      f"{m['driver_tokens_per_cpu_s'] / 1e6:>17.1f} {m['wall_s']:>7.2f} {m['prompts_per_cpu_s']:>13.0f} "
                      f"{m['share_bytes'] / 1e6:>8.1f} {m['batch_bytes'] / 1e6:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
