"""Scorers for the `dataset` environment: a reply against a row's answer, as a score in [0, 1].

A scorer is named in `env.args.scorers`, alone or with a weight and arguments:

    scorers: normalized                                   # one, weight 1
    scorers: [{name: tool_call, weight: 2}, {name: regex, pattern: "\\d{4}"}]

`score(response, answer, row) -> Score` where `response` is what the reply holds in the
dataset's answer form (the text, the call `{"name", "arguments"}`, or the parsed JSON value)
and `row` the task's whole row (its `info` included). The reward is the weighted mean of
the scores; each score and its label are kept in the episode's `info`.

- `exact`: 1 if the text equals the answer (outer whitespace aside);
- `normalized`: 1 if they are equal once case, whitespace and punctuation are folded;
- `numeric`: 1 if the last number in the reply is within `tolerance` (absolute, 1e-6)
  or `relative` of the answer's;
- `regex`: 1 if `pattern` (default: the answer itself) is found in the reply
  (`fullmatch: true`: if it matches the whole reply);
- `contains`: 1 if the normalized answer occurs in the normalized reply;
- `json_fields`: per-field credit, F1 = 2C / (S + T) with C right of S submitted and T
  expected fields (`all_fields: true`: 1 only if every field is right and none is extra);
  a text field is matched by `match` (`normalized` by default, `casefold` or `exact`) or
  by its own entry in `field_match: {field: exact}`;
- `tool_call`: 0 for another tool's name, else `json_fields` over the arguments;
- `judge`: a model grades the reply against a `rubric` (envs/data/judge.py);
- `module:function`: your own, `fn(response, answer, row)` returning a number in [0, 1]
  or a bool.

Labels: `correct` (score 1), `partial` (between), `wrong` (0).
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from looprl.envs.common import import_attribute
from looprl.envs.data.score_types import Score, as_text, labelled
from looprl.errors import EnvError

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def normalize(text: str) -> str:
    """Case, punctuation and runs of whitespace folded: "  The Answer: 42. " → "the answer 42"."""
    return " ".join(_PUNCT.sub(" ", text.casefold()).split())


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands commas allowed), or None."""
    found = _NUMBER.findall(text)
    for token in reversed(found):
        try:
            return float(token.replace(",", ""))
        except ValueError:
            continue
    return None


# how a text field of a call or a JSON answer is compared with the expected text
MATCHES = {
    "normalized": "case, punctuation and runs of spaces folded",  # the default
    "casefold": "case folded, all else as written",
    "exact": "as written, character for character",
}


def same_text(got: str, want: str, match: str) -> bool:
    if match == "exact":
        return got == want
    if match == "casefold":
        return got.casefold() == want.casefold()
    return normalize(got) == normalize(want)


def same_value(got: Any, want: Any, match: str = "normalized") -> bool:
    """One field: numbers numerically (to 1e-9), text by `match` (MATCHES), the rest
    (booleans, lists, objects) by equality."""
    if isinstance(want, bool) or isinstance(got, bool):
        return got == want
    if isinstance(want, int | float) and isinstance(got, int | float):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(want, str) and isinstance(got, str):
        return same_text(got, want, match)
    return got == want


@dataclass(frozen=True)
class Matching:
    """How a per-field scorer compares text fields: `match` for all, `fields` per field."""

    match: str = "normalized"
    fields: tuple[tuple[str, str], ...] = ()

    def of(self, field: str) -> str:
        return dict(self.fields).get(field, self.match)

    def describe(self) -> str:
        """What `looprl envs show` prints: the matching in force."""
        text = f"text fields {self.match} ({MATCHES[self.match]})"
        return text + "".join(f"; {name}: {how}" for name, how in self.fields)


