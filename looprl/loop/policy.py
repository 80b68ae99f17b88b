"""The policy: model + tokenizer + chat renderer + rollout engine, and the trainer's
log-probability computation over episode token sequences."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from looprl.algo import head_logprobs, token_logprobs
from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.config import LoraConfig as LoraSettings
from looprl.engine.hf import HFEngine
from looprl.errors import ConfigError, EngineError
from looprl.forward import cascade
from looprl.forward.kv import bufferable
from looprl.forward.prefix import prefix_kwargs, shared_prefill
from looprl.loop.optim import quiet_bitsandbytes
from looprl.model.arch import fast_paths, lora_targets
from looprl.model.load import base_model, load_causal_lm, load_tokenizer


@dataclass
class Policy:
    model: Any
    tokenizer: Any
    renderer: ChatRenderer
    engine: Any  # HFEngine, or a VLLMEngine once `attach_rollout_engine` has run
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
    renderer and the engine that samples from this very module. A model whose
    architecture rules out some fast paths gets one line on stderr saying which and why."""
    device = pick_device(cfg.model.device)
    dtype = pick_dtype(cfg.model.dtype, device)
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code, cfg.model.chat_template)
    # the template is checked before any weights are read
    renderer = ChatRenderer(
        tokenizer, cfg.model.tool_format, cfg.model.tool_prompt, model_name=cfg.model.name
    )
    model = load_causal_lm(cfg.model.name, dtype, cfg.model.trust_remote_code).to(device)
    notice = fast_paths(model.config).notice()
    if notice is not None:
        print(f"note: {notice}", file=sys.stderr)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.model.lora.enabled:
        model = add_lora(model, cfg.model.lora)
        if cfg.model.gradient_checkpointing:
            model.enable_input_require_grads()
    engine = HFEngine(
        model,
        tokenizer,
        renderer.eos_ids,
        batch_size=cfg.rollout.batch_size,
        jump_forward=cfg.rollout.jump_forward,
        sampler_dtype=None if cfg.rollout.sampler_dtype == "model" else cfg.rollout.sampler_dtype,
        cascade_attention=cfg.model.cascade_attention,
        weight_first_linear=cfg.model.weight_first_linear,
    )
    return Policy(model, tokenizer, renderer, engine, device)


def add_lora(model: Any, lora: LoraSettings) -> Any:
    """`model` wrapped in PEFT LoRA adapters: the targets `lora.target_modules` names,
    widened for MoE models to the fused expert weights (`arch.lora_targets`)."""
    quiet_bitsandbytes()  # before peft imports it
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, lora.target_modules, router=lora.train_router)
    if targets.get("target_parameters") and lora.dropout:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout}: PEFT adapts an MoE model's fused expert "
            "weights only without dropout; set model.lora.dropout=0"
        )
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
        **targets,
    )  # fmt: skip
    with warnings.catch_warnings():  # PEFT's note on its own patterns for expert weights
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match")
        return get_peft_model(model, config)


