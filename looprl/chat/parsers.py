"""Parse tool calls out of the text formats open chat models are trained to emit
(formats.py writes them).

Formats (names as in `FORMATS`):
- hermes (Qwen, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.
- llama3: the message is a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several calls are separated by `;`/newlines or given as a JSON list.
- glm (GLM-4.5, Ling): `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`,
  where values are text and get their JSON type back from the tool's schema.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}`.

Parsing never raises on model output: a malformed message is a *result* (a failure class
from PARSE_FAILURES) because the trainer turns it into a reward. Every scan is built from
`str.find`, anchored regexes and one-pass JSON decoding, so the cost stays linear in the
length of the text, and a decode failure ends the scan instead of being retried.

Leniency, on purpose (small models drift from their format and a call is still a call):
- `<think>...</think>` blocks are set aside first; an unclosed `<think>` makes the rest of the
  message reasoning; a `</think>` with no opening tag ends reasoning that the chat template
  opened in the prompt (Qwen3, R1-style templates).
- In any format, when the format's own markers are absent, a bare JSON call (an object with a
  "name" key, or a list of them, optionally in a markdown fence) is accepted.
- An unclosed hermes `<tool_call>` whose remaining text is one valid JSON value is accepted
  (a stop string may have eaten the closing tag); an unclosed glm block is accepted only when
  it ends right after an `</arg_value>`.
- A missing "arguments" key means `{}`; an arguments string holding JSON is decoded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from looprl.chat.formats import FORMATS
from looprl.types import ToolCall

_DETAIL_MAX = 200
_DECODER = json.JSONDecoder()
_CALL_KEYS = frozenset({"name", "arguments", "parameters"})
# Only a literal `{` may start a match, so the scan cannot backtrack over long runs.
_JSON_CALL_START = re.compile(r'\{\s*"name"\s*:')
_FENCE_OPEN = re.compile(r"```[\w+-]*")
_EMPTY_FENCE = re.compile(r"```[\w+-]*\s*```")
_GLM_NAME = re.compile(r"[^\s<>{}\[\]\"']+")
_GLM_ARG = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>")
_MISTRAL_NAMED = re.compile(r"([^\s\[\]{}\"]+)(?:\[CALL_ID\]([^\s\[\]{}\"]+))?\[ARGS\]")


@dataclass
class ParseResult:
    """The outcome of parsing one assistant message."""

    calls: list[ToolCall]  # validated calls (empty on failure)
    content: str  # text outside tool calls and think blocks, stripped (all visible text on failure)
    reasoning: str | None  # text of the <think> blocks, joined, or None
    failure: str | None = None  # None or one of PARSE_FAILURES
    detail: str | None = None  # short human-readable explanation of the failure


@dataclass
class _Raw:
    """One call candidate as found in the text, before its name and arguments are checked."""

    payload: Any = None
    error: str | None = None  # why the text could not be decoded (-> bad_json)
    raw_strings: bool = False  # glm: argument values are still undecoded text


def _short(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."


def _split_think(text: str) -> tuple[str, str | None]:
    """Split off <think> blocks: (visible text, joined reasoning or None)."""
    visible: list[str] = []
    reasoning: list[str] = []
    pos = 0
    first_close = text.find("</think>")
    if first_close >= 0 and text.find("<think>", 0, first_close) < 0:
        reasoning.append(text[:first_close])
        pos = first_close + len("</think>")
    while True:
        start = text.find("<think>", pos)
        if start < 0:
            visible.append(text[pos:])
            break
        visible.append(text[pos:start])
        end = text.find("</think>", start + len("<think>"))
        if end < 0:
            reasoning.append(text[start + len("<think>") :])
            break
        reasoning.append(text[start + len("<think>") : end])
        pos = end + len("</think>")
    joined = "\n".join(r.strip() for r in reasoning if r.strip())
    return "".join(visible), (joined or None)


def strip_fence(text: str) -> str:
    """`text` without a Markdown code fence around it (```json ... ```)."""
    s = text.strip()
    if s.startswith("```"):
        s = _FENCE_OPEN.sub("", s, count=1).rstrip()
        if s.endswith("```"):
            s = s[:-3]
    return s.strip()


def _tidy(content: str) -> str:
    """Clean what is left after calls were cut out: empty fences, stray separators."""
    s = _EMPTY_FENCE.sub("", content).strip()
    return "" if not s.strip(" \t\r\n;,") else s


def _decode_error(where: str, exc: Exception) -> _Raw:
    reason = "JSON nested too deeply" if isinstance(exc, RecursionError) else str(exc)
    return _Raw(error=_short(f"{where}: {reason}"))


def _tag_blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[tuple[str, bool]], str]:
    """Bodies between tags as (body, closed), and the text outside them."""
    blocks: list[tuple[str, bool]] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end < 0:
            blocks.append((text[body_start:], False))
            break
        blocks.append((text[body_start:end], True))
        pos = end + len(close_tag)
    return blocks, "".join(outside)


def _json_block(body: str, closed: bool) -> list[_Raw]:
    where = "<tool_call> body" if closed else "unclosed <tool_call>"
    try:
        obj = json.loads(strip_fence(body))
    except (ValueError, RecursionError) as exc:
        return [_decode_error(where, exc)]
    if isinstance(obj, list) and obj:
        return [_Raw(item) for item in obj]
    return [_Raw(obj)]


def _scan_json(text: str) -> tuple[list[_Raw], str]:
    """Bare JSON calls: the whole text as one JSON value, else `{"name": ...}` objects in it."""
    whole = strip_fence(text)
    if whole[:1] in ("{", "["):
        try:
            obj = json.loads(whole)
        except (ValueError, RecursionError):
            obj = None
        items = obj if isinstance(obj, list) else [obj]
        if items and all(isinstance(o, dict) and _CALL_KEYS & o.keys() for o in items):
            return [_Raw(o) for o in items], ""
    cands: list[_Raw] = []
    outside: list[str] = []
    pos = 0
    while (match := _JSON_CALL_START.search(text, pos)) is not None:
        start = match.start()
        back = start - 1
        while back >= pos and text[back].isspace():
            back -= 1
        if back >= pos and text[back] == "[":  # maybe a JSON list of calls
            try:
                obj, end = _DECODER.raw_decode(text, back)
            except (ValueError, RecursionError):
                obj = None
            if isinstance(obj, list) and all(isinstance(o, dict) for o in obj):
                outside.append(text[pos:back])
                cands.extend(_Raw(o) for o in obj)
                pos = end
                continue
        outside.append(text[pos:start])
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError) as exc:
            cands.append(_decode_error("tool call JSON", exc))
            return cands, "".join(outside)  # the result fails; nothing after matters
        cands.append(_Raw(obj))
        pos = end
    outside.append(text[pos:])
    return cands, "".join(outside)


def _extract_hermes(text: str) -> tuple[list[_Raw], str]:
    blocks, outside = _tag_blocks(text, "<tool_call>", "</tool_call>")
    if not blocks:
        return _scan_json(text)
    cands: list[_Raw] = []
    for body, closed in blocks:
        cands.extend(_json_block(body, closed))
    return cands, outside


def _extract_llama3(text: str) -> tuple[list[_Raw], str]:
    return _scan_json(text.replace("<|python_tag|>", ""))


def _glm_block(body: str) -> _Raw:
    first = body.find("<arg_key>")
    name = (body if first < 0 else body[:first]).strip()
    if not _GLM_NAME.fullmatch(name):
        return _Raw(error=_short(f"missing or malformed tool name in <tool_call>: {name!r}"))
    args: dict[str, str] = {}
    pos = len(body) if first < 0 else first
    # Anchored at `pos` and free of nested repeats, so each pair costs its own length.
    while (pair := _GLM_ARG.match(body, pos)) is not None:
        end = body.find("</arg_value>", pair.end())
        if end < 0:
            return _Raw(error="unclosed <arg_value>")
        args[pair[1].strip()] = body[pair.end() : end]
        pos = end + len("</arg_value>")
    if body[pos:].strip():
        return _Raw(error=_short(f"malformed arguments near {body[pos : pos + 60].strip()!r}"))
    return _Raw({"name": name, "arguments": args}, raw_strings=True)


def _extract_glm(text: str) -> tuple[list[_Raw], str]:
    blocks, outside = _tag_blocks(text, "<tool_call>", "</tool_call>")
    if not blocks:
        return _scan_json(text)
    cands: list[_Raw] = []
    for body, closed in blocks:
        if body.lstrip().startswith(("{", "[", "```")):  # hermes-style JSON in a glm block
            cands.extend(_json_block(body, closed))
        elif not closed and not body.rstrip().endswith("</arg_value>"):
            cands.append(_Raw(error="unclosed <tool_call>"))
        else:
            cands.append(_glm_block(body))
    return cands, outside


def _extract_mistral(text: str) -> tuple[list[_Raw], str]:
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return _scan_json(text)
    cands: list[_Raw] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(marker, pos)) >= 0:
        outside.append(text[pos:start])
        pos = start + len(marker)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        named = _MISTRAL_NAMED.match(text, pos)
        try:
            if named is None:
                obj, pos = _DECODER.raw_decode(text, pos)
            else:
                args, pos = _DECODER.raw_decode(text, named.end())
                obj = {"name": named[1], "arguments": args, "id": named[2]}
        except (ValueError, RecursionError) as exc:
            cands.append(_decode_error("after [TOOL_CALLS]", exc))
            return cands, "".join(outside)
        items = obj if isinstance(obj, list) else [obj]
        if not items:
            cands.append(_Raw(error="empty call list after [TOOL_CALLS]"))
        cands.extend(_Raw(item) for item in items)
    outside.append(text[pos:])
    return cands, "".join(outside)


_EXTRACTORS = {
    "hermes": _extract_hermes,
    "llama3": _extract_llama3,
    "glm": _extract_glm,
    "mistral": _extract_mistral,
}


def _tool_index(tools: list[dict]) -> dict[str, Any]:
    """Tool name -> parameters schema, from OpenAI function-format or bare tool dicts."""
    index: dict[str, Any] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if isinstance(name, str):
            params = fn.get("parameters")
            index[name] = {} if params is None else params
    return index


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def _check(arguments: dict[str, Any], schema: Any) -> str | None:
    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
        error = best_match(validator.iter_errors(arguments))
    except Exception as exc:  # odd schemas fail in many ways (SchemaError, re.error, ...)
        return _short(f"invalid tool schema: {exc}")
    if error is None:
        return None
    path = "/".join(str(p) for p in error.absolute_path)
    return _short(f"{path}: {error.message}" if path else error.message)


def _coerce_glm(arguments: dict[str, str], schema: Any) -> dict[str, Any]:
    """Give glm's text values their JSON types back, keeping text where the schema wants it."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    props = props if isinstance(props, dict) else {}
    out: dict[str, Any] = {}
    for key, raw in arguments.items():
        prop = props.get(key)
        declared = prop.get("type") if isinstance(prop, dict) else None
        if declared == "string" or (isinstance(declared, list) and "string" in declared):
            out[key] = raw
            continue
        try:
            out[key] = json.loads(raw)
        except (ValueError, RecursionError):
            out[key] = raw
    return out


