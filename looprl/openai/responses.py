"""The OpenAI Responses API (`POST /v1/responses`), answered through the chat path.

A Responses request is translated into a `ChatCompletionRequest` and answered by the
caller's chat function, so `looprl serve` batches it and the agent proxy records and
stitches it exactly as a chat call; the chat reply is translated back:
- `instructions` → a system message first; `input` (a string: one user message; or
  items: messages with `input_text`/`output_text` parts, `function_call` items, which
  join the assistant message before them as its tool calls, and `function_call_output`
  items, which become tool messages) → the messages that follow; `reasoning` items are
  skipped, as the chat path drops `reasoning_content`;
- flat function tools (`name`, `description`, `parameters` at the top level) → chat
  tools; `tool_choice` auto/none/required/`{"type": "function", "name"}`;
  `max_output_tokens` → `max_completion_tokens`; `temperature`, `top_p`;
  `text.format` → `response_format`, accepted as far as the chat path accepts it (with
  a forced `tool_choice` the call is the reply, as in the OpenAI API);
- the reply → output items: a `reasoning` item for `<think>` text, a `message` with one
  `output_text` part (left out when the reply is only tool calls), one `function_call`
  per tool call (`call_id` = the chat call id), and `usage`. A reply cut by the token
  limit is `status: "incomplete"` (`incomplete_details.reason: "max_output_tokens"`).

State. `previous_response_id` continues a stored response: a `ResponseStore` keeps, in
memory, the conversation behind each of the newest `limit` responses (its input and
output, without its instructions, which are not carried over, as in the OpenAI API);
`store: false` keeps a response out. An unknown or forgotten id is a 400.

Streaming. The reply is generated whole, then sent as the documented server-sent
events: `response.created`, `response.in_progress`, per output item
`response.output_item.added`, its content (`response.content_part.added`, one
`response.output_text.delta`, `response.output_text.done`, `response.content_part.done`,
or `response.function_call_arguments.delta` and `.done`), `response.output_item.done`,
then `response.completed` (`response.incomplete` for a cut reply).

Not supported (a clear 400): non-function tools, non-text input parts, other item types,
`include`, `top_logprobs`, `background`, `conversation` and stored `prompt`s.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic

from looprl.errors import RequestError
from looprl.openai.responses_input import (
    FIELDS,
    ResponsesRequest,
    chat_request,
    input_messages,
    renamed,
)
from looprl.openai.responses_output import response_body, response_events
from looprl.openai.wire import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    ToolCallIn,
    validation_error,
)

__all__ = ["ResponseStore", "ResponsesRequest", "respond", "response_events"]

STORE_LIMIT = 1024  # responses a ResponseStore remembers for previous_response_id

# ---------------------------------------------------------------- state


class ResponseStore:
    """The conversations behind the newest `limit` stored responses, in memory, for
    `previous_response_id` (a restart forgets them; so does a flood of newer ones)."""

    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit = limit
        self._conversations: OrderedDict[str, list[ChatMessage]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, conversation: list[ChatMessage]) -> None:
        with self._lock:
            self._conversations[response_id] = conversation
            while len(self._conversations) > self.limit:
                self._conversations.popitem(last=False)

    def conversation(self, response_id: str) -> list[ChatMessage]:
        """The input and output of `response_id` and of those it continued."""
        with self._lock:
            found = self._conversations.get(response_id)
        if found is None:
            raise APIError(
                400,
                f"previous_response_id {response_id!r} is unknown: it was stored with "
                f"store=false, or forgotten (looprl keeps the newest {self.limit} responses "
                "in memory, and none across restarts); send the whole conversation as input",
                "previous_response_id",
                "previous_response_not_found",
            )
        return list(found)


# ---------------------------------------------------------------- answering

Complete = Callable[[ChatCompletionRequest], Awaitable[dict[str, Any]]]


async def respond(
    raw: bytes, complete: Complete, store: ResponseStore
) -> tuple[int, dict[str, Any], ResponsesRequest | None]:
    """Answer one `/v1/responses` body with `complete` (a chat request → its
    `chat.completion` body, raising APIError or RequestError when refused):
    (HTTP status, JSON body, the parsed request)."""
    try:
        request = ResponsesRequest.model_validate_json(raw)
    except pydantic.ValidationError as err:
        # the deepest error first: for `input` (a string or items) the item's own error
        errors = sorted(err.errors(), key=lambda e: -len(e.get("loc", ())))
        error = validation_error(errors, FIELDS, "'model' and 'input'")
        if len(errors[0].get("loc", ())) == 2 and errors[0]["loc"][0] == "input":
            error = APIError(400, "input must be a string or a list of input items", "input")
        return 400, error.body(), None
    try:
        history = []
        if request.previous_response_id:
            history = store.conversation(request.previous_response_id)
        conversation = history + input_messages(request.input)
        chat = chat_request(request, conversation)
        try:
            completion = await complete(chat)
        except (APIError, RequestError) as err:
            raise renamed(err) from None
    except APIError as err:
        return err.status, err.body(), request
    body = response_body(request, completion)
    if request.store is not False:
        store.put(body["id"], [*conversation, _assistant(completion)])
    return 200, body, request


def _assistant(completion: dict[str, Any]) -> ChatMessage:
    """The reply as the chat message a later call's history holds."""
    message = completion["choices"][0]["message"]
    calls = [
        ToolCallIn(id=c["id"], function=FunctionCall(**c["function"]))
        for c in message.get("tool_calls", [])
    ]
    return ChatMessage(role="assistant", content=message["content"], tool_calls=calls or None)
