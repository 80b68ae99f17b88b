"""The workload of bench/speed/step.py: a tic-tac-toe move read from the answer's text.

    looprl envs check bench.step_env:MoveInText    # from the repository root

The same tasks and prompts as `tictactoe-move` (the board, the system prompt and the
`choose_square` schema, `tool_choice` as given, `auto` by default), but the move need not
come as a tool call: it is the `square` of a valid `choose_square` call if the answer
makes one, else the first digit 1-9 anywhere in the answer's text. That square is scored
as `tictactoe-move` scores a call (+1 immediate win, +0.8 minimax-optimal, 0 other legal
move, -1 occupied square; -1 when the answer names no square), and the reward is

    reward = 0.8 * move score + 0.2 * (1 - min(characters of the answer's text, 500) / 500)

(a valid call has no text beside it, so it gets the whole brevity term), in [-0.8, 1].

Why: with free sampling (no grammar) the untrained SmolLM2-135M almost never writes a
valid call, so under `tictactoe-move` every completion of a group scores -1, every
advantage is 0 and an RL step has no update to time. Its free text names a square now
and then (it may echo the board, whose empty squares show their numbers), and the
length of its answers differs from sample to sample, so groups get a reward spread on
both sides of the benchmark without forcing a call. Both sides compute the reward with
this class (TRL's reward function calls it on the same parsed message), so it is the
same function.
"""

from __future__ import annotations

import re
from typing import Any

from looprl.envs.builtin.tictactoe import TicTacToeMove, score_move
from looprl.types import Message, Observation, StepResult, Task

_DIGIT = re.compile(r"[1-9]")
MOVE_WEIGHT, BREVITY_WEIGHT, BREVITY_CHARS = 0.8, 0.2, 500
_OUTCOMES = {1.0: "win", 0.8: "optimal", 0.0: "legal", -1.0: "illegal"}


class MoveInText:
    """`tictactoe-move`'s tasks and prompts; the move is a call's square or the first digit."""

    name = "move-in-text"
    description = "Tic-tac-toe move, from a choose_square call or the first digit 1-9 of the text."
    outcomes = ("win", "optimal", "legal", "illegal", "no_square")
    reward_range = (-MOVE_WEIGHT, MOVE_WEIGHT + BREVITY_WEIGHT)
    max_turns = 1

    def __init__(self, tool_choice: str = "auto", **move_args: Any) -> None:
        self.move = TicTacToeMove(tool_choice=tool_choice, **move_args)
        self.board = ""

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        return self.move.tasks(split, n=n, seed=seed)

    def reset(self, task: Task) -> Observation:
        observation = self.move.reset(task)
        self.board = task.data["board"]
        return observation

    def step(self, message: Message) -> StepResult:
        square = named_square(message)
        move = -1.0 if square is None else score_move(self.board, square)
        brevity = 1.0 - min(len(message.content or ""), BREVITY_CHARS) / BREVITY_CHARS
        reward = MOVE_WEIGHT * move + BREVITY_WEIGHT * brevity
        outcome = "no_square" if square is None else _OUTCOMES[move]
        info = {"board": self.board, "square": square, "move_score": move, "brevity": brevity}
        return StepResult([], True, reward=reward, outcome=outcome, info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        return self.move.demonstrations(task)


def named_square(message: Message) -> int | None:
    """The square of the first valid `choose_square` call, else the text's first digit 1-9."""
    for call in message.tool_calls:
        if call.name == "choose_square" and isinstance(call.arguments.get("square"), int):
            return call.arguments["square"]
    found = _DIGIT.search(message.content or "")
    return int(found.group()) if found else None
