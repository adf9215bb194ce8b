"""The vLLM test modules' guard: skip the module where vLLM cannot start here, or fail it where
the run says vLLM must be there (MEGATRON_RL_REQUIRE_VLLM=1: tests/run_vllm.sh, CI's vLLM phase)."""

from __future__ import annotations

import os

import pytest

from megatron_rl.rollout.vllm import vllm_import_error


def require_vllm(what: str) -> None:
    """Call at a test module's top, before importing what needs vLLM; ``what`` names the tests."""
    reason = vllm_import_error()
    if reason:
        if os.environ.get("MEGATRON_RL_REQUIRE_VLLM") == "1":
            pytest.fail(f"MEGATRON_RL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(f"{what} skipped: {reason}", allow_module_level=True)
