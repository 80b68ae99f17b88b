""" "What still fails" as blocks of the report (before against after, `failure_section`)
and of `looprl compare` (each run's final against the first run's, `compare_failures`,
with the lines its terminal summary prints). The numbers are failures.py's; the lists are
capped, and say how many more there are."""

from __future__ import annotations

from pathlib import Path

from looprl.report.failures import (
    FieldRow,
    Pair,
    eval_records,
    expected_text,
    field_rows,
    given_text,
    got_worse,
    pair_episodes,
    solved,
    still_wrong,
    task_fields,
    wrong_field_counts,
    wrong_fields,
)
from looprl.report.stats import fmt
from looprl.report.transcripts import read_jsonl

STILL_WRONG_SHOWN = 8  # tasks listed as still wrong after training
WORSE_SHOWN = 5  # tasks listed as got worse
FIELDS_SAID = 6  # fields the terminal summary names

FIELD_NOTE = (
    "Each field's share of episodes right, before and after, on the same episodes; the "
    "paired difference after − before in percentage points (pp) with its bootstrap 95% CI "
    "over tasks; fixed / broken: episodes where the field went from wrong to right / from "
    "right to wrong. A reply that could not be read counts as wrong on every field. The "
    "lowest share after training comes first."
)
GREEDY_NOTE = "The same on the greedy eval's episodes (T = 0, one per task):"


def samples_of(run_dir: Path, name: str, result: dict) -> list[dict] | str:
    """eval/NAME.json's episodes from samples/NAME.jsonl, or why they cannot be read."""
    return eval_records(read_jsonl(run_dir / "samples" / f"{name}.jsonl"), result)


def paired_samples(
    run_dir: Path, names: tuple[str, str], results: tuple[dict, dict]
) -> list[Pair] | str:
    """The two evals' episodes paired, or why not."""
    before = samples_of(run_dir, names[0], results[0])
    after = samples_of(run_dir, names[1], results[1])
    if isinstance(before, str) or isinstance(after, str):
        return before if isinstance(before, str) else str(after)
    pairs = pair_episodes(before, after)
    return pairs if pairs else "no episode was scored both times (every pair had an env_error)"


# ============================================================================ the report


def failure_section(
    run_dir: Path, baseline: dict, final: dict, greedy: tuple[dict | None, dict | None]
) -> list[tuple]:
    """The report's "What still fails": the held-out eval, then the greedy eval if run."""
    parts = [("baseline", "final", baseline, final, "")]
    if greedy[0] is not None and greedy[1] is not None:
        parts.append(("baseline_greedy", "final_greedy", *greedy, "Greedy (T = 0)"))
    blocks: list[tuple] = [("h2", "What still fails")]
    for before_name, after_name, before, after, title in parts:
        if title:
            blocks.append(("h3", title))
        pairs = paired_samples(run_dir, (before_name, after_name), (before, after))
        if isinstance(pairs, str):
            where = f"samples/{before_name}.jsonl and samples/{after_name}.jsonl"
            blocks.append(("p", f"Not shown: {pairs} ({where})."))
            continue
        labels = list(after.get("solved_outcomes") or before.get("solved_outcomes") or [])
        blocks += pair_blocks(pairs, labels, FIELD_NOTE if not title else GREEDY_NOTE)
    return blocks


def pair_blocks(pairs: list[Pair], labels: list[str], note: str = FIELD_NOTE) -> list[tuple]:
    """Per-field table (after `note`), what is still wrong after training, and what got
    worse."""
    rows = field_rows(pairs)
    blocks: list[tuple] = []
    if rows:
        blocks += [("p", note), ("table", FIELD_HEADER, [field_cells(r) for r in rows])]
    if labels or rows:
        blocks += _still_wrong_blocks(pairs, labels, bool(rows))
    else:
        blocks.append(
            (
                "p",
                "The env names no solved outcomes and its episodes carry no verdicts, so no "
                "episode is called wrong; the episodes that got worse follow.",
            )
        )
    return blocks + _worse_blocks(pairs, bool(rows))


FIELD_HEADER = ["field", "episodes", "before", "after", "after − before [95% CI]", "fixed / broken"]


