"""Choosing tokens per decoding row: top-k / top-p filtering, an exact inverse-CDF draw
at one uniform from each row's own random stream, the top alternatives of a position
(`top_logprobs`), and which of a row's tokens its grammar forced (`advance_grammar`).

The draw runs where the logits are (one code path for CPU and GPU): tempering, logit
bias, the grammar's mask, forced tokens, top-k/top-p, the uniforms and the inverse CDF.
Only the chosen ids, their logprobs and any top alternatives cross to the host, in one
copy per step (`to_host`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from looprl.algo.logprobs import scoring_temperature, tempered_log_softmax
from looprl.engine.random_stream import stream_uniforms

CDF_BLOCK = 512  # tokens per block of the two-level inverse CDF


def inverse_cdf(probs_LV: torch.Tensor, uniform_L: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability (float64) exceeds U * total:
    a draw from the row's distribution for U ~ U[0, 1). A token chosen this way has
    p > 0 (its cumulative sum steps past the target there).

    Two levels instead of one cumsum over the vocabulary: float64 block sums and their
    cumsum find the block that holds the target, then a cumsum within that block alone
    finds the token. Identical to the full cumsum except where the target lies within
    float64 rounding (~1e-16) of a boundary; a full float64 cumsum over 32 x 49,152
    probabilities takes ~8.6 ms on 2 CPU cores, this ~0.7 ms. Where rounding puts the
    target past the end of its block (or of the distribution), the last token with p > 0
    up to there is taken: found for every row in its block at once (no per-row loop, no
    wait on the device), the last block with mass standing in where the target passed the
    total."""
    rows, vocab = probs_LV.shape
    pad = (-vocab) % CDF_BLOCK
    padded = torch.nn.functional.pad(probs_LV, (0, pad)) if pad else probs_LV
    blocks_LNB = padded.reshape(rows, -1, CDF_BLOCK)
    n_blocks = blocks_LNB.shape[1]
    sums_LN = blocks_LNB.sum(-1, dtype=torch.float64)
    block_cdf_LN = sums_LN.cumsum(-1)
    target_L = uniform_L.to(torch.float64) * block_cdf_LN[:, -1]
    block_L = torch.searchsorted(block_cdf_LN, target_L[:, None], right=True).squeeze(-1)
    # past the total: the last block with mass (its cumsum ends at the total, so the
    # search within it runs past its end too)
    order_N = torch.arange(n_blocks, device=probs_LV.device)
    last_full_L = torch.where(sums_LN > 0, order_N, 0).amax(-1)
    inside_L = torch.where(block_L >= n_blocks, last_full_L, block_L)
    index_L = torch.arange(rows, device=probs_LV.device)
    before_L = block_cdf_LN[index_L, (inside_L - 1).clamp(min=0)].masked_fill(inside_L == 0, 0.0)
    block_LB = blocks_LNB[index_L, inside_L]
    cdf_LB = block_LB.cumsum(-1, dtype=torch.float64) + before_L[:, None]
    offset_L = torch.searchsorted(cdf_LB, target_L[:, None], right=True).squeeze(-1)
    order_B = torch.arange(CDF_BLOCK, device=probs_LV.device)
    last_L = torch.where(block_LB > 0, order_B, 0).amax(-1)  # the block's last p > 0
    return inside_L * CDF_BLOCK + torch.where(offset_L >= CDF_BLOCK, last_L, offset_L)


