"""The OpenAI chat-completions wire format, converted to and from looprl's types.

Used by `looprl serve` and by anything else that speaks the OpenAI API in front of a
`ChatModel` (e.g. an in-process proxy for bring-your-own agents):
- `ChatCompletionRequest`: the request body (pydantic, strict types; unknown fields
  are ignored, as many clients send extras);
- `ChatRequest`: one request, typed, as `ChatModel` and the agent proxy take it, built
  once from the parsed body by `chat_request` (`to_messages` converts the messages);
- `completion_response`, `stream_events`: `ChatChoice`s → response body / SSE stream;
- `APIError`, `error_body`: OpenAI-style errors `{"error": {message, type, param, code}}`.

`stream_events` (from `openai/streaming.py`, which also streams replies token by token)
sends a finished reply as chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from looprl.openai.streaming import stream_events, token_logprobs  # noqa: F401 (re-exported)
from looprl.types import Message, ToolCall

# ---------------------------------------------------------------- replies


@dataclass
class ChatChoice:
    """One generated reply: the parsed message and the exact tokens behind it."""

    message: Message  # parsed assistant Message (tool_calls with ids "call_…", or content)
    text: str  # the raw decoded completion (stop strings cut off)
    prompt_ids: list[int]  # exact prompt token ids sent to the engine
    completion_ids: list[int]  # exact sampled ids (never re-tokenised)
    logprobs: list[float]  # per completion token (the engine's sampling logprobs)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    reasoning: str | None = None  # text of <think> blocks, kept out of `message.content`
    error: str | None = None  # why a forced reply is missing (cut off), as `looprl_error`
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob)
    # completions with echo + logprobs: per prompt token (logprob, alternatives)
    prompt_logprobs: list[tuple[float | None, Any]] | None = None


@dataclass
class ChatRequest:
    """One request as looprl serves it: a chat (`messages`) or a raw completion (`prompt`:
    text or token ids, no chat template). Built once from the wire's parsed body (or by
    `ChatModel.chat` / `complete`) and passed as is to the engine's request."""

    messages: list[Message] | None = None  # the conversation (a chat request)
    prompt: str | list[int] | None = None  # the raw prompt (a completion request)
    tools: list[dict[str, Any]] | None = None  # OpenAI function-format tool schemas
    tool_choice: str = "auto"  # "auto" | "none" | "required" | a tool's name
    parallel_tool_calls: bool = True  # False: a reply keeps only its first tool call
    response_format: dict[str, Any] | None = None  # OpenAI json_object / json_schema
    logit_bias: dict[str, float] | None = None  # token id (a string) → bias in [-100, 100]
    n: int = 1  # replies to sample
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256  # the most tokens of each reply
    stop: list[str] = field(default_factory=list)  # stop strings, cut off the reply
    seed: int | None = None  # a seeded request samples alone, independent of the batch
    top_logprobs: int = 0  # alternatives returned per token (up to 20)
    prompt_logprobs: bool = False  # also score the prompt's own tokens (completions)
    variant: str | None = None  # "trained" / "baseline" of a run; None: the first
    # streaming: told of each token as it is sampled, as (choice, token id, logprob, top)
    on_token: Callable[[int, int, float, Any], None] | None = field(
        default=None, compare=False, repr=False
    )


# ---------------------------------------------------------------- errors


