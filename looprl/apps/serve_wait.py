"""How a route of `looprl serve` waits for its replies: the results of its requests, or
their tokens streamed as they are sampled; a client that disconnects while it waits
cancels its requests (`ClientGone`).

The departure is watched, not polled: while a route waits, a task waits on the ASGI
`receive` for the server's `http.disconnect` (the request body is read by then, so that
message is the only one left to come), and the route races its replies against it. The
moment the client's connection closes (it timed out, was closed, or its process died),
the requests are cancelled in the batcher, and their rows stop before its next decode
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from looprl.apps.batcher import Batcher
from looprl.errors import RequestError
from looprl.openai.streaming import ChatStream, CompletionStream
from looprl.openai.wire import APIError, ChatRequest, error_body

log = logging.getLogger("looprl.apps.serve")  # the server's log


class ClientGone(Exception):
    """The client disconnected before its reply was ready (nobody reads the reply)."""


async def wait_for(batcher: Batcher, futures: list[Future], raw: Request | None) -> list[Any]:
    """The results of `futures`; if the client of `raw` disconnects first, cancel them
    in the batcher and raise `ClientGone`."""
    gathered = asyncio.gather(*[asyncio.wrap_future(future) for future in futures])
    try:
        await _unless_gone(gathered, raw)
        return gathered.result()
    except BaseException:  # disconnected, failed, or this task cancelled: stop them all
        for future in futures:
            batcher.cancel(future)
        gathered.cancel()
        with contextlib.suppress(BaseException):
            await gathered
        raise


async def _unless_gone(waiting: asyncio.Future, raw: Request | None) -> None:
    """Wait for `waiting`; raise `ClientGone` if the client of `raw` disconnects first."""
    if raw is None:
        await asyncio.wait({waiting})
        return
    watcher = asyncio.ensure_future(_departure(raw))
    try:
        done, _ = await asyncio.wait({waiting, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if waiting not in done:
        watcher.result()  # a failure of the watch itself is a bug: raise it
        raise ClientGone()


async def _departure(raw: Request) -> None:
    """Returns when the client of `raw` has disconnected."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def stream_replies(
    batcher: Batcher,
    requests: list[ChatRequest],
    n: int,
    writer: ChatStream | CompletionStream,
    respond: Callable[[list[Any]], dict[str, Any]],
    raw: Request,
) -> StreamingResponse:
    """Submit `requests` (each with `n` choices; request i's choice k is choice i*n + k)
    with token callbacks, and stream `writer`'s chunks as their tokens arrive. Returns
    once the first token is there, or raises the error of a request that failed first.
    A client that goes away (before the first token, or while the stream runs) cancels
    the requests that are not finished."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple | None] = asyncio.Queue()

    def on_token(offset: int) -> Callable[..., None]:
        def put(k: int, token: int, logprob: float, top: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (offset + k, token, logprob, top))

        return put

    futures = []
    for i, request in enumerate(requests):
        future = batcher.submit(replace(request, on_token=on_token(i * n)))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        futures.append(future)
    first = await _first_event(batcher, futures, events, raw)
    for future in futures:  # failed before anything was streamed: an ordinary error reply
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    async def chunks() -> AsyncIterator[str]:
        try:
            for event in writer.start():
                yield event
            item, finished = first, 0
            while True:
                if item is None:
                    finished += 1
                    if finished == len(futures):
                        break
                else:
                    for event in writer.token(*item):
                        yield event
                item = await events.get()
        finally:  # the client went away mid-stream (the server closes the generator)
            for future in futures:
                if not future.done():
                    batcher.cancel(future)
        try:
            results = [future.result() for future in futures]
        except Exception as err:  # failed mid-stream: an error event ends the stream
            yield f"data: {json.dumps(_error_of(err))}\n\n"
            return
        for event in writer.finish(respond(results)):
            yield event

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _first_event(
    batcher: Batcher, futures: list[Future], events: asyncio.Queue, raw: Request
) -> tuple | None:
    """The first streaming event; if the client disconnects before it, cancel `futures`
    and raise `ClientGone`."""
    getting = asyncio.ensure_future(events.get())
    try:
        await _unless_gone(getting, raw)
        return getting.result()
    except BaseException:
        getting.cancel()
        for future in futures:
            batcher.cancel(future)
        raise


def _error_of(err: Exception) -> dict[str, Any]:
    if isinstance(err, APIError):
        return err.body()
    if isinstance(err, RequestError):
        return error_body(str(err), param=err.param)
    log.error("error while streaming", exc_info=err)
    return error_body(f"the server failed to answer ({type(err).__name__})", "server_error")
