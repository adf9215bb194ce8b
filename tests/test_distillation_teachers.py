"""On-policy distillation from several teachers chosen per row by a data field
(teacher.paths, teacher.field, teacher.default).

Two teachers that prefer opposite answers (one ends every answer at once, the other never does):
- each row's per-token teacher logprobs, through the opd recipe, are its own teacher's as that
  teacher scores it alone (a learner built with it as the only teacher.path);
- a row naming no teacher or an unknown one is one error line naming the row field and the
  teachers' names; the config keys are checked together at load time;
- a short CPU run on three prompts routed by their rows' data_source (one with none: the default)
  teaches the student each prompt's own teacher's answer.
"""

import json

import pytest

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.data.build import build_tokenizer
from megatron_rl.data.files import DatasetError
from megatron_rl.learner.teachers import row_teacher
from megatron_rl.learner.train_batch import TrainBatch
from megatron_rl.models.pretrained import vocab_size_for
from megatron_rl.types import Trajectory

from teacher_helpers import digit_teacher

STEPS = 20


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """{name: HF directory}: "stop" answers <eos> at once, "digits" answers digits."""
    root = tmp_path_factory.mktemp("teachers")
    return {"stop": digit_teacher(root / "stop", stops=True), "digits": digit_teacher(root / "digits", stops=False)}


def _routed(teachers, *extra):
    return ["algo.name=opd", f"teacher.paths={{stop: {teachers['stop']}, digits: {teachers['digits']}}}",
            "teacher.field=data_source", *extra]


def _trajectories(tokenizer):
    """Six samples of three prompts, half answering <eos> at once, half digits."""
    trajs = []
    for i, digits in enumerate(["123", "987", "5550"]):
        prompt = tokenizer.prompt_ids(digits + "=")
        trajs.append(Trajectory(f"p{i}", 0, prompt, [tokenizer.eos_id], [-1.0], [0], "stop"))
        response = tokenizer.encode(digits[::-1]) + [tokenizer.eos_id]
        trajs.append(Trajectory(f"p{i}", 1, prompt, response, [-1.0] * len(response), [0] * len(response), "stop"))
    return trajs


