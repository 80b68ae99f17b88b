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
levels merge by their log-normalisers.

A call can also be packed (`Packing`): the trainer runs the real tokens of all its
sequences as one row, so the linear layers (most of the compute) never see padding, and
only attention works on the padded [B, S] layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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
    if not grads and query.device.type == "cpu" and _FLASH_CPU is not None:
        out_BKMD = _flash_levels(query_BKMD, key, value, mask, scale, specs, tensors)
    else:
        out_BKMD = _Cascade.apply(query_BKMD, key, value, mask, scale, specs, *tensors)
    out = out_BKMD.to(dtype).reshape(batch, heads, q_len, dim).transpose(1, 2)
    if packing is not None:
        return packing.pack(out), None
    return out.contiguous(), None


# PyTorch's CPU flash-attention kernel: returns the log-normaliser with the output
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _flash_levels(query, keys, values, mask, scale, specs, level_kv) -> torch.Tensor:
    """Inference on the CPU: each level (and the own columns) through the flash kernel,
    which also returns each query's log-normaliser; the partial results are then merged
    by log-sum-exp. Same result as `_Cascade` (tested), about twice as fast."""
    m = query.shape[2]
    q_len, length = mask.shape[-2], mask.shape[-1]
    own = mask.expand(mask.shape[0], 1, m // q_len, q_len, length).reshape(-1, 1, m, length)
    # the kernel misreads inputs whose last dim is strided (weight-first linears' outputs)
    query, keys, values = _unit_stride(query), _unit_stride(keys), _unit_stride(values)
    out, lse = _FLASH_CPU(query, keys, values, attn_mask=_additive(own, query.dtype), scale=scale)
    # the kernel gives a query with no visible own column (left padding) a log-normaliser
    # of 0: it has no mass there
    outs, lses = [out], [lse.masked_fill(~own.any(-1), float("-inf"))]
    for (groups, valid), level_keys, level_values in zip(specs, level_kv[0::2], level_kv[1::2]):
        level_out, level_lse = torch.zeros_like(out), torch.zeros_like(lses[0])
        for n, rows in groups:
            columns = None if valid is None else _additive(valid[n][None, None, None], query.dtype)
            o, lse = _FLASH_CPU(
                _gather(query, rows)[None],
                level_keys[n][None],
                level_values[n][None],
                attn_mask=columns,
                scale=scale,
            )
            _scatter(o[0], rows, level_out)  # each batch row reads one level row
            _scatter(lse[0], rows, level_lse)
        outs.append(level_out)
        lses.append(level_lse)
    total = torch.logsumexp(torch.stack(lses), 0)
    merged = torch.zeros_like(out)
    for o, lse in zip(outs, lses):
        merged += o * (lse - total).exp_()[..., None]
    return merged


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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


def _gather(x_BK: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[B, Hkv, M, ...] rows -> [Hkv, b*M, ...]: one GEMM operand per KV head."""
    x = x_BK if rows is None else x_BK.index_select(0, rows)
    b, k, m = x.shape[:3]
    return x.transpose(0, 1).reshape(k, b * m, *x.shape[3:])


def _scatter(x_K: torch.Tensor, rows: torch.Tensor | None, out_BK: torch.Tensor) -> None:
    """Inverse of `_gather`: add [Hkv, b*M, ...] into the rows of out [B, Hkv, M, ...]
    (into zeros: a copy, as the groups of a level never share a batch row)."""
    k, m = out_BK.shape[1], out_BK.shape[2]
    x = x_K.reshape(k, -1, m, *x_K.shape[2:]).transpose(0, 1)
    if rows is None:
        out_BK += x
    else:
        out_BK.index_add_(0, rows, x)


def _own_scores(
    query_BKMD: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    b, k, m, _ = query_BKMD.shape
    scores = torch.matmul(query_BKMD, keys.transpose(-1, -2)).mul_(scale)
    q_len = mask.shape[-2]
    view = scores.view(b, k, m // q_len, q_len, -1)
    view.masked_fill_(~mask, float("-inf"))
    return scores


def _level_scores(
    query_K: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor | None, scale: float
) -> torch.Tensor:
    scores = torch.matmul(query_K, keys.transpose(-1, -2)).mul_(scale)
    if valid is not None:
        scores.masked_fill_(~valid, float("-inf"))
    return scores


class _Cascade(torch.autograd.Function):
    """softmax over [shared levels | own columns] @ values, in the grouped-query layout
    [B, Hkv, M = G*Q, D]. Saves the inputs, the output and the log-normaliser; backward
    recomputes the probabilities one level at a time."""

    @staticmethod
    def forward(ctx: Any, query, keys, values, mask, scale, specs, *level_kv):  # type: ignore[override]
        own = _own_scores(query, keys, mask, scale)
        shared = []  # per level: [(n, rows, scores [Hkv, b*M, T])]
        lse_parts = [torch.logsumexp(own, -1)]
        for (groups, valid), level_keys in zip(specs, level_kv[0::2]):
            lse = torch.zeros_like(lse_parts[0])
            blocks = []
            for n, rows in groups:
                s = _level_scores(
                    _gather(query, rows), level_keys[n], None if valid is None else valid[n], scale
                )
                _scatter(torch.logsumexp(s, -1), rows, lse)  # each row reads one level row
                blocks.append((n, rows, s))
            lse_parts.append(lse)
            shared.append(blocks)
        lse = torch.logsumexp(torch.stack(lse_parts), 0)  # [B, Hkv, M]
        out = torch.matmul(own.sub_(lse[..., None]).exp_(), values)
        del own
        for blocks, level_values in zip(shared, level_kv[1::2]):
            for n, rows, s in blocks:
                p = s.sub_(_gather(lse[..., None], rows)).exp_()
                _scatter(torch.matmul(p, level_values[n]), rows, out)
        ctx.scale, ctx.specs = scale, specs
        ctx.save_for_backward(query, keys, values, mask, out, lse, *level_kv)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        query, keys, values, mask, out, lse, *level_kv = ctx.saved_tensors
        scale, specs = ctx.scale, ctx.specs
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)  # [B, Hkv, M, 1]
        p = _own_scores(query, keys, mask, scale).sub_(lse[..., None]).exp_()
        grad_values = torch.matmul(p.transpose(-1, -2), grad_out)
        ds = p.mul_(torch.matmul(grad_out, values.transpose(-1, -2)).sub_(delta))
        del p
        grad_query = torch.matmul(ds, keys).mul_(scale)
        grad_keys = torch.matmul(ds.transpose(-1, -2), query).mul_(scale)
        del ds
        grads: list[torch.Tensor | None] = []
        for i, (groups, valid) in enumerate(specs):
            level_keys, level_values = level_kv[2 * i], level_kv[2 * i + 1]
            want = ctx.needs_input_grad[6 + 2 * i] or ctx.needs_input_grad[7 + 2 * i]
            gk = torch.zeros_like(level_keys) if want else None
            gv = torch.zeros_like(level_values) if want else None
            for n, rows in groups:
                q = _gather(query, rows)
                go = _gather(grad_out, rows)
                s = _level_scores(q, level_keys[n], None if valid is None else valid[n], scale)
                p = s.sub_(_gather(lse[..., None], rows)).exp_()
                if want:
                    gv[n] += torch.matmul(p.transpose(-1, -2), go)
                dp = torch.matmul(go, level_values[n].transpose(-1, -2))
                ds = p.mul_(dp.sub_(_gather(delta, rows)))
                _scatter(torch.matmul(ds, level_keys[n]).mul_(scale), rows, grad_query)
                if want:
                    gk[n] += torch.matmul(ds.transpose(-1, -2), q).mul_(scale)
            grads += [gk, gv]
        return (grad_query, grad_keys, grad_values, None, None, None, *grads)
