"""The whole config (`Config`: every section, and the run's seed) and the rules over
several sections, in one place: each is checked when a config is built (`Config`'s
validator calls `check_rules`), so a bad combination stops `looprl run`,
`looprl plan` and `looprl doctor` alike before anything loads, with one message that
names the fields and a setting that works. Rules that need more than the config (the
environment's capabilities, the number of processes, files on disk) are the run's
preflight (loop/preflight.py, loop/train.py's `check_run`)."""

from __future__ import annotations

import importlib.util

from pydantic import Field, model_validator

from looprl.config.algo import AlgoConfig, CurriculumConfig
from looprl.config.base import Section
from looprl.config.evaluation import EvalConfig
from looprl.config.sections import (
    EnvConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    TrainConfig,
)


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="The environment.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollouts.")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="The RL algorithm.")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="Which train tasks a step plays."
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Optional SFT warm start.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Before/after eval.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    seed: int = Field(0, description="Global seed (python, numpy, torch, task order).")

    @model_validator(mode="after")
    def _check_rules(self) -> Config:
        anchor_to_warm_start(self)
        check_rules(self)
        return self


# The KL anchor a run with an SFT warm start gets unless algo.kl_coef is set: measured on
# reasoning-gym's basic_arithmetic (docs/learning/reasoning_gym.md), where the GSPO steps
# after the SFT lost accuracy without it and added to it with it.
WARM_START_KL = {"kl_coef": 0.1, "kl_reference": "start", "kl_estimator": "k2"}


def anchor_to_warm_start(cfg: Config) -> None:
    """With an SFT warm start and LoRA, an unset algo.kl_coef is WARM_START_KL's: a KL
    penalty to the warm-started policy (and the reference and estimator, where those are
    unset too). Set algo.kl_coef=0 to train without it."""
    algo = cfg.algo
    if "kl_coef" in algo.model_fields_set or not (cfg.sft.enabled and cfg.model.lora.enabled):
        return
    if algo.name == "opd":
        return
    for name, value in WARM_START_KL.items():
        if name == "kl_coef" or name not in algo.model_fields_set:
            object.__setattr__(algo, name, value)


def check_rules(cfg: Config) -> None:
    """Raise ValueError (a `ConfigError` once loaded) for the first rule `cfg` breaks."""
    if cfg.algo.kl_coef > 0 and not cfg.model.lora.enabled:
        raise ValueError(
            "algo.kl_coef > 0 needs model.lora.enabled=true: the KL reference is the "
            "base model with the adapters switched off"
        )
    if cfg.algo.max_oversample > 1 and not cfg.algo.dynamic_sampling:
        raise ValueError(
            "algo.max_oversample > 1 refills the groups dynamic sampling drops: set "
            "algo.dynamic_sampling=true as well (or algo.max_oversample=1)"
        )
    fixed = cfg.algo.expert_samples + cfg.algo.greedy_samples
    if fixed >= cfg.rollout.group_size:
        raise ValueError(
            f"algo.expert_samples={cfg.algo.expert_samples} and algo.greedy_samples="
            f"{cfg.algo.greedy_samples} leave no sampled episodes in a group of "
            f"rollout.group_size={cfg.rollout.group_size}: together they must be smaller"
        )
    if cfg.algo.greedy_samples and cfg.rollout.temperature == 0:
        raise ValueError(
            "algo.greedy_samples adds a greedy episode to groups sampled at "
            "rollout.temperature, which is 0 already: set algo.greedy_samples=0"
        )
    if cfg.algo.experimental.expert_baseline != "group" and not cfg.algo.expert_samples:
        raise ValueError(
            f"algo.experimental.expert_baseline={cfg.algo.experimental.expert_baseline} sets "
            "the advantages of expert episodes, and there are none: set "
            "algo.expert_samples > 0 as well"
        )
    if cfg.algo.expert_samples and cfg.algo.experimental.entropy_coef > 0:
        raise ValueError(
            "algo.expert_samples cannot be combined with algo.experimental.entropy_coef > 0: the "
            "entropy bonus needs each episode's sampling logprobs, and an expert episode "
            "was not sampled; set one of them to 0"
        )
    served = str(cfg.algo.teacher or "").startswith(("http://", "https://"))
    if served and cfg.rollout.temperature not in (0.0, 1.0):
        raise ValueError(
            f"algo.teacher={cfg.algo.teacher} is a server, which scores the student's tokens at "
            f"temperature 1, and rollout.temperature={cfg.rollout.temperature} samples them at "
            "another (a local teacher scores at the sampling temperature): set "
            "rollout.temperature=1, or load the teacher locally (a model or a folder)"
        )
    eight_bit = cfg.train.optimizer == "adamw_8bit"
    if eight_bit and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            "train.optimizer=adamw_8bit needs bitsandbytes, which is not installed: "
            "pip install 'looprl[optim8bit]' (or train.optimizer=adamw)"
        )
    if cfg.rollout.compile != "off" and cfg.rollout.engine != "hf":
        raise ValueError(
            f"rollout.compile={cfg.rollout.compile} compiles the hf engine's decode step, and "
            f"rollout.engine={cfg.rollout.engine} samples elsewhere: set rollout.compile=off"
        )
    k = cfg.rollout.max_staleness
    if k and cfg.algo.is_correction is None:
        raise ValueError(
            f"rollout.max_staleness={k} trains on episodes sampled by a policy up to {k} "
            "steps old: set algo.tis_cap (e.g. 2.0) or another algo.is_correction (e.g. "
            "icepop) to correct for it, or rollout.max_staleness=0"
        )
    if k and cfg.rollout.engine == "vllm" and not cfg.model.lora.enabled:
        raise ValueError(
            "rollout.max_staleness > 0 with rollout.engine=vllm samples from a second set of "
            "weights on the server, a LoRA adapter of its own: set model.lora.enabled=true "
            "(full fine-tuning has one set), or rollout.max_staleness=0"
        )
    check_sharding(cfg)


def check_sharding(cfg: Config) -> None:
    """train.shard=fsdp: the parts of a run that need whole weights on every rank, or a
    tensor layout FSDP2's shards do not have, are refused here (docs/training.md)."""
    if cfg.train.shard == "none":
        if cfg.train.offload:
            raise ValueError(
                "train.offload=true moves FSDP2's shards to CPU memory, and train.shard=none "
                "has none: set train.shard=fsdp as well (or train.offload=false)"
            )
        return
    refused = {
        "train.optimizer=adamw_8bit": (
            cfg.train.optimizer == "adamw_8bit",
            "bitsandbytes quantises whole tensors in blocks, not FSDP2's shards; use "
            "train.optimizer=adamw",
        ),
        "rollout.max_staleness > 0": (
            cfg.rollout.max_staleness > 0,
            "the rollout thread samples from a whole second copy; set rollout.max_staleness=0",
        ),
        "rollout.sampler_dtype": (
            cfg.rollout.sampler_dtype != "model",
            "the sampler copy is a whole second model; set rollout.sampler_dtype=model",
        ),
    }
    for field, (hit, why) in refused.items():
        if hit:
            raise ValueError(f"train.shard=fsdp cannot be combined with {field}: {why}")
