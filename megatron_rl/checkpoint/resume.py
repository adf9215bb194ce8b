"""What exact resume needs besides model and optimizer: the random states, the position in the
prompt stream, and finding the newest checkpoint that actually loads.

Everything here is JSON-friendly so that ``trainer_state.json`` in a checkpoint stays readable."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar

import numpy as np
import torch

from ..errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ResumeError(UserError, RuntimeError):
    """Checkpoints exist but none can be loaded; the message says what to do."""


def capture_rng() -> Dict[str, Any]:
    """Python, NumPy and torch (CPU and, where present, CUDA) random states."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: Dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np.array(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class CountingIterator(Iterator[T]):
    """An iterator that counts what it handed out, so a resumed run can skip as many items of a
    freshly built (deterministic, seeded) stream and continue where the checkpoint left it."""

    def __init__(self, source: Iterable[T]):
        self._it = iter(source)
        self.drawn = 0

    def __iter__(self) -> "CountingIterator[T]":
        return self

    def __next__(self) -> T:
        item = next(self._it)
        self.drawn += 1
        return item

    def skip(self, n: int) -> None:
        for _ in range(n):
            next(self)


def checkpoints_newest_first(root: Path) -> List[Path]:
    """Complete checkpoints under ``root``: the one ``latest`` points to first, then the other
    ``step_N`` directories by decreasing N (temporary ``.step_N.tmp`` directories are never complete)."""
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]), reverse=True)
    pointer = root / "latest"
    if pointer.is_file():
        latest = root / pointer.read_text().strip()
        if latest in steps:
            steps.remove(latest)
            steps.insert(0, latest)
    return steps


def load_newest_good(root: Path, load: Callable[[Path], Dict[str, Any]]) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """Load the newest checkpoint that loads, warning about each newer one that does not.

    ``load(path)`` restores one checkpoint and returns its trainer state. None when there is no
    checkpoint; an error naming every failure when there are checkpoints but none loads (starting
    over silently would overwrite the run)."""
    # torch.distributed.checkpoint reports unreadable shards as a BaseException subclass.
    from torch.distributed.checkpoint.api import CheckpointException

    candidates = checkpoints_newest_first(root)
    failures = []
    for i, path in enumerate(candidates):
        try:
            json.loads((path / "trainer_state.json").read_text())  # cheap check before the tensors
            state = load(path)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any unreadable one is skipped, loudly
            failures.append(f"{path.name}: {err!r}"[:300])
            nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
            logger.warning("checkpoint %s cannot be loaded (%s); %s", path, repr(err)[:200],
                           f"falling back to {nxt}" if nxt else "no older checkpoint left")
            continue
        if failures:
            logger.warning("resumed from %s after skipping %d unreadable newer checkpoint(s)", path.name, len(failures))
        return path, state
    if failures:
        raise ResumeError(f"no checkpoint under {root} can be loaded ({'; '.join(failures)}); move them away "
                           "(the run then starts afresh) or start a new run directory (trainer.run_dir=...)")
    return None
