"""From the engine's `Completion` to the reply a client gets (`ChatChoice`): the one
reply builder of `looprl serve` and the agent proxy.

`chat_choice` decodes the completion, cuts it at the request's stop strings, parses it
into an assistant message (tool calls, `<think>` reasoning) and sets its finish reason;
the choice keeps the exact prompt and sampled token ids and their logprobs.

A forced tool call or a `response_format` JSON reply is grammar-constrained, so it
always parses once the model has written it whole. Cut short (by `max_tokens` or a stop
string), it is a fragment of call syntax or JSON. The client then gets
`finish_reason: "length"` (or "stop") and either what still parses (the calls, or JSON
that satisfies the schema) or empty content with `error` saying what happened: never the
raw template text of a half-written call.

A request with `parallel_tool_calls: false` gets one call at most: under `tool_choice:
"auto"` the model may write several, and the message keeps the first (its text, tokens
and logprobs stay as sampled); a forced call is one call already.

One difference, `as_sampled=True`, is the agent proxy's: a rollout's reply is the
policy's text parsed as is, whatever it is, because the episode records what the policy
wrote and the agent goes on from that (a cut forced call comes back with no tool calls
rather than an `error`; the JSON of a `response_format` is not checked; the finish
reason is "tool_calls" whenever calls parse).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jsonschema

from looprl.chat import ChatRenderer
from looprl.engine import Completion, Constraint, JsonConstraint, ToolConstraint
from looprl.openai.wire import ChatChoice
from looprl.types import Message, ToolCall


def chat_choice(
    renderer: ChatRenderer,
    completion: Completion,
    prompt_ids: list[int],
    tools: list[dict[str, Any]] | None,
    constraint: Constraint | None,
    max_tokens: int,
    call_id: Callable[[int, ToolCall], str],
    stop: list[str] | None = None,
    as_sampled: bool = False,
    parallel_tool_calls: bool = True,
) -> ChatChoice:
    """The reply for one `completion` of a request rendered to `prompt_ids` with `tools`
    (those rendered and parsed) under `constraint`. `call_id(j, call)`: the id of the
    reply's j-th tool call; `as_sampled`: the agent proxy's parsing (module doc);
    `parallel_tool_calls=False`: the message keeps its first tool call only."""
    text = cut_at_stop(renderer.decode(completion.ids), stop or [])
    if as_sampled:
        forced = isinstance(constraint, ToolConstraint)
        message, reasoning = renderer.assistant_reply(text, tools, forced, call_id)
        finish = "tool_calls" if message.tool_calls else completion.finish_reason
        error = None
    else:
        message, reasoning, finish, error = reply_for(
            renderer, text, tools, constraint, completion.finish_reason, max_tokens, call_id
        )
    if not parallel_tool_calls and len(message.tool_calls) > 1:
        message = replace(message, tool_calls=message.tool_calls[:1])
    return ChatChoice(
        message,
        text,
        list(prompt_ids),
        list(completion.ids),
        list(completion.logprobs),
        finish,
        reasoning,
        error,
        completion.top_logprobs,
    )


def cut_at_stop(text: str, stop: list[str]) -> str:
    """Text up to the first stop string (which is left out, as OpenAI does)."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


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
