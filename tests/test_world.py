"""The torchrun world runs the one-process trainer's controller (``megatron_rl.trainer``) on its
driver, with Megatron learners and embedded engines on other ranks, on CPU with gloo through the
real entry point (``torchrun -m megatron_rl.launch``).

- At η = 0 with per-request seeds, a world gives the one-process run's rewards step for step
  (bitwise) and its losses to float noise, at TP=2, PP=2, EP=2 (MoE), and colocated (TP=2, PP=2).
- At η = 2 it learns ``tiny_cpu`` as far as the one-process run in the same steps, and no trained
  sample's tokens (the versions the engines recorded) are older than η.
- Killing an engine rank loses no prompt and ends the run with one line; killing the launcher
  leaves no process of the job alive; a world killed mid-run resumes to the same metrics.
"""

import json
import os
import random
import signal
import time

import pytest

from world_runs import (alive_after, compare_steps, descendants, describe, finish, kill_session, main_cmd, rows, run,
                        start, wait_for_steps, world_cmd, world_ranks)

STEPS = 8
# Synchronous, per-request random streams (tokens independent of which engine serves them).
ETA0 = ("scheduler.max_staleness=0", "rollout.seed_by_request=true", "algo.groups_per_batch=8",
        "algo.group_size=8", f"trainer.total_steps={STEPS}")
