"""Random values shaped by a JSON schema, for the env test kit's random agent.

Honours `enum`/`const`, numeric bounds (`minimum`, `maximum`, the exclusive ones),
string `pattern` (generated from the regex itself: literals, classes, repeats, groups and
alternation), `format` (date, time, date-time, email, uri, uuid), `minLength`/`maxLength`,
and array `minItems`/`maxItems`. Most values are valid; the caller validates each anyway,
and the chat layer's check turns an invalid one into `bad_arguments`, as for a model.
"""

from __future__ import annotations

import random
import string
from typing import Any

try:  # the regex parser behind `re` (named sre_parse before Python 3.11)
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

WORDS = ["hello", "order", "refund", "the", "square", "5", "json", "Dear", "thanks", "—", "é"]
FORMATS = {
    "date": lambda r: f"20{r.randint(20, 30)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "time": lambda r: f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:00",
    "date-time": lambda r: f"{FORMATS['date'](r)}T{FORMATS['time'](r)}Z",
    "email": lambda r: f"{r.choice(['ana', 'bo', 'kim'])}@example.com",
    "uri": lambda r: f"https://example.com/{r.choice(WORDS[:4])}",
    "uuid": lambda r: "-".join(
        "".join(r.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12)
    ),
}
_CATEGORIES = {
    _c.CATEGORY_DIGIT: string.digits,
    _c.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    _c.CATEGORY_SPACE: " ",
    _c.CATEGORY_NOT_DIGIT: string.ascii_letters,
    _c.CATEGORY_NOT_WORD: " -.",
    _c.CATEGORY_NOT_SPACE: string.ascii_letters,
}
_PRINTABLE = string.ascii_letters + string.digits + " -_.:"


def random_value(schema: dict[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """A value shaped by a JSON schema (mostly valid; the caller validates it)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "integer":
        low = int(schema.get("minimum", schema.get("exclusiveMinimum", -4) + 1))
        high = int(schema.get("maximum", schema.get("exclusiveMaximum", 13) - 1))
        return rng.randint(low, max(low, high))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0.0))
        high = schema.get("maximum", schema.get("exclusiveMaximum", 500.0))
        return round(rng.uniform(low, high), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array" and depth < 3:
        item = schema.get("items", {"type": "string"})
        low = schema.get("minItems", 0)
        count = rng.randint(low, max(low, schema.get("maxItems", low + 3)))
        return [random_value(item, rng, depth + 1) for _ in range(count)]
    if kind == "object" and depth < 3:
        props = schema.get("properties", {})
        keys = [k for k in props if k in schema.get("required", []) or rng.random() < 0.5]
        return {k: random_value(props[k], rng, depth + 1) for k in keys}
    if kind == "null":
        return None
    return _random_string(schema, rng)


def _random_string(schema: dict[str, Any], rng: random.Random) -> str:
    if isinstance(schema.get("pattern"), str):
        try:
            return from_pattern(schema["pattern"], rng)
        except Exception:  # a construct this generator does not know: fall through
            pass
    if schema.get("format") in FORMATS:
        return FORMATS[schema["format"]](rng)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    text = text + "x" * max(0, low - len(text))
    return text if high is None else text[:high]


def from_pattern(pattern: str, rng: random.Random) -> str:
    """A string the regex `pattern` matches (searched for, as JSON Schema does)."""
    return _emit(_parser.parse(pattern), rng)


def _emit(items: Any, rng: random.Random) -> str:
    out = []
    for op, arg in items:
        if op is _c.LITERAL:
            out.append(chr(arg))
        elif op is _c.ANY:
            out.append(rng.choice(_PRINTABLE))
        elif op is _c.IN:
            out.append(_from_class(arg, rng))
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            low, high, sub = arg
            high = low + 3 if high is _c.MAXREPEAT else high
            out.extend(_emit(sub, rng) for _ in range(rng.randint(low, max(low, high))))
        elif op is _c.SUBPATTERN:
            out.append(_emit(arg[-1], rng))
        elif op is _c.BRANCH:
            out.append(_emit(rng.choice(arg[1]), rng))
        elif op is _c.AT:
            continue  # anchors take no characters
        else:
            raise ValueError(f"unsupported regex construct {op}")
    return "".join(out)


def _from_class(items: Any, rng: random.Random) -> str:
    if items and items[0][0] is _c.NEGATE:
        banned = {chr(a) for op, a in items[1:] if op is _c.LITERAL}
        return rng.choice([ch for ch in string.ascii_letters if ch not in banned])
    choices: list[str] = []
    for op, arg in items:
        if op is _c.LITERAL:
            choices.append(chr(arg))
        elif op is _c.RANGE:
            choices.extend(chr(code) for code in range(arg[0], arg[1] + 1))
        elif op is _c.CATEGORY:
            choices.extend(_CATEGORIES.get(arg, string.ascii_letters))
    return rng.choice(choices)
