"""Rows of a data file for the `dataset` environment: JSONL, CSV, Parquet, or a folder a
Hugging Face `datasets` object was saved to (`save_to_disk`).

Each row is a dict; errors name the file and the row (1-based: a JSONL file's line, a CSV
file's data row) so that a user can open the file at the right place.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from looprl.errors import EnvError

FORMATS = ("jsonl", "csv", "parquet", "datasets folder")


def read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(row number, row) for every row of `path`."""
    path = Path(path)
    if not path.exists():
        raise EnvError(f"data file {path} does not exist")
    if path.is_dir():
        rows = _datasets_folder(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl(path)
    elif path.suffix == ".csv":
        rows = _csv(path)
    elif path.suffix == ".parquet":
        rows = _parquet(path)
    else:
        raise EnvError(
            f"data file {path}: unknown format {path.suffix!r}; expected .jsonl, .csv, "
            ".parquet or a folder saved with datasets' save_to_disk"
        )
    if not rows:
        raise EnvError(f"data file {path} has no rows")
    return rows


def _jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise EnvError(f"{path}: line {number} is not valid JSON: {err.msg}") from None
        if not isinstance(row, dict):
            raise EnvError(f"{path}: line {number} is not a JSON object")
        rows.append((number, row))
    return rows


def _csv(path: Path) -> list[tuple[int, dict[str, Any]]]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = []
        for number, row in enumerate(reader, start=1):
            if None in row:
                raise EnvError(f"{path}: row {number} has more cells than the header")
            rows.append((number, {k: v for k, v in row.items() if v is not None}))
    return rows


def _parquet(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EnvError(
            f"{path}: reading Parquet needs pyarrow: pip install 'looprl[data]'"
        ) from None
    table = pq.read_table(path)
    return list(enumerate(table.to_pylist(), start=1))


def _datasets_folder(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise EnvError(
            f"{path} is a folder: reading a saved dataset needs the datasets library: "
            "pip install 'looprl[data]'"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # not a saved dataset: say so in the user's terms
        raise EnvError(
            f"{path} is a folder but not one saved with datasets' save_to_disk ({err})"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise EnvError(f"{path}: a DatasetDict without a 'train' split: {list(data)}")
        data = data["train"]
    return list(enumerate(data.to_list(), start=1))


def parse_cell(value: Any, expect: type | tuple[type, ...]) -> Any:
    """A structured cell (messages, tools, info, an object answer) as its value: CSV cells
    hold them as JSON text. Raises ValueError when the text is not JSON of that type."""
    if isinstance(value, str) and not isinstance("", expect):
        value = json.loads(value)
    if not isinstance(value, expect):
        raise ValueError(f"expected {_names(expect)}, got {type(value).__name__}")
    return value


def _names(expect: type | tuple[type, ...]) -> str:
    kinds = expect if isinstance(expect, tuple) else (expect,)
    return " or ".join(
        {list: "a list", dict: "an object", str: "text"}.get(k, k.__name__) for k in kinds
    )
