"""Model loading: the policy (model + tokenizer + chat renderer + rollout engine) as
training, evaluation and serving load it, and `make_engine`, the one place a model's
sampling engine is built from a run's config. The trainer's log-probabilities live in
forward/score.py."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.config import LoraConfig as LoraSettings
from looprl.engine.hf import HFEngine
from looprl.errors import ConfigError, EngineError
from looprl.forward.score import completion_logprobs
from looprl.loop.optim import quiet_bitsandbytes
from looprl.loop.progress import Progress
from looprl.model.arch import fast_paths, lora_targets
from looprl.model.load import base_model, load_causal_lm, load_tokenizer
from looprl.model.memory import checkpoint_layers


@dataclass
class Policy:
    model: Any
    tokenizer: Any
    renderer: ChatRenderer
    engine: Any  # HFEngine, or a VLLMEngine once `attach_rollout_engine` has run
    device: torch.device
    # algo.kl_reference=start: the trainable weights the RL steps began from (loop/reference.py)
    reference: dict[str, torch.Tensor] | None = None
    # algo.teacher: the frozen model on-policy distillation scores the episodes with
    teacher: Any = None

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
    if cfg.model.lora.enabled:
        model = add_lora(model, cfg.model.lora)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
    return Policy(model, tokenizer, renderer, make_engine(cfg, model, tokenizer, renderer), device)


def enable_checkpointing(model: Any) -> None:
    """model.gradient_checkpointing: each decoder layer recomputed in the backward pass,
    the trainer's shared-prompt forward kept (model/memory.py). A model whose layers are
    not transformers' checkpointable kind gets transformers' own switch, which drops the
    KV cache: the trainer then runs whole sequences (forward/score.py)."""
    if checkpoint_layers(model):
        return
    base = base_model(model)
    base.gradient_checkpointing_enable()
    base.config.use_cache = False
    if base is not model:  # LoRA: the frozen embeddings' output must carry a gradient
        model.enable_input_require_grads()


def make_engine(cfg: Config, model: Any, tokenizer: Any, renderer: ChatRenderer) -> HFEngine:
    """The engine that samples from `model` under the run's settings: the one factory
    for training, evaluation and serving (a served run's baseline variant included).
    `rollout.engine=vllm` swaps it for a vLLM server afterwards (`attach_rollout_engine`)."""
    return HFEngine(
        model,
        tokenizer,
        renderer.eos_ids,
        batch_size=cfg.rollout.batch_size,
        jump_forward=cfg.rollout.jump_forward,
        sampler_dtype=None if cfg.rollout.sampler_dtype == "model" else cfg.rollout.sampler_dtype,
        cascade_attention=cfg.model.cascade_attention,
        weight_first_linear=cfg.model.weight_first_linear,
        packed_linear=cfg.model.packed_linear,
        compile_step=cfg.rollout.compile,
    )


def load_model(cfg: Config, progress: Progress) -> Policy:
    """`load_policy` as a phase of its own (the first minute of a run on a slow disk),
    with the rollout engine attached: how training and `looprl eval` load the model."""
    check_rollout_engine(cfg)
    with progress.phase("load model") as phase:
        policy = load_policy(cfg)
        attach_rollout_engine(cfg, policy)
        params = list(policy.model.parameters())
        trained = sum(p.numel() for p in params if p.requires_grad)
        phase.done(
            f"{cfg.model.name} on {policy.device} · {trained:,} of "
            f"{sum(p.numel() for p in params):,} parameters trained"
        )
    return policy


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
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        task_type="CAUSAL_LM",
        **targets,
    )
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
        policy.model,
        policy.tokenizer,
        policy.renderer.eos_ids,
        spec,
        rollout.vllm_url,
        rescore if rollout.vllm_rescore == "policy" else None,
    )
    atexit.register(engine.close)
    policy.engine = engine


def policy_rescorer(policy: Policy, budget: int):
    """The vLLM engine's scorer of constrained completions (`rollout.vllm_rescore=policy`):
    `completion_logprobs(prompts, completions, temperature)` under the policy module, in
    passes of about `budget` tokens."""
    pad = policy.tokenizer.pad_token_id or 0

    def score(
        prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]]:
        return completion_logprobs(
            policy.model, prompts, completions, temperature, pad, policy.device, budget
        )

    return score
