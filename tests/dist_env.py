"""A one-turn environment for the multi-process tests: the reward is a checksum of the
reply scaled into [0, 1), so two different replies of a group get different rewards
and every step trains (a reward of a few values, such as the length modulo 3, ties a
whole group now and then, and that step does not train). The reply is a short JSON
object its schema bounds, so it always ends within the token limit (a reply cut by the
limit is `truncated`, at the lowest reward). With LOOPRL_TEST_FAIL_RANK set, that rank's
train tasks raise from the second draw on: the run's preflight draws one before the model
loads, the first training step the next (a rank that fails mid-run)."""

from __future__ import annotations

import os
import time
import zlib
from typing import ClassVar

from looprl.types import Message, Observation, StepResult, Task

REPLY = {"type": "json_schema", "json_schema": {"name": "reply", "schema": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 3}},
    "required": ["word"], "additionalProperties": False}}}  # fmt: skip


class ChecksumEnv:
    name: ClassVar[str] = "checksum"
    description: ClassVar[str] = "reward = checksum of the reply, in [0, 1)"
    outcomes: ClassVar[tuple[str, ...]] = ("done",)
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    max_turns = 1
    train_draws: ClassVar[int] = 0  # this process's train draws (LOOPRL_TEST_FAIL_RANK)

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        failing = os.environ.get("LOOPRL_TEST_FAIL_RANK")
        if split == "train" and failing is not None and failing == os.environ.get("RANK"):
            ChecksumEnv.train_draws += 1
            if ChecksumEnv.train_draws > 1:
                raise RuntimeError(f"rank {os.environ['RANK']} fails on purpose at {time.time()}")
        return [Task(id=f"{split}-{seed}-{i}", data={"i": i}) for i in range(n or 4)]

    def reset(self, task: Task) -> Observation:
        text = f"Say something about the number {task.data['i']}."
        return Observation(messages=[Message(role="user", content=text)], tools=[],
                           response_format=REPLY)  # fmt: skip

    def demonstrations(self, task: Task) -> list[Message]:
        """An "expert" reply (algo.expert_samples): any fixed text has its own checksum."""
        return [Message(role="assistant", content=f'{{"word": "{task.data["i"]}"}}')]

    def step(self, message: Message) -> StepResult:
        reward = zlib.crc32((message.content or "").encode()) % 1000 / 1000
        return StepResult(messages=[], done=True, reward=reward, outcome="done")
