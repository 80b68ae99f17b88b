"""How an MoE model's routers spread tokens over their experts, counted on real tokens.

`RouterLoad` hooks every router (`arch.router_modules`) for the duration of a `with`
block and counts, per MoE layer, the token slots each expert receives (top-k: k slots
per token). Padding is left out: a pre-hook on the decoder reads each call's 2-D
attention mask, and a router call that sees one row per input position keeps only the
positions the mask marks real (a packed call has no padding; a 4-D mask means packed).
"""

from __future__ import annotations

from typing import Any

import torch

from looprl.model.arch import router_modules
from looprl.model.load import base_model

# per-expert shares are logged only up to this many experts (keys per metrics line)
MAX_SHARE_KEYS = 64


class RouterLoad:
    """Counts [layers, experts] of the routed token slots seen inside the block."""

    def __init__(self, model: Any) -> None:
        self.model = base_model(model)
        self.routers = router_modules(self.model)
        self.counts_LE: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> RouterLoad:
        if not self.routers:
            return self
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        self._hooks.append(decoder.register_forward_pre_hook(self._see_mask, with_kwargs=True))
        for layer, router in enumerate(self.routers.values()):
            self._hooks.append(router.register_forward_hook(self._counter(layer)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _see_mask(self, module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self._valid = None
        if ids is not None and mask is not None and mask.ndim == 2:
            self._valid = mask[:, -ids.shape[1] :].reshape(-1).bool()

    def _counter(self, layer: int) -> Any:
        def count(module: Any, args: tuple, output: Any) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.dtype not in (torch.int64, torch.int32):
                return
            indices_NK = indices.reshape(-1, indices.shape[-1])
            if self._valid is not None and len(self._valid) == len(indices_NK):
                indices_NK = indices_NK[self._valid.to(indices_NK.device)]
            experts = _num_experts(module, indices_NK)
            if self.counts_LE is None:
                self.counts_LE = torch.zeros(len(self.routers), experts, dtype=torch.float64)
            self.counts_LE[layer] += torch.bincount(
                indices_NK.reshape(-1).cpu(), minlength=experts
            )[:experts].double()

        return count


def _num_experts(router: Any, indices_NK: torch.Tensor) -> int:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(router, name, None)
        if isinstance(value, int):
            return value
    weight = getattr(router, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(indices_NK.max()) + 1


def router_metrics(counts_LE: torch.Tensor) -> dict[str, float]:
    """`train/router_load_balance`: the coefficient of variation of the slots per expert,
    std / mean, averaged over MoE layers (0 = perfectly even; √(E − 1) = all on one expert);
    `train/router_max_load`: the busiest expert's slots over the mean, averaged over
    layers; `train/router_share/eNN`: each expert's share of all slots, over all layers
    (up to MAX_SHARE_KEYS experts)."""
    per_layer = counts_LE[counts_LE.sum(1) > 0]
    if not len(per_layer):
        return {}
    mean_L = per_layer.mean(1)
    out = {
        "train/router_load_balance": float((per_layer.std(1, correction=0) / mean_L).mean()),
        "train/router_max_load": float((per_layer.max(1).values / mean_L).mean()),
    }
    experts = counts_LE.shape[1]
    if experts <= MAX_SHARE_KEYS:
        share_E = per_layer.sum(0) / per_layer.sum()
        width = len(str(experts - 1))
        for e, share in enumerate(share_E.tolist()):
            out[f"train/router_share/e{e:0{width}d}"] = share
    return out