DISAGGREGATED = ("rollout.engines=2", "rollout.placement=disaggregated")
LAYOUTS = {
    # name: (ranks, world overrides, start model, algorithm overrides, loss tolerance)
    "tp2": (4, ("learner.tp=2", *DISAGGREGATED), "llama", (), 1e-6),
    "pp2_decoupled_loss": (4, ("learner.pp=2", *DISAGGREGATED), "llama", ("algo.policy_loss=decoupled",), 1e-6),
    # EP=2 is also DP=2: each replica trains on half the batch and gradients are all-reduced.
    "ep2_moe": (4, ("learner.ep=2", *DISAGGREGATED), "mixtral", (), 1e-5),
    "colocated_tp2_shared_prompts": (2, ("learner.tp=2", "rollout.engines=2", "rollout.placement=colocated"),
                                     "llama", ("learner.share_prompts=true",), 1e-6),
    # PPO with a critic (GAE) and a KL charge to a reference model in the reward.
    "tp2_ppo_critic_kl": (4, ("learner.tp=2", *DISAGGREGATED), "llama",
                          ("algo.name=gae", "algo.kl_coef=0.01", "algo.kl_in_reward=true"), 1e-6),
}
# tiny_cpu's shape. Random initial weights depend on the layout that draws them (a pipeline stage
# draws only its own layers), so every run starts from one saved checkpoint instead.
SHAPE = dict(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
_cache = {}


def _start_model(tmp_path_factory, family):
    if ("model", family) not in _cache:
        from hf_helpers import save_random_hf_model

        path = tmp_path_factory.mktemp(f"start_{family}")
        save_random_hf_model(family, path, seed=3, **SHAPE)
        _cache["model", family] = f"model.path={path}"
    return _cache["model", family]


def _reference(tmp_path_factory, family, algo=()):
    """The one-process run these worlds must reproduce (one per start model and algorithm)."""
    if ("rows", family, algo) not in _cache:
        run_dir = tmp_path_factory.mktemp("one_process")
        run(main_cmd(run_dir, [*ETA0, _start_model(tmp_path_factory, family), *algo]))
        _cache["rows", family, algo] = rows(run_dir)
    return _cache["rows", family, algo]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world_at_eta0_gives_the_one_process_runs_steps(tmp_path, tmp_path_factory, layout):
    ranks, world, family, algo, tol = LAYOUTS[layout]
    reference = _reference(tmp_path_factory, family, algo)
    run(world_cmd(ranks, tmp_path, [*ETA0, _start_model(tmp_path_factory, family), *algo, *world]))
    got = rows(tmp_path)
    worst = compare_steps(reference, got, tol)
    print(f"{layout}: {STEPS} steps, rewards equal, worst loss/grad-norm/entropy gap {worst:.2e}")
    assert all(r["staleness/max"] == 0 for r in got)
    assert max(r["train/behav_logprob_gap"] for r in got) < 1e-4  # engines hold the learner's weights
    assert _ledger_lines(tmp_path) == ["balanced"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{STEPS}"
    # Every rank's spans are in the run's timeline: learners train and sync, engines receive and swap.
    spans = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert {s["rank"] for s in spans} == set(range(ranks))
    assert {"train", "sync"} <= {s["name"] for s in spans if s["rank"] == 1}
    if "disaggregated" in " ".join(world):
        assert {"sync", "swap"} <= {s["name"] for s in spans if s["rank"] == ranks - 1}


MOE = ("model.family=mixtral", "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=64")
ETA2_LAYOUTS = {  # name: (world overrides, model overrides)
    "tp2": (("learner.tp=2", *DISAGGREGATED), ()),
    "pp2": (("learner.pp=2", *DISAGGREGATED), ()),
    "ep2_moe": (("learner.ep=2", *DISAGGREGATED), MOE),
}


def _one_process_eta2(tmp_path_factory, model, common):
    if ("eta2", model) not in _cache:
        run_dir = tmp_path_factory.mktemp("one_process_eta2")
        run(main_cmd(run_dir, [*common, *model]))
        _cache["eta2", model] = rows(run_dir)
    return _cache["eta2", model]


@pytest.mark.parametrize("layout", list(ETA2_LAYOUTS))
def test_world_at_eta2_learns_like_one_process_within_the_staleness_bound(tmp_path, tmp_path_factory, layout):
    steps, eta = 60, 2
    world, model = ETA2_LAYOUTS[layout]
    # No final checkpoint: these runs are about learning and staleness (the η = 0 worlds above
    # check the checkpoint of each layout); a save costs a world seconds on 2 cores.
    common = (f"trainer.total_steps={steps}", f"scheduler.max_staleness={eta}", "trainer.log_interval=20",
              "trainer.save_final_checkpoint=false")
    one = _one_process_eta2(tmp_path_factory, model, common)
    run(world_cmd(4, tmp_path, [*common, *model, *world]))
    got = rows(tmp_path)

    def ends(rows_):
        rewards = [r["reward/mean"] for r in rows_]
        return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10

    (one_first, one_last), (world_first, world_last) = ends(one), ends(got)
    print(f"{layout}, eta={eta}, {steps} steps: one process {one_first:.3f} -> {one_last:.3f}; "
          f"world {world_first:.3f} -> {world_last:.3f}; world staleness mean "
          f"{sum(r['staleness/mean'] for r in got) / len(got):.2f}")
    # Measured (60 steps): one process 0.037 -> 0.226 (MoE 0.232); worlds 0.036-0.038 -> 0.244-0.271.
    assert world_last >= world_first + 0.1, (world_first, world_last)
    assert world_last >= one_last - 0.1, (one_last, world_last)
    # From the versions the engines recorded on each trained token (not the scheduler's count).
    assert max(r["staleness/max"] for r in got) <= eta
    assert all(len(r["staleness/histogram"]) <= eta + 1 for r in got)
    assert max(r["staleness/mean"] for r in got) > 0  # generation overlapped training


def test_killed_engine_rank_loses_no_prompt_and_ends_the_run_with_one_line(tmp_path):
    proc = start(world_cmd(4, tmp_path, ["trainer.total_steps=500", "learner.tp=2", *DISAGGREGATED]))
    try:
        wait_for_steps(tmp_path, 3, proc)
        engine = next(r for r in world_ranks(tmp_path) if r["rank"] == 3)
        assert engine["role"] == "engine"
        os.kill(engine["pid"], signal.SIGKILL)
        killed = time.time()
        rc, out = finish(proc, timeout=120)
    finally:
        kill_session(proc)
    took = time.time() - killed
    print(f"run ended {took:.1f} s after the engine rank was killed")
    assert rc != 0
    assert "megatron_rl.launch: error: the rollout engine is gone (the engine on rank 3 is gone" in out, out[-3000:]
    assert _ledger_lines(tmp_path) == ["balanced"]
    assert took < 60


def test_killed_launcher_leaves_no_process_of_the_job(tmp_path):
    """SIGKILL to torchrun alone (no clean-up can run): its ranks die with it (parent-death
    signal) and so do the colocated ranks' engine processes."""
    proc = start(world_cmd(2, tmp_path, ["trainer.total_steps=500", "learner.tp=2", "rollout.engines=2",
                                         "rollout.placement=colocated"]))
    try:
        wait_for_steps(tmp_path, 2, proc)
        job = descendants(proc.pid)
        ranks = world_ranks(tmp_path)
        assert {r["pid"] for r in ranks} | {r["engine_pid"] for r in ranks} <= set(job)  # 2 ranks, 2 engines
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = alive_after(job, 10)  # returns as soon as all are gone
    finally:
        kill_session(proc)
    assert not left, f"processes of the job still alive 10 s after the launcher was killed: {left}"


def test_world_killed_at_a_random_step_resumes_to_the_same_metrics(tmp_path, tmp_path_factory):
    reference = _reference(tmp_path_factory, "llama")
    overrides = [*ETA0, _start_model(tmp_path_factory, "llama"), "learner.tp=2", *DISAGGREGATED,
                 "trainer.checkpoint_interval=3"]
    kill_after = random.randint(4, STEPS - 1)  # past the step-3 checkpoint
    print(f"killing the world after step {kill_after}")
    proc = start(world_cmd(4, tmp_path, overrides))
    try:
        wait_for_steps(tmp_path, kill_after, proc)
        job = descendants(proc.pid)  # ranks, and the checkpoint writer's process on each learner rank
    finally:
        kill_session(proc)
        proc.wait()
    assert kill_after <= len(rows(tmp_path)) < STEPS
    # A kill during a save must take the checkpoint writer's forked workers too (they sit in the
    # rank's own session, out of reach of the launcher's process group): lifetime.forks_die_with_us.
    left = alive_after(job, 10)
    assert not left, f"processes of the killed world outlived it: {describe(left)}"
    out = run(world_cmd(4, tmp_path, overrides))
    assert "resumed from" in (tmp_path / "logs" / "train.log").read_text(), out[-2000:]
    compare_steps(reference, rows(tmp_path), 1e-6)


def _ledger_lines(run_dir):
    """How each run in ``run_dir`` closed its prompt ledger (the trainer logs it last)."""
    log = (run_dir / "logs" / "train.log").read_text()
    return [line.rsplit("(", 1)[1].rstrip(")") for line in log.splitlines() if "prompt ledger:" in line]
