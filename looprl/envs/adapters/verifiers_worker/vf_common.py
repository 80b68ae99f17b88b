"""What the worker's parts share: the refusal raised for a feature looprl cannot honour,
and the seeded held-out split."""

from __future__ import annotations

import random


class Unsupported(Exception):
    """The environment needs something the worker cannot give it (a container, a remote
    sandbox, the Hugging Face hub, a model endpoint): answered as a clear error, not a
    traceback."""


def held_out_split(
    prompts: list[str], eval_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(train, eval) indices into `prompts`: a seeded `eval_fraction` of them held out
    (at least one); a train task whose prompt equals a held-out one is dropped, so the
    splits never overlap."""
    if len(prompts) < 2:
        raise Unsupported(
            f"the taskset has {len(prompts)} task(s): a train and a held-out split need at least 2"
        )
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(prompts) - 1, max(1, round(len(prompts) * eval_fraction)))
    held = sorted(order[:n_eval])
    return without_duplicates(prompts, sorted(order[n_eval:]), held), held


def without_duplicates(prompts: list[str], train: list[int], held: list[int]) -> list[int]:
    """The train indices whose prompt is not also a held-out task's."""
    seen = {prompts[i] for i in held}
    kept = [i for i in train if prompts[i] not in seen]
    if not kept:
        raise Unsupported("every train task's prompt is also a held-out task's")
    return kept
