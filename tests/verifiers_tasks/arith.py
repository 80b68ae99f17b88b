"""A single-turn verifiers (v1) taskset from local data: arithmetic questions, an exact-match
reward (weight 1.0) and a format reward (weight 0.2). Used by tests/test_verifiers_env.py."""

import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.2)
    async def format(self, trace: vf.Trace) -> float:
        return float(re.fullmatch(r"-?\d+", trace.last_reply) is not None)


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 40


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = 3 + 7 * i % 50, 11 + 13 * i % 40
            data = ArithData(
                prompt=f"What is {a} + {b}?",
                answer=a + b,
                system_prompt="Answer with the number only.",
            )
            tasks.append(ArithTask(data, self.config.task))
        return tasks


__all__ = ["ArithTaskset"]
