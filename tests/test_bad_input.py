"""Every expected failure of config, data, checkpoint and run directory ends the command with one
line, ``<prog>: error: <what>, <where>, <how to fix>``, and exit status 2: never a traceback.

The entry points run in this process (``main``), which is what a subprocess would run: an error
that escaped as an exception would fail the test with its traceback. One case per entry point
runs as a real subprocess to check the process's own status and stderr."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.launch.__main__ import main as launch_main
from megatron_rl.main import main as train_main

ROOT = Path(__file__).resolve().parents[1]
RUN = ["trainer.progress=false", "trainer.total_steps=1", "algo.group_size=2", "algo.groups_per_batch=2",
       "learner.mini_batches=1", "trainer.save_final_checkpoint=false"]


def _one_error_line(capsys, prog="megatron_rl"):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("overrides, message", [
    (["learner.foo=1"], "unknown config key learner.foo (command line: learner.foo=1): the keys of learner are: tp, pp"),
    (["learner.l=1e-5"], "unknown config key learner.l (command line: learner.l=1e-5): did you mean learner.lr?"),
    (["trainr.total_steps=5"], "unknown config key trainr.total_steps (command line: trainr.total_steps=5): "
                               "did you mean trainer.total_steps?"),
    (["learner.lr=fast"], "learner.lr='fast' is not a number (command line: learner.lr=fast): give a number, "
                          "e.g. learner.lr="),
    (["trainer.resume=maybe"], "trainer.resume='maybe' is not true or false (command line: trainer.resume=maybe)"),
    (["learner.lr=nan"], "learner.lr=nan is not a finite number"),
    (["reward.timeout_s=inf"], "reward.timeout_s=inf is not a finite number"),
    (["recipe=tiny_gpu"], "recipe=tiny_gpu not found (no tiny_gpu.yaml in"),
    (["learner.lr"], "'learner.lr' is not an override (command line): write key=value"),
    (["reward.min_value=1", "reward.max_value=0"], "reward.min_value=1.0 must be <= reward.max_value=0.0"),
])
def test_config_errors_are_one_line(capsys, overrides, message):
    assert train_main([*overrides, "--print-config"]) == 2
    line = _one_error_line(capsys)
    assert message in line, line
    if overrides[0].startswith("recipe="):
        assert "the recipes are" in line and "tiny_cpu" in line


def test_dataset_that_is_not_utf8(capsys, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps({"question": "1+1", "answer": "#### 2"}).encode() + b"\n"
                     + '{"question": "caf\u00e9", "answer": "#### 3"}\n'.encode("latin-1"))
    assert train_main(["data.name=jsonl", f"data.path={data}", "data.tokenizer=bpe",
                       f"trainer.run_dir={tmp_path / 'run'}", *RUN]) == 2
    assert f"{data}:2: not UTF-8 text (byte 0xe9 at column 18); convert the file to UTF-8" in _one_error_line(capsys)


def _hf_model(path: Path, **overrides) -> Path:
    from hf_helpers import save_random_hf_model

    save_random_hf_model("qwen2", path, **overrides)
    return path


def test_truncated_safetensors_file(capsys, tmp_path):
    model = _hf_model(tmp_path / "hf")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert train_main([f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", *RUN]) == 2
    line = _one_error_line(capsys)
    assert f"cannot read {weights}" in line and "the file is truncated or damaged; copy or convert it again" in line


def test_model_directory_without_weights(capsys, tmp_path):
    model = _hf_model(tmp_path / "hf")
    (model / "model.safetensors").unlink()
    assert train_main([f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", *RUN]) == 2
    assert f"no weights: {model} has a config.json but no *.safetensors files" in _one_error_line(capsys)


def test_vocabulary_smaller_than_the_tokenizer(capsys, tmp_path):
    model = _hf_model(tmp_path / "hf", vocab_size=8)  # the char tokenizer of tiny_cpu has more ids
    assert train_main([f"model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", *RUN]) == 2
    line = _one_error_line(capsys)
    assert f"model.path='{model}' has a vocabulary of 8" in line and "use the checkpoint's own tokenizer" in line


def test_unusable_run_dir(capsys, tmp_path):
    (tmp_path / "a_file").write_text("")
    assert train_main([f"trainer.run_dir={tmp_path / 'a_file' / 'run'}", *RUN]) == 2
    line = _one_error_line(capsys)
    assert f"trainer.run_dir='{tmp_path / 'a_file' / 'run'}' cannot be used (Not a directory" in line
    assert "give a directory this user can create and write" in line


def test_resume_false_refuses_to_overwrite_a_run(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train_main([f"trainer.run_dir={tmp_path}", "trainer.resume=false", *RUN]) == 2
    assert "already holds a run (metrics.jsonl or checkpoints) and trainer.resume=false would overwrite it" \
        in _one_error_line(capsys)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("args, message", [
    (["--world-size", "4", "learner.tp=3", "rollout.engines=1"],
     "learner.tp=3 must divide model.num_attention_heads=4 and model.num_query_groups=2"),
    (["--world-size", "4", "learner.tp=4", "model.num_query_groups=2", "rollout.engines=1"],
     "learner.tp=4 must divide model.num_attention_heads=4 and model.num_query_groups=2 (each TP rank holds whole "
     "heads and KV groups): use learner.tp in [1, 2]"),
    (["--world-size", "4", "learner.pp=3", "rollout.engines=1"],
     "learner.pp=3 must divide model.num_layers=2 (each stage holds whole layers): use learner.pp in [1, 2]"),
    (["--world-size", "4", "learner.ep=2", "model.family=mixtral", "model.num_experts=3", "model.moe_router_topk=1",
      "rollout.engines=2"], "learner.ep=2 must divide model.num_experts=3: use learner.ep in [1, 3]"),
    (["--world-size", "2", "learner.ep=2", "rollout.placement=colocated", "rollout.engines=2"],
     "learner.ep=2 needs a mixture-of-experts model (model.num_experts=0): use learner.ep=1"),
    (["--world-size", "0"], "the world size (0) and the GPUs per node (0) must be >= 1"),
    (["--world-size", "four"], "--world-size and --gpus-per-node take an integer (command line)"),
])
def test_launch_dry_run_refuses_layouts_the_model_cannot_take(capsys, args, message):
    assert launch_main(["--dry-run", "rollout.placement=disaggregated", *args]) == 2
    assert message in _one_error_line(capsys, "megatron_rl.launch")


def test_plot_timeline_on_a_missing_directory(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_timeline.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (f"plot_timeline: error: no timeline at {tmp_path / 'nope'}: pass a run directory "
                                  "(trainer.run_dir) that holds timeline.jsonl, or the timeline.jsonl file itself")


def test_a_bad_input_exits_2_from_the_real_process(tmp_path):
    """The whole path once, as a user runs it: status 2, one line, no traceback."""
    out = subprocess.run([sys.executable, "-m", "megatron_rl.main", "learner.lr=nan"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "megatron_rl: error: learner.lr=nan is not a finite number: give a real value (see "
        "megatron_rl/config/schema.py for its meaning)"]


def test_unreadable_safetensors_index(tmp_path):
    from megatron_rl.models.hf_checkpoint import ConversionError, HFTensorReader

    (tmp_path / "model.safetensors.index.json").write_text("{trunc")
    with pytest.raises(ConversionError, match="model.safetensors.index.json: not a safetensors index"):
        HFTensorReader(tmp_path)
