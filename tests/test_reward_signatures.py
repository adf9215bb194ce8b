"""Rewards in the three signatures users bring (ours, verl's compute_score, AReaL's reward_fn),
told apart at config time, given the prompt, token ids and dataset row, and trained end to end
on the datasets they come with; a returned dict's other numbers become reward/extra/<key>."""

import asyncio
import json

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.checks import validate
from megatron_rl.plugins import PluginError
from megatron_rl.rewards import RewardRunner
from megatron_rl.rewards.user import load_user_reward
from megatron_rl.rewards.worker import RewardInput

from test_dataset_formats import CHAT_TEXTS, verl_rows, write_jsonl, write_parquet
from user_packages import user_package

REWARDS = '''
import json

LOG = {log!r}


def _log(**record):
    with open(LOG, "a") as fh:
        fh.write(json.dumps(record) + "\\n")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: a dict with its score under 'score' and other values."""
    _log(kind="verl", data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
         extra_info=extra_info)
    return {{"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth,
            "pred": solution_str[:10]}}


async def areal_reward(prompt, completions, prompt_ids, completion_ids, answer, **row):
    """AReaL's signature: the prompt text, the one completion, both id lists, the row by keyword."""
    _log(kind="areal", prompt=prompt, completions=completions, prompt_ids=prompt_ids, completion_ids=completion_ids,
         answer=answer, row=row)
    return {{"reward": float(completions.strip() == str(answer)), "hard": float(row["difficulty"] == "hard")}}


def ours_with_row(completion, target, difficulty):
    return 1.0 if difficulty == "hard" else 0.5


def ours_with_all_fields(completion, target, **row):
    return float(sorted(row) == ["answer", "difficulty", "question"])


def best_answer(completion, target):
    return {{"1/2": 0.25, "0.5": 1.0}}.get(target, 0.0)


def ours_with_missing_field(completion, target, level):
    return 1.0


def areal_missing_ids(prompt, completions):
    return 1.0


def no_signature(text):
    return 1.0


def verl_returns_text(data_source, solution_str, ground_truth):
    return "1"
'''


