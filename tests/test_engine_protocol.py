"""The client/server protocol (serve.py, client.py) over a real pipe: when a call the server runs
itself fails because the engine behind it died, the client knows the engine is gone by the time
the call's error reaches its caller (the trainer tells 'engine gone' from 'call failed' by that);
a failure noticed elsewhere first (the learners' side of a broadcast) waits a bounded time for the
engine's report (``failure_within``)."""

import asyncio
import threading
import time
from multiprocessing import Pipe
from typing import Optional

import numpy as np
import pytest

from megatron_rl.rollout.client import EngineClient
from megatron_rl.rollout.embedded.engine import EngineStats
from megatron_rl.api.engine import EngineError, RolloutEngine, failure_within, whole_response
from megatron_rl.rollout.serve import EngineServer
from megatron_rl.types import GenerationChunk, SamplingParams

DEATH = "engine core is dead (exit code -9)"


class DiesDuringReceive(RolloutEngine):
    """An engine whose core dies while a weight receive runs: the receive fails with the reason,
    which ``failure`` reports from then on (as the vLLM engine does). Nothing else is called."""

    def __init__(self) -> None:
        self.stats = EngineStats()
        self._failure: Optional[str] = None

    @property
    def failure(self) -> Optional[str]:
        return self._failure

    async def receive_weights(self, version: int) -> float:
        await asyncio.sleep(0.01)
        self._failure = DEATH
        raise EngineError(DEATH)

    def generate(self, request_id, prompt_ids, params):
        raise AssertionError("not used")

    async def abort(self, request_ids=None) -> None:
        pass

    async def pause(self, mode: str = "keep") -> None:
        raise AssertionError("not used")

    async def resume(self) -> None:
        raise AssertionError("not used")

    async def update_weights(self, named_tensors, version: int) -> None:
        raise AssertionError("not used")

    def weight_version(self) -> int:
        return 0

    async def shutdown(self) -> None:
        pass


def _serve(conn, engine: RolloutEngine) -> None:
    """The server's side runs in a thread of its own with its own event loop (as on an engine rank)."""
    server = EngineServer(conn, engine, extra={"receive_weights": engine.receive_weights})
    threading.Thread(target=lambda: asyncio.run(server.run()), daemon=True).start()


@pytest.mark.timeout(60)
def test_a_server_side_call_failing_on_a_dead_engine_reports_the_death_before_the_error():
    client_end, server_end = Pipe()
    _serve(server_end, DiesDuringReceive())
    client = EngineClient(client_end, name="engine on rank 1", call_timeout_s=30)

    async def main() -> str:
        try:
            await client._call("receive_weights", 1)
        except EngineError as err:
            # What the caller sees at that moment, not after the loop ran on.
            return f"{client.failure}|{err}"
        finally:
            await client.shutdown()
        raise AssertionError("the call succeeded")

    seen_failure, error = asyncio.run(main()).split("|")
    assert seen_failure == f"engine on rank 1 is gone ({DEATH})"
    assert DEATH in error


@pytest.mark.timeout(60)
def test_failure_within_waits_for_a_late_report_of_the_engines_death_and_no_longer_than_told():
    client_end, server_end = Pipe()
    client = EngineClient(client_end, name="engine on rank 2")

    async def main():
        client._ensure_reader()
        quiet = await failure_within(client, 0.3)  # nothing reported: None after the wait
        # The engine's side reports its death 0.5 s from now, as a server does.
        threading.Timer(0.5, server_end.send, args=(("batch", [("engine_failed", DEATH)]),)).start()
        began = time.monotonic()
        late = await failure_within(client, 30)
        waited = time.monotonic() - began
        await client.shutdown()
        return quiet, late, waited

    quiet, late, waited = asyncio.run(main())
    assert quiet is None
    assert late == f"engine on rank 2 is gone ({DEATH})"
    assert 0.4 < waited < 10, waited


class RoutesTwoChunks(DiesDuringReceive):
    """An engine answering every request with two chunks that carry routing (numpy arrays)."""

    ROUTING = [np.arange(12, dtype=np.uint8).reshape(3, 2, 2), np.full((2, 2, 2), 7, dtype=np.uint8)]

    async def _chunks(self, request_id):
        yield GenerationChunk(request_id, [1], [-0.5], [0], routed_experts=self.ROUTING[0])
        yield GenerationChunk(request_id, [2, 3], [-0.1, -0.2], [0, 0], "stop", routed_experts=self.ROUTING[1])

    def generate(self, request_id, prompt_ids, params):
        return self._chunks(request_id)


@pytest.mark.timeout(60)
def test_routing_crosses_the_wire_and_whole_responses_join_it():
    client_end, server_end = Pipe()
    _serve(server_end, RoutesTwoChunks())
    client = EngineClient(client_end, name="engine", call_timeout_s=30)

    async def main():
        try:
            streamed = await whole_response(client.generate("a", [1, 2], SamplingParams()))
            grouped = await client.generate_n(["b", "c"], [1, 2], SamplingParams())
            return streamed, grouped
        finally:
            await client.shutdown()

    streamed, grouped = asyncio.run(main())
    expected = np.concatenate(RoutesTwoChunks.ROUTING)
    for response in (streamed, *grouped):
        assert list(response.token_ids) == [1, 2, 3] and response.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(response.routed_experts, expected)
