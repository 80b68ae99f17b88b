"""Structured extraction (`extraction`): read a short synthetic document and submit its record.

Three document kinds, each with its own `submit_record` schema: an invoice (invoice_number,
vendor, total, due_date), a contact card (name, email, phone, company) and an event notice
(title, date, city, start_time). The documents (60-120 words, varied layouts and formats,
with distractors) come from `extraction_docs.py`; the answer is always the normalised value
(YYYY-MM-DD, 24-hour HH:MM, a plain number). One turn: the observation's single tool is the
schema of the task's kind.

Grading (`grade`), per field, after normalising: text compares case- and whitespace-
insensitively, phone numbers by their digits, `total` numerically to the cent
(|a - b| < 0.005), dates and times as exact strings. With C the correct fields, S the
submitted ones (non-blank, plus every field that breaks the schema) and T the record's:

    precision = C / S,  recall = C / T,  F1 = 2·P·R / (P + R) = 2C / (S + T)
    reward    = max(-1, F1 - 0.1 · V)          V = schema violations (see below)

Outcomes: `exact` (C = S = T, reward 1), `partial` (0 < C), `wrong` (C = 0, reward 0 less any
penalty), and the parse failures of `looprl.types.PARSE_FAILURES` (reward -1). The chat layer
already rejects calls whose arguments break the schema (`bad_arguments`); should one get
through anyway (validation off, a custom parser), each unexpected key, missing field or value
of the wrong type or format is a violation: the field counts as submitted and wrong, and
costs 0.1.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import jsonschema

from looprl.envs.builtin.extraction_docs import KINDS, make_document
from looprl.envs.common import check_choice, check_int, first_call, in_progress, task_indices
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

TOOL_NAME = "submit_record"
VIOLATION_PENALTY = 0.1

_ISO_DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
_TEXT = {"type": "string"}
# Fields are listed in sorted order: forced decoding (engine/grammar.py) compiles the schema
# with sorted keys, so this is the order a forced call writes them in, and the order the
# demonstrations use too.
FIELDS: dict[str, dict[str, dict[str, Any]]] = {
    "invoice": {
        "due_date": {**_ISO_DATE, "description": "Payment due date, YYYY-MM-DD."},
        "invoice_number": {**_TEXT, "description": "The invoice number exactly as printed."},
        "total": {"type": "number", "description": "Total amount due, tax included, as a number."},
        "vendor": {**_TEXT, "description": "The company that issued the invoice."},
    },
    "contact": {
        "company": {**_TEXT, "description": "The company the person works for now."},
        "email": {**_TEXT, "description": "The person's own email address (not a cc address)."},
        "name": {**_TEXT, "description": "The person's full name."},
        "phone": {**_TEXT, "description": "The person's direct number (not a switchboard)."},
    },
    "event": {
        "city": {**_TEXT, "description": "City where the upcoming event takes place."},
        "date": {**_ISO_DATE, "description": "Date of the upcoming event, YYYY-MM-DD."},
        "start_time": {
            "type": "string",
            "pattern": r"^([01]\d|2[0-3]):[0-5]\d$",
            "description": "Start time of the programme, 24-hour HH:MM.",
        },
        "title": {**_TEXT, "description": "The event's name."},
    },
}


def record_tool(kind: str) -> dict[str, Any]:
    """The `submit_record` tool schema of one document kind (OpenAI function format)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": f"Submit the {kind} record extracted from the document.",
            "parameters": {
                "type": "object",
                "properties": FIELDS[kind],
                "required": list(FIELDS[kind]),
                "additionalProperties": False,
            },
        },
    }


RECORD_TOOLS = {kind: record_tool(kind) for kind in KINDS}

# ------------------------------------------------------------------------------ grading


def _text_key(value: str) -> str:
    return " ".join(value.split()).casefold()


def _same_text(got: Any, want: Any) -> bool:
    return _text_key(got) == _text_key(want)


