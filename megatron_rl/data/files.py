"""Rows of a dataset file, whatever its format: JSONL, parquet (verl's format) or a directory that
Hugging Face ``datasets`` saved with ``save_to_disk``.

Each row comes back as a plain dict of JSON values (nested dicts and lists included), so that it
can travel with its prompt to rewards and agents and into a checkpoint. Bad input fails early with
one line naming the file, the row and the fix.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from pathlib import Path
from typing import Any, Dict, List

from ..errors import UserError

# Files a `datasets` save_to_disk directory holds: a Dataset's, or a DatasetDict's.
HF_DATASET_MARKERS = ("dataset_info.json", "state.json")
HF_DATASET_DICT_MARKER = "dataset_dict.json"
PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(UserError):
    """A dataset file that cannot be used; the message names the file, the row and the fix."""


def dataset_format(path: str) -> str:
    """``jsonl`` | ``parquet`` | ``hf`` (a ``datasets`` directory) for ``path``; DatasetError when
    there is nothing usable there."""
    p = Path(path)
    if p.is_dir():
        if any((p / m).is_file() for m in (*HF_DATASET_MARKERS, HF_DATASET_DICT_MARKER)):
            return "hf"
        raise DatasetError(f"data.path={path!r} is a directory without dataset_info.json, state.json or "
                           "dataset_dict.json; point it at a JSONL or parquet file, or at a directory saved with "
                           "datasets' save_to_disk")
    if not p.is_file():
        raise DatasetError(f"data.path={path!r}: file not found (GSM8K ships at ../shared/data/gsm8k/train.jsonl; "
                           "pass data.path=<file>)")
    return "parquet" if p.suffix.lower() in PARQUET_SUFFIXES else "jsonl"


def read_rows(path: str, split: str = "train") -> List[Dict[str, Any]]:
    """Every row of the dataset at ``path`` as a dict of JSON values. ``split`` chooses the split
    of a saved ``DatasetDict``."""
    kind = dataset_format(path)
    if kind == "jsonl":
        rows = read_jsonl_rows(path)
    elif kind == "parquet":
        rows = read_parquet_rows(path)
    else:
        rows = read_hf_rows(path, split)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def read_jsonl_rows(path: str) -> List[Dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped)."""
    rows = []
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                   f"{err.start + 1}); convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8 "
                                   f"{path} > fixed.jsonl") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                                   "fix or delete that line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_parquet_rows(path: str) -> List[Dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: not a readable parquet file ({type(err).__name__}: {_first_line(err)}); "
                           "write it again, e.g. with pandas' DataFrame.to_parquet") from None
    return [jsonable_row(row, path, i + 1) for i, row in enumerate(table.to_pylist())]


def read_hf_rows(path: str, split: str) -> List[Dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; each is one line here
        raise DatasetError(f"{path}: datasets.load_from_disk failed ({type(err).__name__}: {_first_line(err)}); "
                           "save the dataset again with Dataset.save_to_disk") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path} is a DatasetDict without a {split!r} split (it has: "
                               f"{', '.join(loaded) or 'none'}); set data.split to one of them")
        loaded = loaded[split]
    return [jsonable_row(row, path, i + 1) for i, row in enumerate(loaded.to_list())]


def jsonable_row(row: Dict[str, Any], path: str, number: int) -> Dict[str, Any]:
    try:
        return {str(k): jsonable(v) for k, v in row.items()}
    except TypeError as err:
        raise DatasetError(f"{path}: row {number}: {err}; store that column as text, numbers, lists or "
                           "structs") from None


def jsonable(value: Any) -> Any:
    """``value`` with every part a JSON value: bytes as UTF-8 text (base64 when not text), dates
    and times as ISO text, decimals and numpy scalars as numbers, NaN as None."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, (datetime.date, datetime.time, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if callable(getattr(value, "tolist", None)):  # numpy scalars and arrays
        return jsonable(value.tolist())
    raise TypeError(f"a value of type {type(value).__name__} cannot be kept as JSON")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__
