"""The vLLM adapter calls its engine dead as soon as an engine-core process has exited, before
vLLM's own monitor has flagged it (a call failing in that moment reports the engine's death, not a
plain failed call). A real child process stands in for the engine core; no vllm import is needed."""

import multiprocessing
import os
import signal
from types import SimpleNamespace

from megatron_rl.rollout.vllm.adapter import VLLMAdapter


def _adapter(process) -> VLLMAdapter:
    adapter = VLLMAdapter.__new__(VLLMAdapter)  # not started: only the state dead_reason reads
    manager = SimpleNamespace(processes=[process])
    adapter.llm = SimpleNamespace(errored=False, engine_core=SimpleNamespace(resources=SimpleNamespace(
        engine_manager=manager)))
    return adapter


def test_an_exited_engine_core_process_makes_the_engine_dead_before_vllm_notices():
    core = multiprocessing.get_context("spawn").Process(target=signal.pause, daemon=True)
    core.start()
    try:
        adapter = _adapter(core)
        assert adapter.dead_reason() is None
        os.kill(core.pid, signal.SIGKILL)
        core.join(10)
        reason = adapter.dead_reason()
        assert reason is not None and "vLLM engine core is dead" in reason and "-9" in reason
    finally:
        if core.is_alive():
            core.kill()
