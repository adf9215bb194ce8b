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
from world_runs import COMMON, rows, run, world_ranks

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


@pytest.mark.parametrize("ranks, placement, built_as", [
    # Learners at TP=2 on ranks 0-1, the engine on rank 2, built by the entry's on_engine_rank.
    (3, ("rollout.engines=1", "rollout.placement=disaggregated"), "engine_rank"),
    # Each learner rank hosts an engine beside it, built by the entry's on_learner_rank.
    (2, ("rollout.engines=2", "rollout.placement=colocated"), "learner_rank"),
])
def test_a_registered_engine_serves_a_tp2_torchrun_world(tmp_path, counting, ranks, placement, built_as):
    run_dir = tmp_path / "run"
    script = Path(counting_engine.__file__)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script),
         *COMMON, f"trainer.run_dir={run_dir}", "learner.tp=2", *placement, *SMALL], timeout=300)
    assert len(rows(run_dir)) == 2
    calls = _lines(counting)
    assert len(calls) >= 4
    # Built on the world's ranks by the entry's hosting builder, in those ranks' processes.
    assert {b for _, b, _ in calls} == {built_as}
    ranks_that_served = {pid for pid, _, _ in calls}
    assert ranks_that_served <= {str(r["pid"]) for r in world_ranks(run_dir)}
