"""A recipe of one's own, kept outside the repository: given by its path or found through
MEGATRON_RL_RECIPE_PATH, starting from a shipped recipe (Hydra's defaults list), with relative
paths taken from where the command ran and written absolute into the run's config.yaml."""

import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.checks import load_config

from megatron_rl.config import ConfigError
from megatron_rl.config.recipes import RECIPE_PATH_ENV, RECIPES_DIR

SMALL = ["trainer.progress=false", "algo.group_size=2", "algo.groups_per_batch=2", "learner.mini_batches=1"]


def _write_recipes(folder: Path) -> Path:
    """sort_mine.yaml: tiny_cpu, then a sibling file's values, then its own; prompts from a JSONL
    file and a run directory, both given relative to the working directory."""
    folder.mkdir(parents=True)
    (folder / "small_batches.yaml").write_text(yaml.safe_dump({"algo": {"group_size": 2, "groups_per_batch": 2}}))
    (folder / "sort_mine.yaml").write_text(yaml.safe_dump({
        "defaults": ["tiny_cpu", "small_batches", "_self_"],
        "data": {"name": "jsonl", "path": "data/prompts.jsonl", "prompt_key": "question", "answer_key": "answer"},
        "reward": {"name": "sort_digits"},
        "learner": {"mini_batches": 1},
        "trainer": {"total_steps": 2, "run_dir": "runs/mine", "progress": False, "save_final_checkpoint": False},
    }, sort_keys=False))
    return folder / "sort_mine.yaml"


def _write_prompts(workdir: Path) -> None:
    rows = [{"question": f"{n}=", "answer": "".join(sorted(str(n)))} for n in (7434, 912, 30581, 665, 4170, 2893)]
    (workdir / "data").mkdir(parents=True)
    (workdir / "data" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_recipe_outside_the_repository_trains_with_paths_from_the_working_directory(tmp_path, monkeypatch):
    from megatron_rl.main import main

    recipe = _write_recipes(tmp_path / "home" / "recipes")
    workdir = tmp_path / "home" / "project"
    _write_prompts(workdir)
    monkeypatch.chdir(workdir)
    assert main([f"recipe={Path('..') / 'recipes' / recipe.name}"]) == 0
    run_dir = workdir / "runs" / "mine"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["path"] == str(workdir / "data" / "prompts.jsonl")
    assert saved["trainer"]["run_dir"] == str(run_dir)
    assert saved["trainer"]["recipe"] == "sort_mine"
    assert saved["algo"]["group_size"] == 2 and saved["model"]["hidden_size"] == 64  # sibling, then tiny_cpu's
    # The run's config.yaml loads from anywhere: its paths are absolute.
    monkeypatch.chdir(tmp_path)
    again = load_config(str(run_dir / "config.yaml"))
    assert again.data.path == saved["data"]["path"] and again.trainer.run_dir == str(run_dir)


def test_recipe_names_are_found_in_the_recipe_path_before_the_shipped_ones(tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    _write_recipes(mine)
    (mine / "tiny_cpu_fast.yaml").write_text("defaults:\n  - tiny_cpu\n  - _self_\ntrainer:\n  total_steps: 3\n")
    monkeypatch.setenv(RECIPE_PATH_ENV, str(mine))
    assert load_config("tiny_cpu_fast").trainer.total_steps == 3
    cfg = load_config("sort_mine", ["algo.group_size=4"])
    assert (cfg.algo.group_size, cfg.algo.groups_per_batch, cfg.data.name) == (4, 2, "jsonl")
    assert load_config("longtail_cpu").trainer.total_steps == load_config(str(RECIPES_DIR / "longtail_cpu.yaml")
                                                                           ).trainer.total_steps
    with pytest.raises(ConfigError, match=f"recipe=nope not found .*{mine}.*{RECIPE_PATH_ENV}"):
        load_config("nope")
    monkeypatch.setenv(RECIPE_PATH_ENV, str(tmp_path / "absent"))
    message = "which is not a directory: give folders of recipe .yaml files"
    with pytest.raises(ConfigError, match=f"{RECIPE_PATH_ENV} names .*absent, {message}"):
        load_config("tiny_cpu")


def test_recipe_files_are_yaml_and_must_exist(tmp_path):
    (tmp_path / "r.yml").write_text("defaults:\n  - tiny_cpu\n")
    with pytest.raises(ConfigError, match=r"recipe=.*r\.yml: Hydra reads recipes ending in \.yaml only"):
        load_config(str(tmp_path / "r.yml"))
    with pytest.raises(ConfigError, match=r"recipe=.*gone\.yaml: file not found"):
        load_config(str(tmp_path / "gone.yaml"))


def test_hydra_searchpath_in_a_recipe_adds_folders_for_its_defaults(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "long_run.yaml").write_text("trainer:\n  total_steps: 900\n")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({
        "defaults": ["tiny_cpu", "long_run", "_self_"], "hydra": {"searchpath": [f"file://{shared}"]}}))
    assert load_config(str(tmp_path / "r.yaml")).trainer.total_steps == 900


def test_relative_paths_come_out_absolute_and_home_expanded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config("tiny_cpu", ["trainer.run_dir=runs/../runs/x", "data.tokenizer_path='~/tok'"])
    assert cfg.trainer.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.data.tokenizer_path == str(tmp_path / "home" / "tok")
    assert load_config("tiny_cpu").model.path is None and load_config("tiny_cpu").trainer.run_dir is None
