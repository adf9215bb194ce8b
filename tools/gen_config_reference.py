"""Write docs/configuration.md from megatron_rl/config/schema.py.

    python tools/gen_config_reference.py           # rewrite docs/configuration.md
    python tools/gen_config_reference.py --check   # exit 1 if the committed page is out of date

Each field's description is the comment block directly above it in schema.py (the convention for
every field); its type and default come from the dataclasses, its allowed values from
``megatron_rl.checks.ALLOWED`` (registries included, so a registered component shows up).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "megatron_rl" / "config" / "schema.py"
PAGE = ROOT / "docs" / "configuration.md"
REGENERATE = "python tools/gen_config_reference.py"


@dataclasses.dataclass
class Field:
    key: str  # dotted, e.g. "trainer.total_steps"
    type: str
    default: str
    allowed: str
    description: str


def _comment_above(lines: List[str], lineno: int) -> str:
    """The contiguous '#' comment lines directly above line ``lineno`` (1-based), joined."""
    parts: List[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        parts.append(lines[i].strip()[1:].strip())
        i -= 1
    return " ".join(reversed(parts)).strip()


def parse_schema(source: str) -> Tuple[Dict[str, Dict[str, Tuple[str, str]]], Dict[str, str], Dict[str, str]]:
    """Per dataclass: field name -> (annotation text, comment above); class docstrings; and the
    root's group name -> class name."""
    tree = ast.parse(source)
    lines = source.splitlines()
    classes: Dict[str, Dict[str, Tuple[str, str]]] = {}
    docs: Dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: Dict[str, Tuple[str, str]] = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields[stmt.target.id] = (ast.unparse(stmt.annotation), _comment_above(lines, stmt.lineno))
        classes[node.name] = fields
        docs[node.name] = " ".join((ast.get_docstring(node) or "").split())
    groups = {name: annotation for name, (annotation, _) in classes.get("RootConfig", {}).items()}
    return classes, docs, groups


def _type_text(annotation: str) -> str:
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"{_type_text(annotation[len('Optional['):-1])} or null"
    if annotation.startswith("List[") and annotation.endswith("]"):
        return f"list of {annotation[len('List['):-1]}"
    return annotation


def _value_text(value: Any) -> str:
    """A default as a user would type it on the command line / in a YAML recipe."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def collect_fields() -> Tuple[List[Tuple[str, str, List[Field]]], List[str]]:
    """Sections (group, class docstring, fields) and the keys that have no description."""
    sys.path.insert(0, str(ROOT))
    from megatron_rl.config import schema
    from megatron_rl.checks import ALLOWED, allowed

    classes, docs, groups = parse_schema(SCHEMA.read_text())
    root = schema.RootConfig()
    sections = []
    missing = []
    for group, class_name in groups.items():
        instance = getattr(root, group)
        defaults = {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
        rows = []
        for name, (annotation, comment) in classes[class_name].items():
            key = f"{group}.{name}"
            choices = ""
            if key in ALLOWED:
                values = list(allowed(key))
                choices = ", ".join(values)
            if not comment:
                missing.append(key)
            rows.append(Field(key, _type_text(annotation), _value_text(defaults[name]), choices, comment))
        sections.append((group, docs.get(class_name, ""), rows))
    return sections, missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else ""


def render(sections: List[Tuple[str, str, List[Field]]]) -> str:
    out = [
        "# Configuration reference",
        "",
        f"Generated from `megatron_rl/config/schema.py` by `{REGENERATE}`; do not edit by hand.",
        "Every key is set in a recipe (`recipes/*.yaml`) or on the command line as `group.key=value`,",
        "e.g. `trainer.total_steps=50 algo.group_size=8`. `null` means \"not set\" (the description says",
        "what is used instead). Values are checked before anything starts; a bad one stops the run with",
        "one line naming the key (see [troubleshooting](troubleshooting.md)).",
        "",
        "Groups: " + ", ".join(f"[`{g}`](#{g})" for g, _, _ in sections) + ".",
        "",
    ]
    for group, doc, rows in sections:
        out += [f"## {group}", ""]
        if doc:
            out += [doc, ""]
        out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for f in rows:
            out.append(f"| `{f.key}` | {_cell(f.type)} | `{_cell(f.default)}` | {_cell(f.allowed)} | "
                       f"{_cell(f.description)} |")
        out.append("")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    sections, missing = collect_fields()
    if missing:
        print(f"gen_config_reference: error: no description for {', '.join(missing)}: add a comment directly "
              "above each field in megatron_rl/config/schema.py", file=sys.stderr)
        return 2
    page = render(sections)
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"gen_config_reference: error: docs/configuration.md is out of date: run `{REGENERATE}` "
                  "and commit the result", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
