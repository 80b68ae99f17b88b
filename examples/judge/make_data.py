"""Writes replies.jsonl beside this file: customer messages to answer, with no answer key
(a judge scores the replies). Deterministic: python examples/judge/make_data.py"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Bilal", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun",
         "Kira", "Luis", "Mona", "Nils", "Olga", "Pavel"]  # fmt: skip
PROBLEMS = [
    "my order arrived two days late", "the blender I bought is missing its lid",
    "I was charged twice for one ticket", "the app logs me out every hour",
    "my refund has not arrived after three weeks", "the hotel room was not cleaned",
]  # fmt: skip


def main() -> None:
    rng = random.Random(7)
    rows = []
    for name in NAMES:
        for problem in rng.sample(PROBLEMS, 3):
            rows.append(
                {
                    "prompt": f'Customer {name} writes: "Hello, {problem}." Reply to '
                    f"{name} in one sentence.",
                    "info": {"name": name},
                }
            )
    with (Path(__file__).parent / "replies.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
