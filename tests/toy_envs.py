"""Tiny environments for tests: a one-call task whose best answer is a fixed number."""

from __future__ import annotations

import json

from looprl.agents import AgentResult
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

PICK_TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "description": "Pick a number.",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}


class PickSeven:
    """Reward 1 for pick(n=7), 0 for another number, -1 for a failed call."""

    name = "pick-seven"
    description = "Pick the number 7 (a trivial task for learning tests)."
    outcomes = ("hit", "miss", *PARSE_FAILURES)
    reward_range = (-1.0, 1.0)
    max_turns = 1

    def __init__(self, tool_choice: str = "required") -> None:
        self.tool_choice = tool_choice

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        offset = 0 if split == "eval" else 10_000
        return [Task(id=f"{split}-{seed}-{i}", data={}, seed=offset + i) for i in range(n or 8)]

    # what a subclass changes to ask for another answer
    prompt, tool, argument, answer = "Pick a number from 1 to 9.", PICK_TOOL, "n", 7

    def reset(self, task: Task) -> Observation:
        return Observation(
            messages=[Message(role="user", content=self.prompt)],
            tools=[self.tool],
            tool_choice=self.tool_choice,
        )

    def demonstrations(self, task: Task) -> list[Message]:
        call = ToolCall(self.tool["function"]["name"], {self.argument: self.answer})
        return [Message(role="assistant", tool_calls=[call])]

    def step(self, message: Message) -> StepResult:
        if message.parse_failure or not message.tool_calls:
            return StepResult([], done=True, reward=-1.0, outcome=message.parse_failure)
        hit = message.tool_calls[0].arguments.get(self.argument) == self.answer
        reward, outcome = (1.0, "hit") if hit else (0.0, "miss")
        return StepResult([], done=True, reward=reward, outcome=outcome)


class FlakyPickSeven(PickSeven):
    """Raises inside `step` for every 10th task (seeds 9, 19, ...; not the first task of a
    split, which a run's preflight plays): an environment bug, not model output."""

    def __init__(self, every: int = 10) -> None:
        super().__init__()
        self.every = every
        self._task: Task | None = None

    def reset(self, task: Task) -> Observation:
        self._task = task
        return super().reset(task)

    def step(self, message: Message) -> StepResult:
        if self._task is not None and (self._task.seed + 1) % self.every == 0:
            raise RuntimeError("simulated environment bug")
        return super().step(message)


class BrokenPickSeven(PickSeven):
    """Breaks every promise `looprl envs check` checks: tasks change between calls, the
    splits overlap, a reward leaves its range, an outcome is undeclared, one declared
    outcome is unreachable, one task makes `step` raise, and a miss comes with a turn
    reward the env never declared."""

    outcomes = ("hit", "miss", "never", *PARSE_FAILURES)
    _calls = 0

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        BrokenPickSeven._calls += 1
        return [Task(id=f"t{i}", data={"call": BrokenPickSeven._calls}, seed=i)
                for i in range(n or 8)]  # fmt: skip

    def reset(self, task: Task) -> Observation:
        self._task = task
        return super().reset(task)

    def step(self, message: Message) -> StepResult:
        if self._task.seed == 3:
            raise RuntimeError("simulated environment bug")
        result = super().step(message)
        if result.outcome == "hit":
            return StepResult([], done=True, reward=2.0, outcome="jackpot")
        if result.outcome == "miss":
            result.turn_reward = -1.0
        return result


class PickSevenAgent:
    """PickSeven as a bring-your-own agent: one OpenAI-client call per episode."""

    name = "pick-seven-agent"
    description = "Pick the number 7, asked through the OpenAI client (agent env test)."
    outcomes = ("hit", "miss", "no_tool_call")
    reward_range = (-1.0, 1.0)
    max_turns = 1

    def __init__(self, tool_choice: str = "required") -> None:
        self.tool_choice = tool_choice

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        return PickSeven().tasks(split, n, seed)

    async def run_agent(self, client, task: Task) -> AgentResult:
        response = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Pick a number from 1 to 9."}],
            tools=[PICK_TOOL],
            tool_choice=self.tool_choice,
        )
        calls = response.choices[0].message.tool_calls
        if not calls:
            return AgentResult(-1.0, "no_tool_call")
        hit = json.loads(calls[0].function.arguments).get("n") == 7
        return AgentResult(1.0, "hit") if hit else AgentResult(0.0, "miss")


