"""The before/after report of a run: `report.md` (more formats come with `looprl report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from looprl.config import Config


def _row(name: str, before: Any, after: Any) -> str:
    return f"| {name} | {before} | {after} |"


def _reward(r: dict) -> str:
    lo, hi = r["reward_ci95"]
    return f"{r['reward_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def write_report(
    run_dir: Path, cfg: Config, baseline: dict, final: dict | None, wall_s: float, peak_rss: float
) -> Path:
    """Write RUN/report.md. `final` is None for a run that stopped before its retest."""
    if final is None:
        return _write_partial(run_dir, cfg, baseline, wall_s, peak_rss)
    outcomes = sorted(set(baseline["outcomes"]) | set(final["outcomes"]))
    lines = [
        f"# looprl run: {cfg.env.name} · {cfg.model.name} · {cfg.algo.name}",
        "",
        f"{cfg.train.steps} steps · {cfg.rollout.tasks_per_step} tasks × {cfg.rollout.group_size} "
        f"samples per step · lr {cfg.train.lr} · wall-clock {wall_s / 60:.1f} min · "
        f"peak RSS {peak_rss:.2f} GB",
        "",
        f"Held-out evaluation on the same {final['n']} episodes (task seed {final['task_seed']}, "
        f"eval temperature {cfg.eval.temperature}).",
        "",
        "| metric | before | after |",
        "|---|---|---|",
        _row("reward mean [95% CI]", _reward(baseline), _reward(final)),
        _row(
            "valid tool-call rate",
            f"{baseline['valid_tool_call_rate']:.1%}",
            f"{final['valid_tool_call_rate']:.1%}",
        ),
        _row(
            "response_len (tokens)",
            f"{baseline['response_len']:.1f}",
            f"{final['response_len']:.1f}",
        ),
    ]
    for o in outcomes:
        lines.append(
            _row(
                f"outcome: {o}",
                f"{baseline['outcomes'].get(o, 0):.1%}",
                f"{final['outcomes'].get(o, 0):.1%}",
            )
        )
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_partial(
    run_dir: Path, cfg: Config, baseline: dict, wall_s: float, peak_rss: float
) -> Path:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    last = rows[-1] if rows else None
    lines = [
        f"# looprl run (stopped): {cfg.env.name} · {cfg.model.name} · {cfg.algo.name}",
        "",
        f"Stopped after step {last['step'] if last else 0} of {cfg.train.steps}, before the "
        f"final evaluation · wall-clock {wall_s / 60:.1f} min · peak RSS {peak_rss:.2f} GB.",
        "Resume with `looprl run --out RUN --resume`.",
        "",
        f"Baseline (held-out, {baseline['n']} episodes): reward {_reward(baseline)}",
    ]
    if last:
        lines.append(
            f"Last training step: rollout/rewards_mean {last['rollout/rewards_mean']:+.3f}"
        )
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
