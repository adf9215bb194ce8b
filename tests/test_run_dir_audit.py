"""The run directory tells what happened, once: the staleness bound can be audited from
``trained.jsonl`` alone, and a resumed run keeps no row or span of the work it does again."""

import json
import math

from megatron_rl.telemetry.metrics import Timeline, forget_spans_after, json_line, keep_jsonl_rows, run_lengths

ETA = 2


def test_staleness_bound_audited_from_the_run_directory(tmp_path):
    from megatron_rl.checks import load_config
    from megatron_rl.build import build_trainer

    steps = 4
    build_trainer(load_config("tiny_cpu", [
        f"trainer.total_steps={steps}", f"trainer.run_dir={tmp_path}", f"scheduler.max_staleness={ETA}",
        "trainer.progress=false", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1",
        "trainer.save_final_checkpoint=false"])).run()
    # From here on only the run's files.
    rows = [json.loads(line) for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    seen, lags = set(), []
    for row in rows:
        version = row["policy_version"]
        assert version == row["step"] - 1
        assert len(row["groups"]) == 2
        for group in row["groups"]:
            assert group["index"] not in seen  # every admitted group is trained at most once
            seen.add(group["index"])
            assert len(group["token_versions"]) == 2
            for sample in group["token_versions"]:
                assert sample, "a sample without tokens"
                for token_version, count in sample:
                    assert count >= 1 and token_version <= version
                    lags.append(version - token_version)
                    assert version - token_version <= ETA, (row["step"], group, sample)
    print(f"token version lags seen: {sorted(set(lags))}")
    # Rollouts admitted ahead (η = 2) train on later versions: the audit checked stale tokens too.
    assert max(lags) >= 1, sorted(set(lags))


def test_run_lengths():
    assert run_lengths([3, 3, 3, 4, 4, 5]) == [[3, 3], [4, 2], [5, 1]]
    assert run_lengths([]) == []


def test_metrics_lines_are_strict_json():
    line = json_line({"step": 1, "train/loss": float("nan"), "x": [1.0, float("inf")]})
    assert line == '{"step": 1, "train/loss": null, "x": [1.0, null]}\n'


def test_resume_forgets_the_dead_runs_spans_after_the_checkpoint(tmp_path):
    path = tmp_path / "timeline.jsonl"
    timeline = Timeline(path)  # another rank's writer, open for appending throughout
    spans = [dict(name="train", start=1, end=2, step=3), dict(name="checkpoint", start=2, end=3, step=3),
             dict(name="sync", start=3, end=3.5, version=3), dict(name="generate", start=2.5, end=3.2, group=9),
             dict(name="train", start=4, end=5, step=4), dict(name="sync", start=5, end=5.5, version=4),
             dict(name="generate", start=3.5, end=6, group=10)]
    path.write_text("".join(json_line({"rank": 0, **s}) for s in spans) + '{"name": "train", "sta')  # torn
    dropped = forget_spans_after(path, saved_at=3.0, step=3, version=3)
    assert dropped == 6  # the torn line, and what ended after the checkpoint or belongs to later steps
    with timeline.span("train", step=4):
        pass
    timeline.close()
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(s["name"], s.get("step")) for s in kept] == [("train", 3), ("checkpoint", 3), ("train", 4)]
    assert math.isfinite(kept[-1]["start"])


def test_keep_rows_in_place_and_missing_file(tmp_path):
    assert keep_jsonl_rows(tmp_path / "none.jsonl", lambda r: True) == []
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    assert keep_jsonl_rows(path, lambda r: r["step"] < 2) == [{"step": 1}]
    assert path.read_text() == '{"step": 1}\n'


def test_a_run_that_fails_at_start_says_why_in_its_log(tmp_path, capsys):
    """The run directory is made, then the data cannot be read: train.log says so, as stderr does."""
    import logging

    from megatron_rl.main import main, run_guarded
    from megatron_rl.telemetry.run_dir import setup_logging

    try:
        assert main([f"trainer.run_dir={tmp_path}", "data.name=jsonl", "data.path=/nonexistent/x.jsonl"]) == 2
        log = (tmp_path / "logs" / "train.log").read_text()
        assert "data.path='/nonexistent/x.jsonl': file not found" in log
        assert "data.path='/nonexistent/x.jsonl': file not found" in capsys.readouterr().err

        # An unexpected error (a bug): its traceback reaches the log.
        setup_logging(tmp_path / "logs" / "bug.log")

        def broken():
            raise ZeroDivisionError("a bug at start")

        try:
            run_guarded(broken)
        except ZeroDivisionError:
            pass
        log = (tmp_path / "logs" / "bug.log").read_text()
        assert "unexpected error:" in log and "Traceback" in log and "ZeroDivisionError: a bug at start" in log
    finally:
        setup_logging()  # no file handler left behind for later tests
        logging.getLogger().handlers[:] = [h for h in logging.getLogger().handlers
                                           if not isinstance(h, logging.FileHandler)]
