"""A preallocated KV cache for the decoding loop, and the row bookkeeping that lets
finished sequences leave a running batch and waiting ones join it.

transformers' `DynamicLayer` grows its keys and values with `torch.cat` at every step:
each decoding step copies the whole cache (a third of a decode step's time on CPU for a
135M model at batch 32). A `BufferLayer` writes the new keys and values in place into a
buffer sized for the whole generation and hands attention a view of the filled part.

Rows live in a shared column space. A row's KV may start after some unused columns
(left padding, or the gap between a shared prefix and a prompt's own tail); the 2D
attention mask marks which columns a row may see. Keys are cached after the rotary
embedding, so a row's columns need not be contiguous in position: merging two batches
of different lengths right-aligns both and masks the gap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from looprl.forward.cascade import Prefix


class BufferLayer(DynamicLayer):
    """One attention layer's keys and values in a [B, H, capacity, D] buffer; the first
    `length` columns are filled. `update` writes in place, never reallocates."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.buffer_keys, self.buffer_values = keys, values
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._sync()

    def _sync(self) -> None:
        self.keys = self.buffer_keys[:, :, : self.length]
        self.values = self.buffer_values[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = key_states.shape[-2]
        if self.length + k > self.buffer_keys.shape[2]:
            raise RuntimeError(
                f"KV buffer full: {self.length} + {k} > {self.buffer_keys.shape[2]} columns"
            )
        self.buffer_keys[:, :, self.length : self.length + k] = key_states
        self.buffer_values[:, :, self.length : self.length + k] = value_states
        self.length += k
        self._sync()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.buffer_keys = self.buffer_keys[indices]
        self.buffer_values = self.buffer_values[indices]
        self._sync()

    def crop(self, tokens_to_remove: int) -> None:
        self.length -= abs(tokens_to_remove)
        self._sync()


def select_rows(cache: Any, indices: torch.Tensor) -> None:
    """Keep (or repeat) the cache rows `indices`, in place, for any layer kind: keys and
    values, sliding windows, and linear attention's conv and recurrent states (which
    transformers reorders only through `reorder_cache`). An indexing op: under autograd,
    gradients of repeated rows flow back into their source row."""
    for layer in cache.layers:
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(indices)
        else:
            layer.reorder_cache(indices)


def bufferable(cache: Any) -> bool:
    """Only plain full-attention layers move into buffers; any other cache (sliding
    windows, linear attention, quantized) keeps transformers' own layers."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, BufferLayer) for layer in layers)


class Part:
    """Rows of a prefilled or running batch. Row i lives in cache row `cache_rows[i]`
    (several rows share one cache row when they share a prompt). Per cache row C: the 2D
    attention mask over the cache's columns (possibly wider than the `width` columns
    filled so far, to leave room), the next position id, and the logits that predict
    the next token. `prefix`: shared columns every row attends to before its own (the
    prompts' common head, kept once; see `cascade`), or None."""

    def __init__(
        self,
        cache: Any,
        cache_rows: torch.Tensor,
        attention_CL: torch.Tensor,
        next_pos_C: torch.Tensor,
        logits_CV: torch.Tensor | None = None,
        width: int | None = None,
        prefix: Prefix | None = None,
    ) -> None:
        self.cache = cache
        self.prefix = prefix
        self.cache_rows = cache_rows
        self.attention_CL = attention_CL
        self.next_pos_C = next_pos_C
        self.logits_CV = logits_CV
        self.width = attention_CL.shape[1] if width is None else width

    def __len__(self) -> int:
        return len(self.cache_rows)

    def expand(self) -> Part:
        """One cache row per row (an indexing op: under autograd, the gradients of all
        rows that share a prompt flow back into its one pass)."""
        select_rows(self.cache, self.cache_rows)
        rows = self.cache_rows
        return Part(
            self.cache,
            torch.arange(len(rows), device=rows.device),
            self.attention_CL[rows],
            self.next_pos_C[rows],
            None if self.logits_CV is None else self.logits_CV[rows],
            self.width,
            self.prefix,
        )


def merge(
    parts: list[Part], keep: list[torch.Tensor], room: int, trim: bool = False, multiple: int = 1
) -> Part:
    """A running batch of the rows `keep[j]` of each `parts[j]`, right-aligned in one
    column space with `room` free columns for the tokens still to come. Every part's
    cache must be `bufferable`. Each row gets its own cache row (copied once here).
    Parts whose prefixes cover the same tokens keep one of them; otherwise each row gets
    a copy of its prefix's columns before its own. The parts are consumed: each layer's
    old tensors are released as soon as they are copied, so merging needs one new batch
    cache plus one layer, not two caches. `trim`: leave out a part's leading columns that
    none of its kept rows attends to (rows that left kept them), so that a batch that
    rows keep joining and leaving (the server's) does not grow wider for ever. `multiple`:
    the columns (filled and free) rounded up to a multiple of it (a compiled decode step
    keeps one graph per shape: engine/compiled_step.py)."""
    chosen = [(part, part.cache_rows[rows]) for part, rows in zip(parts, keep) if len(rows)]
    if trim:
        chosen = [(_trimmed(part, source), source) for part, source in chosen]
    prefixes = {p.prefix.tokens if p.prefix is not None else None for p, _ in chosen}
    shared = chosen[0][0].prefix if len(prefixes) == 1 else None
    inline = []  # prefix columns copied into each chosen part's rows
    for part, _ in chosen:
        inline.append(0)
        if shared is None and part.prefix is not None:
            if len(part.prefix.levels) != 1:
                raise ValueError("only single-level prefixes can be copied into rows")
            inline[-1] = part.prefix.levels[0].width
    width = max(part.width + extra for (part, _), extra in zip(chosen, inline))
    room += (-(width + room)) % multiple
    total = sum(len(source) for _, source in chosen)
    first = chosen[0][0]
    device = first.attention_CL.device
    attention = torch.zeros((total, width + room), dtype=first.attention_CL.dtype, device=device)
    next_pos = torch.cat([part.next_pos_C[source] for part, source in chosen])
    logits = None  # parts built from kept rows have none: `extend` computes them
    if all(part.logits_CV is not None for part, _ in chosen):
        logits = torch.cat([part.logits_CV[source] for part, source in chosen])
    start = 0
    for (part, source), extra in zip(chosen, inline):
        end = start + len(source)
        own = part.attention_CL[source, : part.width]
        attention[start:end, width - part.width : width] = own
        attention[start:end, width - part.width - extra : width - part.width] = 1
        start = end
    layers = []
    for index, layer in enumerate(first.cache.layers):
        # keys and values may differ in heads and width (MLA caches its latent and rope key)
        keys = _columns(layer.keys, total, width + room)
        values = _columns(layer.values, total, width + room)
        start = 0
        for (part, source), extra in zip(chosen, inline):
            src = part.cache.layers[index]
            columns = slice(width - part.width, width)
            before = slice(width - part.width - extra, width - part.width)
            for n, row in enumerate(source.tolist()):  # row by row: no gathered temporary
                keys[start + n, :, columns] = src.keys[row, :, : part.width]
                values[start + n, :, columns] = src.values[row, :, : part.width]
                if extra:
                    level = part.prefix.levels[0]  # type: ignore[union-attr]
                    keys[start + n, :, before] = level.keys[index][0]
                    values[start + n, :, before] = level.values[index][0]
            start += len(source)
        layers.append(BufferLayer(keys, values, width))
        for j, (part, _) in enumerate(chosen):
            if not any(part is other for other, _ in chosen[:j]):  # each part once
                _release(part.cache.layers[index])
    cache = DynamicCache()
    cache.layers = layers
    index_C = torch.arange(total, device=device)
    return Part(cache, index_C, attention, next_pos, logits, width, shared)


def _columns(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Zeros [rows, heads, columns, dim], with `like`'s heads, dim, dtype and device."""
    _, heads, _, dim = like.shape
    return torch.zeros((rows, heads, columns, dim), dtype=like.dtype, device=like.device)


def _trimmed(part: Part, source: torch.Tensor) -> Part:
    """`part` without its leading columns that no row of `source` attends to: a view
    over the same cache whose `width` and attention start past them."""
    used = part.attention_CL[source, : part.width].any(0).nonzero()
    lead = int(used[0]) if len(used) else part.width
    if lead == 0 or part.cache is None or not bufferable(part.cache):
        return part
    cache = DynamicCache()
    cache.layers = [
        BufferLayer(layer.keys[:, :, lead:], layer.values[:, :, lead:], part.width - lead)
        for layer in part.cache.layers
    ]
    attention = part.attention_CL[:, lead:]
    release(part)  # the views hold the storage now: merge frees it layer by layer
    return Part(
        cache,
        part.cache_rows,
        attention,
        part.next_pos_C,
        part.logits_CV,
        part.width - lead,
        part.prefix,
    )


def release(part: Part) -> None:
    """Free a part's cache now (its rows are done and kept elsewhere, if at all)."""
    if part.cache is not None:
        for layer in part.cache.layers:
            _release(layer)


def _release(layer: Any) -> None:
    empty = torch.empty(0)
    if isinstance(layer, BufferLayer):
        layer.buffer_keys = layer.buffer_values = empty
    layer.keys = layer.values = empty


def select(part: Part, rows: torch.Tensor) -> Part:
    """Keep some rows of a cache that cannot be buffered (transformers' own layers)."""
    source = part.cache_rows[rows]
    select_rows(part.cache, source)
    return Part(
        part.cache,
        torch.arange(len(rows), device=rows.device),
        part.attention_CL[source],
        part.next_pos_C[source],
        part.logits_CV[source],
        part.width,
        part.prefix,
    )


@dataclass
class Retained:
    """A finished row's KV, kept for the episode's next turn (same weights): the tokens
    it covers (prefix + prompt + the generated tokens that went through the model), the
    shared prefix it attends to (kept by reference), and each layer's keys and values at
    the row's own columns only ([H, n, D]). Positions count real tokens, so its next
    position is len(tokens)."""

    tokens: tuple[int, ...]
    prefix: Prefix | None
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def retain(part: Part, row: int, tokens: tuple[int, ...]) -> Retained:
    """Copy row `row`'s valid columns out of a running batch (its attention mask marks
    them: a finished row's later columns are masked)."""
    cache_row = int(part.cache_rows[row])
    valid = part.attention_CL[cache_row, : part.width].nonzero().squeeze(-1)
    covered = len(valid) + (len(part.prefix.tokens) if part.prefix is not None else 0)
    if covered != len(tokens):
        raise RuntimeError(f"row covers {covered} columns but {len(tokens)} tokens")
    layers = part.cache.layers
    return Retained(
        tokens,
        part.prefix,
        [layer.keys[cache_row].index_select(1, valid) for layer in layers],
        [layer.values[cache_row].index_select(1, valid) for layer in layers],
    )


def from_retained(entries: list[Retained], room: int) -> Part:
    """A part whose cache row i holds entries[i] (right-aligned, via `merge`, which keeps
    a prefix the entries share), with `room` free columns for the tails that `extend`
    runs on top."""
    parts = []
    for entry in entries:
        n = entry.keys[0].shape[1]
        cache = DynamicCache()
        cache.layers = [BufferLayer(k[None], v[None], n) for k, v in zip(entry.keys, entry.values)]
        one = torch.zeros(1, dtype=torch.long, device=entry.keys[0].device)
        attention = torch.ones((1, n), dtype=torch.long, device=one.device)
        parts.append(Part(cache, one, attention, one + len(entry.tokens), prefix=entry.prefix))
    return merge(parts, [torch.zeros(1, dtype=torch.long)] * len(parts), room)
