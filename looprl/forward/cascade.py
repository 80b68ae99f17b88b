"""Cascade attention: keys and values that many rows share are kept once, not per row.

All the prompts of an env share a long head (system prompt, tool schemas: ≈ 240 of ≈ 290
tokens on tic-tac-toe), and the G episodes of a task share their whole prompt. A plain
KV cache holds one copy of those columns per row, and transformers' attention repeats
them again per query head (GQA). Here they live in `Prefix` levels:

- a level with one row (the shared head) is read by every row of the batch;
- a level with N rows (each distinct prompt's own tail) is read by the rows `rows_B`
  points at; its `valid_NT` mask marks the real columns (tails are left-padded).

The batch's own cache holds only what is per row (tails in the engine, generated tokens).
Each query attends to the concatenation [level 0 | level 1 | ... | own columns], in one
softmax: the same result as a plain forward over the full sequence, up to float
summation order. The shared levels' scores are one GEMM per KV head over every row's
queries, instead of a batched product against B copies.

The attention is registered with transformers as `looprl_sdpa`: without a prefix in the
call's kwargs (`looprl_prefix=...`) it is transformers' SDPA attention unchanged. With
one, a custom autograd function computes the output and, in backward, recomputes the
probabilities from the saved log-normaliser (flash-attention style), so training keeps
neither the repeated K/V nor the attention matrix of every layer. Without gradients on
the CPU (sampling, old logprobs), each level runs through PyTorch's flash kernel and the
levels merge by their log-normalisers; with gradients on the CPU (the update's loss
passes), the kernel's backward runs once per level (forward/cascade_kernels.py).

A call can also be packed (`Packing`): the trainer runs the real tokens of all its
sequences as one row, so the linear layers (most of the compute) never see padding, and
only attention works on the padded [B, S] layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from looprl.forward.cascade_kernels import (
    FLASH_CPU,
    FLASH_CPU_BACKWARD,
    Cascade,
    FlashCascade,
    flash_levels,
)
from looprl.model.load import base_model

NAME = "looprl_sdpa"
PREFIX_KWARG = "looprl_prefix"


@dataclass
class Level:
    """Shared keys/values, per layer [N, Hkv, T, D]. `rows_B`: the level row each batch row
    reads (None: N == 1, every row). `valid_NT`: the columns each level row may see (None:
    all). `tokens`: what the level covers, to recognise an identical one (N == 1 only)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rows_B: torch.Tensor | None = None
    valid_NT: torch.Tensor | None = None
    tokens: tuple[int, ...] = ()
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        """(level row, batch rows that read it) per level row in use; None = all rows.
        Computed once here, not in every layer (`tolist` would sync a GPU each time)."""
        if self.rows_B is None:
            self.groups = [(0, None)]
            return
        members: dict[int, list[int]] = {}
        for b, n in enumerate(self.rows_B.tolist()):
            members.setdefault(n, []).append(b)
        device = self.rows_B.device
        self.groups = [
            (n, torch.tensor(bs, dtype=torch.long, device=device)) for n, bs in members.items()
        ]

    @property
    def width(self) -> int:
        return self.keys[0].shape[2]


@dataclass
class Packing:
    """A packed call: the model runs one row of N real tokens (no padding) and attention
    unpacks it into B sequences of S positions. `index_BS`: each position's token in the
    packed row (padding points at token 0 and is masked); `valid_BS`: the real positions,
    in packed order when read row by row. The own-columns mask is passed to the model as
    the 4-D attention mask [B, 1, S, S] (transformers uses a 4-D mask as given)."""

    index_BS: torch.Tensor
    valid_BS: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Packing:
        width = max(lengths)
        length_B = torch.tensor(lengths, dtype=torch.long, device=device)
        valid_BS = torch.arange(width, device=device)[None, :] < length_B[:, None]
        start_B = torch.cumsum(length_B, 0) - length_B
        index_BS = (start_B[:, None] + torch.arange(width, device=device)).masked_fill(~valid_BS, 0)
        return cls(index_BS, valid_BS)

    def causal_mask(self) -> torch.Tensor:
        """[B, 1, S, S] bool: each position sees its own sequence's real positions up to it."""
        width = self.valid_BS.shape[1]
        causal = torch.ones((width, width), dtype=torch.bool, device=self.valid_BS.device).tril_()
        return causal[None, None] & self.valid_BS[:, None, None, :]

    def unpack(self, x_1HND: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] -> [B, H, S, D]."""
        return x_1HND[0][:, self.index_BS].transpose(0, 1)

    def pack(self, x_BSHD: torch.Tensor) -> torch.Tensor:
        """[B, S, H, D] -> [1, N, H, D] (the real positions, in packed order)."""
        return x_BSHD[self.valid_BS][None]


@dataclass
class Prefix:
    """The shared levels a batch attends to before its own cache columns, and the packing
    of the call's tokens if it is packed."""

    levels: list[Level]
    packing: Packing | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for level in self.levels for t in level.tokens)


