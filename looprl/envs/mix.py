"""Several environments as one (`mix`): each step and each eval draws tasks from every
member by weight, and the report shows each member's own before/after.

    env:
      mix:
        - {name: tictactoe-move, weight: 2}
        - {name: dataset, args: {path: examples/bookings/train.jsonl, ...}, label: bookings}

`env.mix` is `env.name: mix` with `env.args.members` (config/sections.py). A task's id is
`LABEL/its own id` (the label defaults to the member's name), so episodes, metrics
(`mix/LABEL/rewards_mean`) and the report's rows are told apart by it. Train tasks: each
of the `n` draws picks a member by weight (seeded), so a step's mixture varies around the
weights; held-out tasks: the `n` are shared out by weight (largest remainders), the same
every time. A member's reward must stay inside its own `reward_range`, not only the
mixture's. Members are played with `reset`/`step`: agent environments cannot be mixed.
"""

from __future__ import annotations

import math
import random
from typing import Any, ClassVar

from looprl.envs.base import demonstrations, solved_outcomes
from looprl.envs.common import check_choice, check_reward, in_progress
from looprl.envs.registry import make_env
from looprl.errors import EnvError
from looprl.seeds import member_seed
from looprl.types import Message, Observation, StepResult, Task


class Mix:
    name: ClassVar[str] = "mix"
    description: ClassVar[str] = "Several environments by weight, with per-env report rows."
    needs_args: ClassVar[str] = "members=[{name: ..., weight: ...}, ...]"

    def __init__(self, members: list[dict[str, Any]] | None = None) -> None:
        if not isinstance(members, list) or len(members) < 2:
            raise EnvError("mix: env.mix needs a list of at least two {name, args, weight}")
        self.labels: list[str] = []
        self.specs: list[tuple[str, dict[str, Any]]] = []
        self.weights: list[float] = []
        self.envs: list[Any] = []
        for i, member in enumerate(members):
            where = f"env.mix[{i}]"
            if not isinstance(member, dict) or not isinstance(member.get("name"), str):
                raise EnvError(f"{where}: expected {{name: ..., args: ..., weight: ...}}")
            unknown = set(member) - {"name", "args", "weight", "label"}
            if unknown:
                raise EnvError(
                    f"{where}: unknown keys {sorted(unknown)}; use name, args, weight, label"
                )
            weight = member.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
                raise EnvError(f"{where}: weight={weight!r} must be a number above 0")
            label = str(member.get("label") or member["name"])
            if label in self.labels or "/" in label:
                raise EnvError(f"{where}: label {label!r} is taken or has a '/'; set label")
            try:
                env = make_env(member["name"], member.get("args") or {})
            except EnvError as err:
                raise EnvError(f"{where} ({member['name']}): {err}") from None
            if callable(getattr(env, "run_agent", None)):
                raise EnvError(
                    f"{where}: {member['name']} is an agent environment; agents cannot be mixed"
                )
            self.labels.append(label)
            self.specs.append((member["name"], member.get("args") or {}))
            self.weights.append(float(weight))
            self.envs.append(env)
        self.outcomes = tuple(dict.fromkeys(o for e in self.envs for o in e.outcomes))
        self.solved_outcomes = tuple(
            dict.fromkeys(o for e in self.envs for o in solved_outcomes(e))
        )
        self.reward_range = (
            min(e.reward_range[0] for e in self.envs),
            max(e.reward_range[1] for e in self.envs),
        )
        self.max_turns = max(e.max_turns for e in self.envs)
        self._live: tuple[int, Any] | None = None  # the member playing this episode

    # ------------------------------------------------------------------ protocol

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        check_choice("mix: split", split, ("train", "eval"))
        if split == "train" and n is None:
            raise EnvError("mix: the train split is drawn by weight; pass n")
        if n is None:
            counts: list[int | None] = [None] * len(self.envs)
        elif split == "eval":
            counts = list(_shares(n, self.weights))
        else:
            rng = random.Random(seed)
            picks = rng.choices(range(len(self.envs)), weights=self.weights, k=n)
            counts = [picks.count(i) for i in range(len(self.envs))]
        per_member = [
            [self._wrap(i, t) for t in self.envs[i].tasks(split, c, member_seed(seed, i))]
            if c != 0
            else []
            for i, c in enumerate(counts)
        ]
        if split == "eval":  # members in turn: the first tasks are a cross-section
            return [t for row in _round_robin(per_member) for t in row]
        out = [t for tasks in per_member for t in tasks]
        random.Random(seed + 1).shuffle(out)
        return out

    def reset(self, task: Task) -> Observation:
        index, inner = self._unwrap(task)
        env = self._fresh(index)
        self._live = (index, env)
        return env.reset(inner)

    def step(self, message: Message) -> StepResult:
        index, env = in_progress("mix", self._live)
        result = env.step(message)
        check_reward(env, result.reward)  # the member's own range, not the mixture's
        result.info = {**result.info, "mix_env": self.labels[index]}
        if result.done:
            self._live = None
        return result

    def demonstrations(self, task: Task) -> list[Message] | None:
        index, inner = self._unwrap(task)
        return demonstrations(self._fresh(index), inner)

    # ------------------------------------------------------------------ helpers

    def _fresh(self, index: int) -> Any:
        return make_env(*self.specs[index])

    def _wrap(self, index: int, task: Task) -> Task:
        data = {"env": self.labels[index], "task": task.data, "id": task.id}
        return Task(id=f"{self.labels[index]}/{task.id}", data=data, seed=task.seed)

    def _unwrap(self, task: Task) -> tuple[int, Task]:
        label = task.data.get("env")
        if label not in self.labels:
            raise EnvError(f"mix: task {task.id!r} names no member ({label!r})")
        return self.labels.index(label), Task(task.data["id"], task.data["task"], task.seed)


def _shares(n: int, weights: list[float]) -> list[int]:
    """`n` shared out by weight: floors, then the largest remainders one each."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _round_robin(rows: list[list[Task]]) -> list[list[Task]]:
    longest = max((len(r) for r in rows), default=0)
    return [[r[k] for r in rows if k < len(r)] for k in range(longest)]


ENVIRONMENTS: dict[str, type] = {"mix": Mix}
