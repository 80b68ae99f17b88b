"""One forward pass of the hf engine's running batch: k tokens appended to every row, the
logits after the last of them kept for the next sample. With k > 1 (jump-forward: a
forced call's fixed tokens fed at once) it also gives the forced tokens' logprobs, their
output projection run a chunk of rows at a time so that a jump never holds [C, k, vocab]
logits."""

from __future__ import annotations

from typing import Any

import torch

from looprl.engine.compiled_step import CompiledStep
from looprl.engine.sampling import (
    Row,
    alternatives_lists,
    tempered_rows,
    to_host,
    top_alternatives,
)
from looprl.forward.kv import Part
from looprl.forward.prefix import prefix_kwargs
from looprl.forward.score import decoder_and_head

FORCED_LOGIT_ROWS = 256  # positions whose full-vocabulary logits a jump-forward step holds


def batch_forward(
    model: Any,
    device: torch.device,
    running: Part,
    tokens_CK: torch.Tensor,
    rows: list[Row],
    temperature: float | list[float],
    top_k: int,
    compiled: CompiledStep | None = None,
) -> tuple[torch.Tensor | None, list | None]:
    """Append k tokens to every row of the running batch and keep the logits after the
    last of them (`running.logits_CV`). Rows that had finished get masked columns
    (their KV stays exactly their own). With k > 1 (jump-forward), also the logprobs
    of tokens 2..k at `temperature` (and their `top_k` alternatives): [C, k - 1].
    A one-token step runs `compiled`'s fixed-shape graph where it applies."""
    k = tokens_CK.shape[1]
    width = running.width
    if running.attention_CL.shape[1] < width + k:  # transformers' growing cache
        grow = width + k - running.attention_CL.shape[1]
        running.attention_CL = torch.nn.functional.pad(running.attention_CL, (0, grow))
    live_C = torch.tensor([not row.done for row in rows], dtype=running.attention_CL.dtype)
    running.attention_CL[:, width : width + k] = live_C.to(running.attention_CL.device)[:, None]
    for row in rows:
        row.fed += 0 if row.done else k
    if compiled is not None and compiled.applies(running, k):
        running.logits_CV = compiled.run(model, running, tokens_CK)
        running.width += 1
        running.next_pos_C = running.next_pos_C + 1
        return None, None
    steps = torch.arange(k, device=running.next_pos_C.device)
    inputs = dict(
        input_ids=tokens_CK.to(device),
        attention_mask=running.attention_CL[:, : width + k],
        position_ids=running.next_pos_C[:, None] + steps,
        cache=running.cache,
        use_cache=True,
        **prefix_kwargs(running.prefix),
    )
    split = decoder_and_head(model) if k > 1 else None
    rest: tuple[torch.Tensor | None, list | None] = (None, None)
    if split is None:
        out = model(**inputs, logits_to_keep=k)
        logits_CKV = out.logits.float()  # kept on the device: sampling runs there
        running.logits_CV = logits_CKV[:, -1]
        if k > 1:
            rest = forced_logprobs(logits_CKV[:, :-1], tokens_CK, temperature, top_k)
    else:
        # the output projection runs a few rows at a time: a jump of k tokens over C
        # rows never holds [C, k, vocab] logits (64 rows x 20 tokens: 250 MB a copy)
        decoder, head = split
        out = decoder(**inputs)
        hidden_CKH = out.last_hidden_state
        running.logits_CV = head(hidden_CKH[:, -1]).float()
        per_row = temperature if isinstance(temperature, list) else None
        chunk = max(1, FORCED_LOGIT_ROWS // (k - 1))
        parts, tops = [], [] if top_k else None
        for start in range(0, len(rows), chunk):
            end = start + chunk
            logits = head(hidden_CKH[start:end, :-1]).float()
            own = temperature if per_row is None else per_row[start:end]
            logp, top = forced_logprobs(logits, tokens_CK[start:end], own, top_k)
            parts.append(logp)
            if tops is not None:
                tops += top
        rest = (torch.cat(parts), tops)
    running.cache = out.cache
    running.width += k
    running.next_pos_C = running.next_pos_C + k
    return rest


def forced_logprobs(
    logits_CKV: torch.Tensor, tokens_CK: torch.Tensor, temperature: float | list[float], top_k: int
) -> tuple[torch.Tensor, list | None]:
    """The logprobs of tokens_CK[:, 1:] (on the host) under logits_CKV (the positions
    before them, on the device), at each row's temperature, and their top_k alternatives
    (None without): computed on the device, one copy to the host."""
    logp_CKV = tempered_rows(logits_CKV, temperature)
    later_CK = tokens_CK[:, 1:].to(logits_CKV.device, non_blocking=True)
    crossing = [logp_CKV.gather(-1, later_CK[:, :, None]).squeeze(-1)]
    if top_k:
        crossing += top_alternatives(logits_CKV, temperature, top_k)
    host = to_host(*crossing)
    return host[0], alternatives_lists(*host[1:]) if top_k else None
