"""A rollout engine registered from outside the package: the embedded engine behind a wrapper that
writes one line per group it generates (its pid and how it was built) to ``$COUNTING_ENGINE_LOG``,
so a test sees which engine served a run, in one process or on the ranks of a torchrun world.

Run as a script it registers the engine and then is ``python -m megatron_rl.launch`` (the ranks of
a torchrun world import it that way: ``torchrun ... tests/counting_engine.py recipe=...``)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import AsyncIterator, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_rl.rollout.build import ENGINES
from megatron_rl.api.engine import EngineStats, RolloutEngine
from megatron_rl.types import GenerationChunk, SamplingParams

NAME = "counting"
LOG = "COUNTING_ENGINE_LOG"


class CountingEngine(RolloutEngine):
    """``inner`` with every group it generates written down; the rest is the inner engine's."""

    def __init__(self, inner: RolloutEngine, built_as: str):
        self.inner, self.built_as = inner, built_as

    def _note(self, what: str) -> None:
        with open(os.environ[LOG], "a") as f:
            f.write(f"{os.getpid()} {self.built_as} {what}\n")

    def generate(self, request_id: str, prompt_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        self._note("generate")
        return self.inner.generate(request_id, prompt_ids, params)

    def generate_n(self, request_ids: Sequence[str], prompt_ids: Sequence[int], params: SamplingParams):
        self._note("generate_n")
        return self.inner.generate_n(request_ids, prompt_ids, params)

    async def abort(self, request_ids: Optional[Iterable[str]] = None) -> None:
        await self.inner.abort(request_ids)

    async def pause(self, mode: str = "keep") -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        await self.inner.update_weights(named_tensors, version)

    async def swap_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        await self.inner.swap_weights(named_tensors, version)

    def weight_version(self) -> int:
        return self.inner.weight_version()

    async def sampling_state(self) -> Optional[bytes]:
        return await self.inner.sampling_state()

    async def set_sampling_state(self, state: Optional[bytes]) -> None:
        await self.inner.set_sampling_state(state)

    async def sleep(self) -> None:
        await self.inner.sleep()

    async def wake_up(self) -> None:
        await self.inner.wake_up()

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    @property
    def stats(self) -> EngineStats:
        return self.inner.stats

    @property
    def failure(self) -> Optional[str]:
        return self.inner.failure

    def pids(self) -> List[int]:
        return self.inner.pids()


def register() -> None:
    """ENGINES["counting"]: the embedded entry with each builder wrapped (idempotent)."""
    if NAME in ENGINES:
        return
    embedded = ENGINES.get("embedded")

    def wrapped(build, built_as):
        return lambda *args: CountingEngine(build(*args), built_as)

    ENGINES.add(NAME, replace(embedded, build=wrapped(embedded.build, "one_process"),
                              on_engine_rank=wrapped(embedded.on_engine_rank, "engine_rank"),
                              on_learner_rank=wrapped(embedded.on_learner_rank, "learner_rank")))


if __name__ == "__main__":
    from megatron_rl.launch.__main__ import main
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()
    register()
    sys.exit(main(sys.argv[1:]))
