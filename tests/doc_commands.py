"""The commands the documentation shows, found, classified and made cheap to run.

Every ```bash block of README.md and docs/*.md holds commands, one per line (a trailing ``\\``
continues a line; ``#`` lines are comments). A plain ``` block holds output or text, never a
command: ``untagged_commands`` finds one that does, so that no command escapes the check.

Each command either runs (tests/test_docs.py) or is skipped with what it needs:
- a marker the page carries on the line before the block, ``<!-- needs: a Slurm cluster -->``,
  skips all of that block's commands with that reason;
- otherwise the first rule of ``NEEDS`` that matches the command (after the stand-ins below are
  put in) names what it needs: a GPU, vLLM, Slurm, the network, a real checkpoint.

What runs runs literally in bash, in a sandbox folder that links the repository's entries (so
``launch/local.sh``, ``tools/...`` and ``recipes/`` resolve and ``runs/`` is the sandbox's own),
with ``.venv/bin/python`` a shim onto a preloaded interpreter (tests/doc_python.py). Training is
capped: ``STEP_CAP`` is appended to every command that trains (Hydra takes a key's last value), so
``trainer.total_steps=300`` runs one step, in the sandbox. ``STAND_INS`` replace a page's
placeholders by what the test makes: a run directory with a checkpoint, data files, a teacher.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What a command needs that CI does not have, by the first pattern that matches it. The order
# matters: the most specific reason first.
NEEDS: List[Tuple[str, str]] = [
    (r"\bbash (tests/run(_vllm)?\.sh|\.ci/run)\b", "the test suite itself (CI runs it)"),
    (r"\.venv-vllm/|rollout\.engine=vllm|recipe=\S*vllm", "vLLM (.venv-vllm: bash tests/run_vllm.sh --install-only)"),
    (r"recipe=\S*_gpu\b|tools/bench/\S*_gpu\.py|tools/gpu/|--size gpu\b", "a GPU"),
    (r"^(sbatch|srun|scancel|scontrol)\b|slurm/local_cluster\.sh", "a Slurm cluster"),
    (r"\bpip install\b|\bwandb sync\b", "the network"),
    (r"/ckpt/", "a real checkpoint"),
]

# Placeholders of the pages -> what the sandbox holds instead (made by tests/test_docs.py).
STAND_INS: Dict[str, str] = {
    "runs/tiny_cpu/<stamp>": "runs/tiny_cpu/stamp",       # a 1-step tiny_cpu run with its checkpoint
    "runs/x/": "runs/tiny_cpu/stamp/",
    "checkpoints/step_700": "checkpoints/step_1",
    "/ckpt/teacher-hf": "runs/tiny_cpu/stamp/checkpoints/step_1",   # a Megatron checkpoint is a teacher
    "/ckpt/out-hf": "/tmp/out-hf",                        # outputs, not inputs
    "/ckpt/x-bf16": "/tmp/x-bf16",
    "/tmp/": "{sandbox}/tmp/{page}/",                     # nothing written outside the sandbox; pages apart
    "/data/": "{sandbox}/data/",
}

# Appended to a command that trains, so that it takes one step and writes only into the sandbox.
STEP_CAP = "trainer.total_steps=1 trainer.save_final_checkpoint=false trainer.run_dir={run_dir}"
TRAINS = re.compile(r"(bash launch/local\.sh|-m megatron_rl\.main)\b(?!.*--print-config)")
# Appended to a submit command: the batch script is printed, not submitted.
SUBMITS = re.compile(r"-m megatron_rl\.slurm submit\b(?!.*--(dry-run|wait))")
# Tools run as written, with a cap where they would take long.
TOOL_CAPS: List[Tuple[str, str]] = [
    (r"tools/gen_config_reference\.py", "--check"),      # compare with docs/configuration.md, write nothing
    (r"-m megatron_rl\.eval\b", "--limit 2 --no-progress trainer.run_dir={run_dir}"),
    (r"tools/arithmetic_demo\.py", "--sft-steps 2 --rl-steps 1 --limit 2 --samples 2 --run-dir {run_dir}"),
]

# A line of a plain block that starts like a command: it belongs in a ```bash block.
LOOKS_LIKE_A_COMMAND = re.compile(r"^(\.venv[\w-]*/bin/|python3? |bash |export |[A-Z_]+=\S+ \S)")
NEEDS_MARKER = re.compile(r"<!--\s*needs:\s*(.+?)\s*-->")


@dataclass
class Command:
    page: str          # README.md, docs/recipes.md
    line: int          # where the command starts on the page
    text: str          # as written, continuation lines joined
    exports: List[str]  # the block's `export` lines before it: a reader's shell has them
    needs: Optional[str]
    block: int = 0     # the line of its block's first command: a block's commands run in order

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: Path) -> Iterator[Tuple[str, int, List[str], Optional[str]]]:
    """(info string, line of the first body line, body lines, needs marker) of each fenced block."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        marker = NEEDS_MARKER.search(lines[i - 1]) if i else None
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        yield fence.group(1), i + 2, lines[i + 1:end], marker.group(1) if marker else None
        i = end + 1


