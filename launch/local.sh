#!/usr/bin/env bash
# Quick start, command 1: install what is needed (once) and run a recipe on this machine.
#   bash launch/local.sh                       # the tiny_cpu recipe
#   bash launch/local.sh trainer.total_steps=50 algo.group_size=8
#   bash launch/local.sh recipe=gsm8k_qwen2_gpu data.path=/data/gsm8k/train.jsonl
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
exec "$VENV_PYTHON" -m megatron_rl.main "$@"