def field_cells(row: FieldRow) -> list[str]:
    return [
        row.name,
        str(row.episodes),
        fmt(row.before, ".1%"),
        fmt(row.after, ".1%"),
        pp(row.mean, row.lo, row.hi),
        f"{row.fixed} / {row.broken}",
    ]


def pp(mean: float, lo: float, hi: float) -> str:
    """A paired difference of shares in percentage points, with its CI."""
    return f"{fmt(mean * 100, '+.1f')} pp [{fmt(lo * 100, '+.1f')}, {fmt(hi * 100, '+.1f')}]"


def _still_wrong_blocks(pairs: list[Pair], labels: list[str], has_fields: bool) -> list[tuple]:
    fields = task_fields(pairs)
    unsolved = [p.after for p in pairs if not solved(p.after, labels)]
    what = f"solved: {', '.join(labels)}" if labels else "solved: every field right"
    if not unsolved:
        return [("p", f"After training every one of the {len(pairs)} episodes is solved ({what}).")]
    counts = wrong_field_counts(unsolved, fields)
    by_field = ", ".join(f"{name} {n}" for name, n in counts.items())
    text = f"After training {len(unsolved)} of {len(pairs)} episodes are not solved ({what})"
    blocks: list[tuple] = [
        ("p", text + (f"; the fields they got wrong: {by_field}." if by_field else "."))
    ]
    wrong = still_wrong(pairs, labels)
    header = ["task: not solved / episodes", "reward before → after", "outcome after"]
    header += ["wrong fields"] * has_fields + ["expected", "given after"]
    table = []
    for p, n_wrong, n in wrong[:STILL_WRONG_SHOWN]:
        row = [f"{p.task_id}: {n_wrong} / {n}", _rewards(p), str(p.after.get("outcome"))]
        if has_fields:
            row.append(", ".join(wrong_fields(p.after, fields[p.task_id])) or "-")
        table.append([*row, expected_text(p.after), given_text(p.after)])
    note = "Still not solved after training, worst first (each task's lowest-reward episode)"
    return [
        *blocks,
        ("p", note + _more(len(wrong), STILL_WRONG_SHOWN, "task")),
        ("table", header, table),
    ]


def _worse_blocks(pairs: list[Pair], has_fields: bool) -> list[tuple]:
    worse = got_worse(pairs)
    fell = sum(n for _, n in worse)
    if not worse:
        return [("p", "No episode got worse: none has a lower reward after than before.")]
    fields = task_fields(pairs)
    header = ["task: fell / episodes", "reward before → after", "outcome before → after"]
    header += ["fields broken"] * has_fields + ["expected", "given before", "given after"]
    per_task = {p.task_id: 0 for p in pairs}
    for p in pairs:
        per_task[p.task_id] += 1
    table = []
    for p, n in worse[:WORSE_SHOWN]:
        row = [f"{p.task_id}: {n} / {per_task[p.task_id]}", _rewards(p)]
        row.append(f"{p.before.get('outcome')} → {p.after.get('outcome')}")
        if has_fields:
            names = fields[p.task_id]
            was_right = set(names) - set(wrong_fields(p.before, names))
            broken = [f for f in wrong_fields(p.after, names) if f in was_right]
            row.append(", ".join(broken) or "-")
        table.append([*row, expected_text(p.after), given_text(p.before), given_text(p.after)])
    text = (
        f"Got worse: {fell} of {len(pairs)} episodes have a lower reward after than before, "
        f"on {plural(len(worse), 'task')}; the largest fall first (each task's episode that "
        "fell most)"
    )
    return [("p", text + _more(len(worse), WORSE_SHOWN, "task")), ("table", header, table)]


def _rewards(p: Pair) -> str:
    return f"{fmt(p.before.get('reward'), '+.3f')} → {fmt(p.after.get('reward'), '+.3f')}"


def plural(n: int, what: str) -> str:
    """'1 task', '2 tasks'."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def _more(total: int, shown: int, what: str) -> str:
    if total <= shown:
        return ":"
    return f"; {shown} of {total} {what}s shown, {total - shown} more:"
