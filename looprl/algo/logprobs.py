"""Per-token log-probabilities and masked reductions.

    logp_{b,t} = log softmax(z_{b,t} / tau)[y_{b,t}] = z_{b,t,y}/tau - logsumexp_v(z_{b,t,v}/tau)

Computed as "gathered logit minus logsumexp" in float32, one chunk of `chunk_size`
sequences at a time, so no [B, T, V] float32 copy of the logits (nor a full log_softmax) is
ever materialised beyond one chunk. When the logits require grad, each chunk runs under
activation checkpointing: the backward pass recomputes that chunk's float32 copy instead of
keeping every chunk's copy alive until backward. The gradient with respect to the logits
is of course still a full [B, T, V] tensor (in the logits' dtype).

Temperature: rollouts sampled at temperature tau came from softmax(z / tau), so the trainer
must score them with the *same* tau, otherwise the importance ratio pi/pi_old is off even
when the weights have not moved. Greedy decoding (tau = 0) has no distribution of its own;
its tokens are scored at tau = 1 (`scoring_temperature`), by the engine and the trainer.

The engine records the logprob of each token it samples with `tempered_log_softmax` over
the whole vocabulary (it needs the whole row to sample anyway); the trainer uses the
gathered form above. The two agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def scoring_temperature(temperature: float) -> float:
    """The tau a sample drawn at `temperature` is scored at: itself, or 1 for greedy (0)."""
    return temperature if temperature > 0 else 1.0


def scale_logits(logits: Tensor, temperature: float) -> Tensor:
    """z / tau, the logits whose softmax is the distribution at tau (z itself at tau = 1)."""
    return logits / temperature if temperature != 1.0 else logits


def tempered_log_softmax(logits_CV: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(z / tau, log softmax(z / tau)) over the last dimension, for a sampling step."""
    scaled_CV = scale_logits(logits_CV, temperature)
    return scaled_CV, torch.log_softmax(scaled_CV, dim=-1)


def _chunk_logprobs(logits_CTV: Tensor, target_ids_CT: Tensor, temperature: float) -> Tensor:
    z_CTV = scale_logits(logits_CTV.float(), temperature)  # z / tau
    lse_CT = torch.logsumexp(z_CTV, dim=-1)  # log sum_v exp(z_v / tau)
    picked_CT = z_CTV.gather(-1, target_ids_CT.unsqueeze(-1)).squeeze(-1)  # z_y / tau
    return picked_CT - lse_CT  # log softmax(z / tau)[y]


def token_logprobs(
    logits_BTV: Tensor, target_ids_BT: Tensor, temperature: float = 1.0, chunk_size: int = 1
) -> Tensor:
    """log pi(y_t | ...) for each target token, float32, shape [B, T].

    `logits_BTV[b, t]` must be the logits that predict `target_ids_BT[b, t]` (shift before
    calling). `chunk_size` is the number of sequences processed at once; it changes memory
    use, never the result. `temperature` must equal the sampling temperature.
    """
    if logits_BTV.shape[:-1] != target_ids_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and targets {tuple(target_ids_BT.shape)} "
            "disagree on [B, T]"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    target_ids_BT = target_ids_BT.long()
    recompute = torch.is_grad_enabled() and logits_BTV.requires_grad
    # torch.split (not indexing): its backward concatenates the chunk gradients into one
    # [B, T, V] tensor instead of one zero-padded [B, T, V] tensor per chunk.
    parts: list[Tensor] = []
    for logits_CTV, targets_CT in zip(
        logits_BTV.split(chunk_size), target_ids_BT.split(chunk_size), strict=True
    ):
        if recompute:
            part = checkpoint(
                _chunk_logprobs, logits_CTV, targets_CT, temperature, use_reentrant=False
            )
        else:
            part = _chunk_logprobs(logits_CTV, targets_CT, temperature)
        parts.append(part)
    return torch.cat(parts, dim=0)


