"""The model calls of concurrent agents gathered into `engine.generate` batches: a batch
is sampled once every live agent waits for its reply, or once the oldest call has waited
`BATCH_WAIT_S` (runner.py's docstring tells the whole story)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from looprl.engine import Completion, GenerationRequest, RolloutEngine, SamplingParams
from looprl.seeds import turn_seed

BATCH_WAIT_S = 0.25  # longest a batch waits for an agent that is neither calling nor done


@dataclass
class _Pending:
    episode: int
    request: GenerationRequest
    future: asyncio.Future


class CallBatcher:
    """Gathers the model calls of concurrent agents into `engine.generate` batches."""

    def __init__(
        self,
        engine: RolloutEngine,
        params: SamplingParams,
        live: int,
        on_progress: Callable[[int], None] | None = None,
        first_index: int = 0,
    ) -> None:
        self.engine, self.params, self.live = engine, params, live
        self.first_index = first_index
        self.total, self.on_progress = live, on_progress
        self.pending: list[_Pending] = []
        self.batches = 0
        self.oldest = 0.0  # when the oldest pending call arrived (monotonic seconds)
        self._wake = asyncio.Event()

    def caller(self, episode: int) -> Callable[[GenerationRequest], Any]:
        async def generate(request: GenerationRequest) -> Completion:
            future = asyncio.get_running_loop().create_future()
            if not self.pending:
                self.oldest = time.monotonic()
            self.pending.append(_Pending(episode, request, future))
            self._wake.set()
            return await future

        return generate

    def finished(self) -> None:
        self.live -= 1
        self._wake.set()
        if self.on_progress is not None:
            self.on_progress(self.total - self.live)

    async def run(self) -> None:
        """Until every agent has finished: flush when all live agents wait (or on timeout)."""
        while self.live > 0:
            self.pending = [p for p in self.pending if not p.future.done()]  # timed out
            waiting = {p.episode for p in self.pending}
            if not self.pending:
                await self._sleep(None)
            elif len(waiting) < self.live and time.monotonic() - self.oldest < BATCH_WAIT_S:
                await self._sleep(BATCH_WAIT_S - (time.monotonic() - self.oldest))
            else:
                self._flush()

    async def _sleep(self, timeout: float | None) -> None:
        """Until something happens (a call, an agent finishing), or `timeout` passes."""
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _flush(self) -> None:
        batch = sorted(self.pending, key=lambda p: p.episode)  # the order run_episodes uses
        self.pending = []
        seed = self.params.seed
        params = replace(self.params, seed=turn_seed(seed, self.batches))
        self.batches += 1
        for p in batch:  # an agent may call again: keep its KV for that call (see _play)
            p.request.keep_kv = True
            p.request.stream = self.first_index + p.episode  # as run_episodes
        completions = self.engine.generate([p.request for p in batch], params)
        for p, completion in zip(batch, completions):
            if not p.future.done():
                p.future.set_result(completion)
