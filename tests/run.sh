#!/usr/bin/env bash
# Quick start, command 2: install what is needed (once) and run the test suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k engine -x`). pytest's own exit code
# is returned, so "no tests collected" (5) fails like any failure.
# The suite runs on MEGATRON_RL_TEST_WORKERS pytest-xdist workers (default 2: most tests use one
# core, so two keep a 2-core box busy). Each test file runs whole on one worker, in order
# (--dist loadfile): module fixtures such as the Slurm tests' one local cluster, and results cached
# across a file's tests, are made once; files go out in tests/conftest.py's order, longest first
# (--no-loadscope-reorder: xdist would otherwise order them by their number of tests).
# `-s`, `--pdb` or an explicit `-n N` run as given (`-s` needs one process to show what tests print:
# xdist workers' output is not shown).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
XDIST=(-n "${MEGATRON_RL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  case "$arg" in
    -s|--capture=no|--pdb|-n|-n*|--numprocesses|--numprocesses=*) XDIST=() ;;
  esac
done
exec "$VENV_PYTHON" -m pytest -ra "${XDIST[@]}" "$@"
