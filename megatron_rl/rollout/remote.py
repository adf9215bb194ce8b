"""Engines on other ranks: the same RolloutEngine interface over a TCP connection.

An engine rank opens a listener (``EngineListener``), the world exchanges addresses (one
all-gather at start), and the driver connects a ``RemoteEngine`` to each: requests, results,
aborts, pause/resume, versions and health travel by ``serve.py``'s protocol, so the controller
cannot tell a remote engine from a local one. A connection is authenticated with a key drawn by
the world at start. Weights do not travel over the connection: the learners broadcast them over
the weight-sync groups and the driver only asks each engine to receive a version
(``receive_weights``).
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Client, Listener
from typing import Any, Optional, Tuple

from .client import EngineClient
from ..api.engine import EngineError

logger = logging.getLogger(__name__)

Address = Tuple[str, int]


class EngineListener:
    """Where an engine rank waits for the driver's connection."""

    def __init__(self, host: str, authkey: bytes):
        # Port 0: the OS picks a free one; the address travels to the driver in the all-gather.
        self._listener = Listener((host, 0), authkey=authkey)
        self.address: Address = self._listener.address

    def accept(self):
        try:
            return self._listener.accept()
        finally:
            self._listener.close()


class RemoteEngine(EngineClient):
    """A client of the engine served on rank ``rank`` at ``address``."""

    def __init__(self, address: Address, authkey: bytes, rank: int, call_timeout_s: Optional[float] = None):
        try:
            conn = Client(tuple(address), authkey=authkey)
        except OSError as err:
            raise EngineError(f"cannot reach the engine on rank {rank} at {address[0]}:{address[1]}: {err}") from None
        super().__init__(conn, name=f"engine on rank {rank}", call_timeout_s=call_timeout_s)
        self.rank = rank

    async def receive_weights(self, version: int) -> Any:
        """The engine takes policy ``version`` from the weight-sync groups (while it keeps
        generating), then swaps it in whole: pause(keep), load, resume. Returns what the rank's
        receiver returns: the seconds the receive took there (adapter-only sync: a dict of them
        and the push's figures, ``weights/adapter_sync.py``)."""
        seconds = await self._call("receive_weights", version)
        self._version = version
        return seconds

    async def open_timeline(self, run_dir: str) -> None:
        """The engine rank adds its spans (weight receive, swap) to the run's timeline."""
        await self._call("open_timeline", run_dir)

    async def update_weights(self, named_tensors, version: int) -> None:
        raise EngineError(f"{self.name}: weights reach engines on other ranks through the weight-sync groups "
                          "(receive_weights), not through its connection")

    def _exit_reason(self, how: str) -> str:
        return f"the engine on rank {self.rank} is gone ({how}); that rank died or was killed"

    def _failed_reason(self, reason: str) -> str:
        return f"the engine on rank {self.rank} is gone ({reason})"
