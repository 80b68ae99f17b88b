"""Experiment trackers: the `logging.trackers` key, the up-front package check, a tracker
that fails mid-run, and one real run read back from each tracker's own local store:
wandb offline, trackio's local store and an mlflow file store."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_run_smoke import SMALL, metrics
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import load_config, to_yaml
from looprl.errors import ConfigError
from looprl.loop.log import MetricsLogger

OPTIONAL = ("wandb", "trackio", "mlflow")
INSTALLED = [name for name in OPTIONAL if importlib.util.find_spec(name) is not None]


def needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        package not in INSTALLED,
        reason=f"{package} is not installed (pip install 'looprl[{package}]')",
    )


# ------------------------------------------------------------------ the config key


def test_default_is_tensorboard_and_the_resolved_config_spells_trackers():
    cfg = load_config()
    assert cfg.logging.trackers == ["tensorboard"]
    logging = load_config(overrides=["logging.trackers=[mlflow, wandb]"]).logging
    assert logging.trackers == ["mlflow", "wandb"]
    text = to_yaml(load_config(overrides=["logging.trackers=[]"]))
    assert "trackers: []" in text and "tensorboard:" not in text and "wandb:" not in text


@pytest.mark.parametrize(
    ("old", "trackers"),
    [
        (["logging.tensorboard=false"], []),
        (["logging.wandb=true"], ["tensorboard", "wandb"]),
        (["logging.tensorboard=false", "logging.wandb=true"], ["wandb"]),
        (["logging.trackers=[mlflow]", "logging.tensorboard=true"], ["mlflow", "tensorboard"]),
    ],
)
def test_old_booleans_are_translated_with_a_warning(old, trackers):
    with pytest.warns(FutureWarning, match="logging.trackers") as caught:
        cfg = load_config(overrides=old)
    assert cfg.logging.trackers == trackers
    assert str(trackers).replace("'", "") in str(caught[0].message)  # the new spelling
    assert cfg.logging.tensorboard is None and cfg.logging.wandb is None  # folded, gone
    assert load_config(overrides=[f"logging.trackers={trackers}"]).logging == cfg.logging


@pytest.mark.parametrize(
    ("sets", "needles"),
    [
        (["logging.trackers=[neptune]"], ["neptune", "tensorboard", "wandb", "trackio", "mlflow"]),
        (["logging.trackers=[wandb, wandb]"], ["logging.trackers", "repeated: wandb"]),
        (["logging.trackers=wandb"], ["logging.trackers = 'wandb'", "list"]),
        (["logging.wandb=yes please"], ["logging.wandb", "Deprecated, use logging.trackers"]),
    ],
)
def test_bad_trackers_are_config_errors(sets, needles):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=sets)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.parametrize("name", OPTIONAL)
def test_missing_package_stops_the_run_before_anything_is_written(monkeypatch, tmp_path, name):
    monkeypatch.setitem(sys.modules, name, None)  # what `import name` meets when not installed
    out = tmp_path / "run"
    res = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"}).invoke(
        app, ["run", "--set", f"logging.trackers=[tensorboard, {name}]", "--out", str(out)]
    )
    assert res.exit_code == 2, res.output
    assert f"pip install 'looprl[{name}]'" in res.stderr
    assert "logging.trackers" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


# ------------------------------------------------------------------ a tracker that fails


def test_a_tracker_that_cannot_start_is_dropped_with_a_warning(tmp_path):
    (tmp_path / "tb").write_text("a file where TensorBoard wants its folder")
    with pytest.warns(RuntimeWarning, match="tensorboard tracker could not start"):
        logger = MetricsLogger(tmp_path, ["tensorboard"], {"seed": 0})
    assert logger.trackers == []
    logger.log({"step": 1, "train/loss": 0.5})
    logger.close(report_dir=tmp_path)
    assert metrics(tmp_path) == [{"step": 1, "train/loss": 0.5}]


@needs("mlflow")
def test_a_tracker_that_fails_mid_run_warns_once_and_the_others_go_on(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    logger = MetricsLogger(tmp_path, ["mlflow", "tensorboard"], {"seed": 0})
    logger.log({"step": 1, "train/loss": 0.5})
    mlflow_tracker = logger.trackers[0]
    MlflowClient().delete_run(mlflow_tracker.run_id)  # its store now refuses every write
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (2, 3, 4):
            logger.log({"step": step, "train/loss": 0.5 / step})
        logger.close(report_dir=tmp_path)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert [m.split(" (")[0] for m in messages if "tracker" in m] == [
        "the mlflow tracker could not log metrics"
    ]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]


# ------------------------------------------------------------------ one real run, read back


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A 2-step CLI run logging to TensorBoard and every tracker installed here, offline."""
    if not INSTALLED:
        pytest.skip("no optional tracker is installed (pip install 'looprl[wandb,mlflow]')")
    root = tmp_path_factory.mktemp("trackers")
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "TRACKIO_DIR": str(root / "trackio"),
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # mlflow 3 keeps the file store behind this switch
    }
    run = root / "run"
    trackers = ", ".join(["tensorboard", *INSTALLED])
    cmd = [sys.executable, "-m", "looprl.cli", "run", *SMALL, "--set", "train.steps=2"]
    cmd += ["--set", f"logging.trackers=[{trackers}]", "--out", str(run)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tracker could not" not in res.stderr, res.stderr[-3000:]
    return run, env


def assert_same_as_metrics_jsonl(run: Path, stored: dict[int, dict[str, float]]) -> None:
    """`stored` (step → name → value, as a tracker kept them) holds what metrics.jsonl has:
    the same steps, the same names, the same numbers (nulls are not sent)."""
    expected = {
        row["step"]: {k: v for k, v in row.items() if k != "step" and v is not None}
        for row in metrics(run)
    }
    assert sorted(stored) == sorted(expected) == [1, 2]
    for step, row in expected.items():
        assert stored[step] == pytest.approx(row), step


def test_tensorboard_gets_the_config_and_the_report_as_text(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked_run
    acc = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {tag: acc.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in
             ("config/text_summary", "report/text_summary")}  # fmt: skip
    assert "name: tiny-random" in texts["config/text_summary"]
    assert texts["report/text_summary"] == (run / "report.md").read_text()


def wandb_records(path: Path) -> Iterator[object]:
    """The protobuf records of a `.wandb` file: a 7-byte header, then the LevelDB log format
    (32 KiB blocks; each chunk: crc32 u32, length u16, type u8 = full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


@needs("wandb")
def test_wandb_offline_run_holds_the_metrics_config_and_report(tracked_run):
    run, _ = tracked_run
    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(log))
    by_kind: dict[str, list] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        by_kind.setdefault(kind, []).append(getattr(record, kind))
    (started,) = by_kind["run"]
    assert started.project == "looprl" and started.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["model"]["name"] == "tiny-random"
    assert config["logging"]["trackers"] == ["tensorboard", *INSTALLED]

    history = {}
    for row in by_kind["history"]:
        values = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                  for item in row.item}  # fmt: skip
        history[values.pop("_step")] = {k: v for k, v in values.items() if not k.startswith("_")}
    assert_same_as_metrics_jsonl(run, history)

    (artifact,) = by_kind["artifact"]
    assert artifact.type == "report" and artifact.name == f"report-{started.run_id}"
    paths = {entry.path for entry in artifact.manifest.contents}
    assert {"report.md", "report.html"} <= paths
    assert {f"plots/{p.name}" for p in (run / "plots").glob("*.png")} <= paths


READ_TRACKIO = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage as store
project, run = sys.argv[1:]
(artifact,) = store.get_artifacts(project)
manifest = store.get_artifact_manifest(project, artifact["name"], None)
print(json.dumps({
    "runs": store.get_runs(project),
    "logs": store.get_logs(project, run),
    "config": store.get_run_config(project, run),
    "artifact": artifact["name"],
    "files": [entry["path"] for entry in manifest["manifest"]],
}))
"""


@needs("trackio")
def test_trackio_local_store_has_the_metrics_config_and_report(tracked_run):
    run, env = tracked_run
    res = subprocess.run(  # TRACKIO_DIR is read when trackio is imported: a fresh process
        [sys.executable, "-c", READ_TRACKIO, "looprl", "run"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    stored = json.loads(res.stdout.splitlines()[-1])
    assert stored["runs"] == ["run"]
    logs = {
        row.pop("step"): {k: v for k, v in row.items() if k != "timestamp"}
        for row in stored["logs"]
    }
    assert_same_as_metrics_jsonl(run, logs)
    assert stored["config"]["model"]["name"] == "tiny-random"
    assert stored["artifact"].startswith("report-")
    assert {"report.md", "report.html"} <= set(stored["files"])
    assert {f"plots/{p.name}" for p in (run / "plots").glob("*.png")} <= set(stored["files"])


@needs("mlflow")
def test_mlflow_file_store_has_the_metric_history_params_and_report(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    run, env = tracked_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("looprl")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    assert found.data.params["model.name"] == "tiny-random"

    stored: dict[int, dict[str, float]] = {}
    for key in found.data.metrics:
        for point in client.get_metric_history(found.info.run_id, key):
            stored.setdefault(point.step, {})[key] = point.value
    assert_same_as_metrics_jsonl(run, stored)

    run_id = found.info.run_id
    assert "config.yaml" in {a.path for a in client.list_artifacts(run_id)}
    report = {a.path for a in client.list_artifacts(run_id, "report")}
    assert {"report/report.md", "report/report.html", "report/plots"} <= report
    plots = {a.path for a in client.list_artifacts(run_id, "report/plots")}
    assert plots == {f"report/plots/{p.name}" for p in (run / "plots").glob("*.png")}
