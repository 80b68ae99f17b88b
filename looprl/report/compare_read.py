"""The run folders `looprl compare` reads: each one's config, evals, training and held-out
curves, read once into a `Run`, and the names the runs go by in the tables."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from looprl.config import Config, load_config
from looprl.errors import ConfigError
from looprl.report.also import read_also
from looprl.report.comparisons import load_eval
from looprl.report.curve import read_curve
from looprl.report.write import read_metrics

# the evals paired between runs, in the table's order: (file under eval/, label)
PAIRED_EVALS = (
    ("baseline", "baseline"),
    ("after_sft", "after SFT"),
    ("final", "final"),
    ("final_greedy", "final, greedy (T = 0)"),
)


@dataclass
class Run:
    """One run folder, read once: its config, its evals, its training and held-out curves."""

    path: Path
    name: str
    cfg: Config
    settings: dict[str, Any]  # config.yaml as dotted keys, for the differences
    evals: dict[str, dict]  # name under eval/ (without .json) → EvalResult; eval.also's too
    rows: list[dict[str, Any]]  # metrics.jsonl
    curve: list[dict[str, Any]]  # eval/curve.jsonl (eval.every), [] without one


# ============================================================================ reading


def load_run(path: Path) -> Run:
    """A finished run folder; a ConfigError saying what is missing otherwise."""
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"{path} is not a run folder (no config.yaml)")
    evals = {}
    for name, _ in PAIRED_EVALS:
        result = load_eval(path / "eval" / f"{name}.json")
        if result is not None:
            evals[name] = result
    missing = {
        "baseline": "stopped before its baseline evaluation",
        "final": "is still running or stopped before its final evaluation",
    }
    for name, why in missing.items():
        if name not in evals:
            raise ConfigError(
                f"{path} has no eval/{name}.json: the run {why}, so it cannot be compared "
                f"(a stopped run can be finished with `looprl run {path}/config.yaml "
                f"--out {path} --resume`)"
            )
    for name in ("baseline", "final"):  # eval.also: other envs, also/KEY/NAME
        for key, result in read_also(path, name).items():
            evals[f"also/{key}/{name}"] = result
    settings = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
    return Run(
        path=path,
        name=path.name,
        cfg=load_config(path / "config.yaml"),
        settings=flatten(settings),
        evals=evals,
        rows=read_metrics(path),
        curve=read_curve(path),
    )


def paired_evals(runs: list[Run]) -> list[tuple[str, str]]:
    """PAIRED_EVALS, then each eval.also entry's baseline and final that a run has."""
    also = sorted({key for run in runs for key in run.evals if key.startswith("also/")})
    labels = [(key, f"{key.split('/')[1]} (eval.also), {key.split('/')[2]}") for key in also]
    return [*PAIRED_EVALS, *labels]


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-4}} → {"train.lr": 1e-4}; lists stay whole values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def name_runs(runs: list[Run]) -> None:
    """Folder names as column names; runs whose folders share a name get their parent's."""
    counts = Counter(run.path.name for run in runs)
    for run in runs:
        if counts[run.path.name] > 1:
            run.name = f"{run.path.resolve().parent.name}/{run.path.name}"
    counts = Counter(run.name for run in runs)
    for i, run in enumerate(runs):  # still equal (the same folder twice): number them
        if counts[run.name] > 1:
            run.name = f"{run.name} ({i + 1})"
