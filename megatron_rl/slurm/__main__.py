"""usage: python -m megatron_rl.slurm submit [recipe=NAME|FILE.yaml] [job keys] [--dry-run] [--wait] [key=value ...]

Checks the config, writes the batch script into the run directory (<run_dir>/slurm/job.sbatch),
submits it with sbatch and prints the job id.
  --dry-run          print the script; submit and write nothing
  --wait             return when the job ends, with its exit status
job keys:
  nodes=N            nodes to allocate (default 1)
  gpus_per_node=G    GPUs per node; 0 (default) is a CPU job
  procs_per_node=P   ranks per node (default: one per GPU; 1 on a CPU job)
  cpus_per_task=C    CPUs per node for its ranks (Slurm's --cpus-per-task of the one task per node
                     that runs torchrun); each rank gets C / P threads (OMP_NUM_THREADS)
  partition=, time=, account=, job_name=   passed to #SBATCH (time: minutes, HH:MM:SS or D-HH:MM:SS)
  signal_lead_s=S    seconds before the time limit the job is told to checkpoint and stop (120)
  rdzv_port=PORT     port of torchrun's rendezvous on the first node (default: from the job id)
  python=PATH        the Python the nodes run (default: the one running this tool)
every other key=value is a config override, as for python -m megatron_rl.main."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from .script import JobSpec, render

# key=value arguments that describe the job rather than the training config.
JOB_KEYS = {"nodes": int, "gpus_per_node": int, "procs_per_node": int, "cpus_per_task": int, "partition": str, "time": str,
            "account": str, "job_name": str, "signal_lead_s": int, "rdzv_port": int, "python": str}
USAGE = __doc__
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
SLURM_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)", re.IGNORECASE)
# Partition and account names (a comma-separated list of them for partitions).
SLURM_NAMES = re.compile(r"[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*")
# The largest lead Slurm's --signal=...@TIME accepts (seconds).
MAX_SIGNAL_LEAD_S = 65535


def _valid_time(text: str) -> bool:
    """Slurm's --time: the format, and minutes, seconds (and hours after days) in range (what
    follows the first field of H:M:S or M:S is below 60)."""
    if not SLURM_TIME.fullmatch(text):
        return False
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return True
    days, _, clock = text.rpartition("-")
    fields = [int(f) for f in clock.split(":")]
    if days and fields[0] > 23:
        return False
    return all(f < 60 for f in fields[1:])


def parse(args: List[str]) -> JobSpec:
    """A JobSpec from the command line; raises ValueError naming a bad argument."""
    from ..checks import load_config
    from ..config.recipes import is_recipe_file, recipe_name

    recipe, overrides, job = "tiny_cpu", [], {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"unexpected argument {arg!r}; arguments are key=value (see --help)")
        if key == "recipe":
            recipe = value
        elif key in JOB_KEYS:
            try:
                job[key] = JOB_KEYS[key](value)
            except ValueError:
                kind = "an integer" if JOB_KEYS[key] is int else "text"
                raise ValueError(f"{key}={value!r} must be {kind}") from None
        else:
            overrides.append(arg)
    if "time" in job and not _valid_time(job["time"]):
        raise ValueError(f"time={job['time']!r} is not a Slurm time limit (job argument): write minutes, "
                         "HH:MM:SS or D-HH:MM:SS, e.g. time=04:00:00")
    if job.get("nodes", 1) < 1 or job.get("gpus_per_node", 0) < 0 or job.get("procs_per_node", 1) < 1:
        raise ValueError("nodes and procs_per_node must be >= 1 and gpus_per_node >= 0")
    if job.get("cpus_per_task", 1) < 1:
        raise ValueError(f"cpus_per_task={job['cpus_per_task']} must be >= 1 (cores per node for the job's ranks); "
                         "leave it out to take Slurm's default")
    if not 0 <= job.get("signal_lead_s", 0) <= MAX_SIGNAL_LEAD_S:
        raise ValueError(f"signal_lead_s={job['signal_lead_s']} must be between 0 and {MAX_SIGNAL_LEAD_S} (seconds "
                         "before the time limit at which the job is told to checkpoint and stop), e.g. 120")
    if "rdzv_port" in job and not 1 <= job["rdzv_port"] <= 65535:
        raise ValueError(f"rdzv_port={job['rdzv_port']} is not a TCP port: give one in 1024-65535, or leave it out "
                         "for a port derived from the job id")
    for key in ("partition", "account"):
        if key in job and not SLURM_NAMES.fullmatch(job[key]):
            raise ValueError(f"{key}={job[key]!r} is not a Slurm {key} name: letters, digits, '_', '-' and '.', "
                             "several separated by commas (no spaces)")
    # Fail here, not after the job waited in the queue: the config, and the placement of its
    # layout on the job's ranks.
    from ..placement import PlacementError, plan_for

    per_node = job.get("procs_per_node") or max(1, job.get("gpus_per_node", 0))
    world = job.get("nodes", 1) * per_node
    from ..checks import ONE_PROCESS, WORLD

    cfg = load_config(recipe, overrides, WORLD if world > 1 else ONE_PROCESS)
    try:
        plan_for(cfg, world, per_node)
    except PlacementError as err:
        raise ValueError(str(err)) from None
    from ..data.sources import FILE_DATASETS, source_specs

    # A file, or a directory that datasets' save_to_disk wrote.
    for data_path in [s.path for s in source_specs(cfg.data)] if cfg.data.name in FILE_DATASETS else []:
        if not Path(data_path).exists():
            raise ValueError(f"data.path={data_path!r}: file not found (checked at submit, from {Path.cwd()}): "
                             "give a path the job's nodes can read, e.g. an absolute one")
    name = recipe_name(recipe, cfg.trainer.recipe)
    run_dir = Path(cfg.trainer.run_dir or Path("runs") / name / time.strftime("%Y%m%d-%H%M%S")).resolve()
    overrides = [o for o in overrides if not o.startswith("trainer.run_dir=")]
    if is_recipe_file(recipe):  # the job's nodes read the same file whatever their working directory
        recipe = str(Path(recipe).expanduser().resolve())
    return JobSpec(recipe=recipe, name=name, run_dir=run_dir, overrides=overrides,
                   python=job.pop("python", sys.executable), **job)


def submit(spec: JobSpec, wait: bool = False) -> int:
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch not found: run this on a Slurm login node (or use --dry-run)")
    script = spec.run_dir / "slurm" / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render(spec))
    cmd = ["sbatch", "--parsable"] + (["--wait"] if wait else []) + [str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # --parsable prints the job id as soon as the job is queued, before --wait returns.
    first = proc.stdout.readline().strip()
    if first:
        print(f"submitted job {first.split(';')[0]}: script {script}, log {spec.run_dir}/slurm/slurm-<id>.out, "
              f"run directory {spec.run_dir}", flush=True)
    out, err = proc.communicate()
    if proc.returncode and not first:
        raise RuntimeError(f"sbatch failed: {err.strip() or out.strip()}")
    return proc.returncode


def main(argv: Optional[List[str]] = None) -> int:
    from ..errors import ConfigError
    from ..errors import report

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):  # `submit --help` too
        print(USAGE)
        return 0
    if not args or args[0] != "submit":
        print(USAGE, file=sys.stderr)
        return 2
    rest = [a for a in args[1:] if a not in ("--dry-run", "--wait")]
    try:
        spec = parse(rest)
        if "--dry-run" in args:
            print(render(spec))
            return 0
        return submit(spec, wait="--wait" in args)
    except (ValueError, ConfigError, RuntimeError) as err:
        return report(err, "megatron_rl.slurm")


if __name__ == "__main__":
    sys.exit(main())