def check_rollout_engine(cfg: Config) -> None:
    """rollout.engine=vllm: its environment is installed (or a URL is given); checked
    before anything is loaded or written."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.vllm_url is None:
        from looprl.engine.vllm_server import check_installed

        try:
            check_installed(cfg.rollout.vllm_python)
        except EngineError as err:
            raise ConfigError(str(err)) from None


def attach_rollout_engine(cfg: Config, policy: Policy) -> None:
    """rollout.engine=vllm: start (or attach to) the vLLM server that samples rollouts
    from now on; the `hf` engine stays in place otherwise."""
    if cfg.rollout.engine != "vllm":
        return
    import atexit

    from looprl.engine.vllm import VLLMEngine
    from looprl.engine.vllm_server import LaunchSpec

    rollout = cfg.rollout
    limit = getattr(base_model(policy.model).config, "max_position_embeddings", None) or 2**31
    spec = LaunchSpec(
        python=rollout.vllm_python,
        model_dir=Path(),  # filled in by the engine: the saved base model
        dtype=str(next(policy.model.parameters()).dtype).removeprefix("torch."),
        max_model_len=min(limit, rollout.max_episode_tokens + rollout.max_new_tokens),
        lora_rank=cfg.model.lora.rank if cfg.model.lora.enabled else None,
        eager=rollout.vllm_eager,
        kv_cache_gb=rollout.vllm_kv_cache_gb,
        extra_args=list(rollout.vllm_args),
        timeout_s=rollout.vllm_start_timeout_s,
    )
    rescore = policy_rescorer(policy, cfg.train.micro_batch_tokens)
    engine = VLLMEngine.launch(
        policy.model, policy.tokenizer, policy.renderer.eos_ids, spec, rollout.vllm_url,
        rescore if rollout.vllm_rescore == "policy" else None,
    )  # fmt: skip
    atexit.register(engine.close)
    policy.engine = engine


def policy_rescorer(policy: Policy, budget: int):
    """The vLLM engine's scorer of constrained completions (`rollout.vllm_rescore=policy`):
    each completion's logprobs under the policy module, unconstrained, at the sampling
    temperature, in passes of about `budget` tokens (prompts shared as in the update)."""
    model, pad = policy.model, policy.tokenizer.pad_token_id or 0

    def score(
        prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in prompts]
        todo = [i for i, c in enumerate(completions) if c]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                while todo:
                    chunk, tokens = [], 0
                    while todo and (
                        not chunk
                        or tokens + len(prompts[todo[0]]) + len(completions[todo[0]]) <= budget
                    ):
                        i = todo.pop(0)
                        chunk.append(i)
                        tokens += len(prompts[i]) + len(completions[i])
                    logp_BS, mask_BS = sequence_logprobs(
                        model, [prompts[i] + completions[i] for i in chunk],
                        [[0] * len(prompts[i]) + [1] * len(completions[i]) for i in chunk],
                        pad, policy.device, temperature,
                    )  # fmt: skip
                    for row, i in enumerate(chunk):
                        out[i] = logp_BS[row][mask_BS[row]].float().tolist()
        finally:
            model.train(was_training)
        return out

    return score


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
    pack: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of the tokens after each sequence's initial prompt.

    Prefix sharing, exact gradients included: the prompts run through `shared_prefill`
    (each distinct prompt once, their common head once). With cascade attention the
    episodes' suffixes (all turns after the prompt, right-padded) attend to the head and
    to their prompt's tail where they are, one copy each; otherwise the prompt KV rows
    are copied to every episode that uses them (an indexing op). Either way the gradients
    from all G episodes flow back into the one prompt pass. With cascade attention and
    `pack`, suffixes of different lengths are packed: the model runs their real tokens
    as one row (no padding through the linear layers), and only attention unpacks them
    (`cascade.Packing`). Positions follow the engine's
    convention, so trainer and engine logprobs agree. A model training under gradient
    checkpointing cannot use a cache (transformers drops it), and a model whose cache is
    not plain keys and values (`arch.fast_paths`: sliding windows, linear attention, an
    architecture outside the tested matrix) does not share it: both run whole sequences.

    Logits are computed only where the loss needs them: at the loss-masked positions,
    in chunks (`head_logprobs`), never as a [B, S, vocab] tensor, when the model's logits
    are a plain projection of its last hidden state (checked once per model).
    Returns logp_BS (with grad if enabled; 0 off the mask) and mask_BS (bool); callers
    use only the masked entries, in order.
    """
    if _cache_dropped(model) or not fast_paths(base_model(model).config).trainer_prefix:
        return _whole_sequence_logprobs(model, sequences, masks, pad_id, device, temperature)
    starts = [prompt_length(m) for m in masks]
    prefill = shared_prefill(
        model, [seq[:st] for seq, st in zip(sequences, starts)], pad_id, device
    )
    ids_BS, attention_BS, mask_BS = _right_padded(
        [seq[st:] for seq, st in zip(sequences, starts)],
        [m[st:] for m, st in zip(masks, starts)],
        pad_id,
        device,
    )
    width = ids_BS.shape[1]
    rows = prefill.cache_rows
    packing = None
    if cascade.enabled(model) and bufferable(prefill.cache):
        # cascade attention: the head and each distinct prompt's tail stay one copy each
        shared = prefill.prefix.levels if prefill.prefix is not None else []
        tails = cascade.Level(
            [layer.keys for layer in prefill.cache.layers],
            [layer.values for layer in prefill.cache.layers],
            rows_B=rows,
            valid_NT=prefill.attention_CL[:, : prefill.width].bool(),
        )
        positions_BS = prefill.next_pos_C[rows][:, None] + torch.arange(width, device=device)
        lengths = attention_BS.sum(1).tolist()
        call_ids, call_mask, call_positions = ids_BS, attention_BS, positions_BS
        if pack and 0 < sum(lengths) < len(lengths) * width:
            # one row of the real tokens: no linear layer or norm runs on padding
            packing = cascade.Packing.of(lengths, device)
            call_ids = ids_BS[packing.valid_BS][None]
            call_mask = packing.causal_mask()
            call_positions = positions_BS[packing.valid_BS][None]
        inputs = dict(
            input_ids=call_ids,
            attention_mask=call_mask,
            position_ids=call_positions,
            use_cache=False,
            **prefix_kwargs(cascade.Prefix([*shared, tails], packing)),
        )
        logits_BV = prefill.logits_CV[rows]
    else:
        prefill = prefill.expand()
        inputs = dict(
            input_ids=ids_BS,
            attention_mask=torch.cat([prefill.attention_CL, attention_BS], dim=1),
            position_ids=prefill.next_pos_C[:, None] + torch.arange(width, device=device),
            cache=prefill.cache,
            use_cache=True,
        )
        logits_BV = prefill.logits_CV
    # the prompt's last logits predict suffix token 0; suffix position t predicts t + 1
    first_B = token_logprobs(logits_BV[:, None, :], ids_BS[:, :1], temperature)[:, 0]
    rest_BS = _next_token_logprobs(model, inputs, ids_BS, mask_BS, temperature, packing)
    return torch.cat([first_B[:, None], rest_BS], dim=1), mask_BS


