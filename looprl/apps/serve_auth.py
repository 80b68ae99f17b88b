"""The API key check of `looprl serve`: `Authorization: Bearer KEY` on every path under a
prefix, else a 401 with an OpenAI-style body.

A plain ASGI middleware, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`):
that one hands the route a wrapped `receive` on which the client's departure does not
show, so a route waiting for a long reply could not tell that nobody reads it any more.
This one passes `receive` through untouched.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from looprl.openai.wire import error_body

Scope = dict[str, Any]
Receive = Any  # ASGI callables: () -> awaitable message, and message -> awaitable None
Send = Any


class BearerKey:
    """ASGI middleware: a request whose path starts with `prefix` must carry `api_key`
    as `Authorization: Bearer KEY` (the scheme in any case, as RFC 7235 has it)."""

    def __init__(self, app: Any, api_key: str, prefix: str = "/v1/") -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        if secrets.compare_digest(self._given(scope), self.api_key):
            await self.app(scope, receive, send)
            return
        message = "Incorrect API key provided: pass it as 'Authorization: Bearer KEY'."
        error = error_body(message, "invalid_request_error", None, "invalid_api_key")
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _given(scope: Scope) -> bytes:
        """The key the request carries (b"" for none or another scheme)."""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, given = value.strip().partition(b" ")
                return given.strip() if scheme.lower() == b"bearer" else b""
        return b""
