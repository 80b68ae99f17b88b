"""The prefix-sharing forward used by both the rollout engine and the trainer.

A batch of rows whose prompts repeat (the G samples of a task) and share a long head
(the system prompt and tool schemas of one environment) is prefilled once per distinct
prompt, on top of one pass over the common head. `shared_prefill` builds that `Part`
(see kv.py), `extend` runs more tokens on top of it, and `prefix_kwargs` passes a
cascade-attention prefix (cascade.py) to the model call.
"""

from __future__ import annotations

from typing import Any

import torch

from looprl.forward import cascade
from looprl.forward.kv import Part, bufferable, select_rows

MIN_SHARED_PREFIX = 16  # shorter common prefixes are not worth a pass of their own


def shared_prefill(
    model: Any,
    prompts: list[list[int]],
    pad_id: int,
    device: torch.device,
    min_shared: int = MIN_SHARED_PREFIX,
    use_cascade: bool | None = None,
    share_head: bool = True,
) -> Part:
    """Prefill with prefix sharing at two levels.

    1. The G samples of a task have the same prompt: each distinct prompt is prefilled
       once (cache row), and its rows point at it (`Part.cache_rows`).
    2. The distinct prompts of one env usually share a long head (system prompt, tool
       schemas): that common prefix is run once, at batch 1, and each distinct prompt
       runs only its own tail on top of it. With cascade attention (`cascade.enable`)
       the head's KV stays one copy, the part's `prefix`, and the cache holds only the
       tails; otherwise the head is copied to every cache row, the tails left-padded
       after it (the gap masked). Positions count real tokens, so every token sees
       exactly the positions and keys a plain forward of its own prompt would give it.
    `share_head=False` skips level 2 (models whose fast paths rule out a masked gap
    between the head and the tails: `looprl.model.arch.fast_paths`); the prompts are then
    left-padded to one width. Only the last position's logits are computed. Under
    autograd the shared passes receive the gradients of every row that uses them (the
    trainer relies on that)."""
    unique: dict[tuple[int, ...], int] = {}
    rows_of = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    distinct = list(unique)
    shared = 0
    if len(distinct) > 1 and share_head:
        # keep >= 1 own token per prompt: its last logits come from the tail pass
        shared = min(len(_common_prefix(distinct)), min(len(p) for p in distinct) - 1)
        shared = shared if shared >= min_shared else 0
    rows = torch.tensor(rows_of, dtype=torch.long, device=device)
    empty = torch.empty((len(distinct), 0), dtype=torch.long, device=device)
    start = Part(None, rows, empty, torch.zeros(len(distinct), dtype=torch.long, device=device))
    if shared:
        head = torch.tensor([distinct[0][:shared]], dtype=torch.long, device=device)
        cache = model(input_ids=head, use_cache=True, logits_to_keep=1).cache
        next_pos = torch.full_like(start.next_pos_C, shared)
        if use_cascade is None:
            use_cascade = cascade.enabled(model)
        if use_cascade and bufferable(cache):
            level = cascade.Level(
                [layer.keys for layer in cache.layers],
                [layer.values for layer in cache.layers],
                tokens=tuple(distinct[0][:shared]),
            )
            start = Part(None, rows, empty, next_pos, prefix=cascade.Prefix([level]))
        else:
            select_rows(cache, torch.zeros(len(distinct), dtype=torch.long, device=device))
            attention = torch.ones((len(distinct), shared), dtype=torch.long, device=device)
            start = Part(cache, rows, attention, next_pos)
    return extend(model, start, [p[shared:] for p in distinct], pad_id)


def extend(model: Any, part: Part, tails: list[list[int]], pad_id: int) -> Part:
    """Run each cache row's own tail (>= 1 token) on top of its cached columns (and the
    part's prefix), left-padded after them (the gap masked); positions continue from each
    row's next position. Returns the extended part with the logits that predict each
    row's next token."""
    device = part.next_pos_C.device
    longest = max(len(t) for t in tails)
    ids_CT = torch.full((len(tails), longest), pad_id, dtype=torch.long)
    attention_CT = torch.zeros((len(tails), longest), dtype=torch.long)
    for row, tail in enumerate(tails):
        ids_CT[row, longest - len(tail) :] = torch.tensor(tail, dtype=torch.long)
        attention_CT[row, longest - len(tail) :] = 1
    ids_CT, attention_CT = ids_CT.to(device), attention_CT.to(device)
    positions_CT = part.next_pos_C[:, None] + (attention_CT.cumsum(-1) - 1).clamp(min=0)
    attention_CL = torch.cat([part.attention_CL[:, : part.width], attention_CT], 1)
    out = model(
        input_ids=ids_CT,
        attention_mask=attention_CL,
        position_ids=positions_CT,
        cache=part.cache,
        use_cache=True,
        logits_to_keep=1,
        **prefix_kwargs(part.prefix),
    )
    next_pos = positions_CT[:, -1] + 1
    return Part(
        out.cache, part.cache_rows, attention_CL, next_pos, out.logits[:, -1, :], None, part.prefix
    )


def prefix_kwargs(prefix: cascade.Prefix | None) -> dict[str, Any]:
    """The model-call kwargs that make cascade attention read `prefix` (none without)."""
    return {} if prefix is None else {cascade.PREFIX_KWARG: prefix}


def _common_prefix(seqs: list[tuple[int, ...]]) -> tuple[int, ...]:
    first, last = min(seqs), max(seqs)  # lexicographic extremes bound every common prefix
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]
