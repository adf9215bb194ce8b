#!/usr/bin/env bash
# Quick start, command 2: install what is needed (once) and run the test suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k engine -x`). pytest's own exit code
# is returned, so "no tests collected" (5) fails like any failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
exec "$VENV_PYTHON" -m pytest -ra "$@"
