"""The policy: model + tokenizer + chat renderer + rollout engine, and the trainer's
log-probability computation over episode token sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from looprl.algo import token_logprobs
from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.engine.hf import HFEngine
from looprl.errors import ConfigError
from looprl.models import load_causal_lm, load_tokenizer


@dataclass
class Policy:
    model: Any
    tokenizer: Any
    renderer: ChatRenderer
    engine: HFEngine
    device: torch.device

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device=cuda, but no CUDA device is available; use auto or cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_policy(cfg: Config) -> Policy:
    """Load the model named in the config, wrap it in LoRA adapters if asked, and build the
    renderer and the engine that samples from this very module."""
    device = pick_device(cfg.model.device)
    dtype = pick_dtype(cfg.model.dtype, device)
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    model = load_causal_lm(cfg.model.name, dtype, cfg.model.trust_remote_code).to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.model.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = cfg.model.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            ),
        )
        if cfg.model.gradient_checkpointing:
            model.enable_input_require_grads()
    renderer = ChatRenderer(
        tokenizer, cfg.model.tool_format, cfg.model.tool_prompt, model_name=cfg.model.name
    )
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=cfg.rollout.batch_size)
    return Policy(model, tokenizer, renderer, engine, device)


def sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    masks: list[list[int]],
    pad_id: int,
    device: torch.device,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of the loss-masked tokens of several sequences.

    Sequences are left-padded to a common length T so that their ends line up; only the
    last K positions, which hold every masked (generated) token of every sequence, get
    logits. This keeps the [B, K, vocab] logits small for long prompts. Left padding with
    explicit position ids matches the engine, so trainer and engine logprobs agree.
    Returns logp_BK (with grad if enabled) and mask_BK (bool).
    """
    batch = len(sequences)
    longest = max(len(s) for s in sequences)
    # K: distance from the first generated token to the end, over the batch
    window = max(len(s) - m.index(1) for s, m in zip(sequences, masks) if 1 in m)
    ids_BT = torch.full((batch, longest), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((batch, longest), dtype=torch.long)
    mask_BT = torch.zeros((batch, longest), dtype=torch.bool)
    for row, (seq, m) in enumerate(zip(sequences, masks)):
        ids_BT[row, longest - len(seq) :] = torch.tensor(seq)
        attention_BT[row, longest - len(seq) :] = 1
        mask_BT[row, longest - len(seq) :] = torch.tensor(m, dtype=torch.bool)
    positions_BT = (attention_BT.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids_BT.to(device),
        attention_mask=attention_BT.to(device),
        position_ids=positions_BT.to(device),
        use_cache=False,
        logits_to_keep=window + 1,
    )
    # logits at position p predict token p + 1: drop the last position's logits
    logits_BKV = out.logits[:, :-1, :]
    targets_BK = ids_BT[:, longest - window :].to(device)
    logp_BK = token_logprobs(logits_BKV, targets_BK, temperature=temperature)
    return logp_BK, mask_BT[:, longest - window :].to(device)