def _same_digits(got: Any, want: Any) -> bool:
    return re.sub(r"\D", "", got) == re.sub(r"\D", "", want)


def _same_cents(got: Any, want: Any) -> bool:
    return abs(got - want) < 0.005  # False for nan and inf


def _same_exact(got: Any, want: Any) -> bool:
    return got == want


_COMPARE = {
    "phone": _same_digits,
    "total": _same_cents,
    "due_date": _same_exact,
    "date": _same_exact,
    "start_time": _same_exact,
}
_VALIDATORS = {
    (kind, name): jsonschema.Draft202012Validator(schema)
    for kind, props in FIELDS.items()
    for name, schema in props.items()
}


@dataclass
class Grade:
    correct: dict[str, bool]  # per ground-truth field
    violations: dict[str, str]  # field -> what breaks the schema
    precision: float
    recall: float
    f1: float
    reward: float
    outcome: str  # exact | partial | wrong


def schema_violations(kind: str, submitted: dict[str, Any]) -> dict[str, str]:
    """Field -> reason, for every key, value or missing field that breaks `kind`'s schema."""
    found = {key: "unexpected field" for key in submitted if key not in FIELDS[kind]}
    for key in FIELDS[kind]:
        if key not in submitted:
            found[key] = "missing"
        else:
            error = next(_VALIDATORS[kind, key].iter_errors(submitted[key]), None)
            if error is not None:
                found[key] = error.message[:120]
    return found


def grade(kind: str, submitted: dict[str, Any], truth: dict[str, Any]) -> Grade:
    """Field-level F1 of `submitted` against `truth`, less the schema penalty (module doc)."""
    violations = schema_violations(kind, submitted)
    correct = dict.fromkeys(truth, False)
    n_submitted = 0
    for key, value in submitted.items():
        if key in violations:
            n_submitted += 1  # the offending field counts as a wrong answer
        elif not (isinstance(value, str) and not value.strip()):  # blank = no answer
            n_submitted += 1
            correct[key] = _COMPARE.get(key, _same_text)(value, truth[key])
    n_correct, n_truth = sum(correct.values()), len(truth)
    f1 = 2 * n_correct / (n_submitted + n_truth)
    reward = max(-1.0, f1 - VIOLATION_PENALTY * len(violations))
    if n_correct == n_submitted == n_truth:
        outcome = "exact"
    else:
        outcome = "partial" if n_correct else "wrong"
    precision = n_correct / n_submitted if n_submitted else 0.0
    return Grade(correct, violations, precision, n_correct / n_truth, f1, reward, outcome)


# ---------------------------------------------------------------------------- environment


def _submitted_call(message: Message) -> tuple[ToolCall | None, str | None]:
    """The call to grade (the first one), or else the parse-failure label."""
    call, failure = first_call(message, TOOL_NAME)
    if call is not None and not isinstance(call.arguments, dict):
        return None, "bad_arguments"
    return call, failure