class APIError(Exception):
    """An error the client gets back as an OpenAI-style body with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------- request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON string.")


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None


def to_messages(messages: list[ChatMessage]) -> list[Message]:
    """OpenAI messages → looprl Messages; assistant tool calls get their JSON-string
    arguments decoded, tool results get the name of the call they answer."""
    out: list[Message] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        content = _text(m.content, f"messages[{i}].content")
        role = "system" if m.role == "developer" else m.role
        calls: list[ToolCall] = []
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                raise APIError(400, f"{where} is not valid JSON", where) from None
            if not isinstance(arguments, dict):
                raise APIError(400, f"{where} must be a JSON object", where)
            calls.append(ToolCall(call.function.name, arguments, call.id))
            if call.id:
                call_names[call.id] = call.function.name
        name = None
        if role == "tool":
            name = call_names.get(m.tool_call_id or "", m.name)
        out.append(Message(role, content, calls, m.tool_call_id if role == "tool" else None, name))
    return out


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"{where}[{j}] is a {part.type!r} part; only text parts are supported",
                f"{where}[{j}].type",
            )
        texts.append(part.text)
    return "\n".join(texts)


def chat_request(request: ChatCompletionRequest, variant: str, max_tokens: int) -> ChatRequest:
    """The typed request for this body (`max_tokens`: the default when it sets none)."""
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if getattr(request, penalty):
            raise APIError(400, f"{penalty} is not supported; leave it unset or 0", penalty)
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []] or None
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        tool_choice = choice.function.name
    else:
        tool_choice = choice or ("auto" if tools else "none")
    return ChatRequest(
        messages=to_messages(request.messages),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        response_format=request.response_format,
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        max_tokens=request.max_completion_tokens or request.max_tokens or max_tokens,
        stop=stop_strings(request.stop),
        seed=request.seed,
        top_logprobs=request.top_logprobs or 0,
        logit_bias=request.logit_bias,
        variant=variant,
    )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def validation_error(
    errors: Any, field_names: set[str] | None = None, needs: str = "'model' and 'messages'"
) -> APIError:
    """The first pydantic error of a request as a 400 naming the field it is about
    (`messages[0].role`; a union's branch names are left out of the path).
    `field_names`: the request models' fields (the chat request's by default)."""
    names = _FIELD_NAMES if field_names is None else field_names
    errors = list(errors)
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    parts: list[str] = []
    for p in first.get("loc", ()):  # "body" and the names of a union's branches are skipped
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p in names:
            parts.append(f".{p}")
    param = "".join(parts).lstrip(".")
    if not param:
        return APIError(400, f"the request needs a JSON object body with {needs}")
    return APIError(400, f"{param}: {first.get('msg')}", param)


_FIELD_NAMES = {
    name
    for model in (
        ChatCompletionRequest,
        ChatMessage,
        ContentPart,
        ToolCallIn,
        FunctionCall,
        Tool,
        FunctionDef,
        NamedToolChoice,
        NamedFunction,
        StreamOptions,
    )
    for name in model.model_fields
}


# ---------------------------------------------------------------- response


def message_dict(message: Message, reasoning: str | None = None) -> dict[str, Any]:
    """A looprl assistant Message as an OpenAI response message."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or None}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call in message.tool_calls
        ]
    if reasoning:
        out["reasoning_content"] = reasoning
    return out


def logprobs_dict(choice: ChatChoice, tokenizer: Any) -> dict[str, Any]:
    """One entry per generated token (EOS included), with its alternatives when the
    request asked for `top_logprobs`."""
    tops = choice.top_logprobs or [None] * len(choice.completion_ids)
    entries = zip(choice.completion_ids, choice.logprobs, tops)
    return {"content": token_logprobs(entries, tokenizer), "refusal": None}


def completion_response(
    choices: list[ChatChoice],
    model_id: str,
    tokenizer: Any,
    logprobs: bool = False,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The `chat.completion` body for the choices of one request."""
    prompt_tokens = len(choices[0].prompt_ids) if choices else 0
    completion_tokens = sum(len(c.completion_ids) for c in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": i,
                "message": message_dict(c.message, c.reasoning),
                "logprobs": logprobs_dict(c, tokenizer) if logprobs else None,
                "finish_reason": c.finish_reason,
                **({"looprl_error": c.error} if c.error else {}),
            }
            for i, c in enumerate(choices)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def model_list(model_ids: list[str], owner: str = "looprl") -> dict[str, Any]:
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": mid, "object": "model", "created": created, "owned_by": owner}
            for mid in model_ids
        ],
    }
