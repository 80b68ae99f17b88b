"""The hf engine's running batch: the state of one continuously batched generation.

`HFEngine.generate` opens one, adds all its requests and steps it until it is empty;
the server keeps one open for as long as it runs and adds each request as it arrives
(`eager`), so that a short request joins a long one's generation at the next step
instead of waiting for it to end.

Each `step` first schedules (finished rows leave, waiting requests are prefilled and
join), then chooses every live row's next token and runs them through the model.

- Plain (`generate`): requests wait in order of prompt length; finished rows leave once
  a quarter of the batch has finished, and waiting ones join when a quarter of the
  slots are free (a join copies the running rows' cache, so it waits for room).
- Eager (the server): waiting requests join at the next step whenever a slot is free,
  in arrival order, at most `chunk_tokens` prompt tokens of them per step (at least
  one request; a head the prompts share counts once; no limit while no row runs), so
  that a burst of arrivals does not stall the running rows. The head that the prompts
  of one prefill share (system prompt, tool schemas) is kept, and a later request that
  starts with it prefills only the rest of its prompt. A prompt
  longer than `chunk_tokens` is prefilled in chunks of that size, one chunk per step
  between the running rows' decode steps, and joins once it is whole. A cancelled row
  stops at once (no more tokens, no result) and leaves at the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from looprl.engine import Completion, GenerationRequest, SamplingParams
from looprl.engine.deferred import Pending
from looprl.engine.sampling import Row
from looprl.forward.kv import Part, Retained, from_retained, merge, release, retain, select
from looprl.forward.prefix import MIN_SHARED_PREFIX, extend, shared_prefill

CHUNK_TOKENS = 512  # eager mode: prompt tokens prefilled per step (and the chunk size)
HEADS_KEPT = 4  # eager mode: shared prompt heads kept for later requests


@dataclass
class Chunked:
    """A long prompt being prefilled chunk by chunk (with the requests that share it)."""

    indices: list[int]
    prompt: list[int]
    done: int = 0  # prompt tokens prefilled so far
    part: Part | None = None


@dataclass
class RunningBatch:
    """Requests being generated together by one engine (see module doc)."""

    engine: Any  # the HFEngine whose model, rows and steps these are
    params: SamplingParams  # the call-wide settings (a request's `sampling` overrides)
    base_seed: int
    eager: bool = False
    chunk_tokens: int = CHUNK_TOKENS
    previous: list[Retained] = field(default_factory=list)  # a session's kept rows
    keep_rows: bool = False  # inside a session: keep the rows marked `keep_kv`
    requests: dict[int, GenerationRequest] = field(default_factory=dict)
    waiting: deque[int] = field(default_factory=deque)
    running: Part | None = None
    rows: list[Row] = field(default_factory=list)
    chunked: Chunked | None = None
    # eager mode: the prompt heads of recent prefills (system prompt, tool schemas), so
    # that a later request starting with one prefills only the rest of its prompt
    heads: list[Retained] = field(default_factory=list)
    # tokens sampled but still on the device (engine/deferred.py): no scheduling until
    # they are on the host, as the rows' ends are not known before
    pending: Pending = field(default_factory=Pending)
    _next_index: int = 0

    # ------------------------------------------------------------ public

    def add(self, requests: list[GenerationRequest]) -> list[int]:
        """Queue requests; their indices (a request's default random stream is its index).
        Plain mode orders them by prompt length, eager mode keeps their arrival order."""
        indices = list(range(self._next_index, self._next_index + len(requests)))
        self._next_index += len(requests)
        self.requests.update(zip(indices, requests))
        if self.eager:
            self.waiting.extend(indices)
        else:
            self.waiting.extend(sorted(indices, key=lambda i: len(self.requests[i].prompt_ids)))
        return indices

    def cancel(self, index: int) -> None:
        """Stop request `index`: it never runs, or its row stops now and leaves at the next
        step; no completion is returned for it."""
        if index in self.waiting:
            self.waiting.remove(index)
        elif self.chunked is not None and index in self.chunked.indices:
            self.chunked.indices.remove(index)
            if not self.chunked.indices:
                if self.chunked.part is not None:
                    release(self.chunked.part)
                self.chunked = None
        for row in self.rows:
            if row.index == index and not row.done:
                row.done = row.cancelled = True
        self.requests.pop(index, None)

    @property
    def busy(self) -> bool:
        """Whether a `step` has work: requests to run, or finished rows still to drop
        (their last step keeps a session's KV)."""
        return bool(self.waiting or self.chunked or self.rows)

    @property
    def live_rows(self) -> int:
        """Rows being decoded now (a cancelled or finished one no longer counts, nor one
        whose completion was handed over before its last step ended)."""
        return sum(not row.done and row.index in self.requests for row in self.rows)

    @property
    def batch_rows(self) -> int:
        """Rows in the running batch's cache, finished ones not yet dropped included."""
        return len(self.rows)

    def step(
        self, deliver: Callable[[int, Completion], None] | None = None
    ) -> list[tuple[int, Completion]]:
        """Schedule, then one decode step of every live row (and, in eager mode, one chunk
        of a long prompt): the (index, completion) of each request that finished. With
        `deliver`, each is handed to it instead, as soon as it is final: a row that ends
        with a sampled token before the model runs the other rows' tokens."""
        self._schedule()
        if self.chunked is not None and self.chunked.done < len(self.chunked.prompt):
            self._prefill_chunk()
        if not any(not row.done for row in self.rows):
            return []
        out: list[tuple[int, Completion]] = []
        handed: set[int] = set()

        def hand(rows: list[Row]) -> None:
            for row in rows:
                if row.index in handed:
                    continue
                handed.add(row.index)
                top = row.top if row.top_k else None
                request = self.requests.pop(row.index)
                done = Completion(row.ids, row.logprobs, row.finish, top, row.free)
                if request.on_complete is not None:
                    request.on_complete()
                if deliver is None:
                    out.append((row.index, done))
                else:
                    deliver(row.index, done)

        early = hand if deliver else None
        hand(self.engine._step(self.running, self.rows, self.params, early, self.pending))
        return out

    def close(self) -> None:
        """Free the batch's caches (its unfinished requests are dropped)."""
        for part in (self.running, self.chunked.part if self.chunked else None):
            if part is not None:
                release(part)
        self.running, self.rows, self.chunked = None, [], None
        self.pending = Pending()
        self.waiting.clear()
        self.requests.clear()

    # ------------------------------------------------------------ scheduling

    def _schedule(self) -> None:
        """Drop finished rows and admit waiting requests, when it pays."""
        if self.pending.steps:
            return
        engine, rows, running = self.engine, self.rows, self.running
        live = [j for j, row in enumerate(rows) if not row.done]
        chunk_ready = self.chunked is not None and self.chunked.done == len(self.chunked.prompt)
        reserved = len(self.chunked.indices) if self.chunked is not None else 0
        free = engine.batch_size - len(live) - reserved
        can_join = not live or (running is not None and engine._plain(running.cache))
        join = bool(self.waiting) and free > 0 and can_join
        if join and live and free < max(1, engine.batch_size // 4) and not self.eager:
            join = False  # a merge copies the running rows' cache: wait for more room
        join_chunk = chunk_ready and can_join
        finished = len(rows) - len(live)
        cancelled = any(row.cancelled for row in rows)
        drop = finished and (not live or 4 * finished >= len(rows) or cancelled)
        if not join and not join_chunk and not drop:
            return
        if self.keep_rows and running is not None and engine._plain(running.cache):
            for j, row in enumerate(rows):
                if row.done and row.keep_kv and not row.cancelled:
                    tokens = tuple(row.prompt) + tuple(row.ids[: row.fed])
                    engine._retained.append(retain(running, j, tokens))
        if running is not None and not live:
            release(running)  # before the next prefill: never two batch caches at once
        parts, keep = [], []
        if live:
            parts.append(running)
            keep.append(torch.tensor(live, dtype=torch.long, device=engine.device))
        admitted: list[int] = []
        if join_chunk:
            chunked, self.chunked = self.chunked, None
            parts.append(chunked.part)
            keep.append(torch.arange(len(chunked.indices), device=engine.device))
            admitted += chunked.indices
            free -= len(chunked.indices)
        new = self._admit(free) if join else []
        previous = self.heads if self.eager else self.previous
        for indices, part in prefill(engine, self.requests, new, previous):
            if self.eager:
                self._keep_head(part)
            parts.append(part)
            keep.append(torch.arange(len(indices), device=engine.device))
            admitted += indices
        if not self.waiting:
            self.previous.clear()  # every request has its prefill: free the kept KV
        rows = [rows[j] for j in live]
        rows += [engine._row(i, self.requests[i], self.params, self.base_seed) for i in admitted]
        self.rows = rows
        if not rows:
            self.running = None
            return
        room = max(row.limit - len(row.ids) for row in rows)
        if all(engine._plain(part.cache) for part in parts):
            multiple = engine.compiled.column_multiple
            self.running = merge(parts, keep, room, trim=self.eager, multiple=multiple)
        else:
            self.running = select(parts[0], keep[0])  # only one part: see can_join

    def _keep_head(self, part: Part) -> None:
        """Keep the head a prefill shared between its prompts (its cascade prefix), for
        the next requests that start with it (the most recent `HEADS_KEPT`)."""
        if part.prefix is None or len(part.prefix.levels) != 1:
            return
        level = part.prefix.levels[0]
        if any(head.tokens == level.tokens for head in self.heads):
            return
        keys, values = [k[0] for k in level.keys], [v[0] for v in level.values]
        self.heads = [*self.heads, Retained(level.tokens, None, keys, values)][-HEADS_KEPT:]

    def _admit(self, free: int) -> list[int]:
        """The waiting requests to prefill now. Plain mode: as many as there are free
        slots. Eager mode: in arrival order up to `chunk_tokens` distinct prompt tokens
        (at least one request); a longer prompt starts its chunked prefill instead."""
        if not self.eager:
            return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        new: list[int] = []
        seen: set[tuple[int, ...]] = set()
        budget = self.chunk_tokens
        idle = not any(not row.done for row in self.rows)  # no running row to hold up
        first: list[int] | None = None
        while self.waiting and len(new) < free:
            prompt = self.requests[self.waiting[0]].prompt_ids
            if len(prompt) > self.chunk_tokens:
                if self.chunked is None and free - len(new) > 0:
                    self._start_chunked(free - len(new))
                break
            cost = 0 if tuple(prompt) in seen else _tail_cost(prompt, first, self.heads)
            if new and cost > budget and not idle:
                break
            budget -= cost
            seen.add(tuple(prompt))
            first = first if first is not None else list(prompt)
            new.append(self.waiting.popleft())
        return new

    def _start_chunked(self, free: int) -> None:
        """Take the first waiting request (and the waiting ones with the same prompt: the
        choices of one request) into a chunked prefill."""
        first = self.waiting.popleft()
        prompt = list(self.requests[first].prompt_ids)
        indices = [first]
        for i in list(self.waiting):
            if len(indices) < free and list(self.requests[i].prompt_ids) == prompt:
                self.waiting.remove(i)
                indices.append(i)
        self.chunked = Chunked(indices, prompt)

    def _prefill_chunk(self) -> None:
        """Run the next chunk of the long prompt being prefilled."""
        engine, chunked = self.engine, self.chunked
        assert chunked is not None
        piece = chunked.prompt[chunked.done : chunked.done + self.chunk_tokens]
        if chunked.part is None:
            prompts = [piece] * len(chunked.indices)
            chunked.part = shared_prefill(engine.model, prompts, engine.pad_id, engine.device)
        else:
            chunked.part = extend(engine.model, chunked.part, [piece], engine.pad_id)
        chunked.done += len(piece)


def _tail_cost(prompt: list[int], first: list[int] | None, heads: list[Retained]) -> int:
    """The prompt tokens a prefill beside `first` runs for this prompt: its tail after a
    kept head it starts with, or after the head it shares with `first` when that is long
    enough to be run once (prefix.py)."""
    kept = [len(h.tokens) for h in heads if tuple(prompt[: len(h.tokens)]) == h.tokens]
    if kept and max(kept) < len(prompt):
        return len(prompt) - max(kept)
    if first is None:
        return len(prompt)
    shared = 0
    for a, b in zip(prompt, first):
        if a != b:
            break
        shared += 1
    return len(prompt) - shared if shared >= MIN_SHARED_PREFIX else len(prompt)


def prefill(
    engine: Any, requests: dict[int, GenerationRequest], new: list[int], previous: list[Retained]
) -> list[tuple[list[int], Part]]:
    """Prefill the admitted requests `new` on `engine`'s model: those that extend a kept
    row (an episode's next turn) run only their new tokens on top of it, the others
    share prefixes."""
    found: dict[int, Retained] = {}
    for i in new:
        prompt = requests[i].prompt_ids
        best = None
        for entry in previous:
            n = len(entry.tokens)
            longer = best is None or n > len(best.tokens)
            if n < len(prompt) and longer and tuple(prompt[:n]) == entry.tokens:
                best = entry
        if best is not None:
            found[i] = best
    out = []
    fresh = [i for i in new if i not in found]
    if fresh:
        prompts = [requests[i].prompt_ids for i in fresh]
        part = shared_prefill(
            engine.model,
            prompts,
            engine.pad_id,
            engine.device,
            use_cascade=engine.cascade,
            share_head=engine.paths.shared_head,
        )
        out.append((fresh, part))
    if found:
        indices = list(found)
        tails = [requests[i].prompt_ids[len(found[i].tokens) :] for i in indices]
        start = from_retained([found[i] for i in indices], max(len(t) for t in tails))
        out.append((indices, extend(engine.model, start, tails, engine.pad_id)))
    return out
