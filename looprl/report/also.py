"""The report's "Did anything else change?" section: each `eval.also` env (other envs,
evaluated before and after training on the same fixed episodes, loop/also.py) with its
reward before and after and the paired difference, and the warning `training lowered
KEY` when that difference's 95% CI lies below zero.

Read from the run folder's eval/also/KEY/{baseline,final}.json, so `looprl report` and
`looprl compare` rebuild it from any run."""

from __future__ import annotations

from pathlib import Path

from looprl.report.comparisons import load_eval
from looprl.report.stats import Paired, paired_stats, reward_with_ci

ALSO = ("eval", "also")  # RUN/eval/also/KEY/NAME.json


def read_also(run_dir: Path, name: str) -> dict[str, dict]:
    """Each eval.also entry's eval NAME (baseline or final) kept in the run folder, by key
    (sorted; an unreadable file is left out)."""
    folder = run_dir.joinpath(*ALSO)
    if not folder.is_dir():
        return {}
    found = {}
    for entry in sorted(p for p in folder.iterdir() if p.is_dir()):
        result = load_eval(entry / f"{name}.json")
        if result is not None:
            found[entry.name] = result
    return found


def lowered_line(key: str, baseline: dict, final: dict) -> str | None:
    """'training lowered KEY: ...' when the paired difference's CI lies below zero."""
    paired = paired_stats(baseline, final)
    if isinstance(paired, str) or paired.hi >= 0:
        return None
    return (
        f"training lowered {key}: its held-out reward went from {reward_with_ci(baseline)} "
        f"to {reward_with_ci(final)}, paired {_short(paired)} over {paired.episodes} "
        "episodes (eval.also): the training changed more than its own env"
    )


def also_warnings(run_dir: Path) -> list[str]:
    """The `training lowered KEY` lines of a finished run, one per entry that fell."""
    before, after = read_also(run_dir, "baseline"), read_also(run_dir, "final")
    lines = [lowered_line(key, before[key], after[key]) for key in after if key in before]
    return [line for line in lines if line]


def also_rows(run_dir: Path) -> list[list[str]]:
    """One row per entry: key, env, episodes, before, after, paired difference, counts."""
    before, after = read_also(run_dir, "baseline"), read_also(run_dir, "final")
    rows = []
    for key, base in before.items():
        final = after.get(key)
        cells = [key, str(base.get("env")), str((final or base).get("n", "?"))]
        if final is None:
            rows.append([*cells, reward_with_ci(base), "-", "no final eval", "-"])
            continue
        paired = paired_stats(base, final)
        if isinstance(paired, str):
            rows.append([*cells, reward_with_ci(base), reward_with_ci(final), paired, "-"])
            continue
        counts = f"{paired.better} / {paired.same} / {paired.worse}"
        rows.append([*cells, reward_with_ci(base), reward_with_ci(final), _short(paired), counts])
    return rows


def also_blocks(run_dir: Path) -> list[tuple]:
    """The section (nothing when the run has no eval.also results); its warnings are at
    the report's top (`also_warnings`)."""
    rows = also_rows(run_dir)
    if not rows:
        return []
    return [
        ("h2", "Did anything else change?"),
        (
            "p",
            "Other environments (`eval.also`), each on its own held-out episodes, the same "
            "tasks and sampling seeds before and after training: the paired difference "
            "(after − before) with its bootstrap 95% CI over whole tasks; better / same / "
            "worse counts the episodes whose reward rose, stayed or fell.",
        ),
        (
            "table",
            [
                "key",
                "env",
                "episodes",
                "before",
                "after",
                "paired difference",
                "better / same / worse",
            ],
            rows,
        ),
    ]


def _short(paired: Paired) -> str:
    return f"{paired.mean:+.3f} [95% CI {paired.lo:+.3f}, {paired.hi:+.3f}]"
