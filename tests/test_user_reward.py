"""User rewards by import path (reward.fn=pkg.mod:fn) run end to end, and each wrong path,
signature or return value is one clear line; the code reward judges programs in the sandbox."""

import asyncio
import json
import re

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.checks import validate
from megatron_rl.plugins import PluginError
from megatron_rl.rewards import RewardRunner
from megatron_rl.rewards.code import code_tests, extract_program, judge, parse_cases
from megatron_rl.rewards.user import build_reward, load_user_reward

from user_packages import user_package


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A package ``userpkg_rewards`` with good and bad reward functions; calls are logged to a file."""
    log = tmp_path / "calls.log"
    scoring = f"""
        import asyncio

        LOG = {str(log)!r}

        def score(completion, target):
            with open(LOG, "a") as fh:
                fh.write("sync\\n")
            return float(completion.strip() == target)

        async def ascore(completion, target):
            await asyncio.sleep(0)
            with open(LOG, "a") as fh:
                fh.write("async\\n")
            return {{"reward": 0.25, "note": "extra keys are ignored"}}

        def one_param(completion):
            return 1.0

        def returns_text(completion, target):
            return "1.0"

        def returns_dict_without_reward(completion, target):
            return {{"score": 1.0}}

        def raises(completion, target):
            raise KeyError("no such field")
    """
    with user_package(tmp_path, monkeypatch, "userpkg_rewards", {"scoring": scoring}):
        yield "userpkg_rewards.scoring", log


def _train(tmp_path, reward_fn):
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [
        "trainer.total_steps=1", f"trainer.run_dir={tmp_path / 'run'}", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "algo.group_size=2", "algo.groups_per_batch=2",
        "learner.mini_batches=1", "scheduler.max_staleness=0", f"reward.fn={reward_fn}"])
    return build_trainer(validate(cfg)).run()


@pytest.mark.parametrize("name, call", [("score", "sync"), ("ascore", "async")])
def test_user_reward_trains_end_to_end(user_rewards, tmp_path, name, call):
    module, log = user_rewards
    _train(tmp_path, f"{module}:{name}")
    calls = log.read_text().split()
    assert len(calls) >= 4 and set(calls) == {call}  # every sample of the step's two groups
    if name == "ascore":
        metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        rewards = [v for m in metrics for k, v in m.items() if k.endswith("reward_mean") or k == "reward/mean"]
        assert rewards and all(r == pytest.approx(0.25) for r in rewards), metrics[-1]


def test_wrong_paths_and_signatures_are_one_line_config_errors(user_rewards):
    module, _ = user_rewards
    cases = {
        "userpkg_rewards.nope:score": "module 'userpkg_rewards.nope' is not importable",
        f"{module}:scroe": "has no attribute 'scroe'",
        f"{module}:one_param": "cannot be called as one_param(completion, target)",
        f"{module}.score": "is not an import path",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError) as err:
            validate(load_config("tiny_cpu", [f"reward.fn={spec}"]))
        assert message in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("reward.fn=")


def test_wrong_return_values_stop_the_scoring_with_one_line(user_rewards):
    module, _ = user_rewards
    for name, message in [("returns_text", "returned str '1.0'; return a float (an int, bool, numpy or torch scalar "
                                           "will do) or a dict with a float 'reward'"),
                          ("returns_dict_without_reward", "returned a dict without 'reward' (keys: score)")]:
        runner = RewardRunner(load_user_reward(f"{module}:{name}"), timeout_s=30.0)
        try:
            with pytest.raises(PluginError, match=re.escape(message)):
                asyncio.run(runner.score("x", "y"))
        finally:
            runner.close()


def test_reward_fn_takes_precedence_over_name(user_rewards):
    module, _ = user_rewards
    cfg = load_config("tiny_cpu", [f"reward.fn={module}:score"])
    fn, label = build_reward(cfg.reward)
    assert fn("7", "7") == 1.0 and label == f"reward.fn {module}:score"


def test_command_line_prints_one_line_and_exits_2(tmp_path, capsys):
    from megatron_rl.main import main

    assert main(["reward.fn=no_such_pkg_xyz.mod:score", f"trainer.run_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "megatron_rl: error: reward.fn='no_such_pkg_xyz.mod:score': module 'no_such_pkg_xyz' is not importable")


@pytest.mark.parametrize("name, message", [
    ("returns_text", "megatron_rl: error: reward.fn='userpkg_rewards.scoring:returns_text' returned str '1.0'; "
                     "return a float (an int, bool, numpy or torch scalar will do) or a dict with a float 'reward'"),
    ("raises", "megatron_rl: error: reward.fn userpkg_rewards.scoring:raises failed for every sample of 2 groups "
               "in a row (the last: KeyError: 'no such field'); the run stopped. Fix the reward or the data: the "
               "errors are in logs/train.log"),
])
def test_a_broken_reward_stops_the_run_with_one_line_naming_it(user_rewards, tmp_path, capsys, monkeypatch, name,
                                                              message):
    """Not after dozens of warnings and requeued prompts, and not blaming the engine."""
    import logging

    from megatron_rl.main import main

    module, _ = user_rewards
    # The run's console log handler writes to the captured stderr, closed after this test.
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    status = main([f"reward.fn={module}:{name}", f"trainer.run_dir={tmp_path}", "trainer.total_steps=3",
                   "trainer.progress=false", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1"])
    err = capsys.readouterr().err
    assert status == 1 and err.strip().splitlines()[-1] == message, err[-2000:]
    assert "engine" not in err and (tmp_path / "metrics.jsonl").read_text() == ""  # stopped before a step


SQUARES = json.dumps([{"input": "3\n", "output": "9\n"}, {"input": "12\n", "output": "144"}])


@pytest.mark.parametrize("program, verdict", [
    ("n = int(input())\nprint(n * n)", "pass"),
    ("n = int(input())\nprint(n + n)", "wrong_answer"),
    ("while True:\n    pass", "timeout"),
    ("raise RuntimeError('x')", "crash"),
    ("x = bytearray(10 * 1024 ** 3)", "memory"),
])
def test_code_verdicts(program, verdict):
    from megatron_rl.rewards.sandbox import SandboxLimits

    result = asyncio.run(judge(program, parse_cases(SQUARES), SandboxLimits(wall_s=20.0, cpu_s=1.0, memory_mb=256)))
    assert result.verdict == verdict and result.reward == (1.0 if verdict == "pass" else 0.0)


def test_code_reward_reads_the_last_fenced_block():
    completion = "First try:\n```python\nprint(0)\n```\nFixed:\n```python\nn = int(input())\nprint(n * n)\n```\n"
    assert extract_program(completion).startswith("n = int(input())")
    assert code_tests(completion, SQUARES) == 1.0
    with pytest.raises(ValueError, match="JSON list"):
        parse_cases("not json")
