""" "What still fails" in `looprl compare`: each field's share of the final eval's episodes
right in every run, the first run's paired against its own baseline and each other run's
against the first run's; the episodes no run solved; and, per other run, the episodes it
did worse on than the first. Also the few lines the terminal prints of it."""

from __future__ import annotations

from looprl.report.compare_read import Run
from looprl.report.failures import (
    FieldRow,
    Pair,
    expected_text,
    field_rows,
    given_text,
    got_worse,
    pair_episodes,
    solved,
    task_fields,
    wrong_field_counts,
)
from looprl.report.failures_page import FIELDS_SAID, WORSE_SHOWN, plural, pp, samples_of
from looprl.report.plots import finite
from looprl.report.stats import fmt

TITLE = "What still fails (final eval)"
UNSOLVED_SHOWN = 6  # tasks listed as solved by no run


def compare_failures(runs: list[Run]) -> tuple[list[tuple], list[str]]:
    """The page's blocks and the terminal's lines; a note without lines when the
    transcripts cannot be paired."""
    first = runs[0]
    sides: list[list[dict]] = []
    for run, name in [(first, "baseline"), *((run, "final") for run in runs)]:
        side = samples_of(run.path, name, run.evals[name])
        if isinstance(side, str):
            return [("h2", TITLE), ("p", f"Not shown: {side} in {run.path}.")], []
        sides.append(side)
    # the first run's final against its baseline, then each other run's against the first's;
    # an episode that is an env_error in any of these evals is left out of all of them
    pairs: list[list[Pair]] = []
    for run, (before, after) in zip(runs, [sides[:2], *((sides[1], s) for s in sides[2:])]):
        paired = pair_episodes(before, after)
        if isinstance(paired, str):
            return [("h2", TITLE), ("p", f"Not shown: {run.path}: {paired}.")], []
        pairs.append(paired)
    kept = set.intersection(*({p.index for p in side} for side in pairs))
    pairs = [[p for p in side if p.index in kept] for side in pairs]
    labels = list(first.evals["final"].get("solved_outcomes") or [])
    rows = [{r.name: r for r in field_rows(side)} for side in pairs]
    blocks: list[tuple] = [("h2", TITLE)]
    lines: list[str] = []
    if any(rows):
        blocks += _field_table(runs, rows)
        lines += _field_lines(runs, rows)
    if labels or any(rows):
        more, said = _unsolved(runs, sides[1:], labels, task_fields(pairs[0]), sorted(kept))
        blocks += more
        lines.append(said)
    for run, side in zip(runs[1:], pairs[1:]):
        more, said = _worse(runs[0], run, side)
        blocks += more
        lines.append(said)
    return blocks, lines


def _field_names(rows: list[dict[str, FieldRow]]) -> list[str]:
    """The first run's order (its lowest share after training first), then the others'."""
    return list(dict.fromkeys(name for side in rows for name in side))


def _field_table(runs: list[Run], rows: list[dict[str, FieldRow]]) -> list[tuple]:
    first = runs[0].name
    header = ["field", f"before ({first})", first, f"{first} − before [95% CI]"]
    for run in runs[1:]:
        header += [run.name, f"{run.name} − {first} [95% CI]"]
    table = []
    for name in _field_names(rows):
        own = rows[0].get(name)
        cells = [name, _share(own, "before"), _share(own, "after"), _pp(own)]
        for side in rows[1:]:
            cells += [_share(side.get(name), "after"), _pp(side.get(name))]
        table.append(cells)
    note = (
        "Each field's share of the final eval's episodes right, per run; the first run's "
        f"paired against its own baseline, each other run's against {first}'s, episode by "
        "episode, in percentage points (pp) with a bootstrap 95% CI over tasks."
    )
    return [("p", note), ("table", header, table)]


def _share(row: FieldRow | None, side: str) -> str:
    return "-" if row is None else fmt(getattr(row, side), ".1%")


def _pp(row: FieldRow | None) -> str:
    if row is None:
        return "-"
    return pp(row.mean, row.lo, row.hi)


