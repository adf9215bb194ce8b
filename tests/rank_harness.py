"""Run one function on N ranks (gloo on CPU by default, or NCCL on GPUs) from a pytest test, and
hand each rank's return value back.

    from rank_harness import run_ranks
    results = run_ranks(my_fn, world_size=2, args=(cfg,), timeout_s=120)   # [rank0, rank1]

``my_fn`` must be picklable (a module-level function): ranks are forked from a server process
(multiprocessing's forkserver), a fresh interpreter that has only imported torch, megatron-core
and this package's learner and engine modules, so nothing of the test process's torch state
leaks in, and no rank pays the ~7 CPU-seconds of those imports again (a test suite starts dozens
of ranks on 2 cores). Each rank
gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one
intra-op thread, and an initialised default process group (gloo) before ``my_fn`` runs.

Failure modes are turned into one clear test failure each:
- a rank raises: ``RankFailed`` carrying that rank's formatted traceback (the first failing
  rank's; the others are killed, since their peers are gone and they would only hang);
- a rank dies without reporting (segfault, os._exit): ``RankFailed`` with its exit code;
- the ranks do not all finish within ``timeout_s`` (a collective waiting for a peer that never
  comes): ``RankTimeout`` naming the ranks that had not finished; every rank is killed, and a
  few seconds before that each prints its threads' stacks to stderr (where it hangs).
The rendezvous port is chosen at run time; if another process takes it before rank 0 binds it,
the whole launch is retried on a new port.

Backend: ``MEGATRON_RL_TEST_BACKEND=nccl`` runs the same tests on GPUs, one GPU per rank (rank r
on cuda:r, as torchrun's LOCAL_RANK would place it), with an NCCL process group; a test that needs
more ranks than there are GPUs is skipped with the reason. Tensors in a rank's return value are
moved to the CPU before they travel back, so the test compares them on one device whatever the
backend. Unset (or ``gloo``) is the CPU default that CI runs.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as std_mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["run_ranks", "RankFailed", "RankTimeout", "free_port", "backend", "BACKEND_ENV"]

BACKEND_ENV = "MEGATRON_RL_TEST_BACKEND"
_BACKENDS = ("gloo", "nccl")


def backend() -> str:
    """The process-group backend the ranks use: $MEGATRON_RL_TEST_BACKEND, gloo when unset."""
    name = os.environ.get(BACKEND_ENV, "gloo").strip().lower() or "gloo"
    if name not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend the harness runs; choose one of {', '.join(_BACKENDS)}")
    return name


def _skip_without_gpus(world_size: int) -> None:
    """Under NCCL every rank needs a GPU of its own (NCCL refuses two ranks on one device)."""
    import pytest
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size > count:
        pytest.skip(f"{BACKEND_ENV}=nccl: {world_size} ranks need {world_size} GPUs, {count} present")


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside dicts, lists and tuples moved to the CPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # not namedtuples
        return type(value)(_to_cpu(v) for v in value)
    return value


class RankFailed(AssertionError):
    """A rank raised or died; the message holds its traceback (or exit code)."""


class RankTimeout(AssertionError):
    """Not every rank finished in time; all ranks were killed."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: Sequence[Any],
               env: Dict[str, str], timeout_s: float, results: "std_mp.Queue", backend_name: str = "gloo") -> None:
    """Body of one rank: set up the torchrun-like environment, run ``fn``, report."""
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The same filters as pytest.ini: library warnings repeated by every rank drown the report.
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    # A hang is killed by the parent; shortly before, every rank prints where its threads are.
    faulthandler.dump_traceback_later(max(timeout_s - 3.0, 1.0), exit=False)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if backend_name == "nccl":
            torch.cuda.set_device(rank)  # before the group: NCCL binds each rank to its device
        # The collective timeout matches the harness's, so a rank blocked on a dead peer errors
        # out on its own too (the parent kills it regardless).
        dist.init_process_group(backend_name, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        value = fn(*args)
        if backend_name == "nccl":
            value = _to_cpu(value)  # CUDA tensors would come back on this rank's device
        faulthandler.cancel_dump_traceback_later()
        # Pickled here with the plain pickler: tensors travel as bytes, so the result stays
        # valid after this process exits (torch's shared-memory queue handles would not).
        payload = pickle.dumps(value)
        results.put(("ok", rank, payload))
    except BaseException:  # noqa: BLE001 - everything, including SystemExit, is reported
        results.put(("error", rank, traceback.format_exc()))
        return
    try:
        import megatron.core.parallel_state as ps  # only if the function used it

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    except ImportError:
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after a reported result must not mask it
        pass


def _port_in_use(text: str) -> bool:
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def run_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout_s: float = 300.0,
              env: Optional[Dict[str, str]] = None, port_retries: int = 3) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks (gloo, or NCCL when
    $MEGATRON_RL_TEST_BACKEND=nccl); return the values by rank.

    Raises ``RankFailed`` (a rank's traceback) or ``RankTimeout`` (after ``timeout_s`` seconds,
    all ranks killed); skips the calling test under NCCL when there are fewer GPUs than ranks."""
    if backend() == "nccl":
        _skip_without_gpus(world_size)
    for attempt in range(port_retries):
        try:
            return _launch(fn, world_size, args, timeout_s, dict(env or {}))
        except RankFailed as err:
            if attempt + 1 < port_retries and _port_in_use(str(err)):
                continue  # the port went to someone else between choosing and binding it
            raise
    raise AssertionError("unreachable")


# Imported once by the fork server, before any rank is forked from it: imports only (no process
# group, no CUDA, no megatron parallel state, no CPU patches), which every rank then sets up itself.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_rl.learner.learner",
            "megatron_rl.learner.critic", "megatron_rl.rollout.embedded", "megatron_rl.weights.reshard",
            "megatron_rl.weights.sync"]


def _context():
    ctx = std_mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first launch)
    return ctx


def _launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout_s: float,
            env: Dict[str, str]) -> List[Any]:
    ctx = _context()
    results: "std_mp.Queue" = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                         args=(rank, world_size, port, fn, args, env, timeout_s, results, backend()))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    values: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in values]
                raise RankTimeout(f"{getattr(fn, '__name__', fn)} on {world_size} ranks: ranks {missing} did "
                                  f"not finish within {timeout_s:.0f} s (hang?); all ranks killed")
            try:
                kind, rank, payload = results.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in values and p.exitcode is not None]
                if dead:
                    # Give a result that was put just before exiting a moment to arrive.
                    try:
                        kind, rank, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        r, code = dead[0]
                        raise RankFailed(f"rank {r} of {world_size} died with exit code {code} "
                                         f"without reporting a result") from None
                else:
                    continue
            if kind == "error":
                raise RankFailed(f"rank {rank} of {world_size} raised:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(values) == world_size else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        results.close()
    return [values[r] for r in range(world_size)]
