"""Every random stream a run derives from its seeds, named in one place.

A run has two seeds: `seed` (training) and `eval.seed` (the held-out tasks and their
sampling). Each use below takes its own stream from them, so that one use never shifts
another: a refill round does not move the minibatch shuffle, a second turn does not replay
the first turn's samples. The multipliers are primes far apart, so that the streams of
nearby steps and seeds do not meet. Changing a formula changes every figure a seed gives:
the run's results are reproducible only while these stay as they are.
"""

from __future__ import annotations

STEP = 1_000_003  # a training step's rollout stream: seed × STEP + step
REFILL = 500_009  # a dynamic-sampling refill round's tasks: the step's seed + round × REFILL
SFT = 999_983  # the SFT warm start's demonstration tasks: seed × SFT + step
MINIBATCH = 7  # the update's shuffle of groups into minibatches: seed × MINIBATCH + step
TURN = 7919  # turn k of an episode samples from the request seed + k × TURN
STREAM = 1_000_003  # an engine's per-request random stream: base seed × STREAM + stream
MEMBER = 1_000_003  # a mixture's member i draws its tasks with seed + i × MEMBER (envs/mix.py)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed and task seed of training step `step` (round 0)."""
    return seed * STEP + step


def refill_seed(step_seed: int, round_: int) -> int:
    """The task seed of refill round `round_` of a step (round 0: the step's own)."""
    return step_seed + REFILL * round_


def sft_tasks_seed(seed: int, step: int) -> int:
    """The task seed of SFT step `step`'s demonstrations."""
    return seed * SFT + step


def minibatch_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s shuffle of groups into minibatches."""
    return seed * MINIBATCH + step


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of an episode's turn `turn` (0 = its first); None stays None."""
    return None if seed is None else seed + TURN * turn


def stream_seed(seed: int, stream: int) -> int:
    """The seed of one request's random stream (`stream`: its index in the whole batch); the
    `hf` engine's stream key (engine/random_stream.py), vLLM's per-request seed."""
    return (seed * STREAM + stream) % 2**63


def member_seed(seed: int, member: int) -> int:
    """The task seed of a mixture's member `member` (envs/mix.py) for the mixture's `seed`."""
    return seed + MEMBER * member
