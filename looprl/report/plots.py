"""How the report looks: its PNG plots (training curves, before/after reward with CIs,
outcome shares) and the Markdown and HTML pages rendered from report.py's blocks.

Figures are built with `matplotlib.figure.Figure` directly rather than through pyplot: no
global figure state, no GUI backend, and a PNG is rendered with Agg whatever backend the
user configured. Every function takes plain numbers, so it is testable without a run.
"""

from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


BEFORE_COLOR = "#8c8c8c"
AFTER_COLOR = "#1f77b4"
AFTER_SFT_COLOR = "#9ecae1"  # a lighter shade of AFTER_COLOR: the way there
DPI = 110


def finite(value: Any) -> float:
    """A metric value as a float; None, strings and non-finite numbers become NaN."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def ema(values: list[float], beta: float = 0.7) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard smooths), so the
    first points are not dragged towards zero. NaN points are skipped: they keep the
    previous smoothed value instead of poisoning every later one."""
    out: list[float] = []
    acc, weight = 0.0, 0.0
    for v in values:
        if not math.isnan(v):
            acc = beta * acc + (1 - beta) * v
            weight = beta * weight + (1 - beta)
        out.append(acc / weight if weight else math.nan)
    return out


def plot_curves(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """`rollout/rewards_mean`, `response_len` and, when logged, `rollout/entropy` and
    `rollout/decision_entropy` against step, raw and smoothed. Returns None (and writes
    nothing) when no step was logged."""
    if not rows:
        return None
    from matplotlib.ticker import MaxNLocator

    steps = [finite(r.get("step")) for r in rows]
    panels = [
        ("rollout/rewards_mean", "reward (training rollouts)"),
        ("response_len", "response length (tokens)"),
    ]
    if any("rollout/entropy" in r for r in rows):
        panels.append(("rollout/entropy", "nats per generated token"))
    if any("rollout/decision_entropy" in r for r in rows):
        panels.append(("rollout/decision_entropy", "nats per decision token"))
    fig = _figure(figsize=(4.5 * len(panels), 3.4))
    for ax, (key, label) in zip(fig.subplots(1, len(panels)), panels):
        raw = [finite(r.get(key)) for r in rows]
        ax.plot(steps, raw, color=AFTER_COLOR, alpha=0.35, marker="o", markersize=3, label="raw")
        ax.plot(steps, ema(raw), color=AFTER_COLOR, linewidth=2, label="EMA (β = 0.7)")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if all(math.isnan(v) for v in raw):
            ax.text(0.5, 0.5, "no finite values", ha="center", transform=ax.transAxes)
        ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def plot_before_after(
    before: tuple[float, float, float],
    after: tuple[float, float, float],
    paired: tuple[float, float, float] | None,
    path: Path,
    after_sft: tuple[float, float, float] | None = None,
) -> Path:
    """Left: reward mean before and after with 95% CI error bars, and after the SFT warm
    start between them when the run had one. Right: the paired difference (after −
    before) with its bootstrap CI, on its own axis around zero."""
    bars = [("before", before, BEFORE_COLOR)]
    if after_sft is not None:
        bars.append(("after SFT", after_sft, AFTER_SFT_COLOR))
    bars.append(("after", after, AFTER_COLOR))
    fig = _figure(figsize=(9 + 1.5 * (len(bars) - 2), 3.4))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [len(bars), 1.5]})
    for x, (_, (mean, lo, hi), color) in enumerate(bars):
        left.bar(x, _zero_if_nan(mean), color=color, width=0.6)
        if not math.isnan(mean):
            left.errorbar(x, mean, yerr=_yerr(mean, lo, hi), color="black", capsize=6)
            left.annotate(f"{mean:+.3f}", (x, mean), xytext=(12, 4), textcoords="offset points")
    left.set_xticks(range(len(bars)), [name for name, _, _ in bars])
    left.axhline(0, color="black", linewidth=0.8)
    left.set_ylabel("held-out reward mean")
    left.set_title("reward mean, 95% CI", fontsize=10)
    left.grid(axis="y", alpha=0.3)

    right.axhline(0, color="black", linewidth=0.8)
    right.set_xticks([0], ["after − before"])
    right.set_title("paired difference, 95% bootstrap CI", fontsize=10)
    right.grid(axis="y", alpha=0.3)
    if paired is None:
        right.text(0.5, 0.5, "not available", ha="center", transform=right.transAxes)
    else:
        mean, lo, hi = paired
        right.errorbar(0, mean, yerr=_yerr(mean, lo, hi), fmt="o", color=AFTER_COLOR, capsize=8)
        right.annotate(f"{mean:+.3f}", (0, mean), xytext=(12, 4), textcoords="offset points")
        right.set_xlim(-1, 1)
    return _save(fig, path)


