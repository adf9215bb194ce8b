"""The documentation stays true: the configuration reference is generated from the schema and up
to date, every schema field is described, every error listed in troubleshooting is checked by a
test, the README stays short, and no development diary creeps into user-facing text."""

import re
import subprocess
import sys
from pathlib import Path

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
    for name in ("timeline.svg", "reward.svg"):
        image = ROOT / "docs" / "images" / name
        assert image.is_file() and image.stat().st_size < 200_000, f"{name}: remake with python tools/doc_images.py"
