"""python -m megatron_rl.eval on a converted tiny random checkpoint: a few rows of GSM8K test and
MATH-500, pass@1 and pass@k, a JSON report and a printed table; pass@k by hand."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hf_helpers import save_random_hf_model

from megatron_rl.eval import evaluate, main
from megatron_rl.eval_sets import pass_at_k

PROJECT = Path(__file__).resolve().parents[1]
DATA = PROJECT.parent / "shared" / "data"
if not DATA.is_dir():  # a worktree sits one level deeper than a clone
    DATA = PROJECT.parents[1] / "shared" / "data"


@pytest.mark.parametrize("n, c, k, expected", [(1, 1, 1, 1.0), (1, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5),
                                               (4, 2, 2, 1 - 1 / 6), (4, 0, 4, 0.0), (5, 3, 3, 1.0), (10, 3, 5, 1 - 21 / 252)])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_eval_on_a_converted_checkpoint(tmp_path, capsys, monkeypatch):
    """HF random model -> tools/convert_checkpoint.py -> Megatron checkpoint -> eval of 2 rows each.
    Without trainer.run_dir the run directory is a temporary one, removed at the end, and the report
    is eval.json in the current directory."""
    save_random_hf_model("llama", tmp_path / "hf", vocab_size=320, max_position_embeddings=512)
    done = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "hf-to-megatron", str(tmp_path / "hf"),
                           str(tmp_path / "mcore"), "--no-progress"], cwd=PROJECT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.chdir(tmp_path)
    report = evaluate([f"model.path={tmp_path / 'mcore'}", "--limit", "2", "--samples", "2", "--k", "2",
                       "--gsm8k", str(DATA / "gsm8k" / "test.jsonl"), "--math500", str(DATA / "math500" / "test.jsonl"),
                       "--no-progress", "data.tokenizer=bpe", "data.name=gsm8k", f"data.path={DATA / 'gsm8k' / 'test.jsonl'}",
                       "data.bpe_vocab_size=300", "data.max_prompt_tokens=400", "rollout.max_new_tokens=4"])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "eval.json").read_text()) == report
    assert not list(temp.glob("megatron_rl_eval_*"))  # the temporary run directory is gone
    for name in ("gsm8k", "math500"):
        result = report["datasets"][name]
        assert result["problems"] == 2 and result["samples"] == 2 and len(result["rows"]) == 2
        assert 0.0 <= result["pass@1"] <= result["pass@2"] <= 1.0
        assert f"\n{name} " in "\n" + printed
    assert printed.splitlines()[0].split() == ["dataset", "problems", "samples", "pass@1", "pass@2"]
    assert report["datasets"]["gsm8k"]["rows"][0]["target"] == "18"  # the first GSM8K test answer


def test_a_failed_eval_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    """An eval that stops (here: no model.path) removes the temporary run directory it made."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["--datasets", "gsm8k", "--gsm8k", str(DATA / "gsm8k" / "test.jsonl")]) == 2
    assert "model.path is required" in capsys.readouterr().err
    assert not list(tmp_path.glob("megatron_rl_eval_*"))


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert main(["--datasets", "mmlu"]) == 2
    assert "megatron_rl.eval: error: eval.datasets=['mmlu']: unknown mmlu" in capsys.readouterr().err
    assert main(["--samples", "2", "--k", "3"]) == 2
    assert "eval.k=3 must be between 1 and eval.samples=2" in capsys.readouterr().err
