"""The run directory a person can inspect: config.yaml, tb/, metrics.jsonl, timeline.jsonl,
checkpoints/, logs/."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from ..config.schema import RootConfig


def make_run_dir(cfg: RootConfig) -> Path:
    """The run directory, created (or reused, to resume); raises ConfigError for one that cannot
    be written, or that holds a run which ``trainer.resume=false`` would overwrite."""
    from ..errors import ConfigError

    run_dir = Path(cfg.trainer.run_dir) if cfg.trainer.run_dir else (
        Path("runs") / cfg.trainer.recipe / time.strftime("%Y%m%d-%H%M%S"))
    if not cfg.trainer.resume and holds_a_run(run_dir):
        raise ConfigError(f"trainer.run_dir={str(run_dir)!r} already holds a run (metrics.jsonl or checkpoints) "
                          "and trainer.resume=false would overwrite it: give a new trainer.run_dir, delete that "
                          "directory, or set trainer.resume=true to continue the run")
    try:
        for sub in ("tb", "checkpoints", "logs"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        # The folder the run used, absolute (the config's other paths already are): the file
        # given as recipe= runs this run again wherever the command is typed.
        used = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=os.path.abspath(run_dir)))
        OmegaConf.save(OmegaConf.structured(used), run_dir / "config.yaml")
    except OSError as err:
        raise ConfigError(f"trainer.run_dir={str(run_dir)!r} cannot be used ({err.strerror or err}: "
                          f"{err.filename or run_dir}): give a directory this user can create and write") from None
    return run_dir


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` has a run's results: step metrics or a checkpoint."""
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (
        checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()))


def note_in_run_log(text: str, name: str = "megatron_rl") -> bool:
    """Write ``text`` to the run directory's log file (``logs/train.log``) only, not the console:
    the reason a run stopped, which the console already shows on stderr. False when no run log is
    open yet (the run stopped before its directory was made)."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return False
    record = logging.LogRecord(name, logging.ERROR, __file__, 0, text, None, None)
    for handler in files:
        handler.handle(record)
        handler.flush()
    return True


def setup_logging(log_file: Optional[Path] = None, level: int = logging.INFO) -> None:
    """Console + file logging; quiets megatron-core's expected CPU fallbacks (no apex / TE)."""
    import warnings

    from .._warnings import quiet_known_warnings

    quiet_known_warnings()  # again: a caller may have reset the filters since the import
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="megatron")
    handlers: list = [logging.StreamHandler()]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    for noisy in ("megatron", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
