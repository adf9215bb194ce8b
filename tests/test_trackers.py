"""Experiment trackers (trainer.loggers): W&B offline and MLflow with a local store log the same
reward as metrics.jsonl, take the resolved config, and a resumed run continues the same runs.
Read back with each tracker's own formats: W&B's run file records, MLflow's client."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.telemetry.trackers import STATE_FILE, TRACKERS, flatten, tracker_problem

sys.path.insert(0, str(Path(__file__).parent))
import wandb_records  # noqa: E402

SMALL = ["trainer.progress=false", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1",
         "trainer.loggers=[tensorboard,wandb,mlflow]", "trainer.project=trackers_test"]


def _train(run_dir: Path, steps: int, *extra: str) -> None:
    from megatron_rl.build import build_trainer

    build_trainer(load_config("tiny_cpu", [f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", *SMALL,
                                     *extra])).run()


def test_wandb_offline_and_mlflow_log_the_run_and_a_resume_continues_them(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    run_dir = tmp_path / "run"
    _train(run_dir, 2)
    state = json.loads((run_dir / STATE_FILE).read_text())
    # Resumes from step 2's checkpoint (no second save: megatron-core's checkpoint writer saves
    # once per process here; tests/test_resume.py resumes across processes).
    _train(run_dir, 3, "trainer.save_final_checkpoint=false")
    assert json.loads((run_dir / STATE_FILE).read_text())["wandb"]["id"] == state["wandb"]["id"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    reward = {r["step"]: r["reward/mean"] for r in rows}

    # W&B: one offline run directory per start, both of the same run id.
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{state['wandb']['id']}.wandb" for f in files), files
    logged = {row["step"]: row["reward/mean"] for f in files for row in wandb_records.history(f)}
    assert logged == reward
    assert all(wandb_records.run_ids(f) == [state["wandb"]["id"]] for f in files)
    config = wandb_records.config(files[0])
    assert config["model"]["hidden_size"] == 64 and config["trainer"]["run_dir"] == str(run_dir)
    assert wandb_records.config(files[1])["trainer"]["total_steps"] == 3  # the resumed run's value

    # MLflow: one run, every step, the config as params, finished.
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(state["mlflow"]["run_id"])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert {m.step: m.value for m in history} == reward
    assert run.data.params["model.hidden_size"] == "64" and run.data.params["trainer.total_steps"] == "2"
    assert run.data.tags["megatron_rl.resumed_at_step"] == "3" and run.info.status == "FINISHED"
    assert run.info.run_name == f"tiny_cpu/{run_dir.name}"
    assert (run_dir / "tb").is_dir() and any((run_dir / "tb").iterdir())


def test_a_tracker_that_is_unknown_or_not_installed_is_refused_before_the_run(monkeypatch):
    with pytest.raises(ConfigError, match=r"trainer.loggers has 'wandbb', which is not a tracker: did you mean "
                                          r"wandb\?"):
        load_config("tiny_cpu", ["trainer.loggers=[tensorboard,wandbb]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    fix = "package is not installed: pip install 'megatron_rl[wandb]'"
    assert tracker_problem("wandb") == (f"trainer.loggers has wandb, but the wandb {fix} "
                                        "(or leave it out of trainer.loggers)")
    with pytest.raises(ConfigError, match=r"pip install 'megatron_rl\[wandb\]'"):
        load_config("tiny_cpu", ["trainer.loggers=[wandb]"])


def test_every_tracker_is_an_optional_extra_and_in_the_test_requirements():
    root = Path(__file__).resolve().parents[1]
    setup = (root / "setup.py").read_text()
    tests = (root / "requirements-test.txt").read_text()
    for name, (_, package, install) in TRACKERS.items():
        if name != "tensorboard":  # a runtime requirement
            assert f'"{name}": ' in setup and install == f"pip install 'megatron_rl[{name}]'"
            assert f"\n{package if package != 'mlflow' else 'mlflow-skinny'}==" in tests


def test_flatten_gives_the_names_users_type():
    assert flatten({"model": {"hidden_size": 64, "path": None}, "trainer": {"loggers": ["wandb"]}}) == {
        "model.hidden_size": 64, "model.path": None, "trainer.loggers": ["wandb"]}
    assert yaml.safe_dump  # the config comes from config.yaml


def _run_dir(tmp_path: Path) -> Path:
    from omegaconf import OmegaConf

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(OmegaConf.structured(load_config("tiny_cpu")), run_dir / "config.yaml")
    return run_dir


def test_a_tracker_that_cannot_start_its_run_says_why_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from megatron_rl.telemetry.trackers import TrackerError, open_trackers

    run_dir = _run_dir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(TrackerError, match=r"MLflow could not start a run at file://.*mlruns "
                                           r"\(.*MLFLOW_ALLOW_FILE_STORE"):
        open_trackers(["tensorboard", "mlflow"], run_dir, "p", None)
    assert not (run_dir / STATE_FILE).exists()
    # Online W&B without a key (none in this HOME, none in the environment) and no terminal to ask on.
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_CONFIG_DIR", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    import wandb

    wandb.teardown()  # W&B keeps the settings of an earlier run in this process (WANDB_MODE=offline)
    with pytest.raises(TrackerError, match=r"W&B could not start a run \(.*\): log in with `wandb login`, or set "
                                           r"WANDB_MODE=offline"):
        open_trackers(["wandb"], run_dir, "p", None)
