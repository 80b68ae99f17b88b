"""A multi-turn verifiers (v1) taskset with a tool, from local data: the model looks up a
key's value with `lookup(key)` and answers with it. Rewards: the final answer (weight 1.0)
and whether the tool was used (weight 0.5), and a penalty per extra call (weight -0.1).
Used by tests/test_verifiers_env.py."""

from typing import Literal

import verifiers.v1 as vf

TABLE = {
    "apple": "red",
    "banana": "yellow",
    "grape": "purple",
    "kiwi": "green",
    "lemon": "sour",
    "plum": "dark",
    "pear": "sweet",
    "lime": "tart",
}


class CallState(vf.State):
    calls: int = 0


class TableTools(vf.Toolset[vf.ToolsetConfig, CallState]):
    TOOL_PREFIX = None  # the tool is `lookup`, not `table_tools_lookup`

    @vf.tool
    def lookup(self, key: Literal[tuple(TABLE)]) -> str:  # an enum in the tool's schema
        """The value stored under `key` in the table."""
        self.state.calls += 1
        return TABLE.get(key, f"no key {key!r}")


class LookupData(vf.TaskData):
    key: str


class LookupConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class LookupTask(vf.Task[LookupData, CallState, LookupConfig]):
    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [TableTools(config.tools)]

    @vf.reward(weight=1.0)
    async def answer(self, trace: vf.Trace) -> float:
        return float(TABLE[self.data.key] in trace.last_reply.lower())

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(m.name == "lookup" for m in trace.tool_messages))

    @vf.reward(weight=-0.1)
    async def extra_calls(self, trace: vf.Trace) -> float:
        return float(min(1, max(0, trace.state.calls - 1)))


class LookupTasksetConfig(vf.TasksetConfig):
    task: LookupConfig = LookupConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupTasksetConfig]):
    def load(self) -> list[LookupTask]:
        return [
            LookupTask(
                LookupData(prompt=f"What is the value of {key!r}? Use the tool.", key=key),
                self.config.task,
            )
            for key in TABLE
        ]


__all__ = ["LookupTaskset"]
