"""Every config section: its fields, defaults and one-line descriptions (the algorithm's
own section and the curriculum in `algo.py`; the whole config and the rules over several
sections in `run.py`).

Defaults live in these modules and nowhere else (`looprl.config` re-exports every name;
loading a config from YAML and `--set` overrides is `looprl/config/load.py`).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from looprl.config.base import Section


class LoraConfig(Section):
    enabled: bool = Field(True, description="Train LoRA adapters instead of all weights.")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names to adapt, or 'all-linear' (MoE models: the attention, "
        "dense and shared MLPs, and the fused expert weights).",
    )
    train_router: bool = Field(
        False, description="MoE models: adapt the expert routers too (frozen by default)."
    )


class ModelConfig(Section):
    name: str = Field(
        "smollm2-135m",
        description="Hub id, local path, 'gguf:PATH', or alias: smollm2-135m, gemma3-270m, "
        "tiny-random.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code to run (only when you trust it)."
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template, or a file holding one, for a model whose "
        "tokenizer has none (a base model); unset = the tokenizer's own.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the policy runs; auto = cuda if available, else cpu."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter settings.")
    gradient_checkpointing: bool = Field(
        False,
        description="Keep only each decoder layer's input for the backward pass and "
        "recompute the rest there: the same loss and gradients, less memory, slower updates.",
    )
    cascade_attention: bool = Field(
        True,
        description="Keep the KV of prompt text that rows share once, not per row, in "
        "rollouts and in the update (SDPA models; others keep their own attention).",
    )
    weight_first_linear: bool = Field(
        True,
        description="On the CPU, run decoding's small-batch linear layers as W @ x^T when "
        "a timing at engine start finds that form faster on this machine.",
    )
    packed_linear: bool = Field(
        True,
        description="On the CPU, sample through oneDNN with packed (LoRA-merged) linear "
        "weights when timed faster at engine start; a second copy while sampling.",
    )
    tool_format: Literal["auto", "hermes", "llama3", "glm", "mistral"] = Field(
        "auto", description="Tool-call syntax the model writes; auto = detect from template."
    )
    tool_prompt: Literal["auto", "native", "fallback"] = Field(
        "auto",
        description="How tools reach the prompt: the template's own support, or the fallback "
        "system-prompt block; auto = native when the template renders tools.",
    )


class EnvConfig(Section):
    name: str = Field(
        "tictactoe-move",
        description="Environment name (see `looprl envs`) or 'package.module:Class'.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the environment."
    )
    error_budget: int = Field(
        20, ge=0, description="Episodes that may end in env_error before the run stops."
    )
    mix: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Several environments by weight, [{name, args, weight, label}]: the "
        "same as name: mix with args.members (per-env metrics and report rows).",
    )

    @model_validator(mode="before")
    @classmethod
    def _mix_is_a_mix_env(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("mix"):
            return data
        members, args = data["mix"], {"members": data["mix"]}
        if data.get("name", "mix") != "mix" or data.get("args", args) != args:
            raise ValueError(
                f"env.mix and env.name={data.get('name')!r} / env.args both name the "
                "environment; give env.mix alone"
            )
        return {**data, "name": "mix", "args": {"members": members}}


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="Rollout engine: hf (in-process) or vllm (a vLLM server; docs/engines.md).",
    )
    tasks_per_step: int = Field(8, ge=1, description="Distinct tasks sampled per training step.")
    group_size: int = Field(8, ge=1, description="Episodes per task (the advantage group).")
    temperature: float = Field(1.0, ge=0, le=5, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    max_new_tokens: int = Field(64, ge=1, description="Generated tokens per model call.")
    max_staleness: int = Field(
        0,
        ge=0,
        le=16,
        description="Overlapped rollouts: the next steps are played while the trainer updates, "
        "by a policy K steps older (needs algo.is_correction or tis_cap); 0 = synchronous.",
    )
    max_episode_tokens: int = Field(
        2048, ge=16, description="Total tokens (prompt + all turns) before truncation."
    )
    batch_size: int = Field(64, ge=1, description="Sequences decoded together by the engine.")
    jump_forward: bool = Field(
        True, description="Append grammar-forced spans in one pass instead of token by token."
    )
    compile: Literal["off", "auto", "on"] = Field(
        "off",
        description="hf engine: the decode step compiled at fixed shapes (CUDA graphs on a "
        "GPU, inductor on the CPU); auto = on a GPU only (docs/performance.md).",
    )
    sampler_dtype: Literal["model", "bfloat16", "float16"] = Field(
        "model",
        description="Sample from a copy of the policy in this dtype (faster on CPUs with "
        "bf16 units; the sampling mismatch shows in rollout/logprob_gap); 'model' = exact.",
    )
    think: Literal["off", "tagged", "plain"] = Field(
        "off",
        description="Free text before a forced tool call: off (the call alone), tagged "
        "(<think>...</think> then the call) or plain (text, then the call).",
    )
    think_max_tokens: int = Field(
        256, ge=1, description="Most tokens of that text; then the engine closes it."
    )

    @model_validator(mode="after")
    def _check_think(self) -> RolloutConfig:
        if self.think != "off" and self.think_max_tokens >= self.max_new_tokens:
            raise ValueError(
                f"rollout.think_max_tokens ({self.think_max_tokens}) must be below "
                f"rollout.max_new_tokens ({self.max_new_tokens}), which leaves the room for "
                "the call after the thinking; raise max_new_tokens or lower think_max_tokens"
            )
        return self

    vllm_url: str | None = Field(
        None, description="engine=vllm: use the looprl vLLM server at this URL; unset = start one."
    )
    vllm_python: str = Field(
        ".venv-vllm/bin/python",
        description="engine=vllm: Python of the vLLM environment (`make setup-vllm`).",
    )
    vllm_eager: bool = Field(
        True, description="engine=vllm: no graph capture (starts in seconds, not minutes)."
    )
    vllm_kv_cache_gb: float | None = Field(
        2.0, gt=0, description="engine=vllm: KV cache size; unset = vLLM's default share of memory."
    )
    vllm_args: list[str] = Field(
        default_factory=list, description="engine=vllm: extra `vllm serve` arguments."
    )
    vllm_rescore: Literal["policy", "server"] = Field(
        "policy",
        description="engine=vllm, forced calls: who scores their unconstrained logprobs: "
        "policy (looprl's module, one batched pass; whole weights when sharded) or server.",
    )
    vllm_start_timeout_s: float = Field(
        900.0, gt=0, description="engine=vllm: seconds the server may take to start."
    )


class TrainConfig(Section):
    steps: int = Field(20, ge=0, description="Training steps (one rollout batch each).")
    lr: float = Field(4e-4, gt=0, le=1, description="Peak learning rate (AdamW).")
    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw",
        description="adamw: float32 states (8 bytes/param); adamw_8bit: bitsandbytes' 8-bit "
        "states (≈ 2 bytes/param; needs the optim8bit extra).",
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate decay after warmup."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    micro_batch_tokens: int = Field(
        2048, ge=64, description="Token budget of one forward/backward micro-batch."
    )
    checkpoint_every: int = Field(10, ge=0, description="Save a checkpoint every K steps; 0 = off.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (newest).")
    max_bad_steps: int = Field(
        3, ge=1, description="Consecutive NaN/inf steps skipped before the run stops."
    )
    health: Literal["warn", "stop"] = Field(
        "warn",
        description="A step failing a health check (all env errors or cut replies, equal "
        "groups, nothing to train, NaN, flat loss, zero gradient): warn, or stop checkpointed.",
    )
    health_patience: int = Field(
        3, ge=1, description="Steps in a row that equal groups or a flat loss take to fail."
    )
    shard: Literal["none", "fsdp"] = Field(
        "none",
        description="Under torchrun: none = every rank holds the whole model; fsdp = weights, "
        "gradients and optimizer state split over the ranks (FSDP2).",
    )
    shard_grad_sync: Literal["last", "every"] = Field(
        "last",
        description="With train.shard=fsdp: reduce gradients after a rank's last micro-batch "
        "(less traffic, whole gradients meanwhile) or after each (they stay 1/N).",
    )
    shard_checkpoint: Literal["sharded", "whole"] = Field(
        "sharded",
        description="With train.shard=fsdp: each rank writes its own shards of a checkpoint "
        "(steps, best, rl_start; torch.distributed.checkpoint), or rank 0 gathers them whole.",
    )
    offload: bool = Field(
        False,
        description="With train.shard=fsdp on CUDA: keep the sharded weights, gradients and "
        "optimizer state in CPU memory between uses.",
    )
    replay: str | None = Field(
        None,
        description="A run folder whose saved rollouts (logging.save_rollouts) the steps "
        "train on instead of sampling, scored under this config (`looprl run --replay RUN`).",
    )


class SFTConfig(Section):
    enabled: bool = Field(
        False, description="Warm start: train on the env's demonstrations before RL."
    )
    steps: int = Field(30, ge=1, description="SFT optimizer steps.")
    batch_size: int = Field(16, ge=1, description="Demonstrations per SFT step.")
    lr: float = Field(1e-4, gt=0, le=1, description="SFT learning rate (AdamW, constant).")
    loss_on: Literal["all", "free"] = Field(
        "all",
        description="Tokens the SFT loss averages over: all assistant tokens, or only those "
        "a forced call's grammar leaves free (the decision, e.g. the square's digit).",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict,
        description="env.args overrides for the SFT's demonstration tasks only (e.g. "
        "{agent_plays: O}).",
    )


class LoggingConfig(Section):
    trackers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers that get the metrics, config and report, besides "
        "metrics.jsonl: tensorboard (RUN/tb), wandb, trackio, mlflow; [] = none.",
    )
    project: str = Field(
        "looprl", min_length=1, description="wandb/trackio project or mlflow experiment name."
    )
    sample_every: int = Field(5, ge=0, description="Write training transcripts every K steps.")
    samples_per_log: int = Field(4, ge=0, description="Transcripts written each time.")
    save_rollouts: bool = Field(
        False,
        description="Save each step's groups to RUN/rollouts/ (gzip pickles, ≈ tens of KB a "
        "step) for `looprl run --replay RUN`.",
    )
    # The two booleans below are the old spelling: read, folded into `trackers`, never written.
    tensorboard: bool | None = Field(
        None,
        exclude=True,
        description="Deprecated, use logging.trackers: false removes tensorboard, true adds it.",
    )
    wandb: bool | None = Field(
        None,
        exclude=True,
        description="Deprecated, use logging.trackers: true adds wandb, false removes it.",
    )

    @field_validator("trackers")
    @classmethod
    def _no_repeats(cls, trackers: list[str]) -> list[str]:
        repeated = sorted({name for name in trackers if trackers.count(name) > 1})
        if repeated:
            raise ValueError(f"each tracker may be listed once; repeated: {', '.join(repeated)}")
        return trackers

    @model_validator(mode="after")
    def _fold_deprecated_flags(self) -> LoggingConfig:
        old = {
            n: getattr(self, n) for n in ("tensorboard", "wandb") if getattr(self, n) is not None
        }
        if not old:
            return self
        trackers = [name for name in self.trackers if old.get(name) is not False]
        trackers += [name for name, on in old.items() if on and name not in trackers]
        object.__setattr__(self, "trackers", trackers)
        object.__setattr__(self, "tensorboard", None)
        object.__setattr__(self, "wandb", None)
        spelled = " and ".join(f"logging.{name}: {str(on).lower()}" for name, on in old.items())
        warnings.warn_explicit(  # at no line of looprl: the old spelling is in the user's config
            f"{spelled} is the old spelling; write logging.trackers: [{', '.join(trackers)}]",
            FutureWarning,
            filename="config",
            lineno=0,
        )
        return self
