"""The lines a finished `looprl run` ends with: held-out reward before → after, the
paired difference, and where the report is.

The figures come from the report's own code (`reward_with_ci`, `paired_stats`, with its
fixed bootstrap seed), so what the terminal says and what report.md says cannot differ.
"""

from __future__ import annotations

from pathlib import Path

from looprl.report.stats import paired_stats, reward_with_ci


def headline(baseline: dict, final: dict, report: Path, after_sft: dict | None = None) -> list[str]:
    """Three lines: reward before → (after SFT →) after, the paired difference, the paths."""
    stages = [("before", baseline), ("after", final)]
    if after_sft is not None:
        stages.insert(1, ("after SFT", after_sft))
    paired = paired_stats(baseline, final)
    if isinstance(paired, str):
        difference = f"paired difference not computed: {paired}"
    else:
        difference = (
            f"paired difference, after − before: {paired.mean:+.3f} [95% CI {paired.lo:+.3f}, "
            f"{paired.hi:+.3f}] over {paired.tasks} tasks ({paired.better} episodes higher, "
            f"{paired.same} the same, {paired.worse} lower)"
        )
    return [
        f"held-out reward, {final.get('n', '?')} episodes, mean [95% CI]: "
        + " → ".join(f"{name} {reward_with_ci(result)}" for name, result in stages),
        difference,
        f"report: {report}, {report.with_suffix('.html')}",
    ]
