"""`tiny-random`: a seeded, randomly initialised Llama-style model with the SmolLM2
tokenizer, built in code (no download), sized to train in seconds on a CPU."""

from __future__ import annotations

from typing import Any

# tiny-random: small enough to train in seconds on a CPU, big enough to learn a task.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build_tiny_random(tokenizer: Any, seed: int = 0) -> Any:
    """A seeded, randomly initialised Llama-style causal LM sized for the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
