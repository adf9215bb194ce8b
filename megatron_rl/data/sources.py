"""The data sources a config names: ``data.path`` alone, or ``data.sources``, a list of
``{path, weight}`` entries mixed by weight, each of which may set its own row fields (prompt_key,
answer_key, system_key, system_prompt, split); what it leaves out is taken from ``data.*``.

This module reads no file and imports nothing heavy: config validation checks the list with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from .files import DatasetError
from ..errors import ConfigError, UserError

# Keys a data.sources entry may set besides path and weight (the data.* key of the same name
# is the default).
FIELD_KEYS = ("prompt_key", "answer_key", "system_key", "system_prompt", "split")
SOURCE_KEYS = ("path", "weight", *FIELD_KEYS)
# data.name values whose prompts come from data.path / data.sources.
FILE_DATASETS = ("file", "jsonl", "gsm8k", "math500")


@dataclass(frozen=True)
class SourceSpec:
    path: str
    weight: float
    prompt_key: Optional[str]
    answer_key: Optional[str]
    system_key: Optional[str]
    system_prompt: Optional[str]
    split: str
    # Prefix of its prompts' uids: the file's name, numbered when two sources share one.
    uid_prefix: str


def source_specs(data_cfg: Any) -> List[SourceSpec]:
    """One spec per source of ``data_cfg`` (``cfg.data``); DatasetError, one line, for an entry
    that is not ``{path, weight, ...}``."""
    defaults = {key: getattr(data_cfg, key) for key in FIELD_KEYS}
    if not data_cfg.sources:
        entries: List[Dict[str, Any]] = [{"path": data_cfg.path, "weight": 1.0}]
    else:
        if data_cfg.path:
            raise DatasetError("data.path and data.sources are both set; give the file as one of data.sources "
                               "(data.sources=[{path: a.parquet, weight: 0.7}, ...]) and unset data.path")
        entries = [dict(entry) if hasattr(entry, "keys") else entry for entry in data_cfg.sources]
    specs = []
    for i, entry in enumerate(entries):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            raise DatasetError(f"{where}={entry!r} is not a mapping; write each source as {{path: <file>, "
                               "weight: <number>}}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise DatasetError(f"{where} has unknown key {unknown[0]!r}; a source takes {', '.join(SOURCE_KEYS)}")
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise DatasetError(f"{where} has no path; write {{path: <file>, weight: <number>}}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise DatasetError(f"{where}.weight={weight!r} must be a number > 0 (weights are relative: 0.7 and 0.3, "
                               "or 7 and 3)")
        fields = {key: entry.get(key, defaults[key]) for key in FIELD_KEYS}
        specs.append(SourceSpec(entry["path"], float(weight), uid_prefix="", **fields))
    stems = [Path(s.path.rstrip("/")).stem for s in specs]
    return [SourceSpec(**{**s.__dict__, "uid_prefix": stem if stems.count(stem) == 1 else f"{stem}{i}"})
            for i, (s, stem) in enumerate(zip(specs, stems))]


def check_sources(data_cfg: Any) -> None:
    """data.path / data.sources fit data.name; each source entry is {path, weight, ...}."""
    d = data_cfg
    if d.name not in FILE_DATASETS:
        if d.path or d.sources:
            raise ConfigError(f"data.{'path' if d.path else 'sources'} is set, but data.name={d.name} generates its "
                              "prompts; set data.name=file to train on that dataset")
        return
    if not d.path and not d.sources:
        raise ConfigError(f"data.path is required for data.name={d.name}; e.g. data.path=/data/gsm8k/train.jsonl "
                          "(or data.sources=[{path: a.parquet, weight: 0.7}, {path: b.jsonl, weight: 0.3}])")
    try:
        source_specs(d)
    except UserError as err:
        raise ConfigError(str(err)) from None