def test_each_row_is_scored_by_its_own_teacher(teachers):
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.worker import LearnerWorker

    cfg = load_config("tiny_cpu", _routed(teachers, "trainer.progress=false"))
    tokenizer = build_tokenizer(cfg)
    vocab = vocab_size_for(cfg.model, tokenizer.vocab_size)
    trajs = _trajectories(tokenizer)
    alone = {}
    for name, path in teachers.items():
        single = load_config("tiny_cpu", ["algo.name=opd", f"teacher.path={path}", "trainer.progress=false"])
        alone[name] = Learner(single, vocab, pad_id=tokenizer.pad_id).compute_logprobs(trajs, 1.0, teacher=True)
    # The two teachers disagree on every first token: log p(<eos> first) near 0 for one, far below for the other.
    assert all(alone["stop"][i][0] > -0.1 > -3.0 > alone["digits"][i][0] for i in range(0, len(trajs), 2)), alone

    worker = LearnerWorker(cfg, vocab, tokenizer.pad_id)
    routing = ["digits", "stop", "digits"]  # one name per group (prompt)
    groups = [trajs[i:i + 2] for i in range(0, len(trajs), 2)]
    batch, metrics = worker.recipe.prepare(worker, TrainBatch.of_groups(groups, routing))
    for i, (advantages, student) in enumerate(zip(batch.get("advantages"), batch.get("proximal_logprobs"))):
        teacher = alone[routing[i // 2]][i]
        assert [a + s for a, s in zip(advantages, student)] == pytest.approx(teacher, abs=1e-5), (i, routing[i // 2])
    assert {"distill/reverse_kl", "distill/reverse_kl/stop", "distill/reverse_kl/digits"} <= set(metrics), metrics


def test_a_row_without_a_known_teacher_is_one_error_naming_the_field(teachers, tmp_path, capsys):
    from megatron_rl.main import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "12=", "answer": "12", "data_source": "stop"}) + "\n"
                    + json.dumps({"question": "34=", "answer": "34", "data_source": "cdoe"}) + "\n")
    # Refused before any rollout: every row of a file is checked when the run starts.
    assert main(["recipe=tiny_cpu", *_routed(teachers), "data.name=file", f"data.path={data}", "data.tokenizer=char",
                 "trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == ("megatron_rl: error: prompt rows-1: row field 'data_source' (teacher.field) is 'cdoe', not a "
                    "teacher of teacher.paths (names: digits, stop); add it to teacher.paths or fix the row"), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    cfg = load_config("tiny_cpu", _routed(teachers))
    assert row_teacher({"data_source": "digits"}, cfg.teacher, "row 1") == "digits"
    with pytest.raises(DatasetError, match=r"row 2: row field 'data_source' \(teacher.field\) is 'cdoe', not a "
                                           r"teacher of teacher.paths \(names: digits, stop\)"):
        row_teacher({"data_source": "cdoe"}, cfg.teacher, "row 2")
    with pytest.raises(DatasetError, match="'data_source' .* is missing or empty.* one of digits, stop, or set "
                                           "teacher.default"):
        row_teacher({"question": "1="}, cfg.teacher, "row 3")
    defaulted = load_config("tiny_cpu", _routed(teachers, "teacher.default=stop"))
    assert row_teacher({"data_source": ""}, defaulted.teacher, "row 4") == "stop"


def test_the_teacher_keys_are_checked_together(teachers, tmp_path):
    paths = f"teacher.paths={{stop: {teachers['stop']}, digits: {teachers['digits']}}}"
    cases = [
        (["algo.name=opd", paths], "teacher.paths names 2 teachers but not which row gets which: set teacher.field"),
        (_routed(teachers, "teacher.default=code"), r"teacher.default='code' is not a teacher of teacher.paths"),
        (_routed(teachers, f"teacher.path={teachers['stop']}"), "teacher.path and teacher.paths are both set"),
        (["algo.name=opd", f"teacher.path={teachers['stop']}", "teacher.field=data_source"],
         "teacher.field chooses among named teachers: set teacher.paths"),
        (["algo.name=opd", f"teacher.paths={{stop: {tmp_path / 'none'}}}", "teacher.field=data_source"],
         r"teacher.paths.stop=.* is not a directory"),
        ([paths, "teacher.field=data_source"], "teacher.paths=.* is only read by on-policy distillation"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config("tiny_cpu", overrides)


def test_each_rows_group_learns_its_own_teachers_answer(teachers, tmp_path):
    """Prompts 123= and 5550= (no data_source: teacher.default) go to the teacher that stops at
    once, 987= to the one that answers digits; after 20 steps the student ends the first two at
    once and answers the third with digits, and each teacher's reverse KL has fallen."""
    from megatron_rl.learner.learner import Learner
    from megatron_rl.main import main

    rows = [{"question": "123=", "answer": "123", "data_source": "stop"},
            {"question": "987=", "answer": "789", "data_source": "digits"},
            {"question": "5550=", "answer": "0555"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    assert main(["recipe=tiny_cpu", *_routed(teachers, "teacher.default=stop"), "data.name=file", f"data.path={data}",
                 "data.tokenizer=char", "trainer.progress=false", f"trainer.run_dir={run}",
                 f"trainer.total_steps={STEPS}", "scheduler.max_staleness=0",
                 "algo.group_size=4", "algo.groups_per_batch=3", "learner.mini_batches=1", "algo.entropy_coef=0",
                 "learner.lr=1e-2", "learner.lr_warmup_steps=0", "learner.lr_decay_style=constant"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for name in ("stop", "digits"):
        kl = [m[f"distill/reverse_kl/{name}"] for m in metrics if f"distill/reverse_kl/{name}" in m]
        print(f"{name}: reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}")
        assert kl[-1] < 0.2 * kl[0], (name, kl)

    cfg = load_config("tiny_cpu", ["trainer.progress=false", f"model.path={run / 'checkpoints' / f'step_{STEPS}'}"])
    tokenizer = build_tokenizer(load_config("tiny_cpu", ["trainer.progress=false"]))
    student = Learner(cfg, vocab_size_for(cfg.model, tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    first_eos = [Trajectory(str(i), 0, tokenizer.prompt_ids(row["question"]), [tokenizer.eos_id], [0.0], [0], "stop")
                 for i, row in enumerate(rows)]
    stop_123, stop_987, stop_5550 = (row[0] for row in student.compute_logprobs(first_eos, 1.0))
    print(f"log p(<eos> first): 123= {stop_123:.3f}, 987= {stop_987:.3f}, 5550= {stop_5550:.3f}")
    assert stop_123 > -0.3 and stop_5550 > -0.3 and stop_987 < -2.0, (stop_123, stop_987, stop_5550)


def test_routed_teachers_score_over_data_parallel_replicas_as_one_process(megatron_world, tmp_path):
    """Two teachers at DP=2, one of them with a single row (fewer rows than replicas): every
    row's logprobs are the one-process ones."""
    from hf_helpers import save_random_hf_model
    from parallel_cases import batch, routed_teachers_case, tiny_cfg
    from rank_harness import run_ranks

    paths = {}
    for name, seed in (("a", 5), ("b", 6)):
        save_random_hf_model("llama", tmp_path / name, seed=seed, vocab_size=48, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        paths[name] = str(tmp_path / name)
    cfg = tiny_cfg()
    cfg.teacher.paths, cfg.teacher.field = paths, "data_source"
    trajs = list(batch(5))
    routing = ["a", "a", "b", "a", "a"]
    reference = routed_teachers_case(cfg, trajs, routing)["logprobs"]
    for rank in run_ranks(routed_teachers_case, world_size=2, args=(cfg, trajs, routing), timeout_s=240):
        gap = max(abs(x - y) for rx, ry in zip(reference, rank["logprobs"]) for x, y in zip(rx, ry))
        assert gap < 1e-5, gap
        assert [len(r) for r in rank["logprobs"]] == [len(t.response_ids) for t in trajs]
