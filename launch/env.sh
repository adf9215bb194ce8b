#!/usr/bin/env bash
# Create (first time) and refresh the project's virtual environment in .venv: the pinned
# requirements (CPU torch 2.13.0, megatron-core 0.16.1, ...), the test extras, and this package
# in editable mode. Re-installs only when requirements*.txt or setup.py change.
# Source it (`source launch/env.sh`) or run it; it sets VENV_PYTHON.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_RL_VENV:-$ROOT/.venv}"
BASE_PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if ! "$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "megatron_rl: error: Python >= 3.11 is required ($BASE_PYTHON is $("$BASE_PYTHON" -V 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "megatron_rl: creating virtual environment $VENV" >&2
  "$BASE_PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.megatron_rl_installed"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-test.txt" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "megatron_rl: installing pinned requirements into $VENV (first run: about a minute)" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$ROOT/requirements.txt" -r "$ROOT/requirements-test.txt"
  # .ci/run installs .venv and .venv-vllm at once; both editable installs write
  # megatron_rl.egg-info here: one at a time (a lock on setup.py).
  flock "$ROOT/setup.py" "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
# The code sandbox (reward.name=code, tool-using agents) needs bubblewrap for a private file system
# and no network: install it where this can (root with apt-get); otherwise say what to do.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "megatron_rl: installing bubblewrap for the code sandbox (apt-get)" >&2
    { apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1 || \
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1; }; } || \
      echo "megatron_rl: could not install bubblewrap; code rewards and tool-using agents need it (or sandbox.allow_weak_isolation=true)" >&2
  else
    echo "megatron_rl: bubblewrap is not installed; code rewards and tool-using agents need it: ask an administrator for the bubblewrap package (apt-get/dnf install bubblewrap), or set sandbox.allow_weak_isolation=true" >&2
  fi
fi
export VENV_PYTHON="$VENV/bin/python"
