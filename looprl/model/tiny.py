"""Tiny randomly initialised models of each architecture in the tested matrix
(`arch.MATRIX`), sized like `tiny-random` (hidden 64, 4 layers) and built from config,
for the test suite and benchmarks. `save_tiny` writes one as a model folder with the
SmolLM2 tokenizer, which `model.name=FOLDER` loads like any other model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looprl.model.tiny_random import TINY_CONFIG

# The matrix by short name -> (transformers config class, its arguments beyond the common
# ones). Four layers, so that every kind of layer appears at least once: gemma3 has three
# sliding-window layers (a window of 16 tokens, shorter than any env prompt) and one global
# layer; bailing_hybrid alternates KDA linear attention and MLA full attention, with one
# dense layer before the routed experts (8 experts in 2 groups, top-2 from 1 group); glm4_moe
# has one dense layer, then 8 sigmoid-routed experts and a shared expert (rotary on half of
# each head, q/k norms, q/k/v biases); deepseek_v3 has MLA attention (low-rank queries, a
# compressed key/value latent of 16; query/key heads of 8 + 8 rotary dims, value heads of
# 12: narrower than the keys, as DeepSeek's) and one dense layer before 8 experts in 2
# groups (top-2 from 1 group) and a shared expert.
_MOE = dict(num_experts_per_tok=2)
TINY_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(intermediate_size=128)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=128)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, head_dim=16)),
    "mistral": ("MistralConfig", dict(intermediate_size=128, sliding_window=None)),
    "phi3": ("Phi3Config", dict(intermediate_size=128)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            intermediate_size=128,
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16, **_MOE),
    ),
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=8, **_MOE)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=64, num_experts=8, **_MOE)),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            num_nextn_predict_layers=0,
            **_MOE,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            num_nextn_predict_layers=0,
            **_MOE,
        ),
    ),
    "bailing_hybrid": (
        "BailingHybridConfig",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            layer_group_size=2,
            head_dim=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_mtp_layers=0,
            num_key_value_heads=4,
            **_MOE,
        ),
    ),
}
_COMMON = {**TINY_CONFIG, "num_hidden_layers": 4}  # tiny-random's sizes, four layers


def tiny_config(arch: str, tokenizer: Any) -> Any:
    """The transformers config of the tiny `arch` model, sized for `tokenizer`."""
    import transformers

    if arch not in TINY_ARCHITECTURES:
        known = ", ".join(TINY_ARCHITECTURES)
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {known}")
    class_name, extra = TINY_ARCHITECTURES[arch]
    kwargs = {**_COMMON, **extra}
    if arch == "bailing_hybrid":
        kwargs["tie_word_embeddings"] = False  # its output head is never tied
    return getattr(transformers, class_name)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )


def build_tiny(arch: str, tokenizer: Any, seed: int = 0) -> Any:
    """A seeded, randomly initialised tiny causal LM of architecture `arch`, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "bailing_hybrid":  # zero-initialised routers would route every token alike
        _randomise_routers(model, seed)
    return model.eval()


def _randomise_routers(model: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def perturb_adapters(model: Any, seed: int = 0, std: float = 0.05) -> Any:
    """Give a LoRA model's B matrices random values (PEFT starts them at zero, which
    makes every adapter a no-op), so that a test sees each adapter act and learn."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def save_tiny(arch: str, out: Path, seed: int = 0) -> Path:
    """Write the tiny `arch` model and the SmolLM2 tokenizer into the folder `out`."""
    from looprl.model.load import load_tokenizer

    tokenizer = load_tokenizer("tiny-random")
    out.mkdir(parents=True, exist_ok=True)
    build_tiny(arch, tokenizer, seed).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
