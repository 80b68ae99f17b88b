"""A complete bring-your-own environment: add two numbers and answer with a tool call.

looprl envs check examples.sum_env:SumEnv
looprl run --set env.name=examples.sum_env:SumEnv --set model.name=tiny-random
"""

import random

from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

ANSWER = {"type": "function", "function": {
    "name": "answer", "description": "Give the sum.",
    "parameters": {"type": "object", "properties": {"value": {"type": "integer"}},
                   "required": ["value"], "additionalProperties": False}}}  # fmt: skip


class SumEnv:
    name = "sum"
    description = "Add two numbers; answer with the answer tool."
    outcomes = ("right", "off_by_one", "wrong", *PARSE_FAILURES)
    reward_range = (-1.0, 1.0)
    max_turns = 1

    def tasks(self, split, n=None, seed=0):
        base = 0 if split == "eval" else 1_000_000  # the splits never share a seed
        rng = random.Random(seed)
        seeds = rng.sample(range(base, base + 1_000_000), n or 64)
        return [Task(id=f"{split}-{s}", data={"a": s % 97, "b": s % 89}, seed=s) for s in seeds]

    def reset(self, task):
        self.truth = task.data["a"] + task.data["b"]
        prompt = f"What is {task.data['a']} + {task.data['b']}? Call the answer tool."
        return Observation([Message("user", prompt)], tools=[ANSWER], tool_choice="required")

    def step(self, message):
        if message.parse_failure or not message.tool_calls:  # malformed output is a reward
            return StepResult([], True, -1.0, message.parse_failure or "no_tool_call")
        miss = abs(message.tool_calls[0].arguments.get("value", 0) - self.truth)
        outcome, reward = ("right", 1.0) if miss == 0 else ("off_by_one", 0.5) if miss == 1 \
            else ("wrong", 0.0)  # fmt: skip
        return StepResult([], True, reward, outcome)

    def demonstrations(self, task):  # optional: enables the SFT warm start and the expert
        value = task.data["a"] + task.data["b"]
        return [Message("assistant", tool_calls=[ToolCall("answer", {"value": value})])]
