"""Metrics to `metrics.jsonl` (one object per step) and the experiment trackers; transcripts.

`metrics.jsonl` is the run's record: the report, `--resume` and the tests read it. The
trackers (`trackers.py`) are views of the same numbers, so one that fails is switched off
with a warning and the run goes on.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from looprl.loop.trackers import Tracker, report_files, start_tracker
from looprl.types import Episode


class MetricsLogger:
    """`enabled=False` logs nothing: the ranks other than 0 of a torchrun job."""

    def __init__(
        self,
        run_dir: Path,
        trackers: Sequence[str] = ("tensorboard",),
        config: dict[str, Any] | None = None,
        project: str = "looprl",
        enabled: bool = True,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.trackers: list[Tracker] = []
        for name in trackers if enabled else ():
            try:
                self.trackers.append(start_tracker(name, run_dir, project, config or {}))
            except Exception as err:  # a tracker is never a reason to stop a run
                _warn_off(name, "start", err)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(metrics["step"])
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        scalars = {
            key: float(value)
            for key, value in clean.items()
            if key != "step" and isinstance(value, (int, float))  # None: not finite
        }
        self._each("log metrics", lambda tracker: tracker.log(scalars, step))

    def close(self, report_dir: Path | None = None) -> None:
        """End every tracker's run, first attaching the report found in `report_dir`."""
        files = report_files(report_dir) if report_dir is not None else []
        self._each("finish", lambda tracker: tracker.finish(files))
        self.trackers = []  # a second close has nothing left to end

    def _each(self, action: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as err:  # a tracker is never a reason to stop a run
                self.trackers.remove(tracker)
                _warn_off(tracker.name, action, err)


def _warn_off(name: str, action: str, err: Exception) -> None:
    warnings.warn(
        f"the {name} tracker could not {action} ({type(err).__name__}: {err}); it is off for "
        "the rest of this run, and metrics.jsonl still has every step",
        RuntimeWarning,
        stacklevel=3,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; the step is flagged elsewhere
    return value


def episode_record(episode: Episode, step: int | None = None) -> dict[str, Any]:
    """A transcript a person can read: messages, tool calls, reward and outcome."""
    return {
        "step": step,
        "task_id": episode.task.id,
        "task": episode.task.data,
        "reward": episode.reward,
        "outcome": episode.outcome,
        "response_len": episode.response_len,
        "messages": [
            {**m.to_dict(), **({"parse_failure": m.parse_failure} if m.parse_failure else {})}
            for m in episode.messages
        ],
        "completions": [t.text for t in episode.turns],
        **({"info": _jsonable_tree(episode.info)} if episode.info else {}),
        **({"turn_rewards": episode.turn_rewards} if episode.turn_rewards else {}),
        **({"expert": True} if episode.expert else {}),
        **({"error": episode.error} if episode.error else {}),
    }


def _jsonable_tree(value: Any) -> Any:
    """`value` with whatever JSON cannot hold (a set, an object) as its text."""
    return json.loads(json.dumps(value, default=str))


def append_json(path: Path, record: dict[str, Any]) -> None:
    """One JSON object as one more line of `path`."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def write_samples(path: Path, episodes: list[Episode], step: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for episode in episodes:
            f.write(json.dumps(episode_record(episode, step), ensure_ascii=False) + "\n")