def filter_top_k_top_p(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits_BV, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass *before* it already reaches top_p (keeps >= 1 token)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def settings(row: Row, params: Any) -> Any:
    """The sampling settings a row draws with: its request's own, else the call's."""
    return params if row.sampling is None else row.sampling


def sample_rows(
    logits_CV: torch.Tensor,
    params: Any,
    rows: list[Row],
    pad_id: int,
    bitmask: Callable[[int], torch.Tensor],
    ahead: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every live row (pad for finished ones) and its unconstrained
    logprob at the row's temperature T, both on the logits' device. Rows whose requests
    carry their own settings (`GenerationRequest.sampling`) are drawn in groups of equal
    (T, top_p, top_k); a batch with one group (every training call) takes the
    single-group path unchanged. `ahead`: tokens sampled, not yet in `ids` (deferred.py)."""
    groups: dict[tuple, list[int]] = {}
    for j, row in enumerate(rows):
        own = settings(row, params)
        groups.setdefault((own.temperature, own.top_p, own.top_k), []).append(j)
    if len(groups) <= 1:
        own = settings(rows[0], params) if rows else params
        return _sample_group(logits_CV, own, rows, pad_id, bitmask, ahead)
    device = logits_CV.device
    tokens_C = torch.full((len(rows),), pad_id, dtype=torch.long, device=device)
    logp_C = torch.zeros(len(rows), dtype=torch.float32, device=device)
    for members in groups.values():
        index = torch.tensor(members).to(device, non_blocking=True)
        group = [rows[j] for j in members]
        tokens, logp = _sample_group(
            logits_CV[index], settings(group[0], params), group, pad_id, bitmask, ahead
        )
        tokens_C[index] = tokens
        logp_C[index] = logp.to(logp_C.dtype)
    return tokens_C, logp_C


def choose(
    logits_CV: torch.Tensor,
    rows: list[Row],
    jump: list[list[int]] | None,
    sample: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    temperature: float | list[float],
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor, list | None]:
    """The rows' next tokens [C, k] on the host (the jump-forward's k >= 2 `jump`, else
    `sample`'s draw from the logits, k = 1), the first one's logprob [C, 1] and its
    `top_k` alternatives (None without), computed where the logits lie: only these cross
    to the host, in one copy."""
    crossing: dict[str, torch.Tensor] = {}
    if jump is not None:
        tokens_CK = torch.tensor(jump, dtype=torch.long)
        first_CK = tokens_CK[:, :1].to(logits_CV.device, non_blocking=True)
        crossing["logp"] = tempered_rows(logits_CV, temperature).gather(-1, first_CK)[:, 0]
    else:
        crossing["ids"], crossing["logp"] = sample(logits_CV)
    if top_k:
        top = top_alternatives(logits_CV[:, None], temperature, top_k)
        crossing["top_values"], crossing["top_ids"] = top
    host = dict(zip(crossing, to_host(*crossing.values())))
    if jump is None:
        tokens_CK = host["ids"][:, None]
    tops = alternatives_lists(host["top_values"], host["top_ids"]) if top_k else None
    return tokens_CK, host["logp"][:, None], tops


def _sample_group(
    logits_CV: torch.Tensor,
    params: Any,
    rows: list[Row],
    pad_id: int,
    bitmask: Callable[[int], torch.Tensor],
    ahead: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_rows` for rows that share one temperature, top_p and top_k, all on the
    logits' device. Sampling inverts the row's cumulative distribution at the row's
    uniform for its position (engine/random_stream.py): a multinomial draw, independent
    of the other rows (cdf[i] > U * total >= cdf[i - 1] implies p[i] > 0)."""
    device = logits_CV.device
    logits_CV = logits_CV.contiguous()  # softmax over a strided vocabulary is slow
    scale = scoring_temperature(params.temperature)
    scaled_CV, logp_CV = tempered_log_softmax(logits_CV, scale)
    live = [j for j, row in enumerate(rows) if not row.done]
    if not live:
        tokens_C = torch.full((len(rows),), pad_id, dtype=torch.long, device=device)
        return tokens_C, logp_CV.gather(-1, tokens_C[:, None]).squeeze(-1)
    # the live rows' indices, stream keys and positions: one small copy to the device
    plan_3L = torch.tensor(
        [live, [rows[j].key for j in live], [len(rows[j].ids) + ahead for j in live]]
    )
    live_L, keys_L, positions_L = plan_3L.to(device, non_blocking=True)
    everyone = len(live) == len(rows)
    candidates_LV = constrained(
        scaled_CV if everyone else scaled_CV[live_L], [rows[j] for j in live], scale, bitmask
    )
    if params.temperature <= 0:
        chosen_L = candidates_LV.argmax(dim=-1)
    else:
        candidates_LV = filter_top_k_top_p(candidates_LV, params.top_k, params.top_p)
        uniform_L = stream_uniforms(keys_L, positions_L)
        chosen_L = inverse_cdf(torch.softmax(candidates_LV, dim=-1), uniform_L)
    if everyone:
        tokens_C = chosen_L
    else:
        tokens_C = torch.full((len(rows),), pad_id, dtype=torch.long, device=device)
        tokens_C[live_L] = chosen_L
    return tokens_C, logp_CV.gather(-1, tokens_C[:, None]).squeeze(-1)


def constrained(
    candidates_LV: torch.Tensor,
    live: list[Row],
    scale: float,
    bitmask: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """The live rows' tempered logits with each row's logit_bias (divided by T, as the
    logits are), its grammar's mask and its forced token applied; a copy where any
    applies (the logprobs come from the unconstrained logits), on their device."""
    device, copied = candidates_LV.device, False

    def writable() -> torch.Tensor:
        nonlocal candidates_LV, copied
        if not copied:
            candidates_LV, copied = candidates_LV.clone(), True
        return candidates_LV

    biased = [n for n, row in enumerate(live) if row.logit_bias]
    if biased:
        at = torch.cat([torch.full_like(live[n].bias_ids, n) for n in biased])
        ids = torch.cat([live[n].bias_ids for n in biased])
        values = torch.cat([live[n].bias_values for n in biased]).to(candidates_LV.dtype) / scale
        writable().index_put_((at.to(device), ids.to(device)), values.to(device), accumulate=True)
    grammar = [
        n
        for n, row in enumerate(live)
        if row.matcher is not None and not row.matcher.is_terminated()
    ]
    if grammar:
        mask_NW = bitmask(len(grammar))[: len(grammar)]
        for slot, n in enumerate(grammar):
            live[n].matcher.fill_next_token_bitmask(mask_NW, slot)
        from looprl.engine.grammar import apply_bitmask

        apply_bitmask(writable(), mask_NW, grammar)
    forced = [(n, row.forced[0]) for n, row in enumerate(live) if row.forced]
    if forced:  # a closing the engine writes: only its next token stays open
        at, token = torch.tensor(forced).T.to(device, non_blocking=True)
        out = writable()
        kept = out[at, token]
        out[at] = float("-inf")
        out[at, token] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
    return candidates_LV


def top_alternatives(
    logits_CKV: torch.Tensor, temperature: float | list[float], k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and position, the k most likely tokens of `log_softmax(logits / T)` (their
    logprobs [C, K, k] and ids, on the logits' device): the same distribution the
    recorded logprobs come from, so the sampled token's logprob equals its entry here
    whenever it is among the k. `temperature`: one T for all rows, or each row's."""
    return tempered_rows(logits_CKV, temperature).topk(k, dim=-1)


def alternatives_lists(
    values_CKk: torch.Tensor, ids_CKk: torch.Tensor
) -> list[list[list[tuple[int, float]]]]:
    """`top_alternatives`' tensors (on the host) as per row, per position, (id, logprob)."""
    return [
        [list(zip(ids, values)) for ids, values in zip(row_ids, row_values)]
        for row_ids, row_values in zip(ids_CKk.tolist(), values_CKk.tolist())
    ]


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, in one copy from their device: flattened to float64
    (exact for token ids below 2^53 and for float32 logprobs), concatenated, copied, and
    split back to their shapes and dtypes. Host tensors come back as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out


def tempered_rows(logits_C_: torch.Tensor, temperature: float | list[float]) -> torch.Tensor:
    """log_softmax(logits / T) over the last dimension, with one T for all rows or a T
    per row (the first dimension). Dividing a row by its own T gives the same bits as
    dividing the batch by a common T, so a row's logprobs do not depend on its
    neighbours' temperatures."""
    if isinstance(temperature, list) and len(set(temperature)) == 1:
        temperature = temperature[0]
    if not isinstance(temperature, list):
        return tempered_log_softmax(logits_C_, temperature)[1]
    shape = (len(temperature),) + (1,) * (logits_C_.dim() - 1)
    per_row = torch.tensor(temperature, dtype=logits_C_.dtype).view(shape)
    return torch.log_softmax(logits_C_ / per_row.to(logits_C_.device), dim=-1)


@dataclass
class Row:
    """A request being decoded: its index in the request list, token limit, grammar
    matcher (forced calls), random stream's key, and what it has produced so far."""

    index: int
    prompt: list[int]
    limit: int
    matcher: Any
    key: int  # its random stream's key (engine/random_stream.py)
    keep_kv: bool = False  # inside a session: keep its KV for the next turn
    top_k: int = 0  # alternatives to keep per position (top_logprobs)
    on_token: Any = None  # streaming: called with each token as it is chosen
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    done: bool = False
    finish: str = "length"
    fed: int = 0  # generated tokens that went through the model (their KV is cached)
    # thinking before a forced call: over once `think_end` appears in the text (None: no
    # thinking, or over); at `think_limit` tokens the engine writes `think_close` itself
    think_end: str | None = None
    think_close: str = ""
    think_limit: int = 0
    think_seen: int = 0  # generated tokens already searched for `think_end`
    forced: list[int] = field(default_factory=list)  # tokens of that closing still to write
    # under a grammar: per generated token, 1 if the grammar left a choice about it, 0 if
    # it forced it (`Completion.free`); None: no grammar, or not recorded
    free: list[int] | None = None
    off_grammar: bool = False  # the grammar rejected a token: it knows nothing after it
    # the request's own SamplingParams (temperature, top_p, top_k, stop); None: the call's
    sampling: Any = None
    cancelled: bool = False  # its caller went away: it left the batch without a result
    logit_bias: dict[int, float] | None = None  # token id → added to its logit (the request's)
    bias_ids: torch.Tensor | None = field(default=None, repr=False)  # logit_bias as tensors,
    bias_values: torch.Tensor | None = field(default=None, repr=False)  # built once

    def __post_init__(self) -> None:
        if self.logit_bias:
            self.bias_ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
            self.bias_values = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)


def advance_grammar(row: Row, token: int, tokenizer: Any, bitmask_1W: torch.Tensor) -> None:
    """Let the row's grammar accept `token`, first noting in `row.free` (where it keeps
    one) whether the grammar left a choice about it: `is_forced` on the state before the
    token, as `free_tokens` (loop/decisions.py) finds by replaying the grammar over the
    finished completion. Past the grammar's end a token is forced; from a token the grammar
    rejects on (sampling under its mask produces none) every token counts as free.
    `bitmask_1W`: scratch space, one row of xgrammar's token bitmask."""
    from looprl.engine.grammar import is_forced

    matcher = row.matcher
    if matcher.is_terminated():
        if row.free is not None:
            row.free.append(1 if row.off_grammar else 0)
        return
    if row.free is None:
        matcher.accept_token(token)
        return
    forced = not row.off_grammar and is_forced(matcher, token, tokenizer, bitmask_1W)
    if not matcher.accept_token(token):
        row.off_grammar = True
    row.free.append(0 if forced and not row.off_grammar else 1)


def thinking_fields(constraint: Any) -> dict[str, Any]:
    """The `Row` fields of a request's thinking (none without it)."""
    from looprl.engine import ToolConstraint
    from looprl.engine.grammar import thinking_marks

    if not isinstance(constraint, ToolConstraint) or constraint.thinking.mode == "off":
        return {}
    end, close = thinking_marks(constraint.thinking, constraint.fmt)
    return {"think_end": end, "think_close": close, "think_limit": constraint.thinking.max_tokens}


def advance_thinking(rows: list[Row], tokenizer: Any) -> None:
    """After new tokens: end the thinking of rows whose text now holds its end marker,
    and queue the closing of those that reached their thinking token limit (or, when the
    text then ends inside a character split over tokens, at the first token after)."""
    for row in rows:
        if row.done or row.think_end is None or row.forced:
            continue
        # the new tokens (a jump-forward may add many) and a few before: the marker's
        # tokens all lie there, however it was tokenized
        tail = tokenizer.decode(row.ids[max(0, row.think_seen - len(row.think_end) - 8) :])
        row.think_seen = len(row.ids)
        if row.think_end in tail:
            row.think_end = None
        elif len(row.ids) >= row.think_limit:
            closing = tokenizer.encode(row.think_close, add_special_tokens=False)
            # not inside a character whose bytes are split over tokens: the closing must
            # be what the grammar accepts next (else one more token completes it first)
            probe = row.matcher.fork()
            if all(probe.accept_token(token) for token in closing):
                row.forced = closing
