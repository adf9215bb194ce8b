"""Relative paths in a config are the user's, from where the command ran: made absolute when the
config is loaded, so that the run's config.yaml records the folders it used (and runs again from
anywhere), and a process that starts elsewhere (a Slurm job step, a launched rank) reads the
same files. Hydra's ``to_absolute_path`` does the same for a Hydra app."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

from .schema import RootConfig

# (group, key) of every config value that is a file or folder on this machine. sandbox.python is
# not: a bare name (python3) is looked up on PATH.
PATH_KEYS: Tuple[Tuple[str, str], ...] = (
    ("model", "path"), ("data", "path"), ("data", "tokenizer_path"), ("trainer", "run_dir"))


def absolute(path: Optional[str]) -> Optional[str]:
    """``path`` with ``~`` expanded, from the working directory; None stays None."""
    if path is None or path == "":
        return path
    # abspath, not resolve(): a symlinked data folder keeps the name the user gave it.
    return os.path.abspath(os.path.expanduser(path))


def resolve_paths(cfg: RootConfig) -> RootConfig:
    """``cfg`` with every path of PATH_KEYS absolute (``cfg`` itself is left as it was)."""
    groups = {}
    for group, key in PATH_KEYS:
        section = groups.get(group, getattr(cfg, group))
        groups[group] = dataclasses.replace(section, **{key: absolute(getattr(section, key))})
    return dataclasses.replace(cfg, **groups)
