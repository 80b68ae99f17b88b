"""Rows of a data file for the `dataset` environment: JSONL, CSV, Parquet, a folder a
Hugging Face `datasets` object was saved to (`save_to_disk`), or a dataset on the Hugging
Face hub (`org/name`, read with `datasets.load_dataset` where the hub is reachable).

Each row is a dict; errors name the file and the row (1-based: a JSONL file's line, a CSV
file's data row) so that a user can open the file at the right place. A relative path is
looked up in the config file's folder, then in the current folder (`find_file`).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

from looprl.errors import EnvError

FORMATS = ("jsonl", "csv", "parquet", "datasets folder", "hub dataset")
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# `org/name` on the hub: two parts, no file suffix (a path that exists is read as a path)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
OFFLINE = (
    "Offline, looprl reads data files (.jsonl, .csv, .parquet) and folders written with "
    "datasets' save_to_disk: on a machine that reaches the hub, save it with "
    "datasets.load_dataset({name!r}, split={split!r}).save_to_disk('FOLDER') and set path: FOLDER"
)


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not value.endswith(SUFFIXES)


def find_file(value: str, base: Path | None, field: str) -> str:
    """A data file `value` as an absolute path: a relative one is looked up in `base` (the
    config file's folder) and in the current folder; where both hold it, `base`'s wins.
    An `org/name` found in neither is left as it is, a hub dataset id. Otherwise an EnvError
    naming every path tried."""
    path = Path(value).expanduser()
    tried = [path] if path.is_absolute() else [base / path] if base is not None else []
    if not path.is_absolute():
        tried.append(Path.cwd() / path)
    tried = list(dict.fromkeys(p.resolve() for p in tried))
    for candidate in tried:
        if candidate.exists():
            return str(candidate)
    if not path.is_absolute() and looks_like_hub_id(value):
        return value
    raise EnvError(
        f"{field}: data file {value} does not exist (looked in {' and '.join(map(str, tried))})"
    )


def read_rows(
    path: str | Path, split: str = "train", revision: str | None = None, subset: str | None = None
) -> list[tuple[int, dict[str, Any]]]:
    """(row number, row) for every row of `path`; `split` picks the split of a saved
    DatasetDict or a hub dataset, `revision` and `subset` (its config name) a hub one's."""
    if not Path(path).exists() and looks_like_hub_id(str(path)):
        rows = _hub(str(path), split, revision, subset)
        if not rows:
            raise EnvError(f"hub dataset {path} (split {split!r}) has no rows")
        return rows
    path = Path(path)
    if not path.exists():
        raise EnvError(f"data file {path} does not exist (looked in {path.resolve()})")
    if path.is_dir():
        rows = _datasets_folder(path, split)
    elif path.suffix in SUFFIXES[:2]:
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


def _datasets_folder(path: Path, split: str) -> list[tuple[int, dict[str, Any]]]:
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
        if split not in data:
            raise EnvError(
                f"{path}: a DatasetDict without a {split!r} split; its splits: "
                f"{', '.join(data)} (env.args.split / eval_split pick one)"
            )
        data = data[split]
    return list(enumerate(data.to_list(), start=1))


def _hub(
    name: str, split: str, revision: str | None, subset: str | None
) -> list[tuple[int, dict[str, Any]]]:
    """A hub dataset's split through `datasets`; a hub that cannot be reached is one error
    saying what works offline."""
    offline = OFFLINE.format(name=name, split=split)
    try:
        import datasets
    except ImportError:
        raise EnvError(
            f"{name} is not a local file or folder; reading it from the Hugging Face hub needs "
            f"the datasets library: pip install 'looprl[data]'. {offline}"
        ) from None
    try:
        data = datasets.load_dataset(name, subset, split=split, revision=revision)
    except (ConnectionError, OSError) as err:  # offline mode, no network, no such dataset
        raise EnvError(
            f"{name} is not a local file or folder (looked in {Path(name).resolve()}), and "
            f"the Hugging Face hub could not give it: {_first_line(err)}. {offline}"
        ) from None
    except Exception as err:  # a missing subset, an unknown split or revision
        raise EnvError(f"hub dataset {name}: {type(err).__name__}: {_first_line(err)}") from None
    return list(enumerate(data.to_list(), start=1))


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


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
