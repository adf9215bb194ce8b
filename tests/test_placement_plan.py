"""The placement planner (a pure function): roles, Megatron coordinates, engine and weight-sync
groups, and rejections that say why and what would fit."""

import pytest

from megatron_rl.placement import Layout, PlacementError, plan_placement


def test_disaggregated_learners_first_then_engines():
    plan = plan_placement(8, 8, Layout(tp=2, pp=2, engines=4, placement="disaggregated"))
    assert plan.learner_ranks == (0, 1, 2, 3) and plan.dp == 1
    assert plan.engine_groups == ((4,), (5,), (6,), (7,))
    assert [r.role for r in plan.ranks] == ["learner"] * 4 + ["engine"] * 4
    # Megatron's tp-cp-ep-dp-pp order: TP fastest, PP slowest.
    assert [(r.tp_rank, r.pp_rank) for r in plan.ranks[:4]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert plan.sync_sources == (0, 2)  # TP rank 0 of each stage
    assert plan.sync_groups == ((0, 4, 5, 6, 7), (2, 4, 5, 6, 7))


def test_data_parallel_coordinates_and_multi_rank_engines():
    plan = plan_placement(16, 8, Layout(tp=2, engines=2, engine_tp=4, placement="disaggregated",
                                        engine_kind="vllm"))
    assert plan.dp == 4 and len(plan.learner_ranks) == 8
    assert [r.dp_rank for r in plan.ranks[:8]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert plan.engine_groups == ((8, 9, 10, 11), (12, 13, 14, 15))
    assert {r.node for r in plan.ranks if r.engine == 1} == {1}
    assert plan.sync_sources == (0,)
    # vLLM's workers are not ranks: the table names the channel each stage's source hosts.
    assert plan.table().splitlines()[-1] == (
        "weight channels: stage 0: rank 0 -> the vLLM workers on ranks [8, 9, 10, 11, 12, 13, 14, 15]")
    # Under LoRA (lora.sync=adapters) each engine's first rank takes the pushes over gloo groups.
    lora = plan_placement(16, 8, Layout(tp=2, engines=2, engine_tp=4, placement="disaggregated",
                                        engine_kind="vllm", engine_adapters=True))
    assert lora.table().splitlines()[-1] == (
        "weight-sync groups (gloo; LoRA: the base once, then the adapters, to each vLLM engine's first rank): "
        "stage 0: [0, 8, 12]")


def test_colocated_every_rank_learns_and_hosts_an_engine():
    plan = plan_placement(4, 4, Layout(tp=2, engines=4, placement="colocated"))
    assert plan.learner_ranks == (0, 1, 2, 3) and plan.dp == 2
    assert all(r.role == "learner+engine" for r in plan.ranks)
    assert plan.engine_groups == ((0,), (1,), (2,), (3,))
    assert plan.sync_groups == ()  # weights move within each rank's node
    assert "colocated" in plan.table()


def test_dry_run_table_lists_every_rank():
    text = plan_placement(6, 6, Layout(tp=2, pp=2, engines=2)).table()
    lines = text.splitlines()
    assert "learner tp=2 pp=2" in lines[0] and "2 embedded engine(s)" in lines[0]
    assert lines[1].split()[:4] == ["rank", "node", "local", "role"]
    assert len(lines) == 2 + 6 + 1
    assert lines[-1] == "weight-sync groups: stage 0: [0, 4, 5]; stage 1: [2, 4, 5]"


@pytest.mark.parametrize("world, gpn, layout, why, fits", [
    (5, 5, Layout(tp=2, engines=2), "3 learner ranks are not a multiple of", "rollout.engines=3 (learner dp=1)"),
    (4, 4, Layout(tp=2, engines=4), "leave no learner ranks", "rollout.engines=2 (learner dp=1)"),
    (4, 4, Layout(engines=3, placement="colocated"), "colocated engines take every GPU once",
     "rollout.engines=4 rollout.tp=1"),
    (4, 4, Layout(engines=1, engine_tp=2), "rollout.tp must be 1", None),
    (24, 8, Layout(tp=16, engines=8), "split tensor-parallel group 0-15 across nodes", "learner.tp=8"),
    (12, 8, Layout(engines=2), "not a whole number of nodes", None),
    (6, 6, Layout(tp=2, dp=3, engines=2), "learner.dp=3 but 4 learner ranks", "learner.dp unset"),
    (12, 4, Layout(engines=2, engine_tp=4, engine_kind="vllm", tp=2), None, None),  # fits: 4 learners
    (10, 10, Layout(engines=1, engine_tp=4, engine_kind="vllm", tp=2, ep=4), "learner.ep=4 needs", None),
])
def test_impossible_layouts_say_why_and_what_fits(world, gpn, layout, why, fits):
    if why is None:
        plan_placement(world, gpn, layout)
        return
    with pytest.raises(PlacementError) as err:
        plan_placement(world, gpn, layout)
    text = str(err.value)
    assert why in text, text
    if fits:
        assert "what would fit" in text and fits in text, text


def test_engines_never_straddle_nodes():
    # 4 learners on node 0, then engines of 4: the first would take ranks 4-7 across nodes of 6.
    with pytest.raises(PlacementError, match="engine 0 \\(ranks 4-7\\) would span two nodes of 6"):
        plan_placement(12, 6, Layout(engines=2, engine_tp=4, engine_kind="vllm"))


def test_dry_run_command_prints_the_plan_and_rejects_with_status_2():
    import subprocess
    import sys

    base = [sys.executable, "-m", "megatron_rl.launch", "--dry-run", "--world-size", "8", "--gpus-per-node", "4"]
    ok = subprocess.run(base + ["learner.tp=2", "learner.pp=2", "rollout.engines=4",
                                "rollout.placement=disaggregated"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "learner tp=2 pp=2" in ok.stdout and "weight-sync groups: stage 0: [0, 4, 5, 6, 7]" in ok.stdout
    bad = subprocess.run(base + ["learner.tp=2", "rollout.engines=7", "rollout.placement=disaggregated"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.startswith("megatron_rl.launch: error: cannot place this job on 8 ranks")
    assert "what would fit" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
