"""`--set` flags for the tests that call `looprl run` on the tiny random model."""

from __future__ import annotations

# a run of seconds: 2 tasks × 2 samples a step, an eval of 2 tasks × 2 samples
TINY_RUN = (
    "model.name=tiny-random",
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "eval.tasks=2",
    "eval.samples_per_task=2",
    "eval.greedy=false",
    "logging.trackers=[]",
)


def set_flags(*overrides: str) -> list[str]:
    """`("a.b=1", "c=2")` → `["--set", "a.b=1", "--set", "c=2"]`."""
    return [flag for override in overrides for flag in ("--set", override)]
