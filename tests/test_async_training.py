"""The staleness-bounded asynchronous loop: η = 0 equals the synchronous loop exactly; η > 0
learns within its bound; engine aborts and hanging rewards lose no prompt."""

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter

from megatron_rl.checks import load_config


def _run_cli(run_dir, *overrides, timeout=900):
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.main", f"trainer.run_dir={run_dir}", "trainer.progress=false",
         "trainer.save_final_checkpoint=false", *overrides],
        capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _plain_synchronous_loop(trainer, steps: int):
    """The synchronous loop written out plainly, from the trainer's pieces: B prompts, G samples
    each with the current weights, their scores, one update, publish; metrics per step."""
    from megatron_rl.rollout.workflow import single_turn_group

    b, g = trainer.cfg.algo.groups_per_batch, trainer.cfg.algo.group_size

    async def loop():
        await trainer.sync_weights()
        out, admitted = [], 0
        for step in range(1, steps + 1):
            prompts = [next(trainer.prompts) for _ in range(b)]
            # The request ids the controller gives (admission order); with seed_by_request they
            # alone decide the tokens, whatever order the engine serves them in.
            groups = await asyncio.gather(*(
                single_turn_group(trainer.engine, p, trainer.params, [f"g{admitted + j}-{p.uid}-{i}" for i in range(g)])
                for j, p in enumerate(prompts)))
            admitted += b
            groups = [list(group) for group in groups]
            await trainer.score(prompts, groups)
            out.append(trainer.train_on(prompts, groups, step - 1))
            trainer.version = step
            await trainer.sync_weights()
        await trainer.engine.shutdown()
        return out

    return asyncio.run(loop())


def test_eta_zero_is_the_plain_synchronous_loop(megatron_world, tmp_path):
    """The controller at η = 0 is the synchronous loop: the same rewards, losses, entropies and
    gradient norms, bit for bit, as the loop written out by hand."""
    from megatron_rl.build import build_trainer

    steps = 10
    common = [f"trainer.total_steps={steps}", "trainer.progress=false", "trainer.save_final_checkpoint=false",
              "scheduler.max_staleness=0", "rollout.seed_by_request=true"]
    plain = _plain_synchronous_loop(build_trainer(load_config("tiny_cpu", [*common, f"trainer.run_dir={tmp_path / 'plain'}"])),
                                    steps)
    build_trainer(load_config("tiny_cpu", [*common, f"trainer.run_dir={tmp_path / 'controller'}"])).run()
    controlled = [json.loads(line) for line in (tmp_path / "controller" / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward/mean", "train/loss", "train/entropy", "train/grad_norm", "response/length_mean"):
        assert [m[key] for m in plain] == [m[key] for m in controlled], key
    assert all(m["staleness/max"] == 0 for m in controlled)


def test_eta_two_learns_within_its_bound(tmp_path):
    rows = _run_cli(tmp_path / "eta2", "trainer.total_steps=150", "scheduler.max_staleness=2")
    rewards = [m["reward/mean"] for m in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"eta=2, 150 steps: reward {first:.3f} -> {last:.3f}")
    assert last >= first + 0.3, (first, last)
    assert max(m["staleness/max"] for m in rows) <= 2
    assert max(m["staleness/max"] for m in rows) >= 1  # rollouts really overlapped training
    samples_per_step = 16 * 16
    assert all(len(m["staleness/histogram"]) == 3 and sum(m["staleness/histogram"]) == samples_per_step
               for m in rows)


def test_engine_aborts_and_hanging_rewards_lose_no_prompt(megatron_world, tmp_path, monkeypatch):
    from megatron_rl.build import build_trainer

    # Every 29th reward call sleeps longer than reward.timeout_s: it must become a counted zero.
    # (Rewards run in worker processes, which import the function by its path.)
    monkeypatch.setenv("REWARD_TEST_DIR", str(tmp_path))
    cfg = load_config("tiny_cpu", [
        "trainer.total_steps=8", f"trainer.run_dir={tmp_path}", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "scheduler.max_staleness=2", "algo.groups_per_batch=4",
        "algo.group_size=4", "reward.timeout_s=0.3", "reward.workers=2",
        "reward.fn=reward_functions:hangs_every_29th_call"])
    trainer = build_trainer(cfg)

    real_rollout = trainer.rollout_group

    async def rollout_with_engine_failures(ticket):
        if ticket.index % 7 != 3:
            return await real_rollout(ticket)
        # The engine loses this group's first request (as if it died serving it) and, every
        # other time, everything else it has in flight too.
        task = asyncio.ensure_future(real_rollout(ticket))
        await asyncio.sleep(0)
        await trainer.engine.abort([f"g{ticket.index}-{ticket.prompt.uid}-0"])
        if ticket.index % 2:
            await trainer.engine.abort()
        return await task

    trainer.controller.rollout = rollout_with_engine_failures

    trained = Counter()
    real_train = trainer.train_groups

    def record(groups, version):
        trained.update(g.ticket.prompt.uid for g in groups)
        return real_train(groups, version)

    trainer.controller.train = record
    trainer.run()

    ledger = trainer.ledger
    assert sum(trained.values()) == 8 * 4
    assert all(n == 1 for n in trained.values()), (trained.most_common(3), ledger.counts)
    assert ledger.counts["returned_aborted"] >= 1, ledger.counts
    assert trainer.rewards.counts["timeout"] >= 1
    assert ledger.balanced()
    waiting = {p.uid for p in ledger.retry_queue} | {g.ticket.prompt.uid for g in ledger.buffer}
    waiting |= {t.prompt.uid for t in ledger.running.values()}
    assert set(ledger.attempts) == set(trained) | waiting
    assert not set(trained) & waiting
