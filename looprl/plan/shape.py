"""A model's shape, read from its config alone: parameter counts from a meta-device
instance (no memory allocated, every expert of a mixture-of-experts counted), the LoRA
adapters PEFT would add to it, and the per-token widths the memory model needs.

Counting on the meta device runs the model's own constructor, so tied embeddings, fused
expert tensors, shared experts and any layer the config switches on are counted as the
run would load them; only the sizes in bytes are left to the planner (the run's dtype)."""

from __future__ import annotations

import contextlib
import io
from dataclasses import asdict, dataclass
from typing import Any

import torch

from looprl.config import Config
from looprl.errors import ModelError
from looprl.forward import cascade
from looprl.loop.optim import EIGHT_BIT_MIN_SIZE
from looprl.model.arch import fast_paths
from looprl.model.load import load_model_config


@dataclass
class ModelShape:
    name: str
    model_type: str
    params: int  # every parameter, all experts included
    expert_params: int  # routed experts' parameters, all of them
    active_params: int  # what one token's forward uses (top_k of E experts), input table excluded
    embedding_params: int  # the input embedding table
    lora_params: int  # trainable parameters with model.lora (PEFT on the meta model)
    small_params: int  # in tensors under 4,096 values (8-bit AdamW keeps them 32-bit)
    lora_small_params: int  # the same among the LoRA parameters
    lora_linears_per_layer: float  # adapted linear layers per decoder layer
    layers: int
    hidden: int
    vocab: int
    mlp_width: int  # MLP intermediate values one token computes (routed top_k + shared)
    attention_width: int  # per layer: query + key + value projection widths
    kv_per_token: int  # cached elements per token, summed over the full-attention layers
    state_per_row: int  # linear-attention layers: fixed state bytes per sequence (float32)
    cascade: bool  # the run keeps shared prompt KV once (SDPA, plain full-attention cache)
    linear_params: int = 0  # in plain nn.Linear weights, the output head included

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def meta_model(config: Any, trust_remote_code: bool = False) -> Any:
    """An instance of the model on the meta device: shapes without storage."""
    from transformers import AutoModelForCausalLM

    quiet = io.StringIO()
    with torch.device("meta"), contextlib.redirect_stderr(quiet):
        try:
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, TypeError) as err:
            raise ModelError(f"cannot build {config.model_type!r} from its config: {err}") from None


def _is_routed_expert(name: str) -> bool:
    """Parameters of routed experts: under a module named `experts` (fused tensors or one
    module per expert); `shared_experts` run for every token and are not routed."""
    return "experts" in name.split(".")[:-1]


def _small(params: Any) -> int:
    return sum(p.numel() for p in params if p.numel() < EIGHT_BIT_MIN_SIZE)


def lora_count(model: Any, cfg: Config) -> tuple[int, int, int]:
    """(trainable parameters, those in small tensors, adapted linear layers) PEFT adds with
    `model.lora`, counted by wrapping the meta model with the run's own `add_lora` (for
    MoE models: the fused expert weights too, the routers only if trained)."""
    from looprl.loop.policy import add_lora

    with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
        wrapped = add_lora(model, cfg.model.lora)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    adapted = sum(1 for name, _ in wrapped.named_modules() if name.endswith(".lora_A"))
    return sum(p.numel() for p in trainable), _small(trainable), adapted


def _kv_per_token(config: Any, layer_types: list[str]) -> tuple[int, int]:
    """(cached elements per token over all full-attention layers, linear-attention state
    bytes per sequence). Plain attention caches keys and values: 2 × kv heads × head dim.
    MLA layers (DeepSeek V3, Bailing) cache the compressed latent and the rotary key
    (kv_lora_rank + rope dim), as transformers' MLA models do. A linear-attention layer
    keeps a float32 state of heads × head_dim² per sequence, plus its conv window."""
    heads = _get(config, "num_attention_heads")
    head_dim = _get(config, "head_dim", default=config.hidden_size // heads)
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    if _get(config, "kv_lora_rank") is not None:
        per_layer = config.kv_lora_rank + _get(config, "qk_rope_head_dim", default=0)
    else:
        per_layer = 2 * kv_heads * head_dim
    full = sum(1 for kind in layer_types if kind != "linear_attention")
    linear = len(layer_types) - full
    state = 0
    if linear:
        lin_heads = _get(config, "linear_num_heads", default=heads)
        lin_dim = _get(config, "linear_head_dim", default=head_dim)
        kernel = _get(config, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4)
        state = linear * 4 * (lin_heads * lin_dim * lin_dim + 3 * lin_heads * lin_dim * kernel)
    return full * per_layer, state


def _mlp_width(config: Any) -> int:
    """Intermediate values per token of the widest MLP: a dense MLP's, or a routed layer's
    top_k experts plus its shared experts."""
    dense = _get(config, "intermediate_size", default=4 * config.hidden_size)
    experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    if not experts:
        return dense
    top_k = _get(config, "num_experts_per_tok", "num_experts_per_token", default=1)
    shared = _get(config, "num_shared_experts", "n_shared_experts", default=0)
    moe = _get(config, "moe_intermediate_size", default=dense)
    return max(dense, (top_k + shared) * moe)


def model_shape(cfg: Config) -> ModelShape:
    """Everything the planner needs about `cfg.model`, from its config only."""
    config = load_model_config(cfg.model.name, cfg.model.trust_remote_code)
    model = meta_model(config, cfg.model.trust_remote_code)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if _is_routed_expert(n))
    n_experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    top_k = _get(config, "num_experts_per_tok", "num_experts_per_token", default=0)
    table = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is table
    embedding = table.numel()
    unused_experts = experts - experts * top_k // n_experts if n_experts else 0
    # a lookup reads one row of the input table; a tied table is also the output head
    active = params - unused_experts - (0 if tied else embedding)
    layer_types = list(
        _get(config, "layer_types", default=None) or ["full_attention"] * config.num_hidden_layers
    )
    kv, state = _kv_per_token(config, layer_types)
    heads = config.num_attention_heads
    head_dim = _get(config, "head_dim", default=config.hidden_size // heads)
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    # as the engine decides: only where cascade is exact for the architecture
    on_cascade = (not state) and fast_paths(config).cascade and cascade.enable(model)
    small = _small(model.parameters())  # before PEFT wraps the model
    linear = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    # counted also for a full fine-tune, so that the plan can weigh LoRA as an option
    lora_params, lora_small, adapted = lora_count(model, cfg)
    return ModelShape(
        name=cfg.model.name,
        model_type=config.model_type,
        params=params,
        expert_params=experts,
        active_params=active,
        embedding_params=embedding,
        lora_params=lora_params,
        small_params=small,
        lora_small_params=lora_small,
        lora_linears_per_layer=adapted / config.num_hidden_layers,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        mlp_width=_mlp_width(config),
        attention_width=heads * head_dim + 2 * kv_heads * head_dim,
        kv_per_token=kv,
        state_per_row=state,
        cascade=bool(on_cascade and cfg.model.cascade_attention),
        linear_params=linear,
    )
