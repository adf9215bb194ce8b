"""The sbatch script of a run: srun starts one torchrun per node with a c10d rendezvous on the
first node, and every rank runs the launcher (``megatron_rl.launch``: its role from the placement
plan; a world of one rank is the one-process trainer).

Stopping: the time limit's warning (``--signal=B:USR1``, or ``scancel --signal=USR1 --batch``)
asks the trainer to checkpoint and stop; the job requeues itself only when the trainer's own exit
status (``STOPPED_EXIT``, written to a file because torchrun reports any failed rank as 1) says the
checkpoint was written, and the rerun resumes from it (same run directory). A TERM is a person's
``scancel`` (or Slurm's preemption, which requeues the job itself): it reaches the trainer and
the job ends without a requeue. A crash ends the job with the trainer's status."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..stop import EXIT_FILE_ENV, STOP_FILE, STOPPED_EXIT


@dataclass
class JobSpec:
    recipe: str                     # a recipe name, or the absolute path of a recipe file
    run_dir: Path
    name: str = ""                  # the recipe's name, for the job's (default: recipe)
    overrides: List[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 0          # 0: a CPU job
    procs_per_node: Optional[int] = None  # ranks per node (default: one per GPU; a CPU job: 1)
    cpus_per_task: Optional[int] = None
    partition: Optional[str] = None
    time: Optional[str] = None      # Slurm's time format, e.g. 04:00:00
    account: Optional[str] = None
    job_name: Optional[str] = None
    signal_lead_s: int = 120        # the preemption warning: how long before the time limit
    rdzv_port: Optional[int] = None  # None: a port derived from the job id (two jobs on a node differ)
    python: str = "python"
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def ranks_per_node(self) -> int:
        return self.procs_per_node or max(1, self.gpus_per_node)


def render(spec: JobSpec) -> str:
    """The batch script, as text."""
    run_dir = spec.run_dir
    directives = [
        f"--job-name={spec.job_name or 'megatron_rl-' + (spec.name or spec.recipe)}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the per-GPU processes
        f"--chdir={spec.workdir}",
        f"--output={run_dir}/slurm/slurm-%j.out",
        "--open-mode=append",   # a requeued run appends to the same log
        # The batch shell (B:) gets USR1 this long before the time limit: checkpoint and requeue.
        f"--signal=B:USR1@{spec.signal_lead_s}",
        "--requeue",
    ]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        directives.append(f"--cpus-per-task={spec.cpus_per_task}")
    for key, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account)):
        if value:
            directives.append(f"--{key}={value}")
    train_args = " ".join(shlex.quote(a) for a in [f"recipe={spec.recipe}", f"trainer.run_dir={run_dir}",
                                                    *spec.overrides])
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    # Cores of this job on the node (Slurm's allocation, not the node's), shared among its ranks.
    cores = "${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
    # Derived from the job id (two jobs on a node differ) and the attempt: a requeued job's new
    # rendezvous must not meet the store of its previous attempt, whose processes may still be
    # going away (torchrun's c10d backend then joins the old store as a client and fails).
    port = (str(spec.rdzv_port) if spec.rdzv_port
            else "$(( 20000 + (SLURM_JOB_ID * 16 + ${SLURM_RESTART_COUNT:-0} % 16) % 20000 ))")
    return f"""#!/usr/bin/env bash
{header}
# Written by `python -m megatron_rl.slurm submit`; resubmitting it continues the same run.
set -uo pipefail
RUN_DIR={shlex.quote(str(run_dir))}
STOP_FILE="$RUN_DIR/{STOP_FILE}"
# The signals' handlers come first: a scancel may arrive while the job is still setting up.
warned=0
cancelled=0
pid=""
# USR1: the time limit is near; checkpoint, stop, requeue. TERM: scancel (or Slurm preempting the
# job, which requeues it itself); pass it on and do not requeue.
on_warning() {{ warned=1; echo "megatron_rl: stop requested (USR1) at $(date -Is)"; touch "$STOP_FILE"; }}
on_cancel() {{ cancelled=1; echo "megatron_rl: cancelled (TERM) at $(date -Is)"; [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; }}
trap on_warning USR1
trap on_cancel TERM

# The trainer's own exit status (torchrun reports any failed rank as 1).
export {EXIT_FILE_ENV}="$RUN_DIR/slurm/exit-status-$SLURM_JOB_ID"
rm -f "$STOP_FILE" "${EXIT_FILE_ENV}"   # a request, a status of an earlier attempt are done
echo "megatron_rl: job $SLURM_JOB_ID attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) on $SLURM_JOB_NODELIST at $(date -Is)"

CORES={cores}
export MEGATRON_RL_CPUS="$CORES"
# Log lines reach slurm-<id>.out as they are written, not when a buffer fills (or never, on a kill).
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=$(( CORES / {spec.ranks_per_node} ))
[ "$OMP_NUM_THREADS" -ge 1 ] 2>/dev/null || export OMP_NUM_THREADS=1
# NCCL: report errors instead of hanging; NVLink SHARP (NVLS) off, it needs multicast support.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${{NCCL_DEBUG:-WARN}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT={port}

if [ "$cancelled" -eq 1 ]; then  # cancelled before the training started: do not start it
  echo "megatron_rl: training not started"
  exit 143
fi
srun --kill-on-bad-exit=1 {spec.python} -m torch.distributed.run \\
  --nnodes="$SLURM_NNODES" --nproc-per-node={spec.ranks_per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}" \\
  -m megatron_rl.launch {train_args} &
pid=$!
# `wait` returns early when a trapped signal arrives: keep waiting for the training to stop.
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || break
done
rm -f "$STOP_FILE"
status=$(cat "${EXIT_FILE_ENV}" 2>/dev/null || echo "$rc")
echo "megatron_rl: training ended with status $status (launcher $rc) at $(date -Is)"
if [ "$status" -eq {STOPPED_EXIT} ] && [ "$warned" -eq 1 ] && [ "$cancelled" -eq 0 ]; then
  echo "megatron_rl: checkpoint written; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID" && exit 0
  echo "megatron_rl: requeue refused; submit the same script again to continue"
  exit {STOPPED_EXIT}
fi
[ "$status" -eq 0 ] 2>/dev/null && exit "$rc"
exit "$status"
"""