def plot_outcomes(
    sides: list[tuple[str, dict[str, float]]], path: Path, solved: tuple[str, ...] = ()
) -> Path:
    """Stacked horizontal bars of the outcome shares, one bar per side ("before",
    "after"); every label seen on either side gets a segment (0 where absent). Colours
    carry meaning (`outcome_colors`): successes first, in greens, failures last."""
    labels = sorted(
        {label for _, shares in sides for label in shares},
        key=lambda label: (_outcome_kind(label, solved), label),
    )
    fig = _figure(figsize=(9, 1.2 + 0.6 * len(sides)))
    ax = fig.subplots()
    colors = outcome_colors(labels, solved)
    names = [name for name, _ in sides]
    starts = [0.0] * len(sides)
    for label, color in zip(labels, colors):
        widths = [_zero_if_nan(finite(shares.get(label, 0.0))) for _, shares in sides]
        ax.barh(names, widths, left=starts, color=color, label=label, edgecolor="white")
        for y, (x0, w) in enumerate(zip(starts, widths)):
            if w >= 0.06:  # label only segments wide enough to hold the text
                ax.text(x0 + w / 2, y, f"{w:.0%}", ha="center", va="center", fontsize=8)
        starts = [s + w for s, w in zip(starts, widths)]
    ax.set_xlim(0, max([1.0, *starts]))
    ax.invert_yaxis()  # "before" on top, reading downwards
    ax.set_xlabel("share of held-out episodes")
    ax.legend(
        ncol=max(1, min(len(labels), 6)),
        fontsize=8,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        frameon=False,
    )
    return _save(fig, path)


def _yerr(mean: float, lo: float, hi: float) -> list[list[float]]:
    # matplotlib wants non-negative distances below and above the point
    return [[max(0.0, _zero_if_nan(mean - lo))], [max(0.0, _zero_if_nan(hi - mean))]]


def _zero_if_nan(value: float) -> float:
    return 0.0 if math.isnan(value) else value


# Outcome colours by meaning: solved outcomes green, in-between ones amber, wrong answers
# red, and output that never reached the task (malformed calls, truncation, env errors) grey.
SUCCESS = ("win", "optimal", "success", "exact", "all_passed", "solved")
MIDDLE = ("draw", "legal", "partial", "no_change")
FAILURE = ("loss", "illegal", "wrong", "wrong_side_effect", "none_passed")
SHADES = {
    0: ["#1a9850", "#66bd63", "#a6d96a", "#006837"],  # greens
    1: ["#fdae61", "#fee08b", "#e6c229", "#f4a03c"],  # ambers
    2: ["#d73027", "#a50026", "#f46d43", "#e34a6f"],  # reds
    3: ["#7f7f7f", "#a6a6a6", "#c8c8c8", "#595959"],  # greys
}


def _outcome_kind(label: str, solved: tuple[str, ...] = ()) -> int:
    """0 success, 1 in between, 2 wrong, 3 never reached the task (or unknown)."""
    if label in solved or label in SUCCESS:
        return 0
    if label in MIDDLE:
        return 1
    return 2 if label in FAILURE else 3


def outcome_colors(labels: list[str], solved: tuple[str, ...] = ()) -> list[str]:
    """One colour per label: the next shade of its kind's family (`_outcome_kind`)."""
    used = {kind: 0 for kind in SHADES}
    colors = []
    for label in labels:
        kind = _outcome_kind(label, solved)
        shades = SHADES[kind]
        colors.append(shades[used[kind] % len(shades)])
        used[kind] += 1
    return colors


def _figure(**kwargs: Any) -> Figure:
    # imported here: matplotlib is only needed once a report is written
    from matplotlib.figure import Figure

    return Figure(dpi=DPI, layout="constrained", **kwargs)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ============================================================================ pages


# A report is a list of blocks: ("h1" | "h2" | "h3" | "p" | "warn" | "code", text),
# ("table", header, rows), ("img", png_path, caption) and ("transcripts", [(task_id,
# prompt, before, after)])
# where before/after are (headline, [(role, text), ...]). Text is plain: the renderers
# escape it, never the caller.


