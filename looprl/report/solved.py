"""Did a rising reward come with more solved episodes? A reward can rise because the
policy stopped doing something that costs reward (an illegal move, a malformed call)
without getting any better at the task: the kind of lift a reward that is hackable, or
merely shaped, gives. An environment names the outcomes that count as solved
(`solved_outcomes`: tic-tac-toe's `win`/`optimal`, the workflow's `success`); the
EvalResults carry them and each episode's outcome, in the same order before and after.

The reward rose when the paired difference's 95% CI lies above 0; the solved share rose
when the paired difference of the solved indicator (1 when an episode's outcome is a
solved one, else 0), with the same task bootstrap, lies above 0. When the first holds and
the second does not, the report says so at its top, with the outcome shares that moved.
"""

from __future__ import annotations

from dataclasses import dataclass

from looprl.report.stats import paired_difference, paired_stats

MOVED = 0.05  # an outcome share that changed by this much or more "moved"


@dataclass
class SolvedShare:
    """The solved share before and after, and the paired difference with its CI."""

    labels: list[str]
    before: float
    after: float
    mean: float
    lo: float
    hi: float


def solved_share(baseline: dict, final: dict) -> SolvedShare | None:
    """None when the results name no solved outcomes or lack per-episode outcomes, or
    did not play the same episodes."""
    labels = final.get("solved_outcomes") or baseline.get("solved_outcomes") or []
    before, after = baseline.get("episode_outcomes"), final.get("episode_outcomes")
    ids = baseline.get("task_ids")
    if not labels or before is None or after is None or ids is None:
        return None
    if not len(before) == len(after) == len(ids) or ids != final.get("task_ids"):
        return None
    solved_before = [1.0 if o in labels else 0.0 for o in before]
    solved_after = [1.0 if o in labels else 0.0 for o in after]
    result = paired_difference(solved_before, solved_after, ids)
    if result is None:
        return None
    n = len(ids)
    return SolvedShare(list(labels), sum(solved_before) / n, sum(solved_after) / n, *result)


def moved_outcomes(baseline: dict, final: dict) -> list[str]:
    """'illegal 31% → 0%' for each outcome whose share changed by MOVED or more, the
    largest change first."""
    before, after = baseline.get("outcomes") or {}, final.get("outcomes") or {}
    changes = [(abs(after.get(k, 0.0) - before.get(k, 0.0)), k) for k in sorted({*before, *after})]
    return [
        f"{k} {before.get(k, 0.0):.0%} → {after.get(k, 0.0):.0%}"
        for change, k in sorted(changes, key=lambda c: -c[0])
        if change >= MOVED
    ]


def hacking_flag(baseline: dict, final: dict, what: str = "held-out reward") -> str | None:
    """The warning, in words, when the reward rose by its CI and the solved share did not."""
    paired = paired_stats(baseline, final)
    share = solved_share(baseline, final)
    if isinstance(paired, str) or share is None or paired.lo <= 0 or share.lo > 0:
        return None
    moved = moved_outcomes(baseline, final)
    return (
        f"Check the reward: the {what} rose ({paired.mean:+.3f} [95% CI {paired.lo:+.3f}, "
        f"{paired.hi:+.3f}]) but the share of solved episodes ({', '.join(share.labels)}) "
        f"did not: {share.before:.1%} → {share.after:.1%}, paired {share.mean * 100:+.1f} "
        f"points [95% CI {share.lo * 100:+.1f}, {share.hi * 100:+.1f}]. The lift came from "
        "other outcomes" + (f"; the shares that moved: {', '.join(moved)}." if moved else ".")
    )


def solved_text(baseline: dict, final: dict) -> str | None:
    """One sentence on the solved share before → after, or None without one."""
    share = solved_share(baseline, final)
    if share is None:
        return None
    return (
        f"Solved ({', '.join(share.labels)}): {share.before:.1%} → {share.after:.1%}, paired "
        f"{share.mean * 100:+.1f} points [95% CI {share.lo * 100:+.1f}, {share.hi * 100:+.1f}]."
    )
