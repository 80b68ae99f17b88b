"""The RL stage's own effect, where a run has an SFT warm start: the held-out reward after
the RL steps against after the SFT, on the same episodes (paired). A user must see when
the RL steps took back what the warm start taught: the report then says so as a warning,
with the levers that anchor the RL stage to the warm start (docs/training.md)."""

from __future__ import annotations

from looprl.report.stats import Paired, paired_stats

LEVERS = (
    "algo.kl_coef with algo.kl_reference=start (a KL anchor to the warm start, 0.1 by "
    "default with LoRA: raise it if it is set), fewer steps or a smaller train.lr, or the "
    "held-out curve's best step (eval.every)"
)


def rl_stage(after_sft: dict | None, final: dict | None) -> Paired | None:
    """after − after SFT, paired; None without a warm start or when it cannot be paired."""
    if after_sft is None or final is None:
        return None
    paired = paired_stats(after_sft, final)
    return None if isinstance(paired, str) else paired


def rl_stage_line(paired: Paired, what: str = "") -> str:
    """One line: the RL stage's paired difference, and whether it fell below the SFT's."""
    verdict = ""
    if paired.hi < 0:
        verdict = ": below the SFT warm start"
    elif paired.mean < 0:
        verdict = ": lower than after SFT, within the noise"
    return (
        f"RL stage alone{what} (after − after SFT, paired): {paired.mean:+.3f} "
        f"[95% CI {paired.lo:+.3f}, {paired.hi:+.3f}]{verdict}"
    )


def rl_stage_blocks(after_sft: dict | None, final: dict | None, what: str = "") -> list[tuple]:
    """The report's paragraph on the RL stage, and a warning when it lowered the reward
    below the warm start's with a CI that excludes 0."""
    paired = rl_stage(after_sft, final)
    if paired is None:
        return []
    blocks: list[tuple] = [
        (
            "p",
            f"{rl_stage_line(paired, what)}. Of {paired.episodes} episodes {paired.better} "
            f"scored higher after the RL steps than after the SFT, {paired.same} the same, "
            f"{paired.worse} lower.",
        )
    ]
    if paired.hi < 0:
        blocks.append(
            (
                "warn",
                f"The RL steps lowered the held-out reward{what} below the SFT warm start's "
                f"({paired.mean:+.3f}, CI excludes 0): SFT alone did better on these "
                f"episodes. Levers: {LEVERS}.",
            )
        )
    return blocks
