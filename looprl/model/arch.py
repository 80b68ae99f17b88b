"""What looprl knows about a model's architecture: which fast paths are exact for it,
what LoRA adapts, and where its MoE routers are.

The engine and the trainer have fast paths that assume a plain causal transformer with
a plain KV cache (per layer: keys and values, one column per token):

- `kv_buffers`: the KV cache moves into preallocated buffers, rows of different batches
  merge into one (continuous batching), and a finished row's KV is kept for its
  episode's next turn (KV sessions). Needs every layer's cache to be keys and values.
- `shared_head`: the prompts' common head is prefilled once and each prompt's own tail
  runs on top of it, left-padded after it (a gap of masked columns in the middle). Exact
  only when masked columns change nothing: a linear-attention state would decay over the
  gap, and a sliding window counts cache columns, gap included.
- `cascade`: the shared head's KV is kept once per batch (needs `shared_head`, SDPA and
  no sliding window; `looprl.forward.cascade` checks the last two itself). Off for MLA,
  whose cache holds a latent that attention expands into keys and values.
- `trainer_prefix`: the trainer prefills each distinct prompt once and runs the episodes'
  suffixes on top of a copy of its cache. Needs `kv_buffers`; otherwise every sequence
  runs whole (exact for any causal LM).
- `jump_forward`: grammar-forced spans go through the model as several tokens in one
  call on top of the cache (any transformers cache supports that).

Architectures outside `MATRIX` run the generic transformers path: their own cache, no
merging, sessions, shared head, cascade or trainer prefix sharing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# model_type -> what its tiny model in the test suite verifies (tests/test_architectures.py)
MATRIX = {
    "llama": "dense, full attention (SmolLM2 is one)",
    "qwen2": "dense, full attention, q/k/v biases",
    "qwen3": "dense, full attention, q/k norms",
    "mistral": "dense, full attention (a sliding window turns the window paths off)",
    "phi3": "dense, full attention, fused q/k/v and gate/up projections",
    "gemma3_text": "dense, sliding-window layers interleaved with global layers",
    "qwen3_moe": "MoE: top-k routed experts (fused expert weights)",
    "mixtral": "MoE: top-k routed experts (fused expert weights)",
    "olmoe": "MoE: top-k routed experts, q/k norms",
    "glm4_moe": "MoE: sigmoid-routed experts + a shared expert, partial rotary, q/k norms",
    "deepseek_v3": "MoE + MLA: the cache holds the compressed latent; grouped sigmoid routing",
    "bailing_hybrid": "MoE + hybrid: MLA full attention between KDA linear-attention layers",
}


@dataclass(frozen=True)
class FastPaths:
    """Which of the engine's and the trainer's fast paths are exact for a model, and why
    the others are off (`reasons`: path -> reason)."""

    kv_buffers: bool
    shared_head: bool
    cascade: bool
    trainer_prefix: bool
    jump_forward: bool = True
    reasons: dict[str, str] = field(default_factory=dict)

    def notice(self) -> str | None:
        """One line naming the paths that are off and why (None when all are on)."""
        if not self.reasons:
            return None
        off = "; ".join(f"{path}: {why}" for path, why in self.reasons.items())
        return f"fast paths off for this model ({off})"


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or [])


def fast_paths(config: Any) -> FastPaths:
    """The fast paths that are exact for a model with this transformers config."""
    model_type = getattr(config, "model_type", "")
    if model_type not in MATRIX:
        why = f"{model_type or 'this architecture'} is not in the tested matrix; generic path"
        return FastPaths(
            False,
            False,
            False,
            False,
            reasons={"kv sessions, shared head, cascade, trainer prefix sharing": why},
        )
    kinds = set(_layer_types(config)) - {"full_attention"}
    reasons: dict[str, str] = {}
    if "linear_attention" in kinds:
        state = "linear-attention layers keep a recurrent state, not keys and values"
        reasons["kv sessions and buffers, trainer prefix sharing"] = state
        reasons["shared head, cascade"] = "a masked gap would decay the recurrent state"
    elif kinds or getattr(config, "sliding_window", None) is not None:
        window = "sliding-window layers keep only the window's columns"
        reasons["kv sessions and buffers, trainer prefix sharing"] = window
        reasons["shared head, cascade"] = "the window counts the masked gap's columns"
    plain = not reasons
    # MLA (`kv_lora_rank`): each layer caches its compressed latent and its rotary key (one
    # head each), which buffers, merges and sessions move like keys and values; the
    # attention expands them into per-head keys and values, which a cascade level would
    # have to hold instead
    mla = getattr(config, "kv_lora_rank", None) is not None
    if plain and mla:
        reasons["cascade"] = "MLA caches a compressed latent, not the keys attention reads"
    return FastPaths(plain, plain, plain and not mla, plain, reasons=reasons)


# ---------------------------------------------------------------- MoE


def is_moe(model: Any) -> bool:
    return bool(router_modules(model))


def router_modules(model: Any) -> dict[str, Any]:
    """name -> router module: the `gate`/`router` child of every block that also has an
    `experts` child (the layout of transformers' MoE blocks)."""
    out = {}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        for key in ("gate", "router"):
            if key in children:
                out[f"{name}.{key}" if name else key] = children[key]
    return out


def expert_parameters(model: Any) -> list[str]:
    """Suffixes (`experts.gate_up_proj`) of the fused expert weights: 3-D parameters
    [experts, out, in] that no nn.Linear holds, so PEFT reaches them only through
    `target_parameters`."""
    found = set()
    for name, module in model.named_modules():
        if not name.endswith("experts"):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim == 3:
                found.add(f"experts.{param_name}")
    return sorted(found)


def lora_targets(model: Any, target_modules: Any, router: bool = False) -> dict[str, Any]:
    """PEFT `LoraConfig` target arguments. A dense model, or explicit `target_modules`:
    as given ('all-linear': every nn.Linear but the output head). An MoE model with
    'all-linear': its nn.Linear layers (attention, dense and shared-expert MLPs) by name,
    the routers left out unless `router`, plus the fused expert weights as
    `target_parameters`. The names are spelled out because PEFT 0.21 rewrites a bare
    'all-linear' on mixtral/qwen-MoE-style models to the transformers-4 layout, where
    the router was an nn.Linear: it would adapt the routers too."""
    routers = router_modules(model)
    if not routers or target_modules != "all-linear":
        return {"target_modules": target_modules}
    head = model.get_output_embeddings()
    inside_routers = tuple(f"{name}." for name in routers)
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module is not head
        and name not in routers
        and not name.startswith(inside_routers)
    }
    parameters = expert_parameters(model)
    if router:
        leaves = {name.rsplit(".", 1)[-1] for name in routers}
        parameters += sorted(f"{leaf}.weight" for leaf in leaves)
    return {"target_modules": sorted(names), "target_parameters": parameters}