def enable(model: Any) -> bool:
    """Switch a model's attention to `looprl_sdpa` (SDPA whenever no prefix is passed) if
    it runs SDPA without attention dropout and without sliding windows; return whether
    cascade attention is on."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if config is None:
        return False
    if getattr(config, "_attn_implementation", None) == NAME:
        return True
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return False
    if _windowed(config):  # a sliding window would also have to cut the shared levels
        return False
    _register()
    try:
        base.set_attn_implementation(NAME)
    except (ValueError, ImportError):
        return False
    return getattr(base.config, "_attn_implementation", None) == NAME


def _windowed(config: Any) -> bool:
    """Whether any layer attends through a sliding window (Mistral, Gemma 3, Qwen 2 with
    `use_sliding_window`; Qwen 2 clears `sliding_window` when it is unused)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return True
    return getattr(config, "sliding_window", None) is not None


def enabled(model: Any) -> bool:
    base = base_model(model)
    return getattr(getattr(base, "config", None), "_attn_implementation", None) == NAME


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Q, D], key/value [B, Hkv, L, D] (the
    own columns), attention_mask a bool [B|1, 1, Q, L] (True: attend) or None (causal).
    Returns [B, Q, H, D]. A packed call (`prefix.packing`) has B = 1 and Q = L = N real
    tokens: they are unpacked into the packing's B sequences, attend as those, and the
    result is packed again."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    prefix = kwargs.pop(PREFIX_KWARG, None)
    if prefix is None or (not prefix.levels and prefix.packing is None):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError("cascade attention does not support attention dropout")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("cascade attention does not support sliding-window attention")
    packing = prefix.packing
    if packing is not None:
        query, key, value = packing.unpack(query), packing.unpack(key), packing.unpack(value)
    batch, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    mask = _own_mask(attention_mask, batch, q_len, length, query.device)
    query_BKMD = query.reshape(batch, kv_heads, (heads // kv_heads) * q_len, dim)
    layer = module.layer_idx
    tensors = []
    for level in prefix.levels:
        tensors += [level.keys[layer], level.values[layer]]
    specs = [(level.groups, level.valid_NT) for level in prefix.levels]
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):  # scores and softmax in float32, as SDPA
        query_BKMD, key, value = query_BKMD.float(), key.float(), value.float()
        tensors = [t.float() for t in tensors]
    grads = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query_BKMD, key, value, *tensors)
    )
    if not grads and query.device.type == "cpu" and FLASH_CPU is not None:
        out_BKMD = flash_levels(query_BKMD, key, value, mask, scale, specs, tensors)
    elif query.device.type == "cpu" and FLASH_CPU_BACKWARD is not None:
        out_BKMD = FlashCascade.apply(query_BKMD, key, value, mask, scale, specs, *tensors)
    else:
        out_BKMD = Cascade.apply(query_BKMD, key, value, mask, scale, specs, *tensors)
    out = out_BKMD.to(dtype).reshape(batch, heads, q_len, dim).transpose(1, 2)
    if packing is not None:
        return packing.pack(out), None
    return out.contiguous(), None


def _own_mask(
    mask: torch.Tensor | None, batch: int, q_len: int, length: int, device: torch.device
) -> torch.Tensor:
    """[B|1, 1, 1, Q, L] bool, ready to broadcast over [B, Hkv, G, Q, L]."""
    if mask is None:  # transformers skips an all-visible mask: causal, bottom-right aligned
        rows = torch.arange(q_len, device=device)[:, None] + (length - q_len)
        mask = (torch.arange(length, device=device)[None, :] <= rows)[None, None]
    if mask.dtype != torch.bool:  # an additive float mask: 0 where visible
        mask = mask == 0
    return mask[:, :, None]
