"""The held-out evals' section: `eval.*`, and `eval.also`'s entries (other envs evaluated
before and after on fixed seeds)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from looprl.config.base import Section


class AlsoEval(Section):
    """One more held-out eval on another env, before and after (`eval.also`)."""

    name: str = Field(
        description="Environment name (see `looprl envs`) of this extra held-out eval."
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to that environment."
    )
    tasks: int = Field(
        8, ge=1, description="Its held-out tasks (drawn with eval.seed), × eval.samples_per_task."
    )
    label: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Its key in the report and under RUN/eval/also/ (letters, digits, _.-); "
        "unset = the name, ':' and '/' as '_'.",
    )

    @property
    def key(self) -> str:
        """The report's key and the folder name under eval/also/ and samples/also/."""
        return self.label or self.name.replace(":", "_").replace("/", "_")


class EvalConfig(Section):
    tasks: int = Field(64, ge=1, description="Held-out tasks for baseline and final eval.")
    temperature: float = Field(
        1.0, ge=0, le=5, description="Eval sampling temperature: 1 = as trained, 0 = greedy."
    )
    samples_per_task: int = Field(
        4, ge=1, description="Episodes per eval task (the same seeds before and after)."
    )
    references: list[str] = Field(
        default_factory=list,
        description="EvalResult files of reference models (`looprl eval --endpoint ... --out "
        "F.json`) shown in the report beside before/after, paired against the trained model.",
    )
    seed: int = Field(1234, description="Seed of the eval task sample and sampling.")
    greedy: bool = Field(
        True,
        description="Also evaluate greedily (T = 0, one episode per task) before and after "
        "(skipped when eval.temperature is already 0).",
    )
    greedy_tasks: int | None = Field(
        None,
        ge=1,
        description="Distinct held-out tasks of the greedy eval, one episode each, the "
        "sampled eval's first; unset = eval.tasks × eval.samples_per_task.",
    )
    every: int = Field(
        0,
        ge=0,
        description="Also evaluate the held-out tasks at step 0 and every N steps, same seeds "
        "(the report's curve; the best step's weights: checkpoints/best); 0 = off.",
    )
    curve_tasks: int | None = Field(
        None,
        ge=1,
        description="With eval.every: the curve's tasks, the held-out eval's first; unset = "
        "all eval.tasks (the evals before and after are then its first and last points).",
    )

    also: list[AlsoEval] = Field(
        default_factory=list,
        description="Other envs evaluated before and after on fixed seeds, [{name, args, tasks, "
        "label}]: did training change anything else? (report section).",
    )

    @field_validator("also")
    @classmethod
    def _unique_keys(cls, also: list[AlsoEval]) -> list[AlsoEval]:
        keys = [entry.key for entry in also]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(
                f"each eval.also entry needs its own key; repeated: {', '.join(repeated)} "
                "(give the entries different labels)"
            )
        return also

    @property
    def greedy_runs(self) -> bool:
        """Whether the greedy eval runs (on, and the sampled eval is not greedy already)."""
        return self.greedy and self.temperature > 0

    @property
    def greedy_count(self) -> int:
        """Tasks the greedy eval asks for (the env's held-out set may hold fewer); 0 when it
        does not run."""
        if not self.greedy_runs:
            return 0
        return (
            self.tasks * self.samples_per_task if self.greedy_tasks is None else self.greedy_tasks
        )
