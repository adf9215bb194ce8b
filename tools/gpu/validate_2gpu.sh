#!/usr/bin/env bash
# The 2-GPU checks (NCCL tests, weight sync, placement), in one go (one device call): every figure and its log under $OUT.
#   1. the multi-rank equivalence tests over NCCL, one GPU per rank (TP=2, PP=2, DP=2, EP=2 vs one
#      GPU; cases needing more ranks than GPUs skip with the reason);
#   2. weight sync over NCCL: a TP=1 learner on cuda:0 -> an engine on cuda:1, Qwen2-1.5B shape,
#      bf16; and a TP=2 learner's side alone (gathers + packing: an engine would need a 3rd GPU);
#   3. the single-process trainer at eta = 4, colocated (engine process on the learner's cuda:0)
#      vs disaggregated (engine process on cuda:1), gsm8k_qwen2_gpu at a reduced batch.
# Usage, from the repository root:  bash tools/gpu/validate_2gpu.sh
#   OUT=<dir> (default ./gpu-logs), STEPS=<trainer steps per placement> (default 8),
#   GSM8K=<train.jsonl> (default .data/gsm8k/train.jsonl, else ../shared/data/gsm8k/train.jsonl),
#   SECTIONS="equivalence weightsync placement" (a subset reruns only those), PLACEMENTS=colocated,disaggregated,
#   PLACEMENT_TIMEOUT=<s> (default 250).
# Wheels in .whl/ (megatron-core etc.) are installed into /tmp/site first when present: the GPU
# machine has no registry. Each step has its own time limit, so one hang does not eat the others.
set -uo pipefail
# NVLink multicast stays off: a program that uses it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-logs}"
mkdir -p "$OUT"
STEPS="${STEPS:-8}"
PY="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "validate_2gpu: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
GSM8K="${GSM8K:-$ROOT/.data/gsm8k/train.jsonl}"
[ -f "$GSM8K" ] || GSM8K="$ROOT/../shared/data/gsm8k/train.jsonl"

section() { echo "=== $1 ($(date -u +%H:%M:%S))"; }

# On a CPU the engine process receives each weight version in shared memory (~2.6 GB at
# this shape): a small /dev/shm (container default 64 MB) fails that, so give it room where we can.
shm_kb="$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')"
if [ -n "$shm_kb" ] && [ "$shm_kb" -lt $((16 << 20)) ]; then
  mount -o remount,size=64G /dev/shm 2>/dev/null && echo "validate_2gpu: /dev/shm had ${shm_kb} kB free; remounted at 64G"
fi

{
  section environment
  date -u
  "$PY" -c 'import torch, megatron.core as mc; print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core", mc.__version__); print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); import torch.cuda.nccl as n; print("nccl", n.version())'
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  df -h /dev/shm
  nproc
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

SECTIONS="${SECTIONS:-equivalence weightsync placement}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

if want equivalence; then
section "1. equivalence tests over NCCL"
# test_weight_sync needs 3 ranks (learner TP/PP/EP=2 + an engine): skipped here, with its reason.
MEGATRON_RL_TEST_BACKEND=nccl timeout -k 10 150 "$PY" -m pytest -s -ra -p no:cacheprovider \
  tests/test_learner_parallel.py tests/test_weight_sync.py 2>&1 | tee "$OUT/equivalence.log"
fi

if want weightsync; then

section "2. weight sync over NCCL"
{
  QWEN15="--hidden 1536 --layers 28 --ffn 8960 --vocab 151936 --heads 12 --groups 2 --dtype bf16"
  echo "+ weight_sync.py --tp 1 --engines 1 $QWEN15 --buckets 64,256,1024 --repeats 3"
  timeout -k 10 90 "$PY" tools/bench/weight_sync.py --tp 1 --engines 1 $QWEN15 --buckets 64,256,1024 --repeats 3
  echo "+ weight_sync.py --tp 2 --engines 0 $QWEN15 --buckets 256 --repeats 3"
  timeout -k 10 70 "$PY" tools/bench/weight_sync.py --tp 2 --engines 0 $QWEN15 --buckets 256 --repeats 3
} 2>&1 | tee "$OUT/weight_sync.log"
fi

if want placement; then

section "3. placement: colocated vs disaggregated, eta = 4"
RUNS="$(mktemp -d)"
timeout -k 10 "${PLACEMENT_TIMEOUT:-250}" "$PY" tools/bench/placement_gpu.py --steps "$STEPS" --eta 4 --skip 2 \
  --run-root "$RUNS" --placements "${PLACEMENTS:-colocated,disaggregated}" \
  "data.path=$GSM8K" algo.groups_per_batch=8 rollout.max_new_tokens=64 2>&1 | tee "$OUT/placement.log"
for p in colocated disaggregated; do
  [ -f "$RUNS/$p/metrics.jsonl" ] && cp "$RUNS/$p/metrics.jsonl" "$OUT/metrics_$p.jsonl"
  [ -f "$RUNS/$p/logs/train.log" ] && tail -n 60 "$RUNS/$p/logs/train.log" > "$OUT/train_tail_$p.log"
done
fi
section done
