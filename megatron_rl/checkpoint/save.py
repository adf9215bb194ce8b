"""Training-state checkpoints with Megatron's dist_checkpointing (sharded, reloadable at another
parallel layout). Written to a temporary directory and renamed, then the ``latest`` pointer is
replaced last, so a crash mid-save never corrupts the newest good checkpoint."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


# The critic's tensors are stored under this prefix, beside the policy's.
CRITIC_PREFIX = "critic."


def _model_and_optimizer(owner, is_loading: bool, prefix: str = "") -> Dict[str, Any]:
    model_state = owner.module.sharded_state_dict(prefix=prefix)
    # is_loading makes Megatron allocate optimizer state (Adam moments) for a fresh optimizer to
    # load into; without it a not-yet-stepped optimizer would silently keep zero moments.
    optimizer_state = owner.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return {"model": model_state, "optimizer": optimizer_state}


def _sharded_state(learner, critic=None, is_loading: bool = False) -> Dict[str, Any]:
    state = _model_and_optimizer(learner, is_loading)
    if critic is not None:
        state["critic"] = _model_and_optimizer(critic, is_loading, CRITIC_PREFIX)
    return state


def save_checkpoint(learner, root: Path, step: int, trainer_state: Dict[str, Any], keep: int = 2,
                    critic=None) -> Path:
    from megatron.core import dist_checkpointing

    from ..lifetime import checkpoint_writer_dies_with_us

    checkpoint_writer_dies_with_us()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(_sharded_state(learner, critic), str(tmp))
    if rank0:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        _rotate(root, keep)
    if dist.is_initialized():
        dist.barrier()
    if rank0:  # once, not once per learner rank
        logger.info("saved checkpoint %s", final)
    return final


def _rotate(root: Path, keep: int) -> None:
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Optional[Path]:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(learner, path: Path, critic=None) -> Dict[str, Any]:
    """Load model and optimizer state into a built learner (and critic); return the saved trainer state."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state(learner, critic, is_loading=True), str(path))
    learner.module.load_state_dict(state["model"])
    learner.optimizer.load_state_dict(state["optimizer"])
    if critic is not None:
        critic.module.load_state_dict({k.removeprefix(CRITIC_PREFIX): v for k, v in state["critic"]["model"].items()})
        critic.optimizer.load_state_dict(state["critic"]["optimizer"])
    return json.loads((path / STATE_FILE).read_text())
