"""The calls the agent proxy served (`ModelCall`), and how it compares an agent's
messages with them: what makes two messages the same turn, whether a request extends an
earlier call's conversation, which other choice a message continues, and a message
shortened for an explanation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from looprl.types import Message


@dataclass
class ModelCall:
    """One served call: the request as the agent sent it and the exact tokens."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    reply: Message  # the assistant message we returned (tool call ids included)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    alternatives: list[Message] = field(default_factory=list)  # choices 1.. when n > 1


def history(call: ModelCall) -> list[Message]:
    return [*call.messages, call.reply]


def alternative(tip: ModelCall, messages: list[Message], i: int) -> int:
    """Which of the tip's other choices (1..) message `i` is, or 0 for none."""
    if i != len(tip.messages) or i >= len(messages):
        return 0
    keys = [turn_key(m) for m in tip.alternatives]
    return keys.index(turn_key(messages[i])) + 1 if turn_key(messages[i]) in keys else 0


def turn_key(m: Message) -> tuple:
    """What makes two messages the same turn (tool call ids and parse details aside)."""
    calls = [(c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls]
    return (m.role, m.content or "", calls, m.tool_call_id, m.name)


def is_prefix(head: list[Message], messages: list[Message]) -> bool:
    return len(head) <= len(messages) and all(
        turn_key(a) == turn_key(b) for a, b in zip(head, messages)
    )


def short(m: Message, limit: int = 80) -> str:
    calls = ", ".join(f"{c.name}({json.dumps(c.arguments)})" for c in m.tool_calls)
    text = (m.content or "") + (f" [calls: {calls}]" if calls else "")
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")
