"""A single-turn verifiers classic environment (verifiers 0.1.x) from local data:
arithmetic questions, a train dataset and an eval dataset of its own, and a rubric of an
exact-match reward (weight 1.0) and a format reward (weight 0.2); `explode=True` adds a
reward function that raises. Used by tests/test_verifiers_classic.py."""

import re

import verifiers as vf
from datasets import Dataset


def _rows(start: int, stop: int) -> list[dict]:
    return [{"question": f"What is {i} + {2 * i + 1}?", "answer": str(3 * i + 1)}
            for i in range(start, stop)]  # fmt: skip


def exact(completion, answer) -> float:
    numbers = re.findall(r"-?\d+", completion[-1].content or "")
    return float(bool(numbers) and numbers[-1] == answer)


def format(completion) -> float:
    return float(re.fullmatch(r"-?\d+", completion[-1].content or "") is not None)


def explodes(completion) -> float:
    raise RuntimeError("this reward function always raises")


def load_environment(num_train: int = 30, num_eval: int = 6, explode: bool = False):
    rubric = vf.Rubric(funcs=[exact, format], weights=[1.0, 0.2])
    if explode:
        rubric.add_reward_func(explodes, weight=0.5)
    # the eval set repeats the last train question: the train split must drop it
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(_rows(0, num_train)),
        eval_dataset=Dataset.from_list(_rows(num_train - 1, num_train + num_eval - 1)),
        system_prompt="Answer with the number only.",
        rubric=rubric,
    )
