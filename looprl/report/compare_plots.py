"""The plots of `looprl compare`: the runs' training curves and held-out curves overlaid,
one colour per run, and the page's blocks that show them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from looprl.report.plots import _figure, _save, ema, finite

if TYPE_CHECKING:
    from looprl.report.compare_read import Run

TRAINING_PLOT = "compare_training.png"
HELD_OUT_PLOT = "compare_held_out.png"
# one colour per run, the first run (the reference of every difference) in blue
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2")
LINESTYLES = ("-", "--", ":", "-.")  # runs whose curves coincide stay visible


def plot_training(runs: list[Run], path: Path) -> Path | None:
    """`rollout/rewards_mean` and `response_len` per step, one line per run (EMA, the raw
    points faint behind it); None when no run logged a step."""
    if not any(run.rows for run in runs):
        return None
    from matplotlib.ticker import MaxNLocator

    panels = (
        ("rollout/rewards_mean", "reward (training rollouts)"),
        ("response_len", "response length (tokens)"),
    )
    fig = _figure(figsize=(9.5, 3.6))
    for ax, (key, label) in zip(fig.subplots(1, 2), panels):
        for i, run in enumerate(runs):
            steps = [finite(r.get("step")) for r in run.rows]
            raw = [finite(r.get(key)) for r in run.rows]
            ax.plot(steps, raw, color=_color(i), alpha=0.25, marker="o", markersize=2)
            ax.plot(
                steps,
                ema(raw),
                color=_color(i),
                linestyle=_linestyle(i),
                linewidth=2,
                label=run.name,
            )
        ax.set_title(f"{key} (EMA, β = 0.7)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def plot_held_out(runs: list[Run], path: Path) -> Path | None:
    """Each run's held-out curve (eval.every) with its 95% band; None when no run has one."""
    if not any(run.curve for run in runs):
        return None
    from matplotlib.ticker import MaxNLocator

    fig = _figure(figsize=(7.5, 3.6))
    ax = fig.subplots()
    for i, run in enumerate(runs):
        if not run.curve:
            continue
        steps = [r["step"] for r in run.curve]
        ci = [list(r.get("reward_ci95") or [math.nan, math.nan]) for r in run.curve]
        ax.fill_between(
            steps,
            [finite(c[0]) for c in ci],
            [finite(c[1]) for c in ci],
            color=_color(i),
            alpha=0.15,
        )
        means = [finite(r.get("reward_mean")) for r in run.curve]
        ax.plot(
            steps,
            means,
            color=_color(i),
            linestyle=_linestyle(i),
            marker="o",
            linewidth=2,
            label=run.name,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward")
    ax.set_title("held-out reward over the steps, 95% CI bands", fontsize=10)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _linestyle(i: int) -> str:
    return LINESTYLES[i % len(LINESTYLES)]


def plot_blocks(runs: list[Run], plots: Path) -> list[tuple]:
    """The overlaid curves; a plot from an earlier comparison in the same folder is removed
    first, so none is left stale."""
    for name in (TRAINING_PLOT, HELD_OUT_PLOT):
        (plots / name).unlink(missing_ok=True)
    blocks: list[tuple] = [("h2", "Training curves")]
    training = plot_training(runs, plots / TRAINING_PLOT)
    if training is None:
        blocks.append(("p", "No run logged a training step (metrics.jsonl missing or empty)."))
    else:
        caption = "Training reward and response length per step, per run"
        blocks += [
            (
                "p",
                "Training rollouts at the training temperature on training tasks: "
                "not comparable one-to-one with the held-out numbers.",
            ),
            ("img", training, caption),
        ]
    held_out = plot_held_out(runs, plots / HELD_OUT_PLOT)
    if held_out is not None:
        without = [run.name for run in runs if not run.curve]
        blocks += [
            ("h2", "Held-out curves"),
            (
                "p",
                "Held-out reward at the steps of each run's eval.every, on the same "
                "episodes at every point"
                + (f" ({', '.join(without)}: no curve, eval.every was off)." if without else "."),
            ),
            ("img", held_out, "Held-out reward per evaluated step, per run"),
        ]
    return blocks
