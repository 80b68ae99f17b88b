"""The policy: model + tokenizer + chat renderer + rollout engine, and the trainer's
log-probability computation over episode token sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from looprl.algo import token_logprobs
from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.engine.hf import HFEngine, shared_prefill
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
    engine = HFEngine(
        model,
        tokenizer,
        renderer.eos_ids,
        batch_size=cfg.rollout.batch_size,
        jump_forward=cfg.rollout.jump_forward,
    )
    return Policy(model, tokenizer, renderer, engine, device)


def prompt_length(mask: list[int]) -> int:
    """Tokens before the first generated one: the episode's initial prompt."""
    return mask.index(1) if 1 in mask else len(mask)


def sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    masks: list[list[int]],
    pad_id: int,
    device: torch.device,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of the tokens after each sequence's initial prompt.

    Prefix sharing, exact gradients included: the G episodes of a task share their
    prompt, so each distinct prompt is run once (left-padded, batch U) and its KV cache
    rows are copied to every episode that uses it (an indexing op, so gradients from all
    G episodes flow back into the one prompt pass). Then the episodes' suffixes (all
    turns after the prompt, right-padded) run on top of that cache. Positions follow the
    engine's convention, so trainer and engine logprobs agree.
    Returns logp_BS (with grad if enabled) and mask_BS (bool): S covers every suffix.
    """
    starts = [prompt_length(m) for m in masks]
    prefill = shared_prefill(
        model, [seq[:st] for seq, st in zip(sequences, starts)], pad_id, device
    ).expand()

    suffixes = [seq[st:] for seq, st in zip(sequences, starts)]
    width = max(len(x) for x in suffixes)
    batch = len(sequences)
    ids_BS = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_BS = torch.zeros((batch, width), dtype=torch.long)
    mask_BS = torch.zeros((batch, width), dtype=torch.bool)
    for row, (suffix, m, st) in enumerate(zip(suffixes, masks, starts)):
        ids_BS[row, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
        attention_BS[row, : len(suffix)] = 1
        mask_BS[row, : len(suffix)] = torch.tensor(m[st:], dtype=torch.bool)
    ids_BS, attention_BS = ids_BS.to(device), attention_BS.to(device)
    positions_BS = prefill.next_pos_C[:, None] + torch.arange(width, device=device)
    out = model(
        input_ids=ids_BS,
        attention_mask=torch.cat([prefill.attention_CL, attention_BS], dim=1),
        position_ids=positions_BS,
        cache=prefill.cache,
        use_cache=True,
    )
    # the prompt's last logits predict suffix token 0; suffix position t predicts t + 1
    logits_BSV = torch.cat([prefill.logits_CV[:, None, :], out.logits[:, :-1, :]], dim=1)
    logp_BS = token_logprobs(logits_BSV, ids_BS, temperature=temperature)
    return logp_BS, mask_BS.to(device)
