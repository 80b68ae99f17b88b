"""What still fails after training, in numbers: each field's share of episodes right before
and after on the same held-out episodes (paired, with the task bootstrap of
`stats.paired_difference`), the episodes still not solved after training, and the episodes
that got worse. Everything is read from the evals' transcripts (`samples/NAME.jsonl`, one
record per episode in play order, the same order as `eval/NAME.json`).

An episode's verdicts come from its `info`, whatever the env, under these keys:
- `fields`: `{name: true/false}`, one verdict per answer field (the `dataset` env's
  `tool_call` and `json_fields` scorers; an env of your own gets the table this way);
- `correct`: `{name: true/false}` (the `extraction` env);
- `scores`: `{scorer: value in [0, 1]}` when there are several scorers (the `dataset` env),
  shown as `scorer NAME`;
- `checks`: `[{kind, passed}]` (the `instructions` env), shown as `check KIND`.
An env whose episodes carry none of these gets no table. A verdict missing from an episode
whose task has it elsewhere (a reply that could not be read, cut at the token limit)
counts as wrong; `env_error` episodes are left out.

The expected answer shown beside the given one is the first of `info.expected`, the row's
`answer` (the `dataset` env's task, kept in each record's `task`), `info.truth`
(`extraction`) and `info.best_moves` (`tictactoe-move`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from looprl.report.plots import finite
from looprl.report.stats import paired_difference
from looprl.types import ENV_ERROR

SHOWN = 120  # characters of an expected or given answer shown in a table cell
# where an episode record keeps the expected answer: (part of the record, key), in order
EXPECTED_AT = (("info", "expected"), ("task", "answer"), ("info", "truth"), ("info", "best_moves"))


@dataclass
class Pair:
    """One held-out episode before and after training (records of samples/*.jsonl)."""

    index: int  # its place in the eval's play order
    task_id: str
    before: dict
    after: dict

    @property
    def drop(self) -> float:
        """before − after reward; above 0 when the episode got worse."""
        return finite(self.before.get("reward")) - finite(self.after.get("reward"))


@dataclass
class FieldRow:
    """One field over the paired episodes whose task has it."""

    name: str
    episodes: int
    before: float  # share right (mean verdict) before
    after: float
    mean: float  # paired after − before, and its 95% bootstrap CI over tasks
    lo: float
    hi: float
    fixed: int  # episodes where it went from wrong to right
    broken: int  # ... from right to wrong


# ============================================================================ reading


def eval_records(records: list[dict] | None, result: dict) -> list[dict] | str:
    """An eval's episode records in play order: the last as many records of its samples
    file as `result` has episodes (a file written twice holds the later eval last), or why
    they cannot be used."""
    ids = [str(t) for t in result.get("task_ids") or []]
    if not records:
        return "no transcripts (samples file missing or empty)"
    if not ids:
        return "the eval file has no per-episode task ids (written by an older looprl)"
    tail = records[-len(ids) :]
    if [str(r.get("task_id")) for r in tail] != ids:
        return "the transcripts do not hold the eval's episodes in its order"
    return tail


def pair_episodes(before: list[dict], after: list[dict]) -> list[Pair] | str:
    """The same episodes before and after, `env_error` ones left out; or why not."""
    if [r.get("task_id") for r in before] != [r.get("task_id") for r in after]:
        return "the two evals did not play the same episodes in the same order"
    return [
        Pair(i, str(b.get("task_id")), b, a)
        for i, (b, a) in enumerate(zip(before, after))
        if ENV_ERROR not in (b.get("outcome"), a.get("outcome"))
    ]


def verdicts(record: dict) -> dict[str, float]:
    """The episode's verdicts (module docstring): name → 1.0 right, 0.0 wrong, or a score."""
    info = record.get("info") or {}
    out: dict[str, float] = {}
    for key in ("fields", "correct"):
        if isinstance(info.get(key), dict):
            out.update({str(k): float(v) for k, v in info[key].items() if isinstance(v, bool)})
    scores = info.get("scores")
    if isinstance(scores, dict) and len(scores) > 1:
        for name, value in scores.items():
            if isinstance(value, int | float) and math.isfinite(value):
                out[f"scorer {name}"] = float(value)
    checks: dict[str, list[float]] = {}
    for check in info.get("checks") or []:
        if isinstance(check, dict) and isinstance(check.get("passed"), bool):
            checks.setdefault(f"check {check.get('kind')}", []).append(float(check["passed"]))
    out.update({name: sum(v) / len(v) for name, v in checks.items()})
    return out


# ============================================================================ the numbers


def task_fields(pairs: list[Pair]) -> dict[str, list[str]]:
    """Per task, the verdict names any of its episodes carries, before or after."""
    fields: dict[str, dict[str, None]] = {}
    for p in pairs:
        names = fields.setdefault(p.task_id, {})
        names.update(dict.fromkeys(verdicts(p.before)))
        names.update(dict.fromkeys(verdicts(p.after)))
    return {task: list(names) for task, names in fields.items()}


def field_rows(pairs: list[Pair]) -> list[FieldRow]:
    """One row per verdict name, the lowest share right after training first; [] when no
    episode carries verdicts."""
    fields = task_fields(pairs)
    values: dict[str, tuple[list[float], list[float], list[str]]] = {}
    for p in pairs:
        before, after = verdicts(p.before), verdicts(p.after)
        for name in fields[p.task_id]:
            b, a, ids = values.setdefault(name, ([], [], []))
            b.append(before.get(name, 0.0))
            a.append(after.get(name, 0.0))
            ids.append(p.task_id)
    rows = []
    for name, (b, a, ids) in values.items():
        mean, lo, hi = paired_difference(b, a, ids) or (math.nan, math.nan, math.nan)
        rows.append(
            FieldRow(
                name,
                len(b),
                sum(b) / len(b),
                sum(a) / len(a),
                mean,
                lo,
                hi,
                fixed=sum(x < y for x, y in zip(b, a)),
                broken=sum(x > y for x, y in zip(b, a)),
            )
        )
    return sorted(rows, key=lambda r: (r.after, r.before, r.name))


def solved(record: dict, labels: list[str]) -> bool:
    """Whether an episode is solved: its outcome is one of the env's solved outcomes;
    without any, every verdict right (an episode without verdicts is then not judged)."""
    if labels:
        return record.get("outcome") in labels
    return all(v >= 1.0 for v in verdicts(record).values())


def wrong_fields(record: dict, names: list[str]) -> list[str]:
    """Of `names` (its task's verdicts), those the episode did not get right."""
    got = verdicts(record)
    return [name for name in names if got.get(name, 0.0) < 1.0]


def still_wrong(pairs: list[Pair], labels: list[str]) -> list[tuple[Pair, int, int]]:
    """Per task with an episode not solved after training: (its lowest-reward such pair,
    its unsolved episodes, its episodes); the lowest reward first, then the most fields
    wrong, then play order."""
    fields = task_fields(pairs)
    by_task: dict[str, list[Pair]] = {}
    for p in pairs:
        by_task.setdefault(p.task_id, []).append(p)
    out = []
    for members in by_task.values():
        wrong = [p for p in members if not solved(p.after, labels)]
        if wrong:
            worst = min(wrong, key=lambda p: finite(p.after.get("reward")))
            out.append((worst, len(wrong), len(members)))

    def key(row: tuple[Pair, int, int]) -> tuple:
        p = row[0]
        return (finite(p.after.get("reward")), -len(wrong_fields(p.after, fields[p.task_id])))

    return sorted(out, key=lambda row: (*key(row), row[0].index))


def got_worse(pairs: list[Pair]) -> list[tuple[Pair, int]]:
    """Per task with an episode whose reward fell: (the pair that fell most, how many of
    its episodes fell); the largest fall first."""
    by_task: dict[str, list[Pair]] = {}
    for p in pairs:
        if p.drop > 0:
            by_task.setdefault(p.task_id, []).append(p)
    out = [(max(fell, key=lambda p: p.drop), len(fell)) for fell in by_task.values()]
    return sorted(out, key=lambda row: (-row[0].drop, row[0].index))


def wrong_field_counts(records: list[dict], fields: dict[str, list[str]]) -> dict[str, int]:
    """Field → how many of `records` got it wrong, the most first."""
    counts: dict[str, int] = {}
    for r in records:
        for name in wrong_fields(r, fields.get(str(r.get("task_id")), [])):
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# ============================================================================ answers as text


def expected_text(record: dict) -> str:
    """The expected answer as shown ('-' when the record keeps none)."""
    for part, key in EXPECTED_AT:
        value = (record.get(part) or {}).get(key)
        if value is not None:
            return _clip(_answer(value))
    return "-"


def given_text(record: dict) -> str:
    """The model's last reply: its tool calls as `name({...})`, else its text."""
    replies = [m for m in record.get("messages") or [] if m.get("role") == "assistant"]
    if not replies:
        return "(no reply)"
    reply = replies[-1]
    functions = [c.get("function") or {} for c in reply.get("tool_calls") or []]
    calls = [_answer({"name": f.get("name"), "arguments": f.get("arguments")}) for f in functions]
    text = " ".join(calls) or str(reply.get("content") or "").strip()
    if reply.get("parse_failure"):
        text = f"[{reply['parse_failure']}] {text}".strip()
    return _clip(text) or "(empty)"


def _answer(value: Any) -> str:
    """A call {name, arguments} as `name({...})`, a string as itself, the rest as JSON."""
    if isinstance(value, dict) and set(value) == {"name", "arguments"}:
        args = value["arguments"]
        if isinstance(args, str):
            return f"{value['name']}({args})"
        return f"{value['name']}({json.dumps(args, ensure_ascii=False)})"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN else text[: SHOWN - 1] + "…"
