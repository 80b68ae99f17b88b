"""Metrics to `metrics.jsonl` (one object per step) and TensorBoard; transcripts to JSONL."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from looprl.types import Episode


class MetricsLogger:
    """`enabled=False` logs nothing: the ranks other than 0 of a torchrun job."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        wandb_config: Any = None,
        enabled: bool = True,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.writer = None
        if tensorboard and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tb"))
        self.wandb = None
        if wandb_config is not None and enabled:
            import wandb  # optional dependency

            self.wandb = wandb.init(project="looprl", dir=str(run_dir), config=wandb_config)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(metrics["step"])
        clean = {k: _jsonable(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


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
        **({"error": episode.error} if episode.error else {}),
    }


def append_json(path: Path, record: dict[str, Any]) -> None:
    """One JSON object as one more line of `path`."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def write_samples(path: Path, episodes: list[Episode], step: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for episode in episodes:
            f.write(json.dumps(episode_record(episode, step), ensure_ascii=False) + "\n")
