"""The tool-call text formats of open chat models: their names, which one a chat
template speaks, and the exact text a model trained on one emits for a call (parsers.py
reads such text back, leniently)."""

from __future__ import annotations

import json
import re
from typing import Any

from looprl.types import ToolCall

FORMATS = ("hermes", "llama3", "glm", "mistral")


def _dumps(value: Any) -> str:
    # HF's `tojson` filter keeps non-ASCII as is, so this matches what templates render.
    return json.dumps(value, ensure_ascii=False)


def format_tool_call(call: ToolCall, fmt: str) -> str:
    """The exact text a model trained on `fmt` emits for one call."""
    if fmt == "hermes":
        body = _dumps({"name": call.name, "arguments": call.arguments})
        return f"<tool_call>\n{body}\n</tool_call>"
    if fmt == "llama3":
        return _dumps({"name": call.name, "parameters": call.arguments})
    if fmt == "glm":
        parts = [f"<tool_call>{call.name}\n"]
        for key, value in call.arguments.items():
            text = value if isinstance(value, str) else _dumps(value)
            parts.append(f"<arg_key>{key}</arg_key>\n<arg_value>{text}</arg_value>\n")
        parts.append("</tool_call>")
        return "".join(parts)
    if fmt == "mistral":
        return format_tool_calls([call], fmt)
    raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")


def format_tool_calls(calls: list[ToolCall], fmt: str) -> str:
    """Several calls in one message; mistral puts them in one list, the others one per line."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
    if fmt == "mistral":
        # Mistral's templates echo the call id in the list, so keep it when there is one.
        items = [
            {"name": c.name, "arguments": c.arguments, **({"id": c.id} if c.id else {})}
            for c in calls
        ]
        return "[TOOL_CALLS]" + _dumps(items) if items else ""
    return "\n".join(format_tool_call(call, fmt) for call in calls)


def detect_format(chat_template: str | None, model_name: str = "") -> str:
    """Pick the tool-call format from the chat template text, else the model name."""
    template = chat_template or ""
    if "<arg_key>" in template:
        return "glm"  # checked before <tool_call>, which glm templates also contain
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "<tool_call>" in template:
        return "hermes"
    name = model_name.lower()
    if "glm" in name or re.search(r"(?<![a-z])ling", name):
        return "glm"
    if "mistral" in name:
        return "mistral"
    if "llama-3" in name or "llama3" in name:
        return "llama3"
    return "hermes"
