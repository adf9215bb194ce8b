"""On-policy distillation (algo.name=opd): the student samples, a frozen teacher on the learner
ranks scores its tokens, and the per-token advantage is log π_teacher - log π_student.

- A teacher equal to the student gives zero advantages (and no update).
- A teacher that ends every response at once (trained here in a few steps) pulls the student's
  responses down to that length within 25 steps, and the reverse KL falls.
- A teacher built at TP=2 scores tokens as in one process.
"""

import json

import pytest

from megatron_rl.checks import load_config

from teacher_helpers import digit_teacher

COMMON = ["trainer.progress=false", "trainer.save_final_checkpoint=false", "scheduler.max_staleness=0",
          "algo.group_size=4", "algo.groups_per_batch=4", "algo.entropy_coef=0", "learner.mini_batches=1"]


@pytest.fixture(scope="module")
def stopping_teacher(tmp_path_factory):
    """An HF directory of tiny_cpu's shape whose model answers every prompt with <eos> at once."""
    return digit_teacher(tmp_path_factory.mktemp("teacher"), stops=True)


def _run(tmp_path, overrides):
    from megatron_rl.main import main

    assert main(["recipe=tiny_cpu", *COMMON, f"trainer.run_dir={tmp_path}", *overrides]) == 0
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_teacher_equal_to_the_student_gives_zero_advantages(stopping_teacher, tmp_path):
    rows = _run(tmp_path, ["algo.name=opd", f"teacher.path={stopping_teacher}", f"model.path={stopping_teacher}",
                           "trainer.total_steps=2"])
    for row in rows:
        assert row["distill/reverse_kl"] == 0.0 and row["train/grad_norm"] == 0.0, row


def test_the_student_learns_the_teachers_answer(stopping_teacher, tmp_path):
    rows = _run(tmp_path, ["algo.name=opd", f"teacher.path={stopping_teacher}", "trainer.total_steps=25",
                           "learner.lr=1e-2", "learner.lr_warmup_steps=0", "learner.lr_decay_style=constant"])
    lengths = [r["response/length_mean"] for r in rows]
    kl = [r["distill/reverse_kl"] for r in rows]
    print(f"length {lengths[0]:.2f} -> {lengths[-1]:.2f}, reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}")
    assert lengths[0] > 3.0 and max(lengths[-3:]) < 1.5, lengths
    assert kl[-1] < 0.2 * kl[0], kl


def test_teacher_path_is_checked_at_config_time(stopping_teacher, tmp_path):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="algo.name=opd distils from a teacher: set teacher.path"):
        load_config("tiny_cpu", ["algo.name=opd"])
    with pytest.raises(ConfigError, match="is only read by on-policy distillation"):
        load_config("tiny_cpu", [f"teacher.path={stopping_teacher}"])
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config("tiny_cpu", ["algo.name=opd", f"teacher.path={tmp_path / 'none'}"])


def test_a_tensor_parallel_teacher_scores_as_one_process(megatron_world, tmp_path):
    """The teacher has its own architecture (2 layers, another FFN width than the student's 4 and
    128) and takes the learner's layout: at TP=2 its logprobs are the one-process ones."""
    from hf_helpers import save_random_hf_model
    from parallel_cases import batch, teacher_case, tiny_cfg
    from rank_harness import run_ranks

    save_random_hf_model("llama", tmp_path, seed=5, vocab_size=48, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    one, two = tiny_cfg(), tiny_cfg(tp=2)
    one.teacher.path = two.teacher.path = str(tmp_path)
    reference = teacher_case(one, batch())["logprobs"]
    for rank in run_ranks(teacher_case, world_size=2, args=(two, batch()), timeout_s=240):
        gap = max(abs(a - b) for ra, rb in zip(reference, rank["logprobs"]) for a, b in zip(ra, rb))
        assert gap < 1e-5, gap
