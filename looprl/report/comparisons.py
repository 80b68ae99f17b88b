"""The report's comparisons beyond before/after: on-policy distillation's teacher
(`algo.teacher`, RUN/eval/teacher.json) and reference models (`eval.references`,
EvalResults of `looprl eval --endpoint`) paired against the trained model, and each member
of a mixture (`env.mix`) before and after. `write.py` places the blocks; the table and
paired-difference wording are its own, passed in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from looprl.report.stats import member_results, paired_stats, reward_with_ci


def load_eval(path: Path) -> dict | None:
    """An EvalResult file, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_references(paths: list[str]) -> list[tuple[str, dict | None]]:
    """(path, EvalResult or None when it cannot be read) for each of eval.references."""
    return [(p, load_eval(Path(p))) for p in paths]


def reference_name(result: dict) -> str:
    return str(result.get("model") or "reference")


def reference_blocks(
    paths: list[str], baseline: dict, final: dict, summary_rows: Any, paired_text: Any
) -> list[tuple]:
    """The reference models (`eval.references`) beside before and after, each paired
    against the trained model on the same episodes."""
    if not paths:
        return []
    refs = load_references(paths)
    readable = [r for _, r in refs if r is not None]
    blocks: list[tuple] = [
        ("h2", "Reference models"),
        (
            "p",
            "The same held-out episodes (tasks, order and eval settings) played by each "
            "reference model through its endpoint (`looprl eval --endpoint`).",
        ),
    ]
    if readable:
        headers = ["metric", "before", "after", *(reference_name(r) for r in readable)]
        blocks.append(("table", headers, summary_rows([baseline, final, *readable])))
    for path, ref in refs:
        if ref is None:
            blocks.append(("warn", f"reference {path} could not be read"))
            continue
        paired = paired_stats(ref, final)
        text = paired_text(paired).replace("after − before", f"trained − {reference_name(ref)}")
        blocks.append(("p", text))
    return blocks


def teacher_blocks(
    run_dir: Path,
    teacher: str | None,
    baseline: dict,
    final: dict,
    summary_rows: Any,
    paired_text: Any,
) -> list[tuple]:
    """The teacher's own reward on the same held-out episodes (a distilling run's
    eval/teacher.json) beside before and after, paired against the trained model."""
    result = load_eval(run_dir / "eval" / "teacher.json")
    if result is None:
        return []
    paired = paired_stats(result, final)
    text = paired_text(paired).replace("after − before", "trained − teacher")
    return [
        ("h2", f"Teacher ({teacher})"),
        (
            "p",
            "On-policy distillation's teacher (`algo.teacher`) on the same held-out episodes, "
            "evaluated once: how far the trained student is from it.",
        ),
        (
            "table",
            ["metric", "before", "after", "teacher"],
            summary_rows([baseline, final, result]),
        ),
        ("p", text),
    ]


def member_blocks(baseline: dict, final: dict) -> list[tuple]:
    """Each member of a mix (`env.mix`) before and after, paired on its own episodes."""
    if baseline.get("env") != "mix":
        return []
    before, after = member_results(baseline), member_results(final)
    rows = []
    for label, side in before.items():
        other = after.get(label, {})
        paired = paired_stats(side, other) if other else "not in the final eval"
        change = (
            paired
            if isinstance(paired, str)
            else (f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]")
        )
        rows.append(
            [
                label,
                str(side["n"]),
                reward_with_ci(side),
                reward_with_ci(other) if other else "-",
                change,
            ]
        )
    return [
        ("h2", "By environment"),
        (
            "p",
            "Each member of the mixture on its own held-out episodes; the paired difference "
            "(after − before) with its bootstrap 95% CI.",
        ),
        ("table", ["environment", "episodes", "before", "after", "paired difference"], rows),
    ]
