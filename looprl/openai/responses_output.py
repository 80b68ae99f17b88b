"""Responses API replies: the `response` object built from a `chat.completion` body, and
its server-sent events when streamed (looprl/openai/responses.py says what maps to what).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from looprl.openai.responses_input import ResponsesRequest, TextConfig, ToolChoiceFunction


def response_body(request: ResponsesRequest, completion: dict[str, Any]) -> dict[str, Any]:
    """The `response` object for a request and the `chat.completion` body answering it."""
    choice = completion["choices"][0]
    message, cut = choice["message"], choice["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        reasoning = {"type": "reasoning_text", "text": message["reasoning_content"]}
        output.append(
            {
                "type": "reasoning",
                "id": _id("rs"),
                "summary": [],
                "content": [reasoning],
                "status": status,
            }
        )
    calls = message.get("tool_calls", [])
    if message["content"] or not calls:
        text = {
            "type": "output_text",
            "text": message["content"] or "",
            "annotations": [],
            "logprobs": [],
        }
        output.append(
            {
                "type": "message",
                "id": _id("msg"),
                "role": "assistant",
                "status": status,
                "content": [text],
            }
        )
    for call in calls:
        output.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = completion["usage"]
    tool_choice: Any = request.tool_choice or "auto"
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = tool_choice.model_dump()
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": completion["created"],
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": request.model,
        "instructions": request.instructions,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "store": request.store is not False,
        "text": {"format": _format_dump(request.text)},
        "truncation": "disabled",
        "metadata": request.metadata or {},
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _format_dump(text: TextConfig | None) -> dict[str, Any]:
    if text is None or text.format is None:
        return {"type": "text"}
    return text.format.model_dump(by_alias=True, exclude_none=True)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- streaming


def response_events(body: dict[str, Any]) -> Iterator[str]:
    """A finished `response` as the server-sent events of a streamed one."""
    sequence = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    start = {
        **body,
        "status": "in_progress",
        "output": [],
        "usage": None,
        "incomplete_details": None,
    }
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for index, item in enumerate(body["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for k, part in enumerate(item["content"]):
                empty = {**part, "text": ""}
                yield event("response.content_part.added", **where, content_index=k, part=empty)
                if part["text"]:
                    yield event(
                        "response.output_text.delta",
                        **where,
                        content_index=k,
                        delta=part["text"],
                        logprobs=[],
                    )
                yield event(
                    "response.output_text.done",
                    **where,
                    content_index=k,
                    text=part["text"],
                    logprobs=[],
                )
                yield event("response.content_part.done", **where, content_index=k, part=part)
        elif item["type"] == "function_call":
            started = {**item, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=index, item=started)
            arguments = item["arguments"]
            yield event("response.function_call_arguments.delta", **where, delta=arguments)
            yield event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=arguments,
            )
        else:
            yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
    yield event(final, response=body)