def head_logprobs(
    hidden_NH: Tensor,
    head: torch.nn.Module,
    target_ids_N: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 256,
) -> Tensor:
    """log pi(y_n | ...) from the final hidden states of the N positions that predict the
    targets: the output projection runs `chunk_tokens` rows at a time, so no [N, V] logits
    tensor exists beyond one chunk, neither in the forward pass nor in the backward pass.
    Equal to `token_logprobs(head(hidden), ...)`.

    When only the hidden states take a gradient (a frozen linear head: LoRA), the gradient
    is formed in the forward pass (`_FrozenHeadLogprobs`): two projections per chunk
    instead of the three of checkpointing (forward, recomputed forward, backward).
    Otherwise each chunk runs under activation checkpointing."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    head_grad = any(p.requires_grad for p in head.parameters())
    recompute = torch.is_grad_enabled() and (hidden_NH.requires_grad or head_grad)
    if recompute and not head_grad and isinstance(head, torch.nn.Linear):
        return _FrozenHeadLogprobs.apply(
            hidden_NH, head.weight, head.bias, target_ids_N.long(), temperature, chunk_tokens
        )

    def chunk(h_CH: Tensor, targets_C: Tensor) -> Tensor:
        return _chunk_logprobs(head(h_CH), targets_C, temperature)

    parts: list[Tensor] = []
    for h_CH, targets_C in zip(
        hidden_NH.split(chunk_tokens), target_ids_N.long().split(chunk_tokens), strict=True
    ):
        if recompute:
            parts.append(checkpoint(chunk, h_CH, targets_C, use_reentrant=False))
        else:
            parts.append(chunk(h_CH, targets_C))
    if not parts:
        return hidden_NH.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)


class _FrozenHeadLogprobs(torch.autograd.Function):
    """logp_n = z_n[y_n] - logsumexp(z_n), z_n = (W h_n + b) / tau, for a head W, b that
    takes no gradient. Its gradient with respect to h_n,

        d logp_n / d h_n = (W[y_n] - sum_v p_nv W[v]) / tau,    p_n = softmax(z_n),

    is formed chunk by chunk in the forward pass (one [C, V] x [V, H] product) and kept
    ([N, H], as small as the hidden states checkpointing would keep); the backward pass
    only scales it. Both products run in the head's dtype on float32 log-softmax values,
    as autograd's own backward does. No state: a function with a custom gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: Tensor,
        weight_VH: Tensor,
        bias_V: Tensor | None,
        target_ids_N: Tensor,
        temperature: float,
        chunk_tokens: int,
    ) -> Tensor:
        logp: list[Tensor] = []
        grads: list[Tensor] = []
        for h_CH, targets_C in zip(
            hidden_NH.split(chunk_tokens), target_ids_N.split(chunk_tokens), strict=True
        ):
            z_CV = scale_logits(
                torch.nn.functional.linear(h_CH, weight_VH, bias_V).float(), temperature
            )
            lse_C = torch.logsumexp(z_CV, dim=-1)
            logp.append(z_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C)
            # d logp / d z = onehot(y) - softmax(z), then through z = W h / tau
            dz_CV = torch.exp(z_CV.sub_(lse_C[:, None])).neg_()
            dz_CV.scatter_add_(-1, targets_C[:, None], dz_CV.new_ones(len(targets_C), 1))
            if temperature != 1.0:
                dz_CV.div_(temperature)
            grads.append(dz_CV.to(weight_VH.dtype) @ weight_VH)
        if not logp:
            ctx.save_for_backward(hidden_NH.new_zeros(0, hidden_NH.shape[-1]))
            return hidden_NH.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(torch.cat(grads))
        return torch.cat(logp)

    @staticmethod
    def backward(ctx: Any, grad_N: Tensor) -> tuple[Tensor | None, ...]:
        (dlogp_NH,) = ctx.saved_tensors
        grad_NH = (grad_N[:, None] * dlogp_NH).to(dlogp_NH.dtype)
        return grad_NH, None, None, None, None, None


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) over `dim` (all dims if None). mask is 0/1 (bool or float).

    Positions with mask 0 are replaced by 0 before multiplying, so a NaN/inf there
    neither leaks into the result nor into the gradient.
    """
    m = mask.to(x.dtype)
    x_masked = torch.where(m != 0, x * m, torch.zeros_like(x))
    return x_masked.sum() if dim is None else x_masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1): the mean over masked positions, 0 if there are none."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1.0)