def validate_arguments(call: ToolCall, tools: list[dict]) -> str | None:
    """None if the call's arguments satisfy its tool's JSON schema, else a short reason."""
    index = _tool_index(tools)
    if call.name not in index:
        return _short(f"unknown tool {call.name!r}")
    if not isinstance(call.arguments, dict):
        return f"arguments must be a JSON object, not {type(call.arguments).__name__}"
    return _check(call.arguments, index[call.name])


def _build_call(raw: _Raw, index: dict[str, Any]) -> ToolCall | tuple[str, str]:
    """A validated call, or (failure class, detail)."""
    if raw.error is not None:
        return "bad_json", raw.error
    payload = raw.payload
    if not isinstance(payload, dict):
        return "bad_json", f"tool call must be a JSON object, not {type(payload).__name__}"
    name = payload.get("name")
    if not isinstance(name, str):
        return "bad_json", 'tool call has no string "name"'
    if name not in index:
        return "unknown_tool", _short(f"unknown tool {name!r}; available: {', '.join(index)}")
    args = payload["arguments"] if "arguments" in payload else payload.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return "bad_arguments", "arguments string is not valid JSON"
    if not isinstance(args, dict):
        return "bad_arguments", f"arguments must be a JSON object, not {type(args).__name__}"
    if raw.raw_strings:
        args = _coerce_glm(args, index[name])
    problem = _check(args, index[name])
    if problem is not None:
        return "bad_arguments", problem
    call_id = payload.get("id")
    return ToolCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) else None)


def parse_tool_calls(
    text: str, tools: list[dict], fmt: str = "hermes", require_call: bool = True
) -> ParseResult:
    """Parse one assistant message. Never raises on any `text`; unknown `fmt` is a ValueError.

    With several calls, the first one that fails decides the failure and no call is kept.
    """
    if fmt not in _EXTRACTORS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
    visible, reasoning = _split_think(text)
    cands, outside = _EXTRACTORS[fmt](visible)
    if not cands:
        if require_call:
            return ParseResult([], _tidy(visible), reasoning, "no_tool_call", "no tool call found")
        return ParseResult([], _tidy(visible), reasoning)
    index = _tool_index(tools)
    calls: list[ToolCall] = []
    for raw in cands:
        built = _build_call(raw, index)
        if isinstance(built, tuple):
            return ParseResult([], visible.strip(), reasoning, built[0], built[1])
        calls.append(built)
    return ParseResult(calls, _tidy(outside), reasoning)
