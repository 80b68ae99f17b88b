"""Decoding's linear layers with the weight as the left operand: out^T = W @ x^T.

A decode step multiplies a few rows of activations (one per running sequence) by every
weight matrix of the model. `F.linear(x, W)` gives BLAS the weight as the transposed
right operand of x @ W^T. For a few rows, the MKL in PyTorch's CPU wheel runs that form
markedly slower on this project's 2-core AMD EPYC than the same product with the weight
on the left, W @ x^T, whose result is read back transposed: the same dot products, a
different loop order. With SmolLM2-135M's own weights, one decode step's products took
1.15-1.6x less time that way at 8-64 rows (`bench/speed/rollout.py` prints both), and the
engine decoded 1.15-1.2x more tokens/s with them at batch 8; from batch 32 on the gain
(0.99-1.15x) is within the run-to-run noise of that machine.

`enable(model)` times both forms on the model's own weights at a decode batch and, only
where the weight-first form is faster, turns the model's `nn.Linear` modules into
`WeightFirstLinear`. That class takes the weight-first path only without autograd, on the
CPU, for at most `MAX_ROWS` rows; everything else (training, prefill of long prompts, GPUs)
is `nn.Linear` unchanged. Results agree with `F.linear` up to float summation order.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

# above this many rows F.linear is as fast or faster (measured: equal at ≈ 1,000 rows)
MAX_ROWS = 256
# models whose linear weights are smaller than this stay cache-resident: nothing to win
MIN_WEIGHT_BYTES = 64 * 2**20
# weights timed per form: more than any last-level cache, so the timing reads memory
CALIBRATION_BYTES = 256 * 2**20
CALIBRATION_ROWS = 8
SPEEDUP_NEEDED = 1.05


class WeightFirstLinear(torch.nn.Linear):
    """`nn.Linear` whose small no-grad CPU products run as W @ x^T (see module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() >= 2 else MAX_ROWS + 1
        if torch.is_grad_enabled() or rows > MAX_ROWS or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        x_KR = x.reshape(rows, x.shape[-1]).t()
        if self.bias is None:
            out_NR = torch.mm(self.weight, x_KR)
        else:
            out_NR = torch.addmm(self.bias[:, None], self.weight, x_KR)
        return out_NR.t().view(*x.shape[:-1], out_NR.shape[0])


def linears(model: Any) -> list[torch.nn.Linear]:
    """The model's plain linear layers (subclasses such as quantized layers excluded)."""
    kinds = (torch.nn.Linear, WeightFirstLinear)
    return [m for m in model.modules() if type(m) in kinds]


def enable(model: Any, force: bool | None = None) -> bool:
    """Switch the model's linear layers to `WeightFirstLinear` if that form is measurably
    faster here (`force`: True/False skips the measurement); return whether it is on.
    Models on other devices, and small models, keep `nn.Linear`."""
    layers = linears(model)
    weights = [m.weight for m in layers]
    on = force
    if on is None:
        on = (
            bool(weights)
            and all(w.device.type == "cpu" for w in weights)
            and sum(w.numel() * w.element_size() for w in weights) >= MIN_WEIGHT_BYTES
            and _weight_first_is_faster(weights)
        )
    for m in layers:
        m.__class__ = WeightFirstLinear if on else torch.nn.Linear
    return bool(on)


def enabled(model: Any) -> bool:
    return any(type(m) is WeightFirstLinear for m in model.modules())


@torch.no_grad()
def _weight_first_is_faster(weights: list[torch.Tensor], repeats: int = 5) -> bool:
    """Time one pass over (a memory-sized share of) the weights in each form, interleaved."""
    chosen, size = [], 0
    for w in weights:
        chosen.append(w)
        size += w.numel() * w.element_size()
        if size >= CALIBRATION_BYTES:
            break
    inputs = {
        (w.shape[1], w.dtype): torch.randn(CALIBRATION_ROWS, w.shape[1], dtype=w.dtype)
        for w in chosen
    }

    def seconds(weight_first: bool) -> float:
        start = time.perf_counter()
        for w in chosen:
            x = inputs[(w.shape[1], w.dtype)]
            torch.mm(w, x.t()) if weight_first else F.linear(x, w)
        return time.perf_counter() - start

    for _ in range(2):  # warm-up (after one pass, a first timing measured a smaller gap)
        seconds(True), seconds(False)
    plain, first = [], []
    for _ in range(repeats):
        first.append(seconds(True))
        plain.append(seconds(False))
    return statistics.median(plain) >= SPEEDUP_NEEDED * statistics.median(first)
