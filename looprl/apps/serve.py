"""`looprl serve`: an OpenAI-compatible HTTP server in front of a `ChatModel`.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` (wire format in
`looprl/openai/wire.py`), `POST /v1/responses` (the Responses API, translated to the chat
path by `looprl/openai/responses.py`; `previous_response_id` reads an in-memory store of
the newest responses). A served run answers to three model ids: "NAME" (the variant
chosen with `--variant`, "trained" by default), "NAME:trained" and "NAME:baseline".

Batching: one worker thread owns the model. It takes the first waiting request, keeps
collecting the ones that arrive within `batch_window_s` (and all that queued up while
the engine was busy), and answers them with one `ChatModel.chat_many` call, which
shares engine calls between requests with the same sampling settings.

Every error reaches the client as an OpenAI-style body `{"error": {...}}`: 400 for a
malformed request, 401 for a wrong API key, 404 for an unknown model or route, and a
500 without a traceback for a bug (the traceback goes to the server log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from looprl.apps.inference import ChatModel
from looprl.errors import RequestError
from looprl.openai.responses import ResponseStore, respond, response_events
from looprl.openai.wire import (
    APIError,
    ChatCompletionRequest,
    chat_kwargs,
    completion_response,
    error_body,
    model_list,
    stream_events,
    validation_error,
)

log = logging.getLogger("looprl.apps.serve")
DEFAULT_MAX_TOKENS = 256  # when a request sets neither max_tokens nor max_completion_tokens


class Batcher:
    """A worker thread answering queued chat requests in batches (see module doc)."""

    def __init__(self, model: ChatModel, window_s: float = 0.005, max_requests: int = 64) -> None:
        self.model = model
        self.window_s = window_s
        self.max_requests = max_requests
        self._queue: queue.Queue[tuple[dict, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="looprl-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, request: dict) -> Future:
        """Queue `ChatModel.chat` kwargs; the future holds the choices or the error."""
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.window_s
            stopping = False
            while len(batch) < self.max_requests:
                wait = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._answer(batch)
            if stopping:
                return

    def _answer(self, batch: list[tuple[dict, Future]]) -> None:
        live = [
            (request, future) for request, future in batch if future.set_running_or_notify_cancel()
        ]
        try:
            results = self.model.chat_many([r for r, _ in live], return_exceptions=True)
        except Exception as err:  # a bug outside any single request: fail them all
            results = [err] * len(live)
        for (_, future), result in zip(live, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def model_ids(model: ChatModel, default_variant: str | None = None) -> dict[str, str]:
    """Model id → variant: "NAME" is the default variant, "NAME:VARIANT" each variant."""
    default = default_variant or model.variants[0]
    ids = {model.name: default}
    ids.update({f"{model.name}:{v}": v for v in model.variants})
    return ids


def create_app(
    model: ChatModel,
    default_variant: str | None = None,
    api_key: str | None = None,
    batch_window_s: float = 0.005,
) -> FastAPI:
    """The FastAPI app serving `model`; its batcher runs while the app does."""
    if default_variant is not None and default_variant not in model.variants:
        raise RequestError(
            f"--variant {default_variant}: {model.name} has the variants "
            f"{', '.join(model.variants)}"
        )
    ids = model_ids(model, default_variant)
    batcher = Batcher(model, batch_window_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="looprl serve", lifespan=lifespan)
    app.state.batcher = batcher
    _install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Any:
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(given.encode(), api_key.encode()):
                message = "Incorrect API key provided: pass it as 'Authorization: Bearer KEY'."
                body = error_body(message, "invalid_request_error", None, "invalid_api_key")
                return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name, "variants": list(model.variants)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(list(ids))

    async def answer(body: ChatCompletionRequest) -> dict[str, Any]:
        """The `chat.completion` body for a request (the Responses route uses it too)."""
        if body.model not in ids:
            raise APIError(
                404,
                f"The model {body.model!r} does not exist; this server serves: {', '.join(ids)}",
                "model",
                "model_not_found",
            )
        variant = ids[body.model]
        kwargs = chat_kwargs(body, variant, DEFAULT_MAX_TOKENS)
        choices = await asyncio.wrap_future(batcher.submit(kwargs))
        return completion_response(
            choices, body.model, model.tokenizer, bool(body.logprobs), f"looprl-{variant}"
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        response = await answer(body)
        if not body.stream:
            return response
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream_events(response, include_usage), media_type="text/event-stream"
        )

    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        status, body, parsed = await respond(await request.body(), answer, store)
        if status == 200 and parsed is not None and parsed.stream:
            return StreamingResponse(response_events(body), media_type="text/event-stream")
        return JSONResponse(body, status_code=status)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestError)
    async def inference_error(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(err), param=err.param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(err.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        body = error_body(str(err.detail), param=None, code=code)
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        log.error("error while serving %s", request.url.path, exc_info=err)
        message = f"the server failed to answer ({type(err).__name__}); see the server log"
        return JSONResponse(error_body(message, "server_error"), status_code=500)


def run_server(
    model: ChatModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    default_variant: str | None = None,
) -> None:
    """Serve until Ctrl-C."""
    import uvicorn

    app = create_app(model, default_variant, api_key)
    uvicorn.run(app, host=host, port=port, log_level="info")