def _field_lines(runs: list[Run], rows: list[dict[str, FieldRow]]) -> list[str]:
    names = _field_names(rows)
    lines = [
        f"what still fails, share of the final eval's episodes right per field ({len(names)}):"
    ]
    for name in names[:FIELDS_SAID]:
        own = rows[0].get(name)
        parts = [f"before {_share(own, 'before')}", f"{runs[0].name} {_share(own, 'after')}"]
        for run, side in zip(runs[1:], rows[1:]):
            row = side.get(name)
            parts.append(
                f"{run.name} {_share(row, 'after')} ({run.name} − {runs[0].name} {_pp(row)})"
            )
        lines.append(f"  {name}: " + " · ".join(parts))
    if len(names) > FIELDS_SAID:
        lines.append(f"  ({len(names) - FIELDS_SAID} more fields in compare.md)")
    return lines


def _unsolved(
    runs: list[Run],
    finals: list[list[dict]],
    labels: list[str],
    fields: dict[str, list[str]],
    kept: list[int],
) -> tuple[list[tuple], str]:
    """The episodes (of `kept`) no run's final eval solved, grouped by task, the lowest best
    reward first."""
    n = len(kept)
    everywhere = [i for i in kept if all(not solved(r[i], labels) for r in finals)]
    counts = wrong_field_counts([finals[0][i] for i in everywhere], fields)
    by_field = ", ".join(f"{name} {k}" for name, k in counts.items())
    said = f"not solved in any run's final eval: {len(everywhere)} of {n} episodes" + (
        f" (the fields {runs[0].name} got wrong on them: {by_field})" if by_field else ""
    )
    if not everywhere:
        return [("p", "Every episode is solved by at least one run.")], said
    by_task: dict[str, list[int]] = {}
    for i in everywhere:
        by_task.setdefault(str(finals[0][i].get("task_id")), []).append(i)

    def best(i: int) -> float:
        return max(finite(r[i].get("reward")) for r in finals)

    worst = sorted(
        ((min(ix, key=best), len(ix)) for ix in by_task.values()), key=lambda t: (best(t[0]), t[0])
    )
    header = ["task: episodes none solved", "expected", *(f"{run.name} gave" for run in runs)]
    table = [
        [f"{finals[0][i].get('task_id')}: {k}", expected_text(finals[0][i])]
        + [f"{given_text(r[i])} ({fmt(r[i].get('reward'), '+.3f')})" for r in finals]
        for i, k in worst[:UNSOLVED_SHOWN]
    ]
    more = "" if len(worst) <= UNSOLVED_SHOWN else f"; {UNSOLVED_SHOWN} of {len(worst)} tasks shown"
    text = (
        f"Not solved in any run's final eval: {len(everywhere)} of {n} episodes"
        + (f"; the fields {runs[0].name} got wrong on them: {by_field}" if by_field else "")
        + f". Each task's episode with the lowest best reward, worst first{more}:"
    )
    return [("p", text), ("table", header, table)], said


def _worse(first: Run, run: Run, pairs: list[Pair]) -> tuple[list[tuple], str]:
    """The episodes `run` scored lower on than the first run, the largest fall first."""
    worse = got_worse(pairs)
    fell = sum(k for _, k in worse)
    said = f"{run.name}: lower reward than {first.name} on {fell} of {len(pairs)} episodes"
    if not worse:
        return [("p", f"{run.name} scored no episode lower than {first.name}.")], said
    header = ["task: episodes lower", f"reward {first.name} → {run.name}", "expected"]
    header += [f"{first.name} gave", f"{run.name} gave"]
    table = [
        [
            f"{p.task_id}: {k}",
            f"{fmt(p.before.get('reward'), '+.3f')} → {fmt(p.after.get('reward'), '+.3f')}",
            expected_text(p.after),
            given_text(p.before),
            given_text(p.after),
        ]
        for p, k in worse[:WORSE_SHOWN]
    ]
    more = "" if len(worse) <= WORSE_SHOWN else f"; {WORSE_SHOWN} of {len(worse)} tasks shown"
    text = (
        f"{run.name} did worse than {first.name} on {fell} of {len(pairs)} episodes (a lower "
        f"reward on the same episode), on {plural(len(worse), 'task')}; the largest fall "
        f"first{more}:"
    )
    return [("p", text), ("table", header, table)], said
