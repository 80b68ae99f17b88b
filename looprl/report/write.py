"""The before/after report of a run: `report.md`, a self-contained `report.html` (plots
embedded as data URIs, inline CSS, nothing fetched) and `plots/*.png`.

Everything comes from the run folder contract (eval/*.json, metrics.jsonl, samples/), so
`looprl report RUN` can rebuild the report of any run, finished or stopped. Baseline and
final evaluation play the same episodes in the same order, so the headline number is the
paired difference, with a bootstrap CI that resamples whole tasks: the episodes of one
task share a board and are not independent of each other.

Both formats are rendered (in looprl/report/plots.py) from one list of blocks, so they cannot
disagree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from looprl.config import Config, load_config
from looprl.errors import ConfigError
from looprl.report.also import also_blocks, also_warnings
from looprl.report.comparisons import member_blocks, reference_blocks, teacher_blocks
from looprl.report.curve import PLOT as CURVE_PLOT
from looprl.report.curve import curve_blocks
from looprl.report.failures_page import failure_section
from looprl.report.health import run_warnings
from looprl.report.plots import finite, render_html, render_markdown
from looprl.report.rl_stage import rl_stage_blocks
from looprl.report.solved import hacking_flag, solved_text
from looprl.report.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    Paired,
    fmt,
    mean_ci,
    paired_stats,
    reward_with_ci,
)
from looprl.report.transcripts import first_by_task, read_jsonl, shown_prompt, transcript_side

TRANSCRIPT_TASKS = 4
PLOTS = ("before_after.png", "outcomes.png", "training_curves.png", CURVE_PLOT)

# ============================================================================ run folder


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list of dicts; a missing file or a torn last line is no step."""
    return read_jsonl(run_dir / "metrics.jsonl") or []


