"""The sbatch script of a run: srun starts one torchrun per node with a c10d rendezvous on the
first node, and every rank runs the launcher (``megatron_rl.launch``: its role from the placement
plan; a world of one rank is the one-process trainer); a preemption signal asks the trainer to checkpoint and stop, then the job requeues
itself and the rerun resumes from that checkpoint (same run directory)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..stop import STOP_FILE, STOPPED_EXIT


@dataclass
class JobSpec:
    recipe: str
    run_dir: Path
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
    rdzv_port: int = 29500
    python: str = "python"
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def ranks_per_node(self) -> int:
        return self.procs_per_node or max(1, self.gpus_per_node)


def render(spec: JobSpec) -> str:
    """The batch script, as text."""
    run_dir = spec.run_dir
    directives = [
        f"--job-name={spec.job_name or 'megatron_rl-' + spec.recipe}",
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
    threads = f"$(( ${{SLURM_CPUS_PER_TASK:-$(getconf _NPROCESSORS_ONLN)}} / {spec.ranks_per_node} ))"
    return f"""#!/usr/bin/env bash
{header}
# Written by `python -m megatron_rl.slurm submit`; resubmitting it continues the same run.
set -uo pipefail
RUN_DIR={shlex.quote(str(run_dir))}
STOP_FILE="$RUN_DIR/{STOP_FILE}"
rm -f "$STOP_FILE"   # a request of an earlier attempt is done
echo "megatron_rl: job $SLURM_JOB_ID attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) on $SLURM_JOB_NODELIST at $(date -Is)"

export OMP_NUM_THREADS={threads}
[ "$OMP_NUM_THREADS" -ge 1 ] 2>/dev/null || export OMP_NUM_THREADS=1
# NCCL: report errors instead of hanging; NVLink SHARP (NVLS) off, it needs multicast support.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${{NCCL_DEBUG:-WARN}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

preempted=0
request_stop() {{ preempted=1; echo "megatron_rl: stop requested (signal) at $(date -Is)"; touch "$STOP_FILE"; }}
trap request_stop USR1 TERM

srun --kill-on-bad-exit=1 {spec.python} -m torch.distributed.run \\
  --nnodes="$SLURM_NNODES" --nproc-per-node={spec.ranks_per_node} \\
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:{spec.rdzv_port}" --rdzv-id="$SLURM_JOB_ID" \\
  -m megatron_rl.launch {train_args} &
pid=$!
# `wait` returns early when a trapped signal arrives: keep waiting for the training to stop.
while :; do
  wait "$pid"; rc=$?
  kill -0 "$pid" 2>/dev/null || break
done
rm -f "$STOP_FILE"
if [ "$rc" -eq {STOPPED_EXIT} ] || [ "$preempted" -eq 1 ]; then
  echo "megatron_rl: checkpoint written; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
"""
