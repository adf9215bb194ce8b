"""Adapter-only weight sync in the torchrun world (lora.sync=adapters, weights/adapter_sync.py):
with the learner at TP = 2, the embedded engines (an engine rank of their own, or each colocated
learner rank's engine process) carry the adapters at TP = 1; after the first push (the frozen base
and the adapters) every push carries the full adapters alone, and the engines' logprobs are the
learner's (the sync probe, fp32, <= 1e-5)."""

import pytest

from world_runs import full_adapter_bytes, rows, run, world_cmd

TOL = 1e-5
LORA = ("lora.rank=4", "rollout.check_sync=true", "trainer.total_steps=3", "scheduler.max_staleness=0",
        "algo.groups_per_batch=2", "algo.group_size=2", "learner.mini_batches=1", "learner.lr=3e-2",
        "trainer.save_final_checkpoint=false", "learner.tp=2", "rollout.max_model_len=32")
PLACEMENTS = {  # name: (ranks, overrides)
    "disaggregated": (3, ("rollout.engines=1", "rollout.placement=disaggregated")),
    "colocated": (2, ("rollout.engines=2", "rollout.placement=colocated")),
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_world_at_tp2_syncs_the_full_adapters_alone(tmp_path, placement):
    ranks, overrides = PLACEMENTS[placement]
    run(world_cmd(ranks, tmp_path, [*LORA, *overrides]), timeout=120)
    got = rows(tmp_path)
    print([(r["sync/bytes"], r["sync/adapter_only"], r["sync/probe_gap"], r["train/behav_logprob_gap"])
           for r in got])
    assert len(got) == 3
    # Each step's push (the first, with the base, is the run's start): the adapters, gathered whole.
    assert all(r["sync/adapter_only"] == 1.0 and r["sync/bytes"] == full_adapter_bytes(4) for r in got)
    assert all(r["sync/probe_gap"] <= TOL and r["train/behav_logprob_gap"] <= TOL for r in got)
    # The engines log no fallback to merged weights.
    assert "receives merged weights" not in (tmp_path / "logs" / "train.log").read_text()
