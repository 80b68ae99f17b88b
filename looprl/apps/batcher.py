"""The server's continuous batching: one worker thread owns the engine and keeps one
running batch per variant open (engine/running.py, eager mode), stepping it while any
request is in it.

A request's path: `submit` prepares it (validation, chat template, tokenizing, grammar
compiling) on a small thread pool, so that a huge prompt never holds up the engine;
the prepared request's choices then join its variant's running batch at the next
decode step, whatever their sampling settings (each row carries its own temperature,
top_p, stop strings, seed and token limit). A prompt longer than `chunk_tokens` is
prefilled in chunks between decode steps. Variants that cannot share a forward pass (a
LoRA run's "trained" and "baseline") take turns step by step, so neither starves.

`cancel` (a client that disconnected or timed out) takes the request's rows out at the
next step: they stop generating and their slots are free again. `decode_steps` counts
the steps that decoded rows since the start (the server's `GET /health` shows it beside
`live_rows`), so that work done for nobody can be seen.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from looprl.apps.inference import ChatModel, Prepared
from looprl.engine import Completion, SamplingParams
from looprl.engine.running import CHUNK_TOKENS, RunningBatch

log = logging.getLogger("looprl.apps.batcher")
PREPARE_THREADS = 2  # requests rendered and tokenized at once, beside the engine


@dataclass
class Ticket:
    """A request in the engine: where its choices are and what they have produced."""

    prepared: Prepared
    future: Future
    indices: list[int] = field(default_factory=list)  # its choices' rows in the batch
    done: dict[int, Completion] = field(default_factory=dict)


class Batcher:
    """A worker thread answering chat requests by continuous batching (see module doc).
    `window_s`: when idle, how long the first request waits for others to arrive with
    it (their prompts are then prefilled together, sharing their common head)."""

    def __init__(
        self, model: ChatModel, window_s: float = 0.005, chunk_tokens: int = CHUNK_TOKENS
    ) -> None:
        self.model = model
        self.window_s = window_s
        self.chunk_tokens = chunk_tokens
        self._inbox: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="looprl-batcher", daemon=True)
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="looprl-prepare")
        self._batches: dict[str, RunningBatch] = {}
        self._tickets: dict[tuple[str, int], Ticket] = {}  # (variant, row index) -> ticket
        self._by_future: dict[int, Ticket] = {}  # id(future) -> ticket, while it runs
        self._turn = 0  # which variant's batch steps next
        self.decode_steps = 0  # steps that decoded live rows, since the start (any variant)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def submit(self, request: Any) -> Future:
        """Queue a request (a `ChatRequest`); the future holds its choices or the error."""
        future: Future = Future()
        self._pool.submit(self._prepare, request, future)
        return future

    def cancel(self, future: Future) -> None:
        """The caller went away: stop the request's rows at the next step."""
        self._inbox.put(("cancel", future))

    def live_rows(self) -> int:
        """Rows being decoded now, over all variants (a cancelled row no longer counts)."""
        return sum(batch.live_rows for batch in list(self._batches.values()))

    # ------------------------------------------------------------ worker

    def _prepare(self, request: Any, future: Future) -> None:
        if future.cancelled():
            return
        try:
            prepared = self.model.prepare(request)
        except Exception as err:
            if future.set_running_or_notify_cancel():
                future.set_exception(err)
            return
        self._inbox.put(("add", (prepared, future)))

    def _loop(self) -> None:
        while True:
            busy = any(batch.busy for batch in self._batches.values())
            items = self._collect(busy)
            if items is None:  # stopping: what is still running gets an error reply
                for variant in list(self._batches):
                    self._fail(variant, RuntimeError("the server is shutting down"))
                return
            for kind, payload in items:
                if kind == "add":
                    self._add(*payload)
                else:
                    self._cancel(payload)
            self._step_one()

    def _collect(self, busy: bool) -> list[tuple[str, Any]] | None:
        """The inbox's items: all that are there; when idle, wait for the first and
        those that come within `window_s` of it. None: stop."""
        items: list[tuple[str, Any]] = []
        if not busy:
            first = self._inbox.get()
            if first is None:
                return None
            items.append(first)
            deadline = time.monotonic() + self.window_s
            while (wait := deadline - time.monotonic()) > 0:
                try:
                    item = self._inbox.get(timeout=wait)
                except queue.Empty:
                    break
                if item is None:
                    return None
                items.append(item)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if item is None:
                return None
            items.append(item)

    def _add(self, prepared: Prepared, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        variant = prepared.variant
        try:
            batch = self._batches.get(variant)
            if batch is None:
                with self.model.engine_for(variant) as engine:
                    batch = engine.open_batch(
                        SamplingParams(), eager=True, chunk_tokens=self.chunk_tokens
                    )
                self._batches[variant] = batch
            ticket = Ticket(prepared, future)
            ticket.indices = batch.add(self.model.choice_requests(prepared))
        except Exception as err:  # a bug: this request fails, the others go on
            future.set_exception(err)
            return
        for index in ticket.indices:
            self._tickets[(variant, index)] = ticket
        self._by_future[id(future)] = ticket

    def _cancel(self, future: Future) -> None:
        ticket = self._by_future.pop(id(future), None)
        if ticket is None:
            return  # finished (or failed) already
        variant = ticket.prepared.variant
        for index in ticket.indices:
            self._batches[variant].cancel(index)
            self._tickets.pop((variant, index), None)
        if not future.done():
            future.set_exception(CancelledError())

    def _step_one(self) -> None:
        """One step of the next variant's batch that has work (round robin)."""
        busy = [v for v, batch in self._batches.items() if batch.busy]
        if not busy:
            return
        variant = busy[self._turn % len(busy)]
        self._turn += 1
        batch = self._batches[variant]
        if batch.live_rows:
            self.decode_steps += 1
        try:
            with (
                self.model.engine_lock,
                self.model.engine_for(variant) as engine,
                torch.inference_mode(),
            ):
                batch.step(lambda index, done: self._finished(variant, index, done, engine))
        except Exception as err:  # a bug: fail this batch's requests, start a fresh one
            log.error("the engine failed while batching", exc_info=err)
            self._fail(variant, err)

    def _finished(self, variant: str, index: int, completion: Completion, engine: Any) -> None:
        ticket = self._tickets.pop((variant, index), None)
        if ticket is None:
            return
        ticket.done[index] = completion
        if len(ticket.done) < len(ticket.indices):
            return
        self._by_future.pop(id(ticket.future), None)
        try:
            completions = [ticket.done[i] for i in ticket.indices]
            choices = self.model.choices(ticket.prepared, completions, engine)
        except Exception as err:
            ticket.future.set_exception(err)
            return
        ticket.future.set_result(choices)

    def _fail(self, variant: str, err: Exception) -> None:
        batch = self._batches.pop(variant)
        batch.close()
        for key in [key for key in self._tickets if key[0] == variant]:
            ticket = self._tickets.pop(key)
            self._by_future.pop(id(ticket.future), None)
            if not ticket.future.done():
                ticket.future.set_exception(err)
