"""The embedded engine in a child process: same engine, its own interpreter.

Inside one process the learner and the engine share the Python interpreter lock, so on a CPU
(where both are Python-heavy) overlapping them buys little. ``EngineProcess`` runs an
``EmbeddedEngine`` in a spawned child and speaks to it over a pipe with the protocol of
``rollout/serve.py`` (the same one engines on other ranks are reached by). Weights travel packed
in one buffer per dtype (``packed.py``; torch shares the storage with the child, through shared
memory on a CPU and a CUDA IPC handle on a GPU, instead of copying it through the pipe). If the
child dies, every request in flight and every call waiting on it fails with an ``EngineError``
naming the exit code, so the controller returns their prompts to the queue. The child dies with
its parent (a parent-death signal), so a trainer killed with SIGKILL leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any, Dict, List, Optional

import torch
import torch.multiprocessing as mp

from ...config.schema import LoraConfig, ModelConfig
from ..client import EngineClient
from ..long_tail import LongTailLengths
from ...api.engine import EngineError
from ...lifetime import die_with_parent

logger = logging.getLogger(__name__)

# Variables of an enclosing torchrun world: the child forms a world of its own. (With
# TORCHELASTIC_USE_AGENT_STORE left set, torch's tcp:// rendezvous connects to a store as a client
# instead of hosting one, and the child waits forever for a server that never comes.)
_WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


class EngineProcess(EngineClient):
    def __init__(self, model_cfg: ModelConfig, vocab_size: int, max_batch_size: int = 256, seed: int = 0,
                 cpu_threads: int = 1, recompute_kv_on_update: bool = False, start_timeout_s: float = 300.0,
                 device_index: Optional[int] = None, cuda_graphs: bool = True, record_routing: bool = True,
                 max_seq_len: Optional[int] = None, lora: Optional[LoraConfig] = None,
                 long_tail: Optional[LongTailLengths] = None):
        """``device_index``: the GPU the child computes on (None: CUDA's default device, cuda:0).
        ``lora``: the child's engine applies LoRA adapters unmerged (``EmbeddedEngine``)."""
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        self._device_index = device_index
        options = dict(model_cfg=dataclasses.asdict(model_cfg), vocab_size=vocab_size,
                       max_batch_size=max_batch_size, seed=seed, cpu_threads=cpu_threads,
                       recompute_kv_on_update=recompute_kv_on_update, device_index=device_index,
                       cuda_graphs=cuda_graphs, record_routing=record_routing, max_seq_len=max_seq_len,
                       lora=dataclasses.asdict(lora) if lora is not None else None, long_tail=long_tail,
                       parent_pid=os.getpid())
        self._proc = ctx.Process(target=_child_main, args=(child, options), name="embedded-engine", daemon=True)
        self._proc.start()
        child.close()
        if not conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineError(f"engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, *rest = conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineError(f"engine process exited while starting (exit code {self._proc.exitcode})") from None
        if kind != "ready":
            raise EngineError(f"engine process failed to start: {rest[0]}")
        super().__init__(conn, name="engine process")

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def pids(self) -> List[int]:
        return [self._proc.pid] if self._proc.pid else []

    def _weights_device(self) -> Optional[torch.device]:
        """Where to pack: the engine's GPU when it has its own, else where the weights are."""
        if self._device_index is not None and torch.cuda.is_available():
            return torch.device("cuda", self._device_index)
        return None

    def _alive(self) -> bool:
        return self._proc.is_alive()

    def _close(self) -> None:
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def _exit_reason(self, how: str) -> str:
        self._proc.join(5)
        return f"engine process exited (exit code {self._proc.exitcode}; {how})"


# ---------------------------------------------------------------------- the child
def _child_main(conn, options: Dict[str, Any]) -> None:
    die_with_parent(options["parent_pid"])
    for key in _WORLD_ENV:
        os.environ.pop(key, None)
    try:
        from ...learner.parallel import init_model_parallel
        from ...telemetry.run_dir import setup_logging
        from ..serve import EngineServer
        from .engine import EmbeddedEngine

        setup_logging()
        torch.set_num_threads(options["cpu_threads"])
        if options["device_index"] is not None:
            # Before anything touches CUDA: the model, its KV cache and the sampler's generator
            # are all built on the current device.
            torch.cuda.set_device(options["device_index"])
        init_model_parallel(1, 1, seed=options["seed"])
        engine = EmbeddedEngine(ModelConfig(**options["model_cfg"]), options["vocab_size"],
                                options["max_batch_size"], seed=options["seed"],
                                recompute_kv_on_update=options["recompute_kv_on_update"],
                                cuda_graphs=options["cuda_graphs"], record_routing=options["record_routing"],
                                max_seq_len=options["max_seq_len"],
                                lora=LoraConfig(**options["lora"]) if options["lora"] else None,
                                long_tail=options["long_tail"])
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("failed", repr(err)))
        return
    conn.send(("ready",))
    asyncio.run(EngineServer(conn, engine).run())
