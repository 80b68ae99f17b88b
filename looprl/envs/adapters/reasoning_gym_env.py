"""reasoning-gym's procedural datasets as environments: `env.name: reasoning-gym:<dataset>`.

    env:
      name: reasoning-gym:chain_sum
      args:
        min_terms: 2          # every argument that is not the adapter's own (below) goes to
        max_terms: 2          # the dataset's config, as reasoning-gym defines it
        answer: tool          # tool: one forced `answer(answer)` call; text: <answer>…</answer>
        eval_size: 128        # held-out items
        train_size: 10000     # the train pool (every item is used before any repeats)

The dataset's generator makes the tasks: the held-out tasks are items 0..eval_size-1 of the
generator seeded `seed`, the train tasks items 0..train_size-1 of the generator seeded
`seed + eval_size` (so no (seed, index) pair is shared), and any train item whose question
equals a held-out question is skipped for the next index, so the splits never overlap even
in a small problem space. Everything is procedural: nothing is downloaded.

The reward is the dataset's own `score_answer` (in [0, 1]; some datasets give partial
credit, which `partial_credit: false` turns into 0: the base scorer gives len(answer) /
len(reply) to a reply that contains the answer, so "17" earns 0.5 where 7 is right); a
reply with no answer (no `<answer>` tags, a malformed call) earns `failure_reward` (-1 by
default: below any wrong answer; 0 is reasoning-gym's own convention). Outcomes: `correct`
(score 1), `partial`, `wrong` (0), and `no_answer` (text) or the parse failures (tool).
The item's answer is the demonstration (`sft.enabled`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import textwrap
from functools import lru_cache
from typing import Any, ClassVar

from looprl.envs.common import (
    Adapter,
    check_choice,
    check_failure_reward,
    check_int,
    in_progress,
    reward_label,
    sample_items,
    unscored,
)
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

ANSWER_TOOL = {
    "type": "function",
    "function": {
        "name": "answer",
        "description": "Give your final answer to the question.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer alone."}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}
TOOL_PROMPT = (
    "Answer the question by calling the answer tool once, with the final answer alone "
    "(no explanation) in the format the question asks for."
)
MAX_SKIPS = 10_000  # consecutive train items that repeat a held-out question before giving up


class ReasoningGym(Adapter):
    """One reasoning-gym dataset, its generator and its scorer (module docstring)."""

    prefix: ClassVar[str] = "reasoning-gym"
    target_help: ClassVar[str] = "<dataset>"
    description: ClassVar[str] = (
        "A reasoning-gym dataset by name: procedural tasks scored by its own scorer."
    )
    solved_outcomes: ClassVar[tuple[str, ...]] = ("correct",)

    def __init__(
        self,
        answer: str = "tool",
        eval_size: int = 128,
        train_size: int = 10_000,
        seed: int = 0,
        system_prompt: str | None = None,
        failure_reward: float = -1.0,
        partial_credit: bool = True,
        **config: Any,
    ) -> None:
        self.answer = check_choice(f"{self.name}: answer", answer, ("tool", "text"))
        self.eval_size = check_int("eval_size", eval_size, 1, 1_000_000)
        self.train_size = check_int("train_size", train_size, 1, 10_000_000)
        self.seed = check_int("seed", seed, 0, 2**40)
        check_failure_reward(failure_reward)
        self.failure_reward = float(failure_reward)
        if not isinstance(partial_credit, bool):
            raise EnvError(f"partial_credit={partial_credit!r} is invalid: expected true or false")
        self.partial_credit = partial_credit
        self.reward_range = (self.failure_reward, 1.0)
        self.max_turns = 1
        failures = PARSE_FAILURES if self.answer == "tool" else ("no_answer",)
        graded = ("partial",) if partial_credit else ()
        self.outcomes = ("correct", *graded, "wrong", *failures)
        self.uncertain_outcomes = graded  # not every dataset's scorer gives partial credit
        self.config = json.dumps(config, sort_keys=True, default=str)
        self.system_prompt = system_prompt
        self._task: Task | None = None
        _eval_questions(self.target, self.config, self.seed, self.eval_size)  # a bad name or
        # config fails here, when the env is made

    # ------------------------------------------------------------------ protocol

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: the held-out items (all, or a seeded sample of `n`); train: `n` items of the
        train pool drawn by `seed` (`n` is required)."""
        check_choice(f"{self.name}: split", split, ("train", "eval"))
        if split == "train" and n is None:
            raise EnvError(f"{self.name}: the train split is a pool of {self.train_size}; pass n")
        size = self.eval_size if split == "eval" else self.train_size
        return [self._task_at(split, i) for i in sample_items(list(range(size)), n, seed)]

    def reset(self, task: Task) -> Observation:
        self._task = task
        system = self.system_prompt
        if system is None:
            system = TOOL_PROMPT if self.answer == "tool" else _rg_utils().SYSTEM_PROMPTS["default"]
        messages = [Message("system", system)] if system else []
        messages.append(Message("user", task.data["question"]))
        if self.answer == "tool":
            return Observation(messages, tools=[ANSWER_TOOL], tool_choice="required")
        return Observation(messages, tools=[], tool_choice="none")

    def step(self, message: Message) -> StepResult:
        task, self._task = in_progress(self.name, self._task), None
        reply, failure = self._reply(message)
        if failure is not None:
            return unscored(message, failure, self.failure_reward)
        score = self.score(reply, task)
        if not self.partial_credit and score < 1.0:
            score = 0.0
        outcome = reward_label(score)
        info = {"answer": reply, "expected": task.data["answer"], "score": score}
        return StepResult([], done=True, reward=score, outcome=outcome, info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        expected = task.data["answer"]
        if self.answer == "tool":
            return [Message("assistant", tool_calls=[ToolCall("answer", {"answer": expected})])]
        return [Message("assistant", f"<answer>{expected}</answer>")]

    # ------------------------------------------------------------------ scoring

    def score(self, reply: str, task: Task) -> float:
        """The dataset's own score of `reply` (raises what its scorer raises)."""
        dataset = self._dataset(task.data["split"])
        entry = dataset[task.data["index"]]
        value = float(dataset.score_answer(reply, entry))
        if not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise EnvError(f"{self.name}: its scorer gave {value!r}, outside [0, 1]")
        return value

    def _reply(self, message: Message) -> tuple[str, str | None]:
        if self.answer == "tool":
            if message.parse_failure is not None:
                return "", message.parse_failure
            if not message.tool_calls:
                return "", "no_tool_call"
            if message.tool_calls[0].name != "answer":
                return "", "unknown_tool"
            return str(message.tool_calls[0].arguments.get("answer", "")), None
        found = _rg_utils().extract_answer(message.content)
        return (found, None) if found is not None else ("", "no_answer")

    # ------------------------------------------------------------------ tasks

    def _dataset(self, split: str) -> Any:
        if split == "eval":
            return _generator(self.target, self.config, self.seed, self.eval_size)
        return _generator(self.target, self.config, self.seed + self.eval_size, self.train_size)

    def _task_at(self, split: str, index: int) -> Task:
        dataset = self._dataset(split)
        if split == "train":  # skip items that repeat a held-out question
            held_out = _eval_questions(self.target, self.config, self.seed, self.eval_size)
            skips = 0
            while dataset[index]["question"] in held_out:
                index, skips = (index + 1) % self.train_size, skips + 1
                if skips > min(MAX_SKIPS, self.train_size):
                    raise EnvError(
                        f"{self.name}: the train items keep repeating held-out questions (the "
                        f"config allows too few distinct questions): lower eval_size"
                    )
        item = dataset[index]
        data = {
            "split": split,
            "index": index,
            "question": item["question"],
            "answer": str(item["answer"]),
        }
        return Task(id=f"{split}-{index}", data=data, seed=index)


# ---------------------------------------------------------------------- reasoning-gym


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise EnvError(
            "reasoning-gym is not installed: pip install 'looprl[reasoning-gym]' "
            "(or pip install reasoning-gym)"
        ) from None
    return reasoning_gym


def _rg_utils() -> Any:
    _rg()
    import reasoning_gym.utils

    return reasoning_gym.utils


@lru_cache(maxsize=64)
def _generator(name: str, config: str, seed: int, size: int) -> Any:
    """The dataset `name` with `config` (JSON), `size` items from the generator seeded `seed`."""
    datasets = _rg().factory.DATASETS
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise EnvError(
            f"reasoning-gym has no dataset {name!r}{hint}\n"
            f"Its {len(datasets)} datasets, by family (env.name: reasoning-gym:<dataset>):\n"
            + _by_family(datasets)
        )
    kwargs = json.loads(config)
    config_cls = datasets[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise EnvError(
            f"reasoning-gym:{name}: unknown env.args {unknown}; the adapter's own: answer, "
            f"eval_size, train_size, seed, system_prompt, failure_reward, partial_credit; "
            f"the dataset's: "
            f"{', '.join(fields)}"
        )
    try:
        return _rg().create_dataset(name, **kwargs, seed=seed, size=size)
    except (AssertionError, ValueError, TypeError) as err:
        raise EnvError(f"reasoning-gym:{name}: its config refuses {kwargs}: {err}") from None


def _by_family(datasets: dict[str, Any]) -> str:
    """reasoning-gym's dataset names, a line per family (the package they live in:
    arithmetic, games, ...), wrapped to a terminal's width."""
    families: dict[str, list[str]] = {}
    for name, (dataset_cls, _) in datasets.items():
        family = dataset_cls.__module__.split(".")[1:2] or ["other"]
        families.setdefault(family[0], []).append(name)
    return "\n".join(
        textwrap.fill(
            f"{family}: {', '.join(sorted(names))}",
            width=88,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
        for family, names in sorted(families.items())
    )


@lru_cache(maxsize=16)
def _eval_questions(name: str, config: str, seed: int, size: int) -> frozenset[str]:
    dataset = _generator(name, config, seed, size)
    return frozenset(dataset[i]["question"] for i in range(size))


ENVIRONMENTS: dict[str, type] = {}

__all__ = ["ReasoningGym"]
