"""The held-out curve (`eval.every: N`): the held-out tasks evaluated at step 0 and every N
steps with the same seeds each time, so that every point is paired with every other and
the curve shows where the policy peaked or fell back, not only where it ended.

Each point is a line of `eval/curve.jsonl` (step, reward and its 95% CI, per-episode
rewards and task ids); the best point's weights are kept in `checkpoints/best` (loadable
wherever a checkpoint is: `looprl eval --checkpoint`, `chat`, `serve`, `export`). With
every held-out task on the curve (`eval.curve_tasks` unset) its first point is the eval
the steps start from (after the SFT, or the baseline) and its last the final eval, played
once. A resumed run keeps the points up to its checkpoint and measures the rest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looprl.loop.checkpoint import save_weights, writes_shards
from looprl.loop.dist import current, main_only
from looprl.loop.evaluate import HeldOut, evaluate
from looprl.loop.run_state import trim_steps
from looprl.types import Task

KEPT = (
    "n",
    "reward_mean",
    "reward_ci95",
    "valid_tool_call_rate",
    "response_len",
    "outcomes",
    "rewards",
    "task_ids",
)


@dataclass
class EvalCurve:
    """The run's held-out curve: its tasks, its points so far, the best one's weights."""

    held_out: HeldOut
    every: int
    last: int  # the run's last step
    tasks: list[Task]
    full: bool  # the curve's tasks are the whole held-out eval's
    rows: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, held_out: HeldOut, start: int) -> EvalCurve | None:
        """The run's curve (None without `eval.every`), with the points kept up to `start`
        (a resumed run's checkpoint); a best checkpoint from after `start` is dropped."""
        cfg = held_out.cfg
        if not cfg.eval.every:
            return None
        n = cfg.eval.curve_tasks
        full = n is None or n >= len(held_out.tasks)
        tasks = held_out.tasks if full else held_out.tasks[:n]
        curve = cls(held_out, cfg.eval.every, cfg.train.steps, tasks, full)
        main_only(trim_steps)(curve.path, start)
        dist = current()
        dist.barrier()  # trimmed before any rank reads it
        if curve.path.exists():
            curve.rows = [json.loads(x) for x in curve.path.read_text().splitlines() if x]
        best = curve.best_dir / "meta.json"
        if best.exists() and json.loads(best.read_text())["step"] > start:
            main_only(shutil.rmtree)(curve.best_dir, ignore_errors=True)
        # every rank holds the same points before rank 0 appends one: a rank that read
        # a point another rank had just added would skip that point's collectives
        dist.barrier()
        return curve

    @property
    def path(self) -> Path:
        return self.held_out.run_dir / "eval" / "curve.jsonl"

    @property
    def best_dir(self) -> Path:
        return self.held_out.run_dir / "checkpoints" / "best"

    def due(self, step: int) -> bool:
        """Whether step `step` has a point measured after it: every N-th step, and the
        last one when the final eval is not on the curve's tasks."""
        if any(r["step"] == step for r in self.rows):
            return False
        if step == self.last:
            return not self.full
        return step % self.every == 0

    def point(self, step: int, result: dict | None = None) -> None:
        """Add step `step`'s point: `result` (an eval of the same tasks and seeds already
        played) or an eval now; keep its weights when it is the best point so far."""
        if any(r["step"] == step for r in self.rows):
            return
        if result is None:
            h = self.held_out
            result = evaluate(
                h.policy,
                h.play,
                self.tasks,
                h.cfg,
                None,
                f"held-out curve at step {step}",
                h.progress,
            )
        row = {"step": step, **{k: result[k] for k in KEPT if k in result}}
        best = max((r["reward_mean"] for r in self.rows), default=float("-inf"))
        self.rows.append(row)
        main_only(_append)(self.path, row)
        if row["reward_mean"] > best:
            cfg = self.held_out.cfg
            meta = {"step": step, "reward_mean": row["reward_mean"], "model": cfg.model.name}
            sharded = writes_shards(cfg.train)  # each rank its shards, or rank 0 all
            save_weights(self.best_dir, self.held_out.policy.model, meta, sharded)

    def best(self) -> dict[str, Any] | None:
        """The best point so far (the earliest of equals)."""
        return max(self.rows, key=lambda r: r["reward_mean"], default=None)


def _append(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
