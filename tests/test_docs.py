"""The documentation stays true: the configuration reference is generated from the schema and up
to date, every schema field is described, every error listed in troubleshooting is checked by a
test, the README stays short, no development diary creeps into user-facing text, and every command
of the pages runs as written (one training step each) or is skipped naming what it needs
(tests/doc_commands.py; about 90 s on the 2-core box)."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import doc_commands
import doc_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gen_config_reference  # noqa: E402

REGENERATE = f"run `{gen_config_reference.REGENERATE}` and commit docs/configuration.md"


def test_every_schema_field_has_a_description():
    sections, missing = gen_config_reference.collect_fields()
    assert sum(len(rows) for _, _, rows in sections) > 100
    assert not missing, (f"schema fields without a description: {', '.join(missing)}; add a comment directly "
                         "above each in megatron_rl/config/schema.py, then " + REGENERATE)


def test_configuration_reference_is_up_to_date():
    sections, _ = gen_config_reference.collect_fields()
    expected = gen_config_reference.render(sections)
    page = ROOT / "docs" / "configuration.md"
    assert page.exists() and page.read_text() == expected, f"docs/configuration.md is out of date: {REGENERATE}"


def test_reference_covers_every_field_of_the_schema():
    import dataclasses

    from megatron_rl.config.schema import RootConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    root = RootConfig()
    keys = [f"{g.name}.{f.name}" for g in dataclasses.fields(root) for f in dataclasses.fields(getattr(root, g.name))]
    assert [k for k in keys if f"| `{k}` |" not in page] == [], REGENERATE


def test_comment_parser_reads_the_block_directly_above_a_field():
    source = ("class A:\n    x: int = 1\n    # First line\n    # and second.\n    y: int = 2\n\n"
              "    # not directly above\n\n    z: int = 3\n")
    classes, _, _ = gen_config_reference.parse_schema(source)
    assert classes["A"] == {"x": ("int", ""), "y": ("int", "First line and second."), "z": ("int", "")}


def test_check_mode_reports_the_command_to_regenerate(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gen_config_reference, "PAGE", tmp_path / "configuration.md")
    (tmp_path / "configuration.md").write_text("stale\n")
    assert gen_config_reference.main(["--check"]) == 1
    assert "python tools/gen_config_reference.py" in capsys.readouterr().err


def troubleshooting_fragments():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    return re.findall(r"^\| `([^`]+)` \|", page, re.M)


def test_every_troubleshooting_message_is_checked_by_a_test():
    fragments = troubleshooting_fragments()
    assert len(fragments) >= 30
    # Tests write messages as plain strings or as regular expressions: compare without escapes.
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_docs.py")
    tests = tests.replace("\\", "")
    unchecked = [f for f in fragments if f not in tests]
    assert not unchecked, f"listed in docs/troubleshooting.md but checked by no test: {unchecked}"


def test_readme_is_short_and_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", doc.read_text()):
            if target.startswith("http"):
                continue
            # A relative link must stay inside the repository (a clone has nothing beside it).
            assert ROOT in (doc.parent / target).resolve().parents, f"{doc.relative_to(ROOT)} links outside: {target}"
            # Pages other helpers write (gpu, rewards, agents) may land after this one.
            if Path(target).name in ("gpu.md", "rewards.md", "agents.md"):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


def test_no_development_diary_in_user_facing_text():
    paths = ["README.md", "docs", "recipes", "megatron_rl", "tools", "slurm", "launch"]
    found = subprocess.run(["git", "grep", "-n", "-i", "-E", r"session [0-9]|issue [0-9]", "--", *paths],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    assert found.stdout == "", found.stdout


def test_doc_images_window_and_reward_curve():
    import xml.dom.minidom

    import doc_images

    spans = [{"name": "train", "start": float(i), "end": i + 0.5} for i in range(10)]
    spans += [{"name": "generate", "start": i + 0.2, "end": i + 1.1} for i in range(10)]
    shown = doc_images.window(spans, steps=2)
    assert min(s["start"] for s in shown) == 4.0 and max(s["end"] for s in shown) == 5.5
    assert [s for s in shown if s["name"] == "train"] == spans[4:6]
    svg = doc_images.reward_svg(list(range(1, 101)), [i / 100 for i in range(100)])
    xml.dom.minidom.parseString(svg)  # well-formed
    assert svg.count("<polyline") == 2
    report = {"k": 4, "stages": {"before SFT": {"pass@1": 0.02, "pass@4": 0.07},
                                 "after RL": {"pass@1": 0.6, "pass@4": 0.75}}}
    sft = [{"step": i, "train/loss": 3.0 / i} for i in range(1, 301)]
    rl = [{"step": i, "reward/mean": 0.5 + i / 200} for i in range(1, 61)]
    svg = doc_images.arithmetic_svg(report, sft, rl)
    xml.dom.minidom.parseString(svg)
    assert svg.count("<polyline") == 4 and "after RL: pass@1 0.600, pass@4 0.750" in svg
    for name in ("timeline.svg", "reward.svg"):
        image = ROOT / "docs" / "images" / name
        assert image.is_file() and image.stat().st_size < 200_000, f"{name}: remake with python tools/doc_images.py"


# --- every command of the pages, run or skipped with what it needs (tests/doc_commands.py) ---

COMMANDS = doc_commands.all_commands()
# The repository's entries the pages' commands name, linked into the sandbox.
LINKED = ["launch", "tools", "recipes", "tests", "slurm", "docs", "megatron_rl", "setup.py", "requirements.txt",
          "requirements-test.txt", "README.md", "pytest.ini"]
# A page's ```python or ```yaml block whose first line names a file (`# my_pkg/scoring.py`,
# `# ~/rl/recipes/my_recipe.yaml: ...`) is that file: the sandbox has it, where the page says.
FILE_HEADER = re.compile(r"^# ((~/|my_pkg/)[\w/.-]+\.(py|yaml))(:.*)?\n")


def _page_files():
    for page in doc_commands.PAGES:
        for block in re.findall(r"^```(?:python|yaml)\n(.*?)^```", page.read_text(), re.M | re.S):
            header = FILE_HEADER.match(block)
            if header:
                yield header.group(1), block


def _data_stand_ins(sandbox: Path, home: Path) -> None:
    """The files the pages' commands read, small: digit questions a tiny model can take."""
    import datasets

    rows = [{"question": f"{n}=", "answer": "".join(sorted(str(n)))} for n in (7434, 5120, 981, 33, 6402, 170)]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows)
    (sandbox / "sft.jsonl").write_text(jsonl)
    data = sandbox / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "train.jsonl").write_text(jsonl)
    (data / "my_test.jsonl").write_text(jsonl)
    (data / "code.jsonl").write_text("".join(json.dumps({"question": r["question"], "tests": r["answer"]}) + "\n"
                                             for r in rows))
    verl_rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["question"]}],
                  "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": {"index": i}}
                 for i, r in enumerate(rows)]
    datasets.Dataset.from_list(rows).to_parquet(str(data / "math.parquet"))
    (home / "data" / "gsm8k").mkdir(parents=True)
    datasets.Dataset.from_list(verl_rows).to_parquet(str(home / "data" / "gsm8k" / "train.parquet"))
    gsm8k = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
             for a, b in [(2, 3), (4, 1)]]
    datasets.Dataset.from_list(gsm8k).save_to_disk(str(data / "gsm8k_train"))