class Extraction:
    """Read one synthetic document and submit its record in a single `submit_record` call."""

    name: ClassVar[str] = "extraction"
    description: ClassVar[str] = (
        "Extract an invoice, contact or event record from a short document (one tool call)."
    )
    outcomes: ClassVar[tuple[str, ...]] = ("exact", "partial", "wrong", *PARSE_FAILURES)
    solved_outcomes: ClassVar[tuple[str, ...]] = ("exact",)
    reward_range: ClassVar[tuple[float, float]] = (-1.0, 1.0)
    default_prompt: ClassVar[str] = (
        "You extract structured records from documents. Read the document, then call the "
        "submit_record tool once with the fields it asks for. Take each value from the "
        "document and write it in the format the tool describes (dates as YYYY-MM-DD, times "
        "as 24-hour HH:MM, amounts as plain numbers). Documents hold look-alike values (a "
        "subtotal, a cc address, a past date): pick the one the field describes."
    )

    def __init__(
        self,
        kinds: list[str] | tuple[str, ...] = KINDS,
        tool_choice: str = "required",
        eval_size: int = 256,
        system_prompt: str | None = None,
    ) -> None:
        if not isinstance(kinds, list | tuple) or not kinds:
            raise EnvError(f"kinds={kinds!r} is invalid: expected a non-empty list of {KINDS}")
        self.kinds = tuple(check_choice("kinds", kind, KINDS) for kind in kinds)
        if len(set(self.kinds)) != len(self.kinds):
            raise EnvError(f"kinds={kinds!r} is invalid: a kind is listed twice")
        self.tool_choice = check_choice("tool_choice", tool_choice, ("auto", "required"))
        self.eval_size = check_int("eval_size", eval_size, 1)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvError(f"system_prompt={system_prompt!r} is invalid: expected a string")
        self.system_prompt = system_prompt or self.default_prompt
        self.max_turns = 1
        self._task_state: tuple[str, dict[str, Any]] | None = None  # (kind, truth) until step

    def _task(self, split: str, index: int) -> Task:
        # Eval seeds are even and train seeds odd: the two streams never draw the same seed.
        seed = 2 * index + (0 if split == "eval" else 1)
        kind = self.kinds[index % len(self.kinds)]
        return Task(id=f"{kind}-{split}-{index}", data=make_document(kind, seed), seed=seed)

    @cached_property
    def _eval_documents(self) -> set[str]:
        return {self._task("eval", i).data["document"] for i in range(self.eval_size)}

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: documents 0..eval_size-1. Train: an unbounded stream, so `n` is required;
        a train document whose text equals an eval one is skipped."""
        if split == "eval" or n is None:
            return [
                self._task(split, i)
                for i in task_indices(self.name, split, n, seed, self.eval_size)
            ]
        check_int("n", n, 0)
        rng, seen, out = random.Random(seed), set(), []
        while len(out) < n:
            index = rng.randrange(2**31)
            task = self._task(split, index)
            if index not in seen and task.data["document"] not in self._eval_documents:
                seen.add(index)
                out.append(task)
        return out

    def reset(self, task: Task) -> Observation:
        kind, document, truth = (task.data.get(k) for k in ("kind", "document", "record"))
        if kind not in KINDS or not isinstance(document, str):
            raise EnvError(f"task {task.id!r}: expected data with a kind in {KINDS} and a document")
        if not isinstance(truth, dict) or set(truth) != set(FIELDS[kind]):
            raise EnvError(
                f"task {task.id!r}: the record must have the fields {list(FIELDS[kind])}"
            )
        self._task_state = (kind, truth)
        user = f"Extract the {kind} record from this document.\n\n{document}"
        messages = [Message("system", self.system_prompt), Message("user", user)]
        return Observation(messages, tools=[RECORD_TOOLS[kind]], tool_choice=self.tool_choice)

    def step(self, message: Message) -> StepResult:
        (kind, truth), self._task_state = in_progress(self.name, self._task_state), None
        call, failure = _submitted_call(message)
        info: dict[str, Any] = {"kind": kind, "truth": truth}
        if call is None:
            nothing = dict.fromkeys(truth, False)
            info.update(correct=nothing, violations={}, precision=0.0, recall=0.0, f1=0.0)
            return StepResult([], done=True, reward=-1.0, outcome=failure, info=info)
        result = grade(kind, call.arguments, truth)
        info.update(
            correct=result.correct,
            violations=result.violations,
            precision=result.precision,
            recall=result.recall,
            f1=result.f1,
        )
        return StepResult([], done=True, reward=result.reward, outcome=result.outcome, info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        """One call submitting the ground-truth record, fields in schema order."""
        record = task.data["record"]
        call = ToolCall(TOOL_NAME, {key: record[key] for key in FIELDS[task.data["kind"]]})
        return [Message("assistant", tool_calls=[call])]


ENVIRONMENTS: dict[str, type] = {"extraction": Extraction}
