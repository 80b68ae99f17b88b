"""A verifiers classic ToolEnv (verifiers 0.1.x) from local data: the model looks up a
key's value with the Python tool `lookup(key)` and answers with it. Rubric: the answer
(weight 1.0) and whether the tool was called (weight 0.5). No eval dataset: the worker
holds out a seeded share. Used by tests/test_verifiers_classic.py."""

from typing import Literal

import verifiers as vf
from datasets import Dataset

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


def lookup(key: Literal[tuple(TABLE)]) -> str:  # an enum in the tool's schema
    """The value stored under `key` in the table.

    Args:
        key: the key to look up
    """
    if key not in TABLE:
        raise KeyError(f"no key {key!r}")
    return TABLE[key]


def answer(completion, info) -> float:
    return float(TABLE[info["key"]] in (completion[-1].content or "").lower())


def used_tool(completion) -> float:
    return float(any(m.role == "tool" for m in completion))


def load_environment(**kwargs):
    rows = [{"question": f"What is the value of {k!r}? Use the tool.", "answer": v,
             "info": {"key": k}} for k, v in TABLE.items()]  # fmt: skip
    rubric = vf.Rubric(funcs=[answer, used_tool], weights=[1.0, 0.5])
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[lookup], rubric=rubric, **kwargs)