def render_markdown(blocks: list[tuple]) -> str:
    """report.md: images are linked from plots/, transcripts go in fenced code blocks."""
    out: list[str] = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out += [f"{'#' * int(kind[1])} {rest[0]}", ""]
        elif kind == "p":
            out += [rest[0], ""]
        elif kind == "warn":
            out += [f"> **Warning:** {rest[0]}", ""]
        elif kind == "code":
            out += [_fence(rest[0]), rest[0], _fence(rest[0]), ""]
        elif kind == "table":
            head, rows = rest
            out += [_md_row(head), _md_row(["---"] * len(head)), *map(_md_row, rows), ""]
        elif kind == "img":
            out += [f"![{rest[1]}](plots/{rest[0].name})", ""]
        elif kind == "transcripts":
            for task, prompt, *sides in rest[0]:
                out += [f"### Task {task}", "", _fence(prompt), prompt, _fence(prompt), ""]
                for name, (head, lines) in zip(("Before", "After"), sides):
                    body = "\n".join(f"[{role}]\n{text}" for role, text in lines)
                    out += [f"**{name}**: {head}", "", _fence(body), body, _fence(body), ""]
    return "\n".join(out)


def _fence(text: str) -> str:
    # a fence longer than any backtick run inside, so model text cannot close it
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def render_html(blocks: list[tuple], title: str) -> str:
    """One HTML file that reads offline: its CSP forbids scripts and every fetch."""
    e = html.escape
    body: list[str] = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{e(rest[0])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{e(rest[0])}</p>")
        elif kind == "warn":
            body.append(f'<p class="warn"><strong>Warning:</strong> {e(rest[0])}</p>')
        elif kind == "code":
            body.append(f"<pre>{e(rest[0])}</pre>")
        elif kind == "table":
            head, rows = rest
            cells = "".join(f"<th>{e(h)}</th>" for h in head)
            trs = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
            body.append(f"<table><thead><tr>{cells}</tr></thead><tbody>{trs}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(rest[0].read_bytes()).decode("ascii")
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{e(rest[1])}">'
                f"<figcaption>{e(rest[1])}</figcaption></figure>"
            )
        elif kind == "transcripts":
            trs = "".join(
                f"<tr><td><b>{e(task)}</b><pre>{e(prompt)}</pre></td>"
                + "".join(_html_side(head, lines) for head, lines in sides)
                + "</tr>"
                for task, prompt, *sides in rest[0]
            )
            body.append(
                '<table class="transcripts"><thead><tr><th>task</th><th>before</th>'
                f"<th>after</th></tr></thead><tbody>{trs}</tbody></table>"
            )
    return HTML_PAGE.format(title=e(title), body="\n".join(body))


def _html_side(head: str, lines: list[tuple[str, str]]) -> str:
    msgs = "".join(
        f'<div class="role">{html.escape(role)}</div><pre>{html.escape(text)}</pre>'
        for role, text in lines
    )
    return f'<td><div class="head">{html.escape(head)}</div>{msgs}</td>'


HTML_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
      content="default-src 'none'; img-src data:; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font: 15px/1.45 system-ui, sans-serif; color: #222; margin: 0; background: #fafafa; }}
main {{ max-width: 1100px; margin: 0 auto; padding: 1.5em 2em; background: #fff; }}
h1 {{ font-size: 1.5em; }} h2 {{ margin-top: 1.8em; border-bottom: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 0.8em 0; }}
th, td {{ border: 1px solid #ddd; padding: 0.3em 0.7em; text-align: left; vertical-align: top; }}
th {{ background: #f2f2f2; }}
figure {{ margin: 1em 0; }} figure img {{ max-width: 100%; height: auto; }}
figcaption {{ color: #666; font-size: 0.9em; }}
.warn {{ background: #fdecea; border-left: 4px solid #d73027; padding: 0.5em 0.8em; }}
pre {{ white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f6f6; margin: 0.2em 0;
       padding: 0.4em 0.6em; font-size: 0.85em; }}
table.transcripts {{ width: 100%; table-layout: fixed; }}
.transcripts .head {{ font-weight: 600; }} .transcripts .role {{ color: #777; font-size: 0.8em; }}
</style>
</head>
<body>
<main>
{body}
</main>
</body>
</html>
"""