SAY_TOOL = {
    "type": "function",
    "function": {
        "name": "say",
        "description": "Say a word.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
            "additionalProperties": False,
        },
    },
}


class SayPassword(PickSeven):
    """Reward 1 for say(word="looprl"), 0 for another word, -1 for a failed call: an answer
    a policy's own samples practically never hit, which only its demonstration shows."""

    name = "say-password"
    description = "Say the password (an answer sampling alone never finds)."
    prompt, tool, argument, answer = "Say the password.", SAY_TOOL, "word", "looprl"


class ResetFails(PickSeven):
    """Raises in `reset`: the run's preflight must stop before the model loads."""

    def reset(self, task: Task) -> Observation:
        raise RuntimeError("simulated reset bug")


class LoudPickSeven(PickSeven):
    """Rewards -100 for a miss although it declares reward_range (-1, 1): an env bug the
    rollout turns into env_error, naming the value. Its demonstration scores in range."""

    def step(self, message: Message) -> StepResult:
        result = super().step(message)
        if result.outcome != "hit":
            return StepResult([], done=True, reward=-100.0, outcome="miss")
        return result


class StepFails(PickSeven):
    """Raises in every `step` but not for its demonstration: passes the preflight, then
    every eval episode is an env_error."""

    def demonstrations(self, task: Task) -> list[Message]:
        return []

    def step(self, message: Message) -> StepResult:
        raise RuntimeError("simulated step bug")


# scorers for the dataset env's `module:function` (tests/test_dataset_env.py)
def half_scorer(response, answer, row) -> float:
    return 0.5


def raising_scorer(response, answer, row) -> float:
    raise ValueError(f"no verdict on {answer!r}")


def length_scorer(response, answer, row) -> float:
    """1 when the reply is as long as the row's `info.length` says."""
    return float(len(response) == row["length"])


class CarelessAgent(PickSevenAgent):
    """Reads `tool_calls[0]` without a check: a forced call cut by the token limit makes it
    raise (TypeError on None), which is the policy's `truncated`, not an env error."""

    outcomes = ("hit", "miss")

    async def run_agent(self, client, task: Task) -> AgentResult:
        response = await client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Pick a number from 1 to 9."}],
            tools=[PICK_TOOL],
            tool_choice="required",
        )
        call = response.choices[0].message.tool_calls[0]
        hit = json.loads(call.function.arguments).get("n") == 7
        return AgentResult(1.0, "hit") if hit else AgentResult(0.0, "miss")


class PickSevenMaybeClose(PickSeven):
    """PickSeven declaring a `close` outcome it never gives, marked uncertain (as `partial`
    is for a scorer of the user's): the kit reports it unreached without failing."""

    outcomes = ("hit", "close", "miss", *PARSE_FAILURES)
    uncertain_outcomes = ("close",)


class PickSevenNeverClose(PickSevenMaybeClose):
    uncertain_outcomes = ()


class PickAnything(PickSeven):
    """Every call earns 0.5: each group's rewards are equal, so no step has an advantage."""

    def step(self, message: Message) -> StepResult:
        result = super().step(message)
        if message.tool_calls:
            return StepResult([], done=True, reward=0.5, outcome="hit")
        return result


class TrainStepFails(PickSeven):
    """Raises in `step` on the training steps' tasks (ids train-<step seed>-i; the
    preflight's, drawn with seed 0, pass): the held-out evals measure, and every training
    episode is an env_error."""

    def reset(self, task: Task) -> Observation:
        self._task = task
        return super().reset(task)

    def step(self, message: Message) -> StepResult:
        if self._task.id.startswith("train-") and not self._task.id.startswith("train-0-"):
            raise RuntimeError("simulated train-time bug")
        return super().step(message)


class TasksFailAtStep3(PickSeven):
    """`tasks` raises for the train tasks of training step 3 (seed 3 with run seed 0): the
    rollout thread of an overlapped run dies there."""

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        if split == "train" and seed == 3:
            raise RuntimeError("simulated task-source outage")
        return super().tasks(split, n, seed)
