"""`looprl serve`: an OpenAI-compatible HTTP server in front of a `ChatModel`.

Endpoints: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/chat/completions` (wire format in `looprl/openai/wire.py`),
`POST /v1/completions` (`looprl/openai/completions.py`) and `POST /v1/responses` (the
Responses API, translated to the chat path by `looprl/openai/responses.py`;
`previous_response_id` reads an in-memory store of the newest responses). A served run
answers to three model ids: "NAME" (the variant chosen with `--variant`, "trained" by default),
"NAME:trained" and "NAME:baseline".

A request's path: the parsed body (`ChatCompletionRequest`, or `CompletionRequest` with
one request per prompt) → one typed `ChatRequest` (`openai/wire.py` `chat_request`) →
`ChatModel.prepare`, which validates and renders it and builds its engine
`GenerationRequest` once → the engine's `Completion`s → `ChatChoice`s
(`openai/replies.py` `chat_choice`, the builder the agent proxy uses too) → the body.

Batching (apps/batcher.py): one worker thread owns the model and keeps a running batch
open; a request joins it at the next decode step, whatever its sampling settings, and
leaves it when it is done. A long prompt is prefilled in chunks between decode steps.
A client that disconnects (or times out) before its reply is complete cancels its
request: the route races its reply against the server's disconnect message, and a
stream that the server closes cancels its requests too; their rows leave the batch at
the next step. The waiting and the streaming are in `apps/serve_wait.py`; the API key
check (`apps/serve_auth.py`) is a plain ASGI middleware, which lets the disconnect reach
the route. `GET /health` counts the batcher's decode steps and live rows.

Streaming (`stream: true`): the request carries an `on_token` callback; the engine calls
it on the worker thread for each token as it is sampled, and the callback hands the
token to the request's event loop, where `openai/streaming.py` turns tokens into chunks.
The response starts once the first token (or an error) is there, so a malformed request
still gets its 4xx status rather than an error inside a stream.

Every error reaches the client as an OpenAI-style body `{"error": {...}}`: 400 for a
malformed request, 401 for a wrong API key, 404 for an unknown model or route, and a
500 without a traceback for a bug (the traceback goes to the server log).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from looprl.apps.batcher import Batcher
from looprl.apps.inference import ChatModel
from looprl.apps.serve_auth import BearerKey
from looprl.apps.serve_wait import ClientGone, stream_replies, wait_for
from looprl.engine.running import CHUNK_TOKENS
from looprl.errors import RequestError
from looprl.openai import responses as responses_api
from looprl.openai.completions import (
    CompletionRequest,
    completion_requests,
    echo_text,
    legacy_logprobs,
    text_completion,
)
from looprl.openai.streaming import ChatStream, CompletionStream
from looprl.openai.wire import (
    APIError,
    ChatCompletionRequest,
    ChatRequest,
    chat_request,
    completion_response,
    error_body,
    model_list,
    validation_error,
)

log = logging.getLogger("looprl.apps.serve")
DEFAULT_MAX_TOKENS = 256  # when a request sets neither max_tokens nor max_completion_tokens


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
    max_tokens_limit: int | None = None,
    prefill_chunk_tokens: int = CHUNK_TOKENS,
) -> FastAPI:
    """The FastAPI app serving `model`; its batcher runs while the app does.
    `max_tokens_limit`: the most tokens a request may ask for (default: the model's
    context length); a request asking for more gets a 400 that states the limit.
    `prefill_chunk_tokens`: prompt tokens prefilled per decode step (a longer prompt is
    prefilled in chunks of this size between the running rows' steps)."""
    if default_variant is not None and default_variant not in model.variants:
        raise RequestError(
            f"--variant {default_variant}: {model.name} has the variants "
            f"{', '.join(model.variants)}"
        )
    ids = model_ids(model, default_variant)
    batcher = Batcher(model, batch_window_s, prefill_chunk_tokens)
    limit = max_tokens_limit or model.context_length
    limit_source = (
        "the server's --max-tokens-limit" if max_tokens_limit else "the model's context length"
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="looprl serve", lifespan=lifespan)
    app.state.batcher = batcher
    _install_error_handlers(app)

    if api_key:
        app.add_middleware(BearerKey, api_key=api_key, prefix="/v1/")

    def variant_of(model_id: str) -> str:
        if model_id not in ids:
            raise APIError(
                404,
                f"The model {model_id!r} does not exist; this server serves: {', '.join(ids)}",
                "model",
                "model_not_found",
            )
        return ids[model_id]

    def check_max_tokens(asked: int | None, param: str = "max_tokens") -> int:
        """The request's token limit checked against the server's; the default for
        a request that sets none."""
        if asked is not None and limit is not None and asked > limit:
            raise APIError(
                400,
                f"{param}={asked} is more than this server allows: at most {limit} tokens "
                f"({limit_source}); ask for fewer",
                param,
            )
        return min(DEFAULT_MAX_TOKENS, limit or DEFAULT_MAX_TOKENS)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model.name,
            "variants": list(model.variants),
            "live_rows": batcher.live_rows(),
            "decode_steps": batcher.decode_steps,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(list(ids))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        variant_of(model_id)
        return model_list([model_id])["data"][0]

    def typed(body: ChatCompletionRequest) -> ChatRequest:
        """The typed request of a chat body: its variant, token limit and arguments."""
        variant = variant_of(body.model)
        asked = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return chat_request(body, variant, check_max_tokens(asked, param))

    async def answer(body: ChatCompletionRequest, raw: Request | None = None) -> dict[str, Any]:
        """The whole `chat.completion` body for a request (the Responses route's path)."""
        request = typed(body)
        variant = request.variant
        (choices,) = await wait_for(batcher, [batcher.submit(request)], raw)
        return completion_response(
            choices, body.model, model.tokenizer, bool(body.logprobs), f"looprl-{variant}"
        )

    store = responses_api.ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        async def answer_this(body: ChatCompletionRequest) -> dict[str, Any]:
            return await answer(body, request)

        status, body, parsed = await responses_api.respond(await request.body(), answer_this, store)
        if status == 200 and parsed is not None and parsed.stream:
            events = responses_api.response_events(body)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(body, status_code=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        if not body.stream:
            return await answer(body, raw)
        request = typed(body)
        fingerprint = f"looprl-{request.variant}"
        logprobs = bool(body.logprobs)

        def respond(results: list[Any]) -> dict[str, Any]:
            return completion_response(
                results[0], body.model, model.tokenizer, logprobs, fingerprint
            )

        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": fingerprint,
        }
        live = not request.tools or request.tool_choice == "none"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChatStream(
            head, body.n, live, logprobs, model.tokenizer, request.stop, include_usage
        )
        return await stream_replies(batcher, [request], body.n, writer, respond, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        variant = variant_of(body.model)
        check_max_tokens(body.max_tokens)
        requests = completion_requests(body, variant)
        tokenizer = model.tokenizer
        echoes = [echo_text(r.prompt, tokenizer) if body.echo else "" for r in requests]  # type: ignore[arg-type]
        fingerprint = f"looprl-{variant}"
        logprobs = body.logprobs is not None

        def respond(results: list[Any]) -> dict[str, Any]:
            return text_completion(results, echoes, body.model, tokenizer, logprobs, fingerprint)

        if not body.stream:
            futures = [batcher.submit(r) for r in requests]
            return respond(await wait_for(batcher, futures, raw))
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "system_fingerprint": fingerprint,
        }
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        choice_echoes = [echo for echo in echoes for _ in range(body.n)]
        stops = [r.stop for r in requests for _ in range(body.n)]

        def legacy(entries: list, offset: int) -> dict[str, Any]:
            return legacy_logprobs(entries, offset, tokenizer)

        writer = CompletionStream(
            head, choice_echoes, legacy if logprobs else None, tokenizer, stops, include_usage
        )
        return await stream_replies(batcher, requests, body.n, writer, respond, raw)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, err: ClientGone) -> JSONResponse:
        body = error_body("the client closed the connection", "client_closed_request")
        return JSONResponse(body, status_code=499)

    @app.exception_handler(RequestError)
    async def inference_error(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(str(err), param=err.param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        if request.url.path.rstrip("/").endswith("/v1/completions"):
            fields = set(CompletionRequest.model_fields) | {"include_usage"}
            error = validation_error(err.errors(), fields, "'model' and 'prompt'")
        else:
            error = validation_error(err.errors())
        return JSONResponse(error.body(), status_code=400)

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


@contextlib.contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Run `app` on a free port of `host` in a background thread and yield its base URL,
    until the block ends (tests and benchmarks drive a real server this way)."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def run_server(
    model: ChatModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    default_variant: str | None = None,
    max_tokens_limit: int | None = None,
) -> None:
    """Serve until Ctrl-C."""
    import uvicorn

    app = create_app(model, default_variant, api_key, max_tokens_limit=max_tokens_limit)
    uvicorn.run(app, host=host, port=port, log_level="info")
