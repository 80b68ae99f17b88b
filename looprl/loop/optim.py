"""The optimizer of the policy update: AdamW with full-precision states, or 8-bit AdamW.

AdamW keeps two states per trainable parameter, the moving averages of the gradient and
of its square, each in the parameter's dtype: 8 bytes per float32 parameter, as much
again as a full fine-tune's weights and gradients together. `adamw_8bit` is
bitsandbytes' `AdamW8bit`: both states quantised to 8 bits in blocks of 256 values with a
float32 scale per block (1 + 1 + 8/256 bytes per parameter), dequantised for the update
and quantised again after it, which runs on the CPU as on CUDA. Tensors under 4,096
values (norms, biases) keep 32-bit states, as bitsandbytes does by default: their
quantisation error would cost more than they weigh.

The update itself is Adam's (Loshchilov & Hutter, decoupled weight decay):
    m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
    θ ← θ − lr (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + ε) − lr λ θ
with the 8-bit variant storing m and v quantised between steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from looprl.errors import ConfigError

EIGHT_BIT_EXTRA = "optim8bit"
# bitsandbytes' defaults, which its CPU and CUDA kernels both implement
EIGHT_BIT_BLOCK = 256
EIGHT_BIT_MIN_SIZE = 4096


def quiet_bitsandbytes() -> None:
    """bitsandbytes' CPU backend logs, when imported (peft imports it whenever it is
    installed), that a 4-bit matmul kernel is missing: looprl never runs 4-bit matmuls."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def make_optimizer(
    params: Iterable[torch.nn.Parameter], name: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """`train.optimizer` over `params`: "adamw" or "adamw_8bit"."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_8bit":
        quiet_bitsandbytes()
        try:
            import bitsandbytes
        except ImportError as err:  # the config check names the extra first; belt and braces
            raise ConfigError(
                f"train.optimizer=adamw_8bit needs bitsandbytes: pip install "
                f"'looprl[{EIGHT_BIT_EXTRA}]' ({err})"
            ) from None
        return bitsandbytes.optim.AdamW8bit(
            params, lr=lr, weight_decay=weight_decay, min_8bit_size=EIGHT_BIT_MIN_SIZE
        )
    raise ConfigError(f"train.optimizer={name!r}: expected adamw or adamw_8bit")
