"""The lines a finished `looprl run` ends with: held-out reward before → after, the
paired difference, the greedy policy's reward before → after, and where the report is.

The figures come from the report's own code (`reward_with_ci`, `paired_stats`, with its
fixed bootstrap seed), so what the terminal says and what report.md says cannot differ.
"""

from __future__ import annotations

from pathlib import Path

from looprl.report.also import read_also
from looprl.report.comparisons import load_eval
from looprl.report.rl_stage import rl_stage, rl_stage_line
from looprl.report.stats import Paired, member_results, paired_stats, reward_with_ci


def headline(
    baseline: dict,
    final: dict,
    report: Path,
    after_sft: dict | None = None,
    greedy: tuple[dict | None, dict] | None = None,
    references: list[dict] | None = None,
) -> list[str]:
    """Reward before → (after SFT →) after, the paired difference, then with `greedy`
    (its baseline and final EvalResults) the same for T = 0, and the paths."""
    stages = [("before", baseline), ("after", final)]
    if after_sft is not None:
        stages.insert(1, ("after SFT", after_sft))
    lines = [
        f"held-out reward, {final.get('n', '?')} episodes, mean [95% CI]: "
        + " → ".join(f"{name} {reward_with_ci(result)}" for name, result in stages),
        _difference(paired_stats(baseline, final)),
    ]
    stage = rl_stage(after_sft, final)  # with an SFT warm start: the RL steps' own effect
    if stage is not None:
        lines.append(rl_stage_line(stage))
    if greedy is not None and greedy[0] is not None:
        before, after = greedy
        paired = paired_stats(before, after)
        change = "" if isinstance(paired, str) else f", paired {_short(paired)}"
        lines.append(
            f"greedy (T = 0), {after.get('n', '?')} episodes: before {reward_with_ci(before)}"
            f" → after {reward_with_ci(after)}{change}"
        )
    if final.get("env") == "mix":  # each member of the mixture on its own episodes
        before = member_results(baseline)
        for label, after in member_results(final).items():
            paired = paired_stats(before[label], after) if label in before else "no baseline"
            change = "" if isinstance(paired, str) else f", paired {_short(paired)}"
            lines.append(
                f"  {label}: {reward_with_ci(before.get(label, {}))} → "
                f"{reward_with_ci(after)}{change}"
            )
    lines += _also_lines(report.parent)
    teacher = load_eval(report.parent / "eval" / "teacher.json")  # a distilling run's
    if teacher is not None:
        paired = paired_stats(teacher, final)
        change = "" if isinstance(paired, str) else f", trained − teacher {_short(paired)}"
        lines.append(f"teacher {teacher.get('model')}: {reward_with_ci(teacher)}{change}")
    for ref in references or []:
        paired = paired_stats(ref, final)
        change = "" if isinstance(paired, str) else f", trained − reference {_short(paired)}"
        lines.append(f"reference {ref.get('model')}: {reward_with_ci(ref)}{change}")
    return [*lines, f"report: {report}, {report.with_suffix('.html')}"]


def _also_lines(run_dir: Path) -> list[str]:
    """eval.also: each other env's reward before → after, paired (report/also.py)."""
    before, lines = read_also(run_dir, "baseline"), []
    for key, after in read_also(run_dir, "final").items():
        paired = paired_stats(before[key], after) if key in before else "no baseline"
        change = "" if isinstance(paired, str) else f", paired {_short(paired)}"
        lines.append(
            f"also {key}, {after.get('n', '?')} episodes: "
            f"{reward_with_ci(before.get(key, {}))} → {reward_with_ci(after)}{change}"
        )
    return lines


def _difference(paired: Paired | str) -> str:
    if isinstance(paired, str):
        return f"paired difference not computed: {paired}"
    return (
        f"paired difference, after − before: {paired.mean:+.3f} [95% CI {paired.lo:+.3f}, "
        f"{paired.hi:+.3f}] over {paired.tasks} tasks ({paired.better} episodes higher, "
        f"{paired.same} the same, {paired.worse} lower)"
    )


def _short(paired: Paired) -> str:
    return f"{paired.mean:+.3f} [95% CI {paired.lo:+.3f}, {paired.hi:+.3f}]"
