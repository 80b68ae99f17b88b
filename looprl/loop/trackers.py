"""Experiment trackers: views of a run besides its folder (TensorBoard, wandb, trackio, mlflow).

Every tracker gets the same three things: the resolved config when it starts, each step's
metrics under the names `metrics.jsonl` uses (`step` is the step, null values are left
out), and, when the run ends, the report (`report.md`, `report.html`, `plots/`). Each one
is a small class with `log(scalars, step)` and `finish(report_files)`; `MetricsLogger`
in `log.py` drives them and drops one that raises, since `metrics.jsonl` is the record.

Only TensorBoard is a dependency of looprl; the others are extras, imported by
`check_trackers` before a run writes anything, so a missing package is a config error.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from looprl.errors import ConfigError

# tracker → (the module it imports, the command that installs it)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'looprl[wandb]'"),
    "trackio": ("trackio", "pip install 'looprl[trackio]'"),
    "mlflow": ("mlflow", "pip install 'looprl[mlflow]'"),
}
REPORT_FILES = ("report.md", "report.html", "plots")


class Tracker(Protocol):
    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def finish(self, report_files: list[Path]) -> None:
        """Attach the report files (none when the run ended without a report), then end."""


def check_trackers(names: list[str]) -> None:
    """Import each tracker's package, so a missing or broken one stops the run up front."""
    for name in names:
        module, install = TRACKER_PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(
                f"logging.trackers lists {name!r}, but its package cannot be imported ({err}); "
                f"install it with `{install}`, or remove {name!r} from logging.trackers"
            ) from None


def start_tracker(name: str, run_dir: Path, project: str, config: dict[str, Any]) -> Tracker:
    """Start one tracker's run, named after the run folder, with the resolved config."""
    kinds = {
        "tensorboard": TensorBoardTracker,
        "wandb": WandbTracker,
        "trackio": TrackioTracker,
        "mlflow": MlflowTracker,
    }
    return kinds[name](run_dir, project, config)


def report_files(run_dir: Path) -> list[Path]:
    """The report's files that exist in `run_dir`."""
    return [run_dir / name for name in REPORT_FILES if (run_dir / name).exists()]


class TensorBoardTracker:
    """Event files in RUN/tb; the config and report.md as text (TensorBoard has no files)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        self.writer.add_text("config", _code_block(yaml.safe_dump(config, sort_keys=False)))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, report_files: list[Path]) -> None:
        for path in report_files:
            if path.name == "report.md":
                self.writer.add_text("report", path.read_text())
        self.writer.close()


class WandbTracker:
    """A wandb run whose local files live in RUN/wandb; `WANDB_MODE` (e.g. offline) applies."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, report_files: list[Path]) -> None:
        import wandb

        if report_files:
            artifact = wandb.Artifact(f"report-{self.run.id}", type="report")
            _add_files(artifact, report_files)
            self.run.log_artifact(artifact)
        self.run.finish()


class TrackioTracker:
    """A trackio run in trackio's local store (`TRACKIO_DIR`), or where trackio's settings say."""

    name = "trackio"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        import trackio

        self.run = trackio.init(project=project, name=run_dir.name, config=config, embed=False)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, report_files: list[Path]) -> None:
        import trackio

        if report_files:
            artifact = trackio.Artifact(f"report-{self.run.id}", type="report")
            _add_files(artifact, report_files)
            self.run.log_artifact(artifact)
        trackio.finish()  # this run, which trackio.init made current; finishing it clears that


class MlflowTracker:
    """An MLflow run in the store MLflow picks itself (`MLFLOW_TRACKING_URI`, else its default).

    The config goes in twice: flattened into params (`model.lora.rank`), which the MLflow UI
    compares across runs, and whole as the `config.yaml` artifact. The report files go under
    the `report/` artifact folder.
    """

    name = "mlflow"
    PARAM_CHARS = 500  # the smallest limit MLflow servers have had; config.yaml holds it all

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        experiment = self.client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        params = [Param(k, v[: self.PARAM_CHARS]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_dict(self.run_id, config, "config.yaml")

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, report_files: list[Path]) -> None:
        for path in report_files:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), f"report/{path.name}")
            else:
                self.client.log_artifact(self.run_id, str(path), "report")
        self.client.set_terminated(self.run_id)


def _add_files(artifact: Any, paths: list[Path]) -> None:
    """Files and folders into a wandb or trackio artifact (both have `add_file`/`add_dir`)."""
    for path in paths:
        add = artifact.add_dir if path.is_dir() else artifact.add_file
        add(str(path), name=path.name)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{'model': {'lora': {'rank': 16}}} → {'model.lora.rank': '16'}."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _code_block(text: str) -> str:
    """Markdown code block by indentation, which TensorBoard's text panel renders as is."""
    return "\n".join("    " + line for line in text.splitlines())
