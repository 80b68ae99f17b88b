"""The routes of the in-process OpenAI endpoint: one agent request → its `httpx.Response`.

Both transports of an agent's client (the async `ProxyTransport` in proxy.py and the sync
one in sync_proxy.py) answer through `answer`: `POST /v1/chat/completions` and
`POST /v1/responses` (looprl/openai/responses.py) from the episode's `AgentSession`,
`GET /v1/models`, and an OpenAI-style 404 for anything else.
"""

from __future__ import annotations

from typing import Any

from looprl.openai.responses import respond, response_events
from looprl.openai.wire import error_body, model_list, stream_events

try:  # the HTTP library the installed openai client is built on
    import httpx2 as httpx
except ImportError:  # pragma: no cover - openai < 3 uses httpx
    try:
        import httpx  # type: ignore[no-redef]
    except ImportError:
        raise ImportError("agent environments need the openai client: pip install openai") from None

MODEL_ID = "looprl-policy"  # what /v1/models lists; any model name is accepted


async def answer(session: Any, method: str, path: str, body: bytes) -> Any:
    """The `httpx.Response` to one request of an agent's client (`session`: its
    `AgentSession`)."""
    path = path.rstrip("/")
    events: Any = None
    if method == "POST" and path.endswith("/chat/completions"):
        status, reply, parsed = await session.chat(body)
        if status == 200 and parsed is not None and parsed.stream:
            usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            events = stream_events(reply, usage)
    elif method == "POST" and path.endswith("/responses"):
        status, reply, request = await respond(body, session.complete, session.responses)
        if status == 200 and request is not None and request.stream:
            events = response_events(reply)
    elif method == "GET" and path.endswith("/models"):
        status, reply = 200, model_list([MODEL_ID])
    else:
        message = (
            "looprl's agent proxy serves POST /v1/chat/completions and POST /v1/responses, "
            f"not {method} {path}"
        )
        status, reply = 404, error_body(message, code="not_found")
    if events is not None:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, content="".join(events).encode(), headers=headers)
    return httpx.Response(status, json=reply)
