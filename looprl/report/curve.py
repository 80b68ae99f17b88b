"""The report's held-out curve (`eval.every`): held-out reward per step with its 95% band
beside the training reward, the best step named (its weights: `checkpoints/best`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from looprl.report.plots import AFTER_COLOR, BEFORE_COLOR, _figure, _save, ema, finite

PLOT = "held_out_curve.png"


def read_curve(run_dir: Path) -> list[dict[str, Any]]:
    """eval/curve.jsonl's points, by step; [] for a run without `eval.every`."""
    path = run_dir / "eval" / "curve.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return sorted(rows, key=lambda r: r["step"])


def best_point(curve: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The point with the highest held-out reward (the earliest of equals)."""
    return max(curve, key=lambda r: finite(r.get("reward_mean")), default=None)


def plot_eval_curve(rows: list[dict[str, Any]], curve: list[dict[str, Any]], path: Path) -> Path:
    """Held-out reward per evaluated step (95% CI band) and the training reward per step
    (EMA), on one axis; the best held-out step marked."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(figsize=(7.5, 3.6))
    ax = fig.subplots()
    steps = [r["step"] for r in curve]
    means = [finite(r.get("reward_mean")) for r in curve]
    ci = [list(r.get("reward_ci95") or [math.nan, math.nan]) for r in curve]
    ax.fill_between(
        steps,
        [finite(c[0]) for c in ci],
        [finite(c[1]) for c in ci],
        color=AFTER_COLOR,
        alpha=0.2,
        label="held-out 95% CI",
    )
    ax.plot(steps, means, color=AFTER_COLOR, marker="o", linewidth=2, label="held-out reward")
    if rows:
        train = [finite(r.get("rollout/rewards_mean")) for r in rows]
        ax.plot(
            [r["step"] for r in rows],
            ema(train),
            color=BEFORE_COLOR,
            linewidth=1.5,
            label="training reward (EMA)",
        )
    best = best_point(curve)
    if best is not None:
        ax.scatter(
            [best["step"]],
            [best["reward_mean"]],
            s=120,
            facecolors="none",
            edgecolors="black",
            zorder=5,
            label=f"best: step {best['step']}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title(
        "held-out reward over the steps (same tasks and seeds at every point)", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def curve_blocks(run_dir: Path, rows: list[dict[str, Any]]) -> list[tuple]:
    """The report's section on the held-out curve; [] without one."""
    curve = read_curve(run_dir)
    if not curve:
        return []
    best = best_point(curve)
    assert best is not None
    last = curve[-1]
    lo, hi = (list(best.get("reward_ci95") or []) + [math.nan, math.nan])[:2]
    text = (
        f"{len(curve)} held-out evaluations on the same {best.get('n', '?')} episodes, at "
        f"steps {', '.join(str(r['step']) for r in curve)}. Best at step {best['step']}: "
        f"{best['reward_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        + (
            f" (the last point, step {last['step']}: {last['reward_mean']:+.3f})"
            if last is not best
            else " (the last point)"
        )
        + "; its weights are in checkpoints/best."
    )
    png = plot_eval_curve(rows, curve, run_dir / "plots" / PLOT)
    return [
        ("h2", "Held-out curve"),
        ("p", text),
        ("img", png, "Held-out reward per evaluated step and the training reward"),
    ]
