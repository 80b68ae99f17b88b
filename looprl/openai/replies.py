"""From a completion's text to the reply a client gets: the message, its finish reason,
and, when a forced reply could not be finished, an error instead of its broken text.

A forced tool call or a `response_format` JSON reply is grammar-constrained, so it
always parses once the model has written it whole. Cut short (by `max_tokens` or a stop
string), it is a fragment of call syntax or JSON. The client then gets
`finish_reason: "length"` (or "stop") and either what still parses (the calls, or JSON
that satisfies the schema) or empty content with `error` saying what happened: never the
raw template text of a half-written call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema

from looprl.chat import ChatRenderer
from looprl.engine import Constraint, JsonConstraint, ToolConstraint
from looprl.types import Message, ToolCall


def reply_for(
    renderer: ChatRenderer,
    text: str,
    tools: list[dict[str, Any]] | None,
    constraint: Constraint | None,
    finish_reason: str,
    max_tokens: int,
    call_id: Callable[[int, ToolCall], str],
) -> tuple[Message, str | None, str, str | None]:
    """(message, reasoning, finish_reason, error) of one completion's `text`."""
    if isinstance(constraint, JsonConstraint):
        return _json_reply(renderer, text, constraint, finish_reason, max_tokens, call_id)
    forced = isinstance(constraint, ToolConstraint)
    message, reasoning = renderer.assistant_reply(text, tools, forced, call_id)
    if forced and not message.tool_calls:
        error = f"the forced tool call {_cut_by(finish_reason, max_tokens)}"
        return Message(role="assistant", content=""), None, finish_reason, error
    return message, reasoning, _finish(message, finish_reason), None


def _json_reply(
    renderer: ChatRenderer,
    text: str,
    constraint: JsonConstraint,
    finish_reason: str,
    max_tokens: int,
    call_id: Callable[[int, ToolCall], str],
) -> tuple[Message, str | None, str, str | None]:
    if constraint.tools:  # tool_choice auto: a call may stand in for the JSON
        message, reasoning = renderer.assistant_reply(text, constraint.tools, False, call_id)
        if message.tool_calls:
            return message, reasoning, _finish(message, finish_reason), None
    try:
        value = json.loads(text)
        if constraint.schema is not None:
            jsonschema.validate(value, constraint.schema)
        elif not isinstance(value, dict):
            raise ValueError("not an object")
    except (ValueError, jsonschema.ValidationError):
        error = f"the JSON reply (response_format) {_cut_by(finish_reason, max_tokens)}"
        return Message(role="assistant", content=""), None, finish_reason, error
    return Message(role="assistant", content=text), None, finish_reason, None


def _finish(message: Message, finish_reason: str) -> str:
    """ "tool_calls" for a finished reply with calls; a cut-off one stays "length"."""
    return "tool_calls" if message.tool_calls and finish_reason != "length" else finish_reason


def _cut_by(finish_reason: str, max_tokens: int) -> str:
    if finish_reason == "length":
        return f"did not finish within max_tokens={max_tokens}; raise max_tokens"
    return "was cut off by a stop string; leave out stop strings that can occur in it"
