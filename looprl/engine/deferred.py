"""Decode steps whose sampled tokens stay on the logits' device for a few steps.

A row needs its tokens on the host at every step only for what the host does with
them: advancing a grammar, looking for a stop string, thinking's end marker, a forced
closing, streaming each token to a caller, or listing its top alternatives. When no
live row of a batch needs any of that (a training rollout's plain replies), the sampled
ids [C] and their logprobs [C] stay where they were drawn, the next forward pass reads
the ids there, and they cross to the host together every `FLUSH_EVERY` steps (or when
a row reaches its token limit, which the host knows without them): on a GPU, one wait
for the device in eight steps instead of one a step. On the CPU the tensors already are
on the host, so there is nothing to save and the steps past a row's end would cost:
the same code runs with a copy every step (`CPU_FLUSH_EVERY`; the tests set it to 8 to
run the trimming below).

Rows learn that they ended (EOS) at the copy: up to `FLUSH_EVERY - 1` tokens past their
end were sampled and fed to the model meanwhile. Those are dropped, their KV columns
masked and uncounted (`Row.fed`), so the row's cache is what a step-by-step decode
leaves; its tokens are the same ones, as each row draws from its own random stream at
its own positions (engine/random_stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from looprl.engine.forward_step import batch_forward
from looprl.engine.sampling import Row, settings, to_host
from looprl.forward.kv import Part

FLUSH_EVERY = 8  # decode steps between two copies of the sampled tokens to the host
# on the CPU the "copy" is free and a step past a row's end is not: a copy every step
CPU_FLUSH_EVERY = 1


@dataclass
class Pending:
    """Tokens sampled but not yet on the host: per step, the ids and logprobs [C] on the
    device, and the KV column each step's tokens went to (the last step's, before its
    forward pass, none yet)."""

    ids: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    columns: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.ids)


def deferrable(rows: list[Row], params: Any, streaming: bool) -> bool:
    """Whether no live row needs its tokens on the host at every step."""
    return not streaming and all(
        row.done
        or (
            row.matcher is None
            and not settings(row, params).stop
            and row.on_token is None
            and not row.top_k
            and row.think_end is None
            and not row.forced
        )
        for row in rows
    )


def deferred_step(
    engine: Any, running: Part, rows: list[Row], params: Any, pending: Pending
) -> list[Row]:
    """`HFEngine._step` for a batch where `deferrable` holds: sample every live row's
    next token on the device, copy the pending tokens to the host when it is time, and
    run the new tokens through the model. Returns the rows that ended."""
    temperature = engine._temperatures(rows, params)
    ids_C, logp_C = engine._sample(running.logits_CV.float(), params, rows, pending.steps)
    pending.ids.append(ids_C)
    pending.logprobs.append(logp_C)
    at_limit = any(not r.done and len(r.ids) + pending.steps >= r.limit for r in rows)
    ending: list[Row] = []  # rows whose last token is this step's: done after its pass
    ended: list[Row] = []
    every = CPU_FLUSH_EVERY if ids_C.device.type == "cpu" else FLUSH_EVERY
    if pending.steps >= every or at_limit:
        ending, ended = _flush(engine, running, rows, params, pending)
    last = {row.index for row in ending}
    if any(not row.done and row.index not in last for row in rows):
        if pending.steps:  # not copied yet: its column, in case its row has ended
            pending.columns.append(running.width)
        step = (running, ids_C[:, None], rows, temperature, 0, engine.compiled)
        batch_forward(engine.model, engine.device, *step)
    for row in ending:  # as a step-by-step decode: the last token goes through the model
        row.done = True
        row.finish = engine._finish_reason(row, params)
    return ended + ending


def _flush(
    engine: Any, running: Part, rows: list[Row], params: Any, pending: Pending
) -> tuple[list[Row], list[Row]]:
    """Copy the pending tokens to the host and give each live row its own, up to its
    end. Returns the rows whose end is this step's token (still to go through the model)
    and those that ended at an earlier step (done now: their later tokens dropped, their
    columns masked)."""
    ids_CN, logp_CN = to_host(torch.stack(pending.ids, 1), torch.stack(pending.logprobs, 1))
    last = pending.steps - 1
    ending, ended = [], []
    for j, row in enumerate(rows):
        if row.done:
            continue
        tokens = ids_CN[j].tolist()
        room = row.limit - len(row.ids)  # the n-th token (from 0) ends the row at n + 1 >= room
        stops = [n for n, t in enumerate(tokens) if t in engine.stop_token_ids or n + 1 >= room]
        n = stops[0] if stops else last
        row.ids += tokens[: n + 1]
        row.logprobs += logp_CN[j].tolist()[: n + 1]
        if not stops:
            continue
        if n == last:
            ending.append(row)
            continue
        dropped = pending.columns[n + 1 :]  # fed after its end
        running.attention_CL[j, dropped] = 0
        row.fed -= len(dropped)
        row.done = True
        row.finish = engine._finish_reason(row, params)
        ended.append(row)
    pending.ids, pending.logprobs, pending.columns = [], [], []
    return ending, ended