def _whole_sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    masks: list[list[int]],
    pad_id: int,
    device: torch.device,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No cache: each sequence in full (right-padded); position t predicts token t + 1."""
    ids_BT, attention_BT, mask_BT = _right_padded(sequences, masks, pad_id, device)
    positions_BT = torch.arange(ids_BT.shape[1], device=device).expand_as(ids_BT)
    inputs = dict(input_ids=ids_BT, attention_mask=attention_BT, position_ids=positions_BT)
    logp_BT = _next_token_logprobs(model, inputs, ids_BT, mask_BT, temperature)
    return logp_BT, mask_BT[:, 1:]


def _next_token_logprobs(
    model: Any,
    inputs: dict[str, Any],
    ids_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    temperature: float,
    packing: cascade.Packing | None = None,
) -> torch.Tensor:
    """logprobs of ids_BS[:, 1:] from the model's outputs at positions 0..S-2 (a packed
    call's outputs are one row of real tokens: `packing` maps them back)."""
    split = decoder_and_head(model)
    if split is None:
        logits = model(**inputs).logits
        logits_BSV = (logits if packing is None else logits[0][packing.index_BS])[:, :-1, :]
        return token_logprobs(logits_BSV, ids_BS[:, 1:], temperature=temperature)
    decoder, head = split
    hidden = decoder(**inputs).last_hidden_state
    needed_BS = mask_BS[:, 1:]
    if packing is None:
        hidden_NH = hidden[:, :-1, :][needed_BS]
    else:  # only the needed rows of the packed output: no padded copy
        hidden_NH = hidden[0][packing.index_BS[:, :-1][needed_BS]]
    picked_N = head_logprobs(hidden_NH, head, ids_BS[:, 1:][needed_BS], temperature)
    rest_BS = torch.zeros(needed_BS.shape, dtype=picked_N.dtype, device=ids_BS.device)
    return rest_BS.masked_scatter(needed_BS, picked_N)


def _right_padded(
    seqs: list[list[int]], masks: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (seq, m) in enumerate(zip(seqs, masks)):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[row, : len(seq)] = 1
        mask[row, : len(seq)] = torch.tensor(m, dtype=torch.bool)
    return ids.to(device), attention.to(device), mask.to(device)


def _cache_dropped(model: Any) -> bool:
    """transformers drops the KV cache of a model training under gradient checkpointing."""
    base = base_model(model)
    name = "is_activation_checkpointing"  # newer transformers; the older name warns there
    if not hasattr(type(base), name):
        name = "is_gradient_checkpointing"
    checkpointing = getattr(base, name, False)
    return bool(checkpointing) and model.training and torch.is_grad_enabled()


def decoder_and_head(model: Any) -> tuple[Any, Any] | None:
    """The model's body (returning its final hidden states) and output projection, if
    its logits are exactly `head(hidden)`: checked once per model on a short input, so a
    model that scales or soft-caps its logits keeps the plain path."""
    base = base_model(model)
    verdict = getattr(base, "_looprl_split_head", None)
    if verdict is None:
        verdict = False
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
        head = base.get_output_embeddings()
        if decoder is not None and head is not None and decoder is not base:
            device = next(base.parameters()).device
            ids = torch.tensor([[1, 2, 3, 4]], device=device)
            was_training = model.training
            model.eval()  # no dropout in the comparison
            with torch.no_grad():
                want = model(input_ids=ids).logits.float()
                got = head(decoder(input_ids=ids).last_hidden_state).float()
            model.train(was_training)
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                verdict = (decoder, head)
        base._looprl_split_head = verdict
    return verdict or None
