"""Responses API requests (`POST /v1/responses`) and their translation to chat requests.

`ResponsesRequest` is the body (strict types; unknown fields ignored, as for chat);
`input_messages` turns its input items into chat messages and `chat_request` builds the
`ChatCompletionRequest` the chat path answers (looprl/openai/responses.py says what maps
to what). `renamed` gives an error of the chat path the names of the Responses fields.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from looprl.errors import RequestError
from looprl.openai.wire import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCallIn,
)

TEXT_PARTS = ("input_text", "output_text")

# ---------------------------------------------------------------- request


class _Strict(BaseModel):  # strict types; unknown fields are ignored, as for chat requests
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: str
    text: str | None = None


class InputItem(_Strict):
    """Any input item; `type` (or a `role` alone, for a message) says which fields count."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[TextPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[TextPart] | None = None


class FunctionTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Strict):
    type: str
    name: str | None = None


class TextFormat(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


FIELDS = {
    name
    for model in (
        ResponsesRequest,
        InputItem,
        TextPart,
        FunctionTool,
        ToolChoiceFunction,
        TextConfig,
        TextFormat,
    )
    for name in model.model_fields
} | {"schema"}


def input_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """Responses input → chat messages (see the module doc)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            if item.role is None:
                raise APIError(400, f"{where} is a message without a role", f"{where}.role")
            out.append(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")))
        elif kind == "function_call":
            call = ToolCallIn(id=item.call_id, function=_function_call(item, where))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # the same assistant turn
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise APIError(400, f"{where} needs the call_id it answers", f"{where}.call_id")
            text = _text(item.output, f"{where}.output")
            out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id))
        elif kind != "reasoning":
            raise APIError(
                400,
                f"{where} is a {kind!r} item; looprl takes message, function_call and "
                "function_call_output items (and skips reasoning items)",
                f"{where}.type",
            )
    return out


def _function_call(item: InputItem, where: str) -> FunctionCall:
    for name in ("call_id", "name"):
        if not getattr(item, name):
            raise APIError(400, f"{where} is a function_call without {name}", f"{where}.{name}")
    try:
        arguments = json.loads(item.arguments or "{}")
    except ValueError:
        raise APIError(400, f"{where}.arguments is not valid JSON", f"{where}.arguments") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.arguments must be a JSON object", f"{where}.arguments")
    return FunctionCall(name=str(item.name), arguments=item.arguments or "{}")


def _text(content: str | list[TextPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise APIError(
                400,
                f"{where}[{j}] has type {part.type!r}; only text parts "
                f"({', '.join(TEXT_PARTS)}) are supported",
                f"{where}[{j}].type",
            )
    return "\n".join(str(part.text) for part in content)


def chat_request(
    request: ResponsesRequest, conversation: list[ChatMessage]
) -> ChatCompletionRequest:
    """The chat request for `request`, whose conversation (history + input) is given."""
    _refuse_unsupported(request)
    messages = list(conversation)
    if request.instructions:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    if not messages:
        raise APIError(400, "input is empty: give a string or a list of input items", "input")
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        tools=_chat_tools(request.tools),
        tool_choice=_chat_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        temperature=request.temperature,
        top_p=request.top_p,
        max_completion_tokens=request.max_output_tokens,
        response_format=_response_format(request.text),
    )


def _refuse_unsupported(request: ResponsesRequest) -> None:
    if request.include:
        raise APIError(400, "include is not supported: leave it unset or empty", "include")
    if request.top_logprobs:
        raise APIError(400, "top_logprobs is not supported; leave it unset or 0", "top_logprobs")
    if request.background:
        raise APIError(400, "background responses are not supported", "background")
    if request.conversation is not None:
        raise APIError(
            400,
            "conversation objects are not supported; continue with previous_response_id "
            "or send the whole conversation as input",
            "conversation",
        )
    if request.prompt is not None:
        raise APIError(400, "stored prompts are not supported; send instructions", "prompt")


def _chat_tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise APIError(
                400,
                f"tools[{i}] is a {tool.type!r} tool; looprl serves function tools only",
                f"tools[{i}].type",
            )
        if not tool.name:
            raise APIError(
                400,
                f"tools[{i}] has no name; a Responses function tool has name, description "
                "and parameters at its top level",
                f"tools[{i}].name",
            )
        function = FunctionDef(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(Tool(function=function))
    return out or None


def _chat_tool_choice(choice: str | ToolChoiceFunction | None) -> Any:
    if not isinstance(choice, ToolChoiceFunction):
        return choice
    if choice.type != "function" or not choice.name:
        raise APIError(
            400,
            'tool_choice must be auto, none, required or {"type": "function", "name": ...}',
            "tool_choice",
        )
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as the chat request's `response_format`."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {
        "name": fmt.name,
        "description": fmt.description,
        "schema": fmt.schema_,
        "strict": fmt.strict,
    }
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


# Error params of the chat path, renamed to the Responses request's fields.
_PARAMS = [
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^tools\[(\d+)\]\.function\.?"), r"tools[\1]."),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^max_(completion_)?tokens\b"), "max_output_tokens"),
]

# in messages too: the chat path's token limits are the Responses request's max_output_tokens
_TOKEN_LIMIT = re.compile(r"\bmax_(completion_)?tokens\b")


def renamed(err: APIError | RequestError) -> APIError:
    """`err` as a 400 (or its own status) naming the Responses field it is about."""
    status = err.status if isinstance(err, APIError) else 400
    message = err.message if isinstance(err, APIError) else str(err)
    param = err.param
    for pattern, name in _PARAMS:
        if param:
            param = pattern.sub(name, param).rstrip(".")
    message = message.replace("response_format", "text.format")
    message = _TOKEN_LIMIT.sub("max_output_tokens", message)
    return APIError(status, message, param, getattr(err, "code", None))
