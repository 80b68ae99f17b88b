"""The result every doctor check returns, so that each check can be run and tested alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["required", "optional", "skipped"]
STATUS = {"required": "problem", "optional": "note", "skipped": "skipped"}


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table.

    `kind` says what a failed check means: `required` stops a run (a problem, exit 1),
    `optional` is an extra a first run does without (a note), `skipped` was not checked
    because a check it depends on failed. `value` is what the check loaded (a tokenizer,
    the policy, ...), handed to the checks that need it, so nothing is loaded twice."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    kind: Kind = "required"
    value: Any = field(default=None, repr=False, compare=False)

    @property
    def status(self) -> str:
        return "OK" if self.ok else STATUS[self.kind]

    @property
    def blocks_run(self) -> bool:
        return not self.ok and self.kind == "required"


def skipped(name: str, because: str) -> Check:
    return Check(name, ok=False, detail=f"not checked: {because}", kind="skipped")


def first_line(err: BaseException) -> str:
    """An error's first line (tracebacks and transformers' hints stay out of the table)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