@pytest.fixture
def rewards_pkg(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    with user_package(tmp_path, monkeypatch, "sigpkg_rewards", {"scoring": REWARDS.format(log=str(log))}):
        yield "sigpkg_rewards.scoring", log


def _calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(run_dir, *overrides):
    from megatron_rl.build import build_trainer

    cfg = load_config("tiny_cpu", [
        "trainer.total_steps=2", f"trainer.run_dir={run_dir}", "trainer.progress=false",
        "trainer.save_final_checkpoint=false", "algo.group_size=2", "algo.groups_per_batch=2",
        "learner.mini_batches=1", "scheduler.max_staleness=0", "data.name=file", *overrides])
    return build_trainer(validate(cfg)).run()


def test_signatures_are_told_apart_at_config_time(rewards_pkg):
    module, _ = rewards_pkg
    kinds = {name: load_user_reward(f"{module}:{name}").kind
             for name in ("compute_score", "areal_reward", "ours_with_row", "ours_with_all_fields", "best_answer")}
    assert kinds == {"compute_score": "verl", "areal_reward": "areal", "ours_with_row": "ours",
                     "ours_with_all_fields": "ours", "best_answer": "ours"}
    cases = {
        "no_signature": "no_signature(text) cannot be called as no_signature(completion, target) (too many positional "
                        "arguments), nor as verl's compute_score(data_source, solution_str, ground_truth, extra_info) "
                        "or AReaL's reward_fn(prompt, completions, prompt_ids, completion_ids, **row); give it one of "
                        "these signatures",
        "areal_missing_ids": "areal_missing_ids(prompt, completions) looks like AReaL's reward_fn(prompt, completions, "
                             "prompt_ids, completion_ids, **row) but cannot be called so",
    }
    for name, message in cases.items():
        with pytest.raises(ConfigError) as err:
            validate(load_config("tiny_cpu", [f"reward.fn={module}:{name}"]))
        assert message in str(err.value) and "\n" not in str(err.value), err.value


def test_rewards_read_the_row_in_worker_processes(rewards_pkg):
    module, log = rewards_pkg
    row = {"question": "7=", "answer": "7", "difficulty": "hard"}
    item = RewardInput("7", ("7",), "7=", (1, 8, 11), (8, 2), "7", row)
    expectations = {"ours_with_row": [1.0], "ours_with_all_fields": [1.0], "areal_reward": [1.0]}
    for name, scores in expectations.items():
        runner = RewardRunner(load_user_reward(f"{module}:{name}"), timeout_s=30.0)
        try:
            assert asyncio.run(runner.score_many([item])) == scores, name
            if name == "areal_reward":
                (scored,) = asyncio.run(runner.score_inputs([item]))
                assert scored.extras == {"hard": 1.0}
        finally:
            runner.close()
    areal = [c for c in _calls(log) if c["kind"] == "areal"][0]
    assert (areal["prompt"], areal["prompt_ids"], areal["completion_ids"]) == ("7=", [1, 8, 11], [8, 2])
    assert areal["row"] == {"question": "7=", "difficulty": "hard"}  # answer came by name
    # Several acceptable answers: ours is scored against each and keeps the best.
    runner = RewardRunner(load_user_reward(f"{module}:best_answer"), timeout_s=30.0)
    try:
        assert asyncio.run(runner.score_many([RewardInput("x", ("1/2", "0.5"))])) == [1.0]
    finally:
        runner.close()


@pytest.mark.parametrize("name, message", [
    ("ours_with_missing_field", "reward.fn='sigpkg_rewards.scoring:ours_with_missing_field': its parameter 'level' "
                                "names no field of the dataset row (the row has: answer, question); rename it to a "
                                "field, give it a default, or take **row"),
    ("verl_returns_text", "reward.fn='sigpkg_rewards.scoring:verl_returns_text' returned str '1'; return a float"),
])
def test_a_reward_the_row_cannot_feed_stops_with_one_line(rewards_pkg, name, message):
    module, _ = rewards_pkg
    runner = RewardRunner(load_user_reward(f"{module}:{name}"), timeout_s=30.0)
    try:
        with pytest.raises(PluginError) as err:
            asyncio.run(runner.score_many([RewardInput("7", ("7",), row={"question": "7=", "answer": "7"})]))
        assert message in str(err.value)
    finally:
        runner.close()


def test_verl_parquet_and_compute_score_train_end_to_end(rewards_pkg, tmp_path):
    from megatron_rl.data.tokenizer import write_chat_tokenizer

    module, log = rewards_pkg
    write_chat_tokenizer(tmp_path / "tok", CHAT_TEXTS, 300)
    data = write_parquet(tmp_path / "train.parquet", verl_rows())
    _train(tmp_path / "run", f"data.path={data}", "data.tokenizer=model", f"data.tokenizer_path={tmp_path / 'tok'}",
           "data.max_prompt_tokens=40", "model.max_position_embeddings=64", "rollout.max_new_tokens=4",
           f"reward.fn={module}:compute_score")
    calls = _calls(log)
    assert len(calls) >= 8  # 2 steps x 2 groups x 2 samples
    by_truth = {r["reward_model"]["ground_truth"]: r for r in verl_rows()}
    for call in calls:
        row = by_truth[call["ground_truth"]]
        assert call["data_source"] == "toy/add" and call["extra_info"] == row["extra_info"]
    metrics = _metrics(tmp_path / "run")
    assert len(metrics) == 2 and all("reward/extra/acc" in m for m in metrics)
    assert "reward/extra/pred" not in metrics[0]  # text is no metric
    assert all(m["reward/extra/acc"] == m["reward/mean"] for m in metrics)  # acc is the score here
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("<|im_start|>user\nWhat is ")


def test_hf_directory_with_integer_answers_trains_end_to_end(tmp_path):
    import datasets

    rows = [{"question": f"{q}=", "answer": int("".join(sorted(q)))} for q in ("312", "5341", "987", "2112")]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sorted_ds"))
    _train(tmp_path / "run", f"data.path={tmp_path / 'sorted_ds'}", "reward.name=sort_digits")
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    by_prompt = {r["question"]: str(r["answer"]) for r in rows}
    assert samples and all(s["target"] == by_prompt[s["prompt"]] for s in samples)
    assert len(_metrics(tmp_path / "run")) == 2


def test_areal_reward_reads_row_fields_end_to_end(rewards_pkg, tmp_path):
    module, log = rewards_pkg
    data = write_jsonl(tmp_path / "rows.jsonl", [{"question": "312=", "answer": 123, "difficulty": "hard"},
                                                 {"question": "54=", "answer": 45, "difficulty": "easy"}])
    _train(tmp_path / "run", f"data.path={data}", f"reward.fn={module}:areal_reward")
    calls = _calls(log)
    assert len(calls) >= 8
    for call in calls:
        assert call["answer"] == {"312=": 123, "54=": 45}[call["prompt"]]  # the row's own value, raw
        assert call["row"]["difficulty"] == ("hard" if call["answer"] == 123 else "easy")
        assert call["prompt_ids"] and all(isinstance(i, int) for i in call["prompt_ids"] + call["completion_ids"])
    metrics = _metrics(tmp_path / "run")
    assert all(0.0 <= m["reward/extra/hard"] <= 1.0 for m in metrics) and len(metrics) == 2
