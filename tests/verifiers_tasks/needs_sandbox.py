"""A verifiers (v1) taskset whose tasks need a container: looprl refuses it clearly."""

import verifiers.v1 as vf


class BoxTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True

    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return 0.0


class BoxTaskset(vf.Taskset[BoxTask]):
    def load(self) -> list[BoxTask]:
        return [BoxTask(vf.TaskData(prompt="fix the repo", image="python:3.12"))]


__all__ = ["BoxTaskset"]