@pytest.fixture(scope="module")
def doc_sandbox(tmp_path_factory):
    """A folder that looks like a clone with its .venv, where the pages' commands run; its
    `.venv/bin/python` is a preloaded interpreter (tests/doc_python.py)."""

    base = tmp_path_factory.mktemp("docs")
    sandbox, home = base / "repo", base / "home"
    for d in (sandbox / ".venv" / "bin", sandbox / "tmp", home, sandbox / "pkgs"):
        d.mkdir(parents=True)
    for name in LINKED:
        (sandbox / name).symlink_to(ROOT / name)
    if (ROOT.parent / "shared").exists():  # the recipes' ../shared/data
        (base / "shared").symlink_to(ROOT.parent / "shared")
    shim = f'#!/bin/sh\nexec "{sys.executable}" -S "{ROOT / "tests" / "doc_python.py"}" client "$@"\n'
    for name in ("python", "python3"):
        (sandbox / ".venv" / "bin" / name).write_text(shim)
        (sandbox / ".venv" / "bin" / name).chmod(0o755)
    # launch/env.sh installs nothing into a venv whose stamp matches the requirements.
    wanted = b"".join((ROOT / n).read_bytes() for n in ("requirements.txt", "requirements-test.txt", "setup.py"))
    (sandbox / ".venv" / ".megatron_rl_installed").write_text(hashlib.sha256(wanted).hexdigest() + "\n")
    for named, text in _page_files():
        target = home / named[2:] if named.startswith("~/") else sandbox / "pkgs" / named
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix == ".py":
            (target.parent / "__init__.py").touch()
        target.write_text(text)
    for page in doc_commands.PAGES:  # each page's /tmp/
        (sandbox / "tmp" / page.stem).mkdir(exist_ok=True)
    _data_stand_ins(sandbox, home)
    socket_path = str(base / "python.sock")
    env = {**os.environ, "HOME": str(home), doc_python.SOCKET_ENV: socket_path, "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(sandbox / "pkgs"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("MEGATRON_RL_RECIPE_PATH", None)
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "doc_python.py"), "serve", socket_path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout.readline().strip() == "ready", "tests/doc_python.py did not start"
        # The run the pages call runs/tiny_cpu/<stamp>: one step, with its checkpoint.
        made = subprocess.run([".venv/bin/python", "-m", "megatron_rl.main", "trainer.total_steps=1",
                               "trainer.run_dir=runs/tiny_cpu/stamp"], cwd=sandbox, env=env, capture_output=True,
                              text=True, timeout=300)
        assert made.returncode == 0, made.stderr[-3000:]
        for name in ("a", "b"):  # two runs to compare
            (sandbox / "runs" / name).symlink_to(sandbox / "runs" / "tiny_cpu" / "stamp")
        yield sandbox, env, set()  # the ids of the commands run so far
    finally:
        server.kill()
        server.wait()


