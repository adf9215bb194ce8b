"""The Slurm path for real: a single-node Slurm (Debian's slurmctld + slurmd + munge) started on
localhost, the tiny_cpu recipe submitted with the submit tool, and a preemption warning that
makes the job checkpoint, requeue itself and finish from its checkpoint; a person's ``scancel``
ends the job for good, and a crash is not requeued.

Without Slurm installed these tests skip with the reason, unless MEGATRON_RL_REQUIRE_SLURM=1
(CI installs Slurm and sets it), in which case they fail."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.learner.parallel import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        reason = "Slurm is not installed (bash slurm/local_cluster.sh install, as root)"
        if os.environ.get("MEGATRON_RL_REQUIRE_SLURM") == "1":
            pytest.fail(reason + "; MEGATRON_RL_REQUIRE_SLURM=1 asks for it")
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURMCTLD_PORT": str(free_port()), "SLURMD_PORT": str(free_port())}
    started = subprocess.run(["bash", str(ROOT / "slurm" / "local_cluster.sh"), "start", str(state)],
                             capture_output=True, text=True, env=env, timeout=60)
    assert started.returncode == 0, started.stderr
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    yield state
    # A job a failed test left running would outlive the daemons: end every job of this cluster first.
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    if jobs:
        subprocess.run(["scancel", "--signal=KILL", "--full", *jobs], timeout=30)
        deadline = time.time() + 30
        while subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split() \
                and time.time() < deadline:
            time.sleep(0.5)
    subprocess.run(["bash", str(ROOT / "slurm" / "local_cluster.sh"), "stop", str(state)], timeout=30)
    os.environ.pop("SLURM_CONF", None)


def _submit(run_dir: Path, *args: str, wait: bool = False):
    cmd = [sys.executable, "-m", "megatron_rl.slurm", "submit", "recipe=tiny_cpu", f"rdzv_port={free_port()}",
           f"trainer.run_dir={run_dir}", "trainer.progress=false", *args] + (["--wait"] if wait else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _job(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _rows(run_dir: Path):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_dry_run_prints_the_batch_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_rl.slurm", "submit", "recipe=tiny_cpu", "nodes=2",
                          "gpus_per_node=8", "partition=gpu", "time=04:00:00", f"trainer.run_dir={tmp_path}",
                          "algo.group_size=4", "rollout.engines=16", "--dry-run"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 f"#SBATCH --output={tmp_path}/slurm/slurm-%j.out", "--nproc-per-node=8", "--rdzv-backend=c10d",
                 f"trainer.run_dir={tmp_path}", "algo.group_size=4", "scontrol requeue", "-m megatron_rl.launch",
                 # the trainer's own status decides the requeue; TERM (scancel) never requeues
                 f'export MEGATRON_RL_EXIT_FILE="$RUN_DIR/slurm/exit-status-$SLURM_JOB_ID"', "trap on_cancel TERM",
                 '[ "$status" -eq 3 ] && [ "$warned" -eq 1 ] && [ "$cancelled" -eq 0 ]',
                 # threads from the job's allocation, a rendezvous port and id per job and attempt
                 "CORES=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}",
                 "RDZV_PORT=$(( 20000 + (SLURM_JOB_ID * 16 + ${SLURM_RESTART_COUNT:-0} % 16) % 20000 ))",
                 '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"'):
        assert line in script, line
    assert "trap request_stop USR1 TERM" not in script and "29500" not in script
    assert not (tmp_path / "slurm").exists()  # a dry run writes nothing


def test_help_and_a_recipe_file_of_ones_own(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_rl.slurm", "submit", "--help"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "cpus_per_task=C    CPUs per node" in out.stdout, out.stderr
    (tmp_path / "mine.yaml").write_text("defaults:\n  - tiny_cpu\n  - _self_\n")
    out = subprocess.run([sys.executable, "-m", "megatron_rl.slurm", "submit", "recipe=mine.yaml", "--dry-run"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # The nodes read the file by its absolute path; the job and its run directory take its name.
    assert f"-m megatron_rl.launch recipe={tmp_path / 'mine.yaml'} trainer.run_dir={tmp_path}/runs/mine/" in out.stdout
    assert "#SBATCH --job-name=megatron_rl-mine\n" in out.stdout


def test_bad_arguments_fail_before_submitting(tmp_path):
    for args, message in ((["nodes=two"], "nodes='two' must be an integer"),
                          (["algo.name=nope"], "algo.name='nope' is not allowed"),
                          (["procs_per_node=3", "learner.tp=2", "rollout.engines=2", "rollout.placement=disaggregated"],
                           "cannot place this job on 3 ranks"),
                          (["time=banana"], "time='banana' is not a Slurm time limit (job argument): write minutes, "
                                            "HH:MM:SS or D-HH:MM:SS, e.g. time=04:00:00"),
                          (["data.name=gsm8k", "data.path=no/such/train.jsonl"],
                           # relative paths are the submitter's, made absolute before the job is queued
                           f"data.path='{ROOT}/no/such/train.jsonl': file not found (checked at submit, from")):
        out = subprocess.run([sys.executable, "-m", "megatron_rl.slurm", "submit", *args, "--dry-run"],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_submitted_tiny_cpu_job_completes_and_learns(slurm, tmp_path):
    result = _submit(tmp_path, "trainer.total_steps=120", "cpus_per_task=2", wait=True)
    assert result.returncode == 0, result.stdout + result.stderr + _log(tmp_path)
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    assert _job(job_id)["JobState"] == "COMPLETED"
    assert (tmp_path / "slurm" / "job.sbatch").is_file()
    rewards = [r["reward/mean"] for r in _rows(tmp_path)]
    assert len(rewards) == 120
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"slurm job {job_id}: reward {first:.3f} -> {last:.3f}")
    assert last >= first + 0.2, (first, last)


def _running_job(run_dir: Path, *args: str, steps_first: int = 2) -> str:
    """Submit a long tiny_cpu job and return its id once it has made ``steps_first`` steps."""
    result = _submit(run_dir, "trainer.total_steps=100000", "cpus_per_task=2", "trainer.checkpoint_interval=0", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    deadline = time.time() + 300
    while ("attempt 1" not in _log(run_dir) or len(_rows(run_dir)) < steps_first) and time.time() < deadline:
        time.sleep(0.2)
    assert "attempt 1" in _log(run_dir) and len(_rows(run_dir)) >= steps_first, _log(run_dir)
    return job_id


def _ended(run_dir: Path, job_id: str, timeout: float = 120) -> dict:
    """The job once its batch script has finished (its last line is written), and a few seconds
    later, so that a requeue it asked for would show."""
    deadline = time.time() + timeout
    while "training ended with status" not in _log(run_dir) and time.time() < deadline:
        time.sleep(0.5)
    while "COMPLETING" in _job(job_id).get("JobState", "") + _job(job_id).get("Reason", "") and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(5)
    return _job(job_id)


def test_scancel_ends_the_job_for_good(slurm, tmp_path):
    """A person's scancel (TERM to the batch shell and the job's processes), here while the job
    starts: the job is CANCELLED and stays so; no restart."""
    job_id = _running_job(tmp_path, steps_first=0)
    subprocess.run(["scancel", job_id], check=True)
    job = _ended(tmp_path, job_id)
    log = _log(tmp_path)
    assert job.get("JobState") == "CANCELLED" and job.get("Restarts") == "0", (job, log)
    # The batch shell's TERM handler reports it; or, when Slurm's TERM reaches the batch shell
    # after srun asked for a step of the ending job, srun's refusal does (seen on a loaded box).
    assert "cancelled (TERM)" in log or "has expired" in log, log
    assert "requeueing" not in log and "attempt 2" not in log, log


def test_a_crash_after_the_warning_is_not_requeued(slurm, tmp_path):
    """Warned (USR1), the trainer fails to write its stop checkpoint: the job fails with the
    trainer's status, and is not requeued (nor does the log claim a checkpoint)."""
    job_id = _running_job(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    shutil.rmtree(checkpoints)
    checkpoints.write_text("not a directory: the stop checkpoint cannot be written")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    job = _ended(tmp_path, job_id)
    log = _log(tmp_path)
    assert job.get("JobState") == "FAILED" and job.get("Restarts") == "0", (job, log)
    assert "training ended with status 1" in log and "checkpoint written" not in log, log


WORLD = ("procs_per_node=4", "learner.tp=2", "rollout.engines=2", "rollout.placement=disaggregated")


def test_preempted_world_job_requeues_and_resumes_from_its_checkpoint(slurm, tmp_path):
    """The 4-rank world (TP=2 learner, 2 engine ranks) as a Slurm job: preempted (`scontrol
    requeue`), it writes its stop checkpoint and the rerun resumes from it; warned of the time
    limit (USR1), it checkpoints after its step, requeues itself, resumes and runs to the end."""
    steps = 16
    # A periodic checkpoint first: megatron-core's writer then has its helper process running
    # when the TERM of the preemption arrives.
    result = _submit(tmp_path, f"trainer.total_steps={steps}", "cpus_per_task=2", "trainer.checkpoint_interval=4",
                     *WORLD)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    # Three starts of a 4-rank world on 2 cores; generous, since a loaded machine is slow.
    deadline = time.time() + 480
    while len(_rows(tmp_path)) < 5 and time.time() < deadline:
        time.sleep(0.2)
    assert len(_rows(tmp_path)) >= 5, _log(tmp_path)
    # Preemption: `scontrol requeue` sends TERM to the batch shell and every process of the step
    # (the checkpoint writer's helper process too); the stop checkpoint must still be written
    # and the rerun resume from it (the run writes no periodic checkpoint).
    done_before = len(_rows(tmp_path))
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    while "attempt 2" not in _log(tmp_path) and time.time() < deadline:
        time.sleep(0.2)
    while "resumed from" not in _train_log(tmp_path) and time.time() < deadline:
        time.sleep(0.2)
    resumed = re.search(r"resumed from \S+: step (\d+)", _train_log(tmp_path))
    assert resumed and int(resumed.group(1)) >= done_before, (_log(tmp_path), _train_log(tmp_path)[-3000:])
    # The first attempt stopped with its checkpoint written (3), not failing mid-save (1).
    assert "training ended with status 3" in _log(tmp_path), _log(tmp_path)
    while len(_rows(tmp_path)) < int(resumed.group(1)) + 2 and time.time() < deadline:
        time.sleep(0.2)
    # What Slurm sends signal_lead_s before the time limit (#SBATCH --signal=B:USR1@...).
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    while time.time() < deadline:
        job = _job(job_id)
        if job.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and job.get("Restarts") == "2":
            break
        time.sleep(1)
    log = _log(tmp_path)
    assert job.get("JobState") == "COMPLETED" and job.get("Restarts") == "2", (job, log)
    assert "requeueing job" in log and "attempt 3" in log
    train_log = _train_log(tmp_path)
    assert train_log.count("resumed from") == 2 and "BrokenPipeError" not in train_log
    assert "learner tp=2" in train_log and "2 embedded engine(s)" in train_log  # the world ran, thrice
    assert train_log.count("prompt ledger:") == 3 and "NOT balanced" not in train_log
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, steps + 1))


def _train_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "train.log"
    return path.read_text() if path.exists() else ""


def _log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "slurm").glob("slurm-*.out")))[-4000:]
