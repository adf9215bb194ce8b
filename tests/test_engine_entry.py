"""An engine registered from a module of its own (tests/counting_engine.py: ENGINES["counting"],
the embedded engine behind a wrapper that writes down every group it generates) serves the run
in every placement: in one process (built by the composition root, megatron_rl/build.py) and on
the ranks of a TP=2 torchrun world (hosted by the launcher from the same registry entry), never
silently replaced by the embedded engine."""

import sys
from pathlib import Path

import pytest

import counting_engine
from megatron_rl.rollout.build import ENGINES
from world_runs import COMMON, run, rows

SMALL = ("trainer.total_steps=2", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1",
         "trainer.save_final_checkpoint=false", "rollout.engine=counting")


def _lines(log: Path):
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def counting(tmp_path, monkeypatch):
    """The counting engine registered in this process for the test, and its log."""
    log = tmp_path / "engine_calls.log"
    monkeypatch.setenv(counting_engine.LOG, str(log))
    counting_engine.register()
    try:
        yield log
    finally:
        ENGINES.remove(counting_engine.NAME)


def test_a_registered_engine_serves_a_one_process_run(tmp_path, counting):
    from megatron_rl.build import build_trainer
    from megatron_rl.checks import load_config

    cfg = load_config("tiny_cpu", ["trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}", *SMALL])
    build_trainer(cfg).run()
    calls = _lines(counting)
    assert len(calls) >= 4  # 2 steps x 2 groups (more if a prompt ran ahead)
    assert {built_as for _, built_as, _ in calls} == {"one_process"}


def test_a_registered_engine_serves_a_tp2_torchrun_world(tmp_path, counting):
    """Learners at TP=2 on ranks 0-1, the engine on rank 2 (~40 s on 2 cores). The colocated
    placement hosts an engine through the entry's ``on_learner_rank`` the same way (a 2-rank
    world, ~60 s: left to the η = 0 world tests, which run it with the embedded entry)."""
    run_dir = tmp_path / "run"
    script = Path(counting_engine.__file__)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", str(script),
         *COMMON, f"trainer.run_dir={run_dir}", "learner.tp=2", "rollout.engines=1",
         "rollout.placement=disaggregated", *SMALL], timeout=300)
    assert len(rows(run_dir)) == 2
    calls = _lines(counting)
    assert len(calls) >= 4
    # Built on the engine rank by the entry's hosting builder, in that rank's process.
    assert {built_as for _, built_as, _ in calls} == {"engine_rank"}
    assert len({pid for pid, _, _ in calls}) == 1