def test_no_command_hides_in_an_untagged_block():
    assert doc_commands.untagged_commands() == [], "put commands in ```bash blocks: tests/test_docs.py runs those"


def test_commands_use_the_venv_python():
    bare = [c.id for c in COMMANDS if re.match(r"(\w+=\S+ )*python3? ", c.text)]
    assert bare == [], "write .venv/bin/python (the venv launch/local.sh makes) in a page's commands"


def _run_in_sandbox(command, sandbox: Path, env, ran) -> None:
    run_dir = sandbox / "runs" / "doc" / command.id.replace("/", "_").replace(":", "_")
    script = doc_commands.runnable(command, str(sandbox), str(run_dir))
    done = subprocess.run(["bash", "-c", script], cwd=sandbox, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (f"{command.id}: `{command.text}` failed (exit {done.returncode}) as\n{script}\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ran.add(command.id)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command_runs(command, doc_sandbox):
    if command.needs:
        pytest.skip(f"needs {command.needs}: {command.text[:80]}")
    sandbox, env, ran = doc_sandbox
    # What the block does before this command (a tokenizer written, a checkpoint converted) is done
    # first, also when this command is selected alone.
    for before in COMMANDS:
        if before.page == command.page and before.block == command.block and before.line < command.line \
                and not before.needs and before.id not in ran:
            _run_in_sandbox(before, sandbox, env, ran)
    _run_in_sandbox(command, sandbox, env, ran)
