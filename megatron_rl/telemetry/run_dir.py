"""The run directory a person can inspect: config.yaml, tb/, metrics.jsonl, timeline.jsonl,
checkpoints/, logs/."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from ..config.schema import RootConfig


def make_run_dir(cfg: RootConfig) -> Path:
    run_dir = Path(cfg.trainer.run_dir) if cfg.trainer.run_dir else (
        Path("runs") / cfg.trainer.recipe / time.strftime("%Y%m%d-%H%M%S"))
    for sub in ("tb", "checkpoints", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    return run_dir


def setup_logging(log_file: Optional[Path] = None, level: int = logging.INFO) -> None:
    """Console + file logging; quiets megatron-core's expected CPU fallbacks (no apex / TE)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="megatron")
    handlers: list = [logging.StreamHandler()]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    for noisy in ("megatron", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
