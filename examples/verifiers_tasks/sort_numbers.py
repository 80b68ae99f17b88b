"""A verifiers (v1) taskset from local data: sort three numbers. Rewards: the sorted list
exactly (weight 1.0), the same numbers in any order (weight 0.3), and a reply that is the
list alone (weight 0.2). Each task's data has its `answer`, so looprl's SFT warm start
takes it as the demonstration.

    looprl run examples/verifiers_tasks/run.yaml --out runs/verifiers-sort
"""

import random
import re

import verifiers.v1 as vf


class SortData(vf.TaskData):
    answer: str  # "3, 7, 12"


class SortTask(vf.Task[SortData]):
    def numbers(self, text: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", text)]

    @vf.reward(weight=1.0)
    async def sorted_exactly(self, trace: vf.Trace) -> float:
        return float(self.numbers(trace.last_reply) == self.numbers(self.data.answer))

    @vf.reward(weight=0.3)
    async def same_numbers(self, trace: vf.Trace) -> float:
        return float(sorted(self.numbers(trace.last_reply)) == self.numbers(self.data.answer))

    @vf.reward(weight=0.2)
    async def list_only(self, trace: vf.Trace) -> float:
        return float(re.fullmatch(r"\d+(, \d+)*", trace.last_reply) is not None)


class SortConfig(vf.TasksetConfig):
    num_tasks: int = 400
    seed: int = 0


class SortTaskset(vf.Taskset[SortTask, SortConfig]):
    def load(self) -> list[SortTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for _ in range(self.config.num_tasks):
            numbers = rng.sample(range(1, 100), 3)
            data = SortData(
                prompt=f"Sort these numbers from smallest to largest: {numbers[0]}, "
                f"{numbers[1]}, {numbers[2]}",
                system_prompt="Reply with the sorted numbers only, separated by ', '.",
                answer=", ".join(str(n) for n in sorted(numbers)),
            )
            tasks.append(SortTask(data, self.config.task))
        return tasks


__all__ = ["SortTaskset"]
