"""Cascade attention's arithmetic (forward/cascade.py builds the levels and calls one of these).

Three ways to compute softmax over [shared levels | own columns] @ values, in the
grouped-query layout [B, Hkv, M = G*Q, D], all equal up to float summation order (tested):
`Cascade`, an autograd function of plain matrix products (any device); `flash_levels`,
inference on the CPU (each level through PyTorch's CPU flash-attention kernel, merged by
log-sum-exp); `FlashCascade`, training on the CPU (that forward, and the kernel's backward
once per level).
"""

from __future__ import annotations

from typing import Any

import torch

# PyTorch's CPU flash-attention kernel: returns the log-normaliser with the output
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_CPU_BACKWARD = FLASH_CPU and getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


# own-column queries per batch row up to which two products beat the flash kernel
OWN_PRODUCT_ROWS = 8


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def flash_levels(query, keys, values, mask, scale, specs, level_kv, with_lse: bool = False) -> Any:
    """Inference on the CPU: each level (and the own columns) through the flash kernel,
    which also returns each query's log-normaliser; the partial results are then merged
    by log-sum-exp. Same result as `Cascade` (tested), about twice as fast."""
    # the kernel misreads inputs whose last dim is strided (weight-first linears' outputs)
    query = _unit_stride(query)
    out, lse = _own_part(query, keys, values, mask, scale)
    outs, lses = [out], [lse]
    for (groups, valid), level_keys, level_values in zip(specs, level_kv[0::2], level_kv[1::2]):
        level_out, level_lse = torch.zeros_like(out), torch.zeros_like(lses[0])
        for n, rows in groups:
            columns = None if valid is None else _additive(valid[n][None, None, None], query.dtype)
            o, lse = FLASH_CPU(
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
    for o, part in zip(outs, lses):
        merged += o * (part - total).exp_()[..., None]
    return (merged, total) if with_lse else merged


def _own_part(query, keys, values, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the own columns alone: (output, log-normaliser; -inf for a query
    that sees none). A decode step's few queries per row (up to `OWN_PRODUCT_ROWS`) run
    as two batched products: the flash kernel's per-(row, head) blocks cost more there
    (≈ 510 against 290 µs a layer for 64 rows x 3 queries x 60 columns, one probe)."""
    if query.shape[2] <= OWN_PRODUCT_ROWS:
        scores = _own_scores(query, keys, mask, scale)
        lse = torch.logsumexp(scores, -1)
        finite = lse.masked_fill(lse.isinf(), 0.0)
        return torch.matmul(scores.sub_(finite[..., None]).exp_(), values), lse
    own = _own_visible(mask, query.shape[2])
    out, lse = FLASH_CPU(
        query,
        _unit_stride(keys),
        _unit_stride(values),
        attn_mask=_additive(own, query.dtype),
        scale=scale,
    )
    # the kernel gives a query with no visible own column (left padding) a log-normaliser
    # of 0: it has no mass there
    return out, lse.masked_fill(~own.any(-1), float("-inf"))


def _save(ctx: Any, scale: float, specs: Any, *tensors: torch.Tensor) -> None:
    """What both autograd functions keep for the backward: the inputs, the output and the
    log-normaliser (no probabilities: the backward rebuilds them)."""
    ctx.scale, ctx.specs = scale, specs
    ctx.save_for_backward(*tensors)


def _saved(ctx: Any) -> tuple[float, Any, tuple[torch.Tensor, ...]]:
    return ctx.scale, ctx.specs, ctx.saved_tensors


def _own_visible(mask: torch.Tensor, m: int) -> torch.Tensor:
    """The own columns' [B|1, 1, Q, L] mask in the kernel's layout [B|1, 1, M = G*Q, L]."""
    q_len, length = mask.shape[-2], mask.shape[-1]
    return mask.expand(mask.shape[0], 1, m // q_len, q_len, length).reshape(-1, 1, m, length)


class FlashCascade(torch.autograd.Function):
    """Training on the CPU: the forward of `flash_levels`, and a backward that runs the
    flash kernel's backward once per level (and once for the own columns) with the merged
    output and the total log-normaliser: the kernel rebuilds each level's probabilities as
    exp(scores - total), the ones the softmax over all levels gave, and takes the row term
    sum(grad_out * out) from the merged output, so each call yields that level's exact
    share of the gradients. Same results as `Cascade` (tested), ≈ 1.7x faster."""

    @staticmethod
    def forward(ctx: Any, query, keys, values, mask, scale, specs, *level_kv):  # type: ignore[override]
        out, lse = flash_levels(query, keys, values, mask, scale, specs, level_kv, with_lse=True)
        _save(ctx, scale, specs, query, keys, values, mask, out, lse, *level_kv)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        scale, specs, (query, keys, values, mask, out, lse, *level_kv) = _saved(ctx)
        grad_out, query = grad_out.contiguous(), _unit_stride(query)
        lse = lse.masked_fill(lse.isinf(), 0.0)  # a row that sees nothing: no probability
        own = _additive(_own_visible(mask, query.shape[2]), query.dtype)
        grad_query, grad_keys, grad_values = FLASH_CPU_BACKWARD(
            grad_out,
            query,
            _unit_stride(keys),
            _unit_stride(values),
            out,
            lse,
            0.0,
            False,
            attn_mask=own,
            scale=scale,
        )
        grads: list[torch.Tensor | None] = []
        for i, (groups, valid) in enumerate(specs):
            level_keys, level_values = level_kv[2 * i], level_kv[2 * i + 1]
            gk, gv = torch.zeros_like(level_keys), torch.zeros_like(level_values)
            for n, rows in groups:
                columns = (
                    None if valid is None else _additive(valid[n][None, None, None], query.dtype)
                )
                gq, gk_n, gv_n = FLASH_CPU_BACKWARD(
                    _gather(grad_out, rows)[None],
                    _gather(query, rows)[None],
                    _unit_stride(level_keys[n])[None],
                    _unit_stride(level_values[n])[None],
                    _gather(out, rows)[None],
                    _gather(lse[..., None], rows)[None, ..., 0],
                    0.0,
                    False,
                    attn_mask=columns,
                    scale=scale,
                )
                _scatter(gq[0], rows, grad_query)
                gk[n] += gk_n[0]
                gv[n] += gv_n[0]
            grads += [gk, gv]
        return (grad_query, grad_keys, grad_values, None, None, None, *grads)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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


class Cascade(torch.autograd.Function):
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
        _save(ctx, scale, specs, query, keys, values, mask, out, lse, *level_kv)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        scale, specs, (query, keys, values, mask, out, lse, *level_kv) = _saved(ctx)
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