def matching(match: Any, field_match: Any) -> Matching:
    """The checked `match` and `field_match` arguments; a misspelt way is an EnvError with
    a suggestion."""
    if field_match is None:
        field_match = {}
    if not isinstance(field_match, dict) or not all(isinstance(k, str) for k in field_match):
        raise EnvError(f"field_match={field_match!r}: expected {{field: way}}, e.g. {{sku: exact}}")
    for where, way in [
        ("match", match),
        *((f"field_match.{k}", v) for k, v in field_match.items()),
    ]:
        if not isinstance(way, str) or way not in MATCHES:
            close = difflib.get_close_matches(str(way), list(MATCHES), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise EnvError(
                f"{where}={way!r} is not a way to match text; {hint}known: {', '.join(MATCHES)}"
            )
    return Matching(match, tuple(field_match.items()))


# ---------------------------------------------------------------------------- built-ins


def exact(response: Any, answer: Any, row: dict) -> Score:
    return labelled(float(as_text(response).strip() == as_text(answer).strip()))


def normalized(response: Any, answer: Any, row: dict) -> Score:
    return labelled(float(normalize(as_text(response)) == normalize(as_text(answer))))


def contains(response: Any, answer: Any, row: dict) -> Score:
    want = normalize(as_text(answer))
    return labelled(float(bool(want) and want in normalize(as_text(response))))


def make_numeric(tolerance: float = 1e-6, relative: float = 0.0) -> Callable:
    def numeric(response: Any, answer: Any, row: dict) -> Score:
        want = answer if isinstance(answer, int | float) else last_number(as_text(answer))
        got = response if isinstance(response, int | float) else last_number(as_text(response))
        if want is None or got is None:
            return labelled(0.0)
        return labelled(float(math.isclose(got, want, rel_tol=relative, abs_tol=tolerance)))

    return numeric


def make_regex(pattern: str | None = None, fullmatch: bool = False) -> Callable:
    compiled = _compile(pattern) if pattern is not None else None

    def regex(response: Any, answer: Any, row: dict) -> Score:
        rx = compiled if compiled is not None else _compile(as_text(answer))
        text = as_text(response).strip()
        return labelled(float(bool(rx.fullmatch(text) if fullmatch else rx.search(text))))

    return regex


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise EnvError(f"regex pattern {pattern!r} does not compile: {err}") from None


def field_credit(
    got: Any,
    want: Any,
    all_fields: bool,
    match: Matching = Matching(),  # noqa: B008 (frozen)
) -> Score:
    """F1 over the expected fields of `want` (a dict): 2C / (S + T); `all_fields`: 0 or 1;
    text fields compared as `match` says."""
    if not isinstance(want, dict):
        raise EnvError(f"a per-field scorer needs the answer as an object, got {as_text(want)!r}")
    if not isinstance(got, dict):
        return labelled(0.0, dict.fromkeys(want, False))
    right = {
        key: key in got and same_value(got[key], value, match.of(key))
        for key, value in want.items()
    }
    submitted = sum(1 for value in got.values() if value not in (None, ""))
    n_right = sum(right.values())
    if all_fields:
        value = float(n_right == len(want) and submitted == len(want))
    else:
        value = 2 * n_right / (submitted + len(want)) if (submitted + len(want)) else 1.0
    return labelled(value, right)


def make_json_fields(
    all_fields: bool = False, match: str = "normalized", field_match: Any = None
) -> Callable:
    how = matching(match, field_match)

    def json_fields(response: Any, answer: Any, row: dict) -> Score:
        return field_credit(response, answer, all_fields, how)

    json_fields.matching = how  # type: ignore[attr-defined]  (shown by `envs show`)
    return json_fields


def make_tool_call(
    all_fields: bool = False, match: str = "normalized", field_match: Any = None
) -> Callable:
    how = matching(match, field_match)

    def tool_call(response: Any, answer: Any, row: dict) -> Score:
        if not isinstance(answer, dict) or "name" not in answer:
            raise EnvError("the tool_call scorer needs the answer as {name, arguments}")
        want = answer.get("arguments") or {}
        if not isinstance(response, dict) or response.get("name") != answer["name"]:
            return labelled(0.0, dict.fromkeys(want, False))
        if not want:
            return labelled(float(not response.get("arguments")))
        return field_credit(response.get("arguments"), want, all_fields, how)

    tool_call.matching = how  # type: ignore[attr-defined]  (shown by `envs show`)
    return tool_call


_BUILTINS: dict[str, Callable[..., Callable]] = {
    "exact": lambda: exact,
    "normalized": lambda: normalized,
    "contains": lambda: contains,
    "numeric": make_numeric,
    "regex": make_regex,
    "json_fields": make_json_fields,
    "tool_call": make_tool_call,
}
SCORER_NAMES = tuple(_BUILTINS)
# scorers that compare against a row's answer (a user's function may not need one)
NEEDS_ANSWER = SCORER_NAMES


# ------------------------------------------------------------------------- from config


@dataclass
class Scorer:
    name: str
    weight: float
    fn: Callable[[Any, Any, dict], Any]

    def __call__(self, response: Any, answer: Any, row: dict) -> Score:
        out = self.fn(response, answer, row)
        if isinstance(out, Score):
            value, result = out.value, out
        else:
            value = float(out) if isinstance(out, bool | int | float) else math.nan
            result = None
        if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
            raise EnvError(
                f"scorer {self.name!r} returned {out!r}; a scorer returns a number in [0, 1] "
                "or a bool"
            )
        return result if result is not None else labelled(float(value))

    @property
    def needs_answer(self) -> bool:
        return self.name in NEEDS_ANSWER

    @property
    def group(self) -> bool:
        """Whether it scores a task's replies together (a group judge)."""
        return bool(getattr(self.fn, "group", False))

    @property
    def matching(self) -> Matching | None:
        """How a per-field scorer compares text fields (None for the others)."""
        return getattr(self.fn, "matching", None)

    @property
    def remote(self) -> bool:
        """Whether it asks a model (the judge): not run on every row up front."""
        return bool(getattr(self.fn, "remote", False))


def make_scorers(spec: Any) -> list[Scorer]:
    """The scorers `env.args.scorers` names: a name, a {name, weight, ...} mapping, or a
    list of either. Unknown names, bad weights and bad arguments are clear EnvErrors."""
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise EnvError("scorers is empty: name at least one (e.g. scorers: normalized)")
    out = []
    for i, item in enumerate(items):
        where = f"scorers[{i}]" if isinstance(spec, list) else "scorers"
        args = dict(item) if isinstance(item, dict) else {"name": item}
        name = args.pop("name", None)
        weight = args.pop("weight", 1.0)
        if not isinstance(name, str) or not name:
            raise EnvError(f"{where}: expected a scorer name or {{name: ..., weight: ...}}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise EnvError(f"{where} ({name}): weight={weight!r} must be a number above 0")
        out.append(Scorer(name, float(weight), _scorer_fn(name, args, where)))
    return out


def _scorer_fn(name: str, args: dict[str, Any], where: str) -> Callable:
    if name in _BUILTINS:
        try:
            return _BUILTINS[name](**args)
        except TypeError as err:
            raise EnvError(f"{where} ({name}): bad arguments {args}: {err}") from None
        except EnvError as err:
            raise EnvError(f"{where} ({name}): {err}") from None
    if name == "judge":
        from looprl.envs.data.judge import GroupJudge, Judge

        mode = args.pop("mode", "pointwise")
        if mode not in ("pointwise", "group"):
            raise EnvError(f"{where} (judge): mode={mode!r}; expected pointwise or group")
        try:
            return (GroupJudge if mode == "group" else Judge)(**args)
        except TypeError as err:
            raise EnvError(f"{where} (judge): bad arguments {args}: {err}") from None
    if ":" in name:
        if args:
            raise EnvError(f"{where} ({name}): a function scorer takes no arguments, got {args}")
        return _import_function(name, where)
    raise EnvError(
        f"{where}: unknown scorer {name!r}; known: {', '.join(SCORER_NAMES)}, judge "
        "(or 'package.module:function' for your own)"
    )


def _import_function(spec: str, where: str) -> Callable:
    try:
        fn = import_attribute(spec, "scorer")
    except EnvError as err:
        raise EnvError(f"{where}: {err}") from None
    if not callable(fn):
        raise EnvError(f"{where}: {spec} is not a function")
    return fn


def combine(scorers: list[Scorer], scores: list[Score]) -> float:
    """The weighted mean of the scores, in [0, 1]."""
    total = sum(s.weight for s in scorers)
    return sum(s.weight * sc.value for s, sc in zip(scorers, scores)) / total