def page_commands(page: Path) -> List[Command]:
    name = str(page.relative_to(ROOT))
    found: List[Command] = []
    for info, first, body, marker in _blocks(page):
        if info != "bash":
            continue
        exports: List[str] = []
        joined, start = "", 0
        for offset, raw in enumerate(body):
            if not joined:
                start = first + offset
            joined += raw.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1].rstrip() + " "
                continue
            text, joined = joined.strip(), ""
            if not text or text.startswith("#"):
                continue
            if text.startswith("export "):
                exports.append(text)
                continue
            found.append(Command(name, start, text, list(exports), marker or needs_of(put_stand_ins(text, "")), first))
    return found


def all_commands() -> List[Command]:
    return [c for page in PAGES for c in page_commands(page)]


def untagged_commands() -> List[str]:
    """``page:line`` of each line of a plain or ``console`` block that reads like a command."""
    found = []
    for page in PAGES:
        for info, first, body, _ in _blocks(page):
            if info in ("", "console", "sh", "shell"):
                found += [f"{page.relative_to(ROOT)}:{first + k}" for k, line in enumerate(body)
                          if LOOKS_LIKE_A_COMMAND.match(line)]
    return found


def needs_of(text: str) -> Optional[str]:
    if SUBMITS.search(text) or "--dry-run" in text:
        return None  # prints the batch script: no cluster, no GPU
    for pattern, reason in NEEDS:
        if re.search(pattern, text):
            return reason
    return None


def put_stand_ins(text: str, sandbox: str, page: str = "") -> str:
    for placeholder, stand_in in STAND_INS.items():
        # An absolute placeholder only where a path starts: ~/data/ is not /data/.
        start = r"(?<![\w~./-])" if placeholder.startswith("/") else ""
        replacement = stand_in.format(sandbox=sandbox, page=Path(page).stem)
        text = re.sub(start + re.escape(placeholder), lambda _, r=replacement: r, text)
    return text


def _without_comment(text: str) -> Tuple[str, str]:
    """The command and its trailing `` # comment`` (the pages write comments after two spaces)."""
    match = re.search(r"\s+#\s.*$", text)
    return (text[:match.start()], text[match.start():]) if match else (text, "")


def runnable(command: Command, sandbox: str, run_dir: str) -> str:
    """The bash script that runs ``command`` in the sandbox: stand-ins in, caps appended."""
    text, _ = _without_comment(put_stand_ins(command.text, sandbox, command.page))
    if TRAINS.search(text):
        text += " " + STEP_CAP.format(run_dir=run_dir)
    if SUBMITS.search(text):
        text += " --dry-run"
    for pattern, cap in TOOL_CAPS:
        if re.search(pattern, text):
            text += " " + cap.format(run_dir=run_dir)
    exports = [put_stand_ins(e, sandbox, command.page) for e in command.exports]
    return "\n".join(["set -euo pipefail", *exports, text]) + "\n"
