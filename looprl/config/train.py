"""The `train` section: the optimisation (optimizer, schedule, clipping, micro-batch
budget), checkpoints, the health checks' stop, replay, and the split of the model over
several processes (`train.shard`). Its defaults live here and nowhere else."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from looprl.config.base import Section


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
