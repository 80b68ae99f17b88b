"""The rules of the `instructions` env: each a pure `check(answer, spec) -> bool` in
`CHECKS` (the rule is in its docstring), how a prompt states it (`RULES`), and the
validation of a check spec. Content checks ask for something to be present; the
`RESTRICTIONS` forbid something and so hold for almost any short answer."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from looprl.errors import EnvError

# ------------------------------------------------------------------------------ checks

_WORD = re.compile(r"\w+(?:['’-]\w+)*")
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def count_words(text: str) -> int:
    """Runs of letters, digits or underscores, joined by inner apostrophes or hyphens
    ("don't", "e-mail", "next_step" are one word each); punctuation and markup are not words."""
    return len(_WORD.findall(text))


def has_word(text: str, term: str) -> bool:
    """`term` occurs in `text` as a whole word, ignoring case ("Refund" yes, "refunds" no)."""
    return re.search(rf"(?<!\w){re.escape(term)}(?!\w)", text, re.IGNORECASE) is not None


def json_object(answer: str) -> dict[str, Any] | None:
    """The JSON object in the first ``` fence of `answer` (```json or bare), else in the
    whole answer; None if that is not a JSON object."""
    fence = _FENCE.search(answer)
    try:
        value = json.loads(fence.group(1) if fence else answer)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def check_json_keys(answer: str, spec: dict[str, Any]) -> bool:
    """A JSON object (see `json_object`) whose keys are exactly `keys` (spec "exact") or
    include all of them."""
    found = json_object(answer)
    if found is None:
        return False
    return set(found) == set(spec["keys"]) if spec["exact"] else set(spec["keys"]) <= set(found)


def check_max_words(answer: str, spec: dict[str, Any]) -> bool:
    """At most `limit` words (see `count_words`)."""
    return count_words(answer) <= spec["limit"]


def check_include(answer: str, spec: dict[str, Any]) -> bool:
    """Every term of `terms` appears as a whole word, ignoring case."""
    return all(has_word(answer, term) for term in spec["terms"])


def check_exclude(answer: str, spec: dict[str, Any]) -> bool:
    """No term of `terms` appears as a whole word, ignoring case."""
    return not any(has_word(answer, term) for term in spec["terms"])


def check_no_exclamation(answer: str, spec: dict[str, Any]) -> bool:
    """No "!" anywhere."""
    return "!" not in answer


def check_starts_with(answer: str, spec: dict[str, Any]) -> bool:
    """After leading whitespace the answer begins with `text` (ignoring case), not followed
    by a letter or digit ("Hello," passes for "Hello", "Helloo" does not)."""
    return re.match(rf"{re.escape(spec['text'])}(?!\w)", answer.strip(), re.IGNORECASE) is not None


def check_ends_with(answer: str, spec: dict[str, Any]) -> bool:
    """Once trailing whitespace and . , ; : ! are dropped, the answer ends with `text`
    (ignoring case) as whole words."""
    tail = answer.strip().rstrip(".,;:! \t\r\n")
    return re.search(rf"(?<!\w){re.escape(spec['text'])}\Z", tail, re.IGNORECASE) is not None


def check_bullet_count(answer: str, spec: dict[str, Any]) -> bool:
    """Exactly `count` lines begin (after indentation) with "- " followed by some text."""
    bullets = [line for line in answer.splitlines() if line.strip().startswith("- ")]
    return len(bullets) == spec["count"]


CHECKS: dict[str, Callable[[str, dict[str, Any]], bool]] = {
    "json_keys": check_json_keys,
    "include": check_include,
    "starts_with": check_starts_with,
    "ends_with": check_ends_with,
    "bullet_count": check_bullet_count,
    "max_words": check_max_words,
    "exclude": check_exclude,
    "no_exclamation": check_no_exclamation,
}
RESTRICTIONS = frozenset({"max_words", "exclude", "no_exclamation"})

RULES: dict[str, Callable[[dict[str, Any]], str]] = {  # how the prompt states each check
    "json_keys": lambda s: "Answer with a JSON object with {} the keys {}.".format(
        "exactly" if s["exact"] else "at least", ", ".join(json.dumps(k) for k in s["keys"])
    ),
    "include": lambda s: f"Include the words: {', '.join(s['terms'])}.",
    "starts_with": lambda s: f'Start with "{s["text"]}".',
    "ends_with": lambda s: f'End with "{s["text"]}".',
    "bullet_count": lambda s: f'Write exactly {s["count"]} lines starting with "- ".',
    "max_words": lambda s: f"Use at most {s['limit']} words.",
    "exclude": lambda s: f"Do not use the words: {', '.join(s['terms'])}.",
    "no_exclamation": lambda s: "Do not use exclamation marks.",
}


def _is_words(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, str) and t.strip() for t in v)


# The fields of each check spec besides "kind", and what a valid value is.
_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "json_keys": {"keys": _is_words, "exact": lambda v: isinstance(v, bool)},
    "include": {"terms": _is_words},
    "starts_with": {"text": lambda v: isinstance(v, str) and bool(v.strip())},
    "ends_with": {"text": lambda v: isinstance(v, str) and bool(v.strip())},
    "bullet_count": {"count": lambda v: type(v) is int and v >= 0},
    "max_words": {"limit": lambda v: type(v) is int and v >= 0},
    "exclude": {"terms": _is_words},
    "no_exclamation": {},
}


def check_spec(spec: Any) -> None:
    """Raise EnvError unless `spec` is a well-formed check (so `CHECKS` cannot fail on it)."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in _FIELDS:
        raise EnvError(f"bad check {spec!r}: expected a dict with kind one of {', '.join(CHECKS)}")
    bad = [field for field, valid in _FIELDS[kind].items() if not valid(spec.get(field))]
    if bad:
        raise EnvError(f"bad check {spec!r}: invalid {', '.join(bad)}")
