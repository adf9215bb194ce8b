"""Run the real entry points from a test: a one-process run (``python -m megatron_rl.main``) and a
torchrun world (``torchrun --standalone -m megatron_rl.launch``), each in its own session so a
hang is killed whole (ranks and their engine processes) and reported with its output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

# Every world test: quiet, small batches.
COMMON = ("recipe=tiny_cpu", "trainer.progress=false", "trainer.log_interval=1")


def main_cmd(run_dir: Path, overrides: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "megatron_rl.main", *COMMON, f"trainer.run_dir={run_dir}", *overrides]


def world_cmd(ranks: int, run_dir: Path, overrides: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "megatron_rl.launch", *COMMON, f"trainer.run_dir={run_dir}", *overrides]


def start(cmd: Sequence[str]) -> subprocess.Popen:
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> Tuple[int, str]:
    """(exit status, output); a run still going after ``timeout`` s is killed whole and fails."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"run did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    return proc.returncode, out


def run(cmd: Sequence[str], timeout: float = 600) -> str:
    rc, out = finish(start(cmd), timeout)
    assert rc == 0, out[-4000:]
    return out


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its ranks and their engine processes
    except ProcessLookupError:
        pass


def rows(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while len(rows(run_dir)) < steps and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert len(rows(run_dir)) >= steps, f"the run wrote {len(rows(run_dir))} steps, not {steps}"


def _stat(pid: int):
    """(state, parent pid) of a process, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def descendants(root: int) -> List[int]:
    """Every live process under ``root`` (children, their children, ...)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[1], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pids: Sequence[int]) -> List[int]:
    """The processes of ``pids`` still running (a zombie is dead)."""
    return [pid for pid in pids if (st := _stat(pid)) is not None and st[0] != "Z"]


def alive_after(pids: Sequence[int], seconds: float) -> List[int]:
    """The processes of ``pids`` still running ``seconds`` from now (sooner if all are gone)."""
    deadline = time.time() + seconds
    while (left := alive(pids)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def describe(pids: Sequence[int]) -> str:
    """State, parent and command line of each process, for an assertion message."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            cmd = "?"
        out.append(f"{pid} {_stat(pid)} {cmd}")
    return "; ".join(out)


def world_ranks(run_dir: Path) -> List[dict]:
    return json.loads((Path(run_dir) / "world.json").read_text())["ranks"]


def compare_steps(reference: List[dict], got: List[dict], loss_tol: float) -> float:
    """Rewards equal step for step; losses and grad norms (the critic's and the KL charge too,
    where the run has them) within ``loss_tol``; returns the worst gap."""
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    worst = 0.0
    for a, b in zip(reference, got):
        assert a["reward/mean"] == b["reward/mean"], (a["step"], a["reward/mean"], b["reward/mean"])
        assert a["response/length_mean"] == b["response/length_mean"], a["step"]
        extra = [k for k in ("critic/value_loss", "critic/grad_norm", "reward/kl_penalty_mean") if k in a]
        assert all(k in b for k in extra), (set(extra) - set(b))
        for key in ("train/loss", "train/grad_norm", "train/entropy", *extra):
            gap = abs(a[key] - b[key])
            worst = max(worst, gap)
            assert gap <= loss_tol, (a["step"], key, a[key], b[key])
    return worst


def full_adapter_bytes(rank: int, recipe: str = "tiny_cpu") -> int:
    """The fp32 bytes of a recipe's full (TP = 1) adapters at ``rank``: per layer, A [rank, in]
    and B [out, rank] of the fused QKV, the attention output, the gated fc1 and fc2."""
    from megatron_rl.checks import load_config

    m = load_config(recipe, []).model
    head = m.hidden_size // m.num_attention_heads
    qkv_out = m.hidden_size + 2 * m.num_query_groups * head
    shapes = [(m.hidden_size, qkv_out), (m.hidden_size, m.hidden_size), (m.hidden_size, 2 * m.ffn_hidden_size),
              (m.ffn_hidden_size, m.hidden_size)]  # (in, out) of each adapted linear
    return 4 * m.num_layers * sum(rank * (n_in + n_out) for n_in, n_out in shapes)
