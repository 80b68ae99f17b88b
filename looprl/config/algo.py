"""The RL algorithm's section (`algo`, with its experimental levers apart) and which
train tasks a step plays (`curriculum`)."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from looprl.config.base import Section

# the bound of each `is_correction` mode when `is_bound` is unset (algo/corrections.py)
DEFAULT_IS_BOUND = {
    "token_truncate": 2.0,
    "token_mask": 3.0,
    "sequence_truncate": 3.0,
    "sequence_mask": 3.0,
    "icepop": 2.0,
}

# Clip ranges (eps_low, eps_high) used when the config leaves them unset:
# GSPO paper (arXiv 2507.18071) sequence-level ranges; DAPO clip-higher for token ratios.
DEFAULT_CLIP = {
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "gspo_turn": (3e-4, 4e-4),
    "grpo": (0.2, 0.28),
    "dr_grpo": (0.2, 0.28),
    # CISPO (arXiv 2506.13585): no lower bound on the weight, the upper one tuned
    "cispo": (1.0, 0.28),
    # on-policy distillation's per-token ratios (algo/distill.py), as GRPO's
    "opd": (0.2, 0.28),
}

IS_CORRECTIONS = Literal[
    "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop"
]

MOVED = {"entropy_coef", "expert_baseline"}  # once algo.*, now algo.experimental.*


class AlgoExperimental(Section):
    """Levers that were measured and did not lift the held-out reward
    (docs/learning/ablations.md): selectable for experiments, named apart so that a recipe
    does not reach for them by default."""

    entropy_coef: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Entropy bonus beta: each advantage adds beta * (its decision tokens' "
        "-log pi - the group's mean); 0 = off.",
    )
    expert_baseline: Literal["group", "samples"] = Field(
        "group",
        description="Expert episodes' advantages: group = one member of the group; "
        "samples = their lead over the samples' mean, floored at 0 (samples keep their own).",
    )


class AlgoConfig(Section):
    name: Literal["gspo", "gspo_token", "gspo_turn", "grpo", "dr_grpo", "cispo", "opd"] = Field(
        "gspo",
        description="Policy loss: gspo, gspo_token, gspo_turn (a ratio per turn), grpo, "
        "dr_grpo, cispo (clipped weight x logp), opd (distillation from algo.teacher).",
    )
    eps_low: float | None = Field(
        None, ge=0, le=1, description="Lower clip range; unset = the algorithm's default."
    )
    eps_high: float | None = Field(
        None, ge=0, description="Upper clip range; unset = the algorithm's default."
    )
    num_minibatches: int = Field(
        4, ge=1, description="Optimizer updates per rollout batch (the ratio moves off 1)."
    )
    scale_advantages: bool = Field(
        True, description="Divide advantages by the group std (off for Dr.GRPO)."
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal."
    )
    max_oversample: float = Field(
        1.0,
        ge=1,
        le=16,
        description="With dynamic_sampling: play up to this many times tasks_per_step tasks "
        "to refill the dropped groups; 1 = drop only.",
    )
    turn_reward_weight: float = Field(
        0.0,
        ge=0,
        description="gspo_turn with an env that grades turns: weight w of A_ik = A_i + w * "
        "normalised turn return; 0 = off.",
    )
    turn_gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Discount of the turn returns G_k = sum_j gamma^(j-k) r_j; 0 = each "
        "turn's own grade.",
    )
    loss_on: Literal["all", "free"] = Field(
        "all",
        description="Tokens the policy loss covers: all generated tokens, or only those a "
        "forced call's grammar leaves free (the decision, e.g. the square's digit).",
    )
    expert_samples: int = Field(
        0,
        ge=0,
        description="Expert guidance: in each group this many episodes are the env's "
        "demonstration instead of policy samples (< rollout.group_size); 0 = off.",
    )
    greedy_samples: int = Field(
        0,
        ge=0,
        le=1,
        description="Greedy member: in each group this many episodes (0 or 1) are decoded "
        "at T = 0, so the policy's argmax is ranked against its own samples; 0 = off.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty's weight; 0 = off. Unset with an SFT warm start and LoRA: 0.1, "
        "kl_reference start, k2 (an anchor to the warm start).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="KL estimator: k3 or k2 in the loss, k1 in the reward (algo/kl.py: k1 "
        "and k2 follow the reverse KL's gradient, k3 the forward KL's).",
    )
    teacher: str | None = Field(
        None,
        description="On-policy distillation's teacher: a model alias, a folder, a run folder, "
        "or a server http://HOST:PORT/v1 (#MODEL: its model); the student's tokenizer.",
    )
    distill_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the distillation loss added to algo.name's loss (per-token "
        "reverse KL to algo.teacher); 0 = off.",
    )
    kl_reference: Literal["base", "start"] = Field(
        "base",
        description="The KL penalty's reference: base = the base model (adapters off); "
        "start = the policy as the RL steps began (after the SFT warm start).",
    )
    is_correction: IS_CORRECTIONS | None = Field(
        None,
        description="Importance-sampling correction of engine-sampled episodes: "
        "token_truncate, token_mask, sequence_truncate, sequence_mask, icepop; unset = off.",
    )
    is_bound: float | None = Field(
        None,
        gt=0,
        description="The correction's bound C (ratio cap), or icepop's B (band [1/B, B]); "
        "unset = the mode's default.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Short for is_correction=token_truncate with is_bound=cap: weight each "
        "token's loss by min(exp(trainer old logp - engine logp), cap); unset = off.",
    )

    experimental: AlgoExperimental = Field(
        default_factory=AlgoExperimental,
        description="Levers measured without a gain so far (docs/learning/ablations.md); "
        "kept for experiments, not for recipes.",
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_moved_levers(cls, data: Any) -> Any:
        """`algo.entropy_coef` and `algo.expert_baseline` are the old spelling (run folders
        written before the move hold them at their defaults): read into `algo.experimental`,
        with a warning when one asks for something."""
        if not isinstance(data, dict) or not MOVED.intersection(data):
            return data
        data, moved = dict(data), {}
        for name in MOVED.intersection(data):
            moved[name] = data.pop(name)
        experimental = dict(data.get("experimental") or {})
        twice = sorted(MOVED.intersection(experimental).intersection(moved))
        if twice:
            raise ValueError(
                f"algo.{twice[0]} and algo.experimental.{twice[0]} are the same lever; "
                f"write algo.experimental.{twice[0]} alone"
            )
        defaults = AlgoExperimental()
        asked = {k: v for k, v in moved.items() if v != getattr(defaults, k)}
        if asked:
            spelled = ", ".join(f"algo.{k}" for k in sorted(asked))
            warnings.warn_explicit(  # the old spelling is in the user's config, not here
                f"{spelled}: moved to algo.experimental (measured without a gain so far); "
                "write " + ", ".join(f"algo.experimental.{k}" for k in sorted(asked)),
                FutureWarning,
                filename="config",
                lineno=0,
            )
        return {**data, "experimental": {**experimental, **moved}}

    @model_validator(mode="after")
    def _fill_defaults(self) -> AlgoConfig:
        if self.turn_reward_weight > 0 and self.name != "gspo_turn":
            raise ValueError(
                f"algo.turn_reward_weight > 0 gives each turn its own advantage, which only "
                f"algo.name=gspo_turn takes (one ratio per turn); got algo.name={self.name}"
            )
        for name, default in (("kl_estimator", "k3"), ("kl_reference", "base")):
            if getattr(self, name) != default and self.kl_coef == 0:
                raise ValueError(
                    f"algo.{name}={getattr(self, name)} sets the KL penalty, which is off "
                    f"(algo.kl_coef=0): set algo.kl_coef > 0 as well, or drop algo.{name}"
                )
        self._check_teacher()
        self._fill_correction()
        low, high = DEFAULT_CLIP[self.name]
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", high)
        return self

    @property
    def distills(self) -> bool:
        """Whether the update scores the episodes with a teacher (algo/distill.py)."""
        return self.name == "opd" or self.distill_coef > 0

    def _check_teacher(self) -> None:
        if self.distills and not self.teacher:
            what = "algo.name=opd" if self.name == "opd" else "algo.distill_coef > 0"
            raise ValueError(
                f"{what} distills from a teacher: set algo.teacher (a model alias, a "
                "folder or a run folder with the student's tokenizer)"
            )
        if self.teacher and not self.distills:
            raise ValueError(
                f"algo.teacher={self.teacher!r} is only used by on-policy distillation: set "
                "algo.name=opd, or algo.distill_coef > 0 to add it to algo.name's loss"
            )
        if self.name == "opd" and self.distill_coef > 0:
            raise ValueError(
                "algo.distill_coef adds distillation to another loss; with algo.name=opd "
                "distillation is the loss: drop algo.distill_coef"
            )
        if self.name == "opd" and self.kl_coef > 0:
            raise ValueError(
                "algo.name=opd is a KL to the teacher already; algo.kl_coef adds one to the "
                "initial policy, which opd does not take: set algo.kl_coef=0"
            )

    def _fill_correction(self) -> None:
        """`tis_cap: C` is `is_correction: token_truncate` with `is_bound: C`; an unset
        bound takes the mode's default (algo/corrections.py)."""
        mode, bound = self.is_correction, self.is_bound
        if self.tis_cap is not None:
            if mode not in (None, "token_truncate"):
                raise ValueError(
                    f"algo.tis_cap is short for is_correction=token_truncate, and "
                    f"algo.is_correction={mode}: keep one of them"
                )
            if bound is not None and bound != self.tis_cap:
                raise ValueError(
                    f"algo.tis_cap={self.tis_cap} and algo.is_bound={bound} are the same "
                    "bound: keep one of them"
                )
            mode, bound = "token_truncate", self.tis_cap
        if mode is None:
            if bound is not None:
                raise ValueError(
                    "algo.is_bound is the bound of algo.is_correction, which is unset: "
                    "set algo.is_correction (e.g. icepop) or drop algo.is_bound"
                )
            return
        bound = DEFAULT_IS_BOUND[mode] if bound is None else bound
        if mode == "icepop" and bound <= 1:
            raise ValueError(
                f"algo.is_bound={bound}: icepop keeps the tokens whose ratio lies in "
                "[1/B, B], so B must be > 1 (e.g. 2)"
            )
        object.__setattr__(self, "is_correction", mode)
        object.__setattr__(self, "is_bound", bound)
        object.__setattr__(self, "tis_cap", bound if mode == "token_truncate" else None)


class CurriculumConfig(Section):
    enabled: bool = Field(
        False, description="Prefer train tasks whose recent groups were mixed; retire mastered."
    )
    candidates: int = Field(
        4, ge=1, le=64, description="Tasks drawn per step, as a multiple of tasks_per_step."
    )
    window: int = Field(4, ge=1, description="Recent groups remembered per task.")
    retire_after: int = Field(
        2, ge=1, description="Equal-reward groups in a row at mastered_reward that retire a task."
    )
    mastered_reward: float = Field(
        0.5, description="Group reward at or above which an equal-reward group counts as mastered."
    )
    floor: float = Field(
        0.2, gt=0, le=1, description="Weight of a seen task whose recent groups were never mixed."
    )