def _load_eval(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(result, dict):
        raise ConfigError(f"{path} does not hold an EvalResult object")
    return result


def regenerate_report(run_dir: Path) -> Path:
    """`looprl report RUN`: rebuild the report from the run folder. The run's wall clock
    is not stored, so the time shown is the training time (sum of `perf/step_s`) and the
    memory is the largest `perf/peak_rss_gb` logged."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run folder (no config.yaml)")
    baseline = _load_eval(run_dir / "eval" / "baseline.json")
    if baseline is None:
        raise ConfigError(
            f"{run_dir} has no eval/baseline.json: the run stopped before its baseline "
            "evaluation, so there is nothing to report"
        )
    cfg = load_config(run_dir / "config.yaml")
    final = _load_eval(run_dir / "eval" / "final.json")
    rows = read_metrics(run_dir)
    step_s = [x for x in (finite(r.get("perf/step_s")) for r in rows) if not math.isnan(x)]
    rss = [x for x in (finite(r.get("perf/peak_rss_gb")) for r in rows) if not math.isnan(x)]
    return write_report(
        run_dir,
        cfg,
        baseline,
        final,
        sum(step_s) if step_s else None,
        max(rss) if rss else None,
        wall_label="training time (sum of perf/step_s)",
    )


# ============================================================================ the report


def write_report(
    run_dir: Path,
    cfg: Config,
    baseline: dict,
    final: dict | None,
    wall_s: float | None,
    peak_rss: float | None,
    *,
    wall_label: str = "wall-clock",
) -> Path:
    """Write RUN/report.md, RUN/report.html and RUN/plots/*.png; return report.md's path.
    `final` is None for a run that stopped before its retest (a partial report)."""
    from looprl.report.plots import plot_before_after, plot_curves, plot_outcomes

    rows = read_metrics(run_dir)
    plots = run_dir / "plots"
    for name in PLOTS:  # a rebuilt report must not leave a stale plot from an earlier one
        (plots / name).unlink(missing_ok=True)
    before = mean_ci(baseline)
    greedy_before = _load_eval(run_dir / "eval" / "baseline_greedy.json")
    sides = [("before", baseline.get("outcomes") or {})]
    greedy = [greedy_before, None]  # the greedy evals before and after, when run
    blocks: list[tuple] = []
    if final is None:
        last = rows[-1] if rows else {}
        blocks += [
            ("h1", f"looprl run (stopped): {cfg.env.name} · {cfg.model.name} · {cfg.algo.name}"),
            (
                "p",
                f"Stopped after step {last.get('step', 0)} of {cfg.train.steps}, before the "
                f"final evaluation · {_time(wall_s, wall_label)} · {_rss(peak_rss)}.",
            ),
            *[("warn", text) for text in run_warnings(rows, {"baseline eval": baseline})],
            ("p", "Resume with:"),
            ("code", f"looprl run {run_dir}/config.yaml --out {run_dir} --resume"),
            ("h2", f"Baseline (held-out, {baseline.get('n', '?')} episodes)"),
            ("table", ["metric", "before"], _summary_rows([baseline])),
        ]
        if last:
            reward = fmt(last.get("rollout/rewards_mean"), "+.3f")
            blocks.append(("p", f"Last training step: rollout/rewards_mean {reward}"))
    else:
        after = mean_ci(final)
        # with an SFT warm start: baseline → after SFT → after RL, on the same episodes
        mid = _load_eval(run_dir / "eval" / "after_sft.json")
        columns = [baseline, final] if mid is None else [baseline, mid, final]
        headers = (
            ["metric", "before", "after"]
            if mid is None
            else ["metric", "before", "after SFT", "after"]
        )
        if mid is not None:
            sides.append(("after SFT", mid.get("outcomes") or {}))
        sides.append(("after", final.get("outcomes") or {}))
        paired = paired_stats(baseline, final)
        greedy = [greedy_before, _load_eval(run_dir / "eval" / "final_greedy.json")]
        evals = {"baseline eval": baseline, "final eval": final}
        blocks += [
            ("h1", f"looprl run: {cfg.env.name} · {cfg.model.name} · {cfg.algo.name}"),
            ("p", _headline(cfg, wall_s, wall_label, peak_rss)),
            *[("warn", text) for text in run_warnings(rows, evals) + also_warnings(run_dir)],
            *_flags(baseline, final, greedy),
            ("h2", "Before / after"),
            (
                "p",
                f"Held-out evaluation on the same {final.get('n', '?')} episodes (task seed "
                f"{final.get('task_seed', '?')}, eval temperature {cfg.eval.temperature}).",
            ),
            ("table", headers, _summary_rows(columns)),
            ("p", _paired_text(paired)),
            *rl_stage_blocks(mid, final),  # with an SFT warm start: the RL steps' own effect
            *[("p", text) for text in [solved_text(baseline, final)] if text],
            *_greedy_blocks(*greedy, _load_eval(run_dir / "eval" / "after_sft_greedy.json")),
            *teacher_blocks(
                run_dir, cfg.algo.teacher, baseline, final, _summary_rows, _paired_text
            ),
            *reference_blocks(cfg.eval.references, baseline, final, _summary_rows, _paired_text),
            *member_blocks(baseline, final),
            *also_blocks(run_dir),  # eval.also: did anything else change?
        ]
        png = plot_before_after(
            before,
            after,
            None if isinstance(paired, str) else (paired.mean, paired.lo, paired.hi),
            plots / "before_after.png",
            after_sft=None if mid is None else mean_ci(mid),
        )
        caption = "Held-out reward before" + (", after SFT" if mid is not None else "")
        blocks.append(("img", png, f"{caption} and after, and the paired difference"))
    solved = tuple(baseline.get("solved_outcomes") or ())
    outcomes_png = plot_outcomes(sides, plots / "outcomes.png", solved)
    blocks.append(("img", outcomes_png, "Outcome shares"))
    if final is not None:
        blocks += failure_section(run_dir, baseline, final, (greedy[0], greedy[1]))

    blocks.append(("h2", "Training curves"))
    curves = plot_curves(rows, plots / "training_curves.png")
    if curves is None:
        blocks.append(("p", "No training step was logged (metrics.jsonl is missing or empty)."))
    else:
        blocks.append(
            (
                "p",
                f"{len(rows)} steps logged of {cfg.train.steps} configured. "
                "Training rollouts at the training temperature on training tasks: "
                "not comparable one-to-one with the held-out numbers.",
            )
        )
        blocks.append(("img", curves, "Training reward and response length per step"))
    blocks += curve_blocks(run_dir, rows)  # eval.every: the held-out curve

    blocks += [
        ("h2", "Run facts"),
        (
            "table",
            ["fact", "value"],
            _facts(cfg, rows, wall_s, wall_label, peak_rss, baseline, greedy_before),
        ),
    ]
    if final is not None:
        blocks += [("h2", "Transcripts: the same tasks before and after"), *_transcripts(run_dir)]

    # utf-8 whatever the locale: the pages hold ·, ×, − and model text
    md_path = run_dir / "report.md"
    md_path.write_text(render_markdown(blocks), encoding="utf-8")
    page = render_html(blocks, title=blocks[0][1])
    (run_dir / "report.html").write_text(page, encoding="utf-8")
    return md_path


def _flags(baseline: dict, final: dict, greedy: list[dict | None]) -> list[tuple]:
    """The warnings shown at the top: a reward that rose without more solved episodes."""
    flags = [hacking_flag(baseline, final)]
    if greedy[0] is not None and greedy[1] is not None:
        flags.append(hacking_flag(greedy[0], greedy[1], what="greedy (T = 0) reward"))
    return [("warn", flag) for flag in flags if flag]


def _greedy_blocks(before: dict | None, after: dict | None, mid: dict | None = None) -> list[tuple]:
    """The greedy policy (T = 0, one episode per task) before and after, if evaluated;
    `mid`, after an SFT warm start, as a column between them."""
    if before is None or after is None:
        return []
    headers, sides = ["metric", "before", "after"], [before, after]
    if mid is not None:
        headers, sides = ["metric", "before", "after SFT", "after"], [before, mid, after]
    blocks = [
        ("h2", "Greedy policy (T = 0)"),
        (
            "p",
            f"{after.get('n', '?')} held-out tasks (task seed {after.get('task_seed', '?')}), "
            "one greedy episode each, the same before and after: what the policy does when it "
            "takes its most likely token every time.",
        ),
        ("table", headers, _summary_rows(sides)),
        ("p", _paired_text(paired_stats(before, after))),
        *rl_stage_blocks(mid, after, " at T = 0"),
    ]
    text = solved_text(before, after)
    return blocks + ([("p", text)] if text else [])


def _summary_rows(sides: list[dict]) -> list[list[str]]:
    labels = sorted({label for r in sides for label in r.get("outcomes") or {}})
    rows = [
        ["reward mean [95% CI]", *(reward_with_ci(r) for r in sides)],
        ["valid tool-call rate", *(fmt(r.get("valid_tool_call_rate"), ".1%") for r in sides)],
        ["response_len (tokens)", *(fmt(r.get("response_len"), ".1f") for r in sides)],
    ]
    for label in labels:
        shares = [fmt((r.get("outcomes") or {}).get(label, 0.0), ".1%") for r in sides]
        rows.append([f"outcome: {label}", *shares])
    return rows + [["episodes", *(str(r.get("n", "?")) for r in sides)]]


def _paired_text(paired: Paired | str) -> str:
    if isinstance(paired, str):
        return f"Paired difference not computed: {paired}."
    return (
        f"Paired difference (after − before, episode by episode): {paired.mean:+.3f} "
        f"[95% CI {paired.lo:+.3f}, {paired.hi:+.3f}], bootstrap over {paired.tasks} tasks "
        f"({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}). Of {paired.episodes} "
        f"episodes {paired.better} scored higher, {paired.same} the same, {paired.worse} lower."
    )


def _time(wall_s: float | None, label: str) -> str:
    if wall_s is None:
        return f"{label} unknown"
    return f"{label} {wall_s:.0f} s" if wall_s < 120 else f"{label} {wall_s / 60:.1f} min"


def _rss(peak_rss: float | None) -> str:
    return "peak RSS unknown" if peak_rss is None else f"peak RSS {peak_rss:.2f} GB"


def _headline(cfg: Config, wall_s: float | None, wall_label: str, peak: float | None) -> str:
    return (
        f"{cfg.train.steps} steps · {cfg.rollout.tasks_per_step} tasks × "
        f"{_group(cfg)} per step · lr {cfg.train.lr} · "
        f"{_time(wall_s, wall_label)} · {_rss(peak)}"
    )


def _group(cfg: Config) -> str:
    """A group's members: samples, the greedy episode of algo.greedy_samples, and the
    expert episodes of algo.expert_samples."""
    k, g = cfg.algo.expert_samples, cfg.algo.greedy_samples
    if not k and not g:
        return f"{cfg.rollout.group_size} samples"
    parts = [f"{cfg.rollout.group_size - k - g} samples"]
    if g:
        parts.append(f"{g} greedy")
    if k:
        parts.append(f"{k} expert demonstration{'s' if k > 1 else ''}")
    return f"({' + '.join(parts)})"


def _facts(
    cfg: Config,
    rows: list,
    wall_s: float | None,
    wall_label: str,
    peak: float | None,
    base: dict,
    greedy: dict | None = None,
) -> list[list[str]]:
    lora = cfg.model.lora
    greedy_row = [["greedy eval", f"{greedy.get('n', '?')} tasks × 1, T = 0"]] if greedy else []
    return [
        [
            "environment",
            f"{cfg.env.name} {json.dumps(cfg.env.args) if cfg.env.args else ''}".strip(),
        ],
        ["model", f"{cfg.model.name} ({f'LoRA r={lora.rank}' if lora.enabled else 'full'})"],
        ["algorithm", cfg.algo.name],
        ["steps", f"{len(rows)} logged of {cfg.train.steps} configured"],
        ["learning rate", f"{cfg.train.lr} ({cfg.train.lr_schedule})"],
        ["tasks × group", f"{cfg.rollout.tasks_per_step} × {_group(cfg)}"],
        [
            "held-out eval",
            f"{base.get('n', '?')} episodes: {cfg.eval.tasks} tasks × "
            f"{cfg.eval.samples_per_task}, T = {cfg.eval.temperature}",
        ],
        *greedy_row,
        [wall_label, "unknown" if wall_s is None else f"{wall_s:.0f} s ({wall_s / 60:.1f} min)"],
        ["peak memory", _rss(peak)],
        ["seed", str(cfg.seed)],
    ]


# ============================================================================ transcripts
# (one episode as shown: looprl/report/transcripts.py)


def _transcripts(run_dir: Path) -> list[tuple]:
    """Up to TRANSCRIPT_TASKS tasks, first episode of each, before next to after. Tasks
    whose outcome or reward changed come first (in eval order), then unchanged ones."""
    before = read_jsonl(run_dir / "samples" / "baseline.jsonl")
    after = read_jsonl(run_dir / "samples" / "final.jsonl")
    if not before or not after:
        return [("p", "Skipped: samples/baseline.jsonl or samples/final.jsonl is missing.")]
    first_before, first_after = first_by_task(before), first_by_task(after)
    common = [t for t in first_before if t in first_after]
    if not common:
        return [("p", "Skipped: the baseline and final samples share no task.")]

    def changed(t: str) -> bool:
        b, a = first_before[t], first_after[t]
        return (b.get("outcome"), b.get("reward")) != (a.get("outcome"), a.get("reward"))

    chosen = ([t for t in common if changed(t)] + [t for t in common if not changed(t)])[
        :TRANSCRIPT_TASKS
    ]
    note = (
        f"{len(chosen)} of {len(common)} tasks, the first episode of each; tasks whose "
        "outcome or reward changed are shown first, in evaluation order."
    )
    pairs = [
        (
            t,
            shown_prompt(first_before[t]),
            transcript_side(first_before[t]),
            transcript_side(first_after[t]),
        )
        for t in chosen
    ]
    return [("p", note), ("transcripts", pairs)]
