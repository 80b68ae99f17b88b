"""Tic-tac-toe: one optimal move (`tictactoe-move`) and a whole game (`tictactoe-game`).

Boards are 9-character strings of "X", "O" and "." in row-major order; squares are numbered
1-9 row-major (1 top left, 9 bottom right), which is also what `choose_square` takes.
The game is small enough to solve exactly, so rewards come from a memoised minimax rather
than from a heuristic: a move is "optimal" iff it keeps the best game-theoretic value.
The board helpers live in tictactoe_board.py, the game's opponents in tictactoe_opponents.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from looprl.envs.builtin.tictactoe_board import (  # noqa: F401  (the public helpers live here too)
    EMPTY_BOARD,
    ILLEGAL_REWARD,
    LEGAL_REWARD,
    OPTIMAL_REWARD,
    WIN_REWARD,
    Player,
    as_square,
    best_moves,
    expected_result,
    expert_move,
    exploit_move,
    legal_moves,
    other,
    play,
    positions,
    render_board,
    render_lines,
    render_threats,
    score_move,
    to_move,
    unfinished_x_to_move,
    winner,
    winning_moves,
)
from looprl.envs.builtin.tictactoe_opponents import (  # noqa: F401  (public here too)
    OPPONENTS,
    SnapshotPlayers,
    parse_opponent,
)
from looprl.envs.common import check_choice, check_int, first_call, sample_items, task_indices
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Observation, StepResult, Task, ToolCall

CHOOSE_SQUARE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Place your mark on an empty square.",
        "parameters": {
            "type": "object",
            "properties": {
                "square": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 9,
                    "description": "Number of an empty square, 1-9, row by row from the top left.",
                }
            },
            "required": ["square"],
            "additionalProperties": False,
        },
    },
}
_TOOL_NAME = "choose_square"
BOARD_VIEWS = ("grid", "grid+lines", "grid+threats")


def show_board(board: str, view: str = "grid") -> str:
    """The board as the model reads it (one of `BOARD_VIEWS`): the grid, and below it its
    eight lines (`grid+lines`) or the lines one mark completes (`grid+threats`)."""
    grid = render_board(board)
    if view == "grid+lines":
        return f"{grid}\n\nLines:\n{render_lines(board)}"
    if view == "grid+threats":
        return f"{grid}\n\nTwo in a line: {render_threats(board)}"
    return grid


_MOVE_OUTCOMES = {
    WIN_REWARD: "win",
    OPTIMAL_REWARD: "optimal",
    LEGAL_REWARD: "legal",
    ILLEGAL_REWARD: "illegal",
}


class _TicTacToeEnv:
    """What both environments share: argument checks, the prompt and the episode guard."""

    name: ClassVar[str]
    default_prompt: ClassVar[str]
    reward_range: ClassVar[tuple[float, float]] = (-1.0, 1.0)
    _state: Any

    def __init__(self, tool_choice: str, system_prompt: str | None, board_view: str) -> None:
        self.tool_choice = check_choice("tool_choice", tool_choice, ("auto", "required"))
        self.board_view = check_choice("board_view", board_view, BOARD_VIEWS)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise EnvError(f"system_prompt={system_prompt!r} is invalid: expected a string")
        self.system_prompt = system_prompt or self.default_prompt
        self._state = None

    def _check_split(self, split: str) -> None:
        check_choice(f"{self.name}: split", split, ("train", "eval"))

    def _board(self, board: str) -> str:
        return show_board(board, self.board_view)

    def _observation(self, user_text: str) -> Observation:
        messages = [Message("system", self.system_prompt), Message("user", user_text)]
        return Observation(messages, tools=[CHOOSE_SQUARE_TOOL], tool_choice=self.tool_choice)

    def _live_state(self) -> Any:
        if self._state is None or self._state.done:
            raise EnvError(f"{self.name}: step() called without an episode in progress")
        return self._state


# ----------------------------------------------------------------------- single move env


@dataclass
class _MoveState:
    board: str
    done: bool = False


class TicTacToeMove(_TicTacToeEnv):
    """One position with X to move; the reward grades that single move by exact minimax."""

    name: ClassVar[str] = "tictactoe-move"
    description: ClassVar[str] = "Pick X's best move in a tic-tac-toe position (one tool call)."
    outcomes: ClassVar[tuple[str, ...]] = ("win", "optimal", "legal", "illegal", *PARSE_FAILURES)
    solved_outcomes: ClassVar[tuple[str, ...]] = ("win", "optimal")  # the best move was played
    reward_range: ClassVar[tuple[float, float]] = (ILLEGAL_REWARD, WIN_REWARD)
    default_prompt: ClassVar[str] = (
        "You are playing tic-tac-toe as X. Squares are numbered 1-9 row by row from the top "
        "left. Choose your move by calling the choose_square tool with the number of an empty "
        "square."
    )

    def __init__(
        self,
        tool_choice: str = "required",
        eval_size: int = 256,
        pool_size: int = 2048,
        pool_seed: int = 2026,
        system_prompt: str | None = None,
        board_view: str = "grid",
    ) -> None:
        super().__init__(tool_choice, system_prompt, board_view)
        self.pool_size = check_int("pool_size", pool_size, 2, len(unfinished_x_to_move()))
        # Both splits must be non-empty.
        self.eval_size = check_int("eval_size", eval_size, 1, pool_size - 1)
        self.pool_seed = check_int("pool_seed", pool_seed)
        self.max_turns = 1
        self._pool = positions(pool_size, pool_seed)

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval is the first `eval_size` positions of the pool, train the rest."""
        self._check_split(split)
        first, end = (0, self.eval_size) if split == "eval" else (self.eval_size, self.pool_size)
        return [
            Task(id=f"move-{self._pool[i]}", data={"board": self._pool[i]}, seed=i)
            for i in sample_items(list(range(first, end)), n, seed)
        ]

    def reset(self, task: Task) -> Observation:
        board = task.data.get("board")
        if board not in unfinished_x_to_move():
            raise EnvError(f"task {task.id!r}: {board!r} is not a reachable X-to-move position")
        self._state = _MoveState(board)
        return self._observation(f"Current board:\n{self._board(board)}\n\nYou are X. Your move?")

    def step(self, message: Message) -> StepResult:
        state: _MoveState = self._live_state()
        state.done = True
        info: dict[str, Any] = {"board": state.board, "best_moves": best_moves(state.board, "X")}
        call, failure = first_call(message, _TOOL_NAME)
        info["square"] = call.arguments.get("square") if call else None
        if call is None:
            return StepResult([], done=True, reward=ILLEGAL_REWARD, outcome=failure, info=info)
        reward = score_move(state.board, info["square"])
        return StepResult([], True, reward=reward, outcome=_MOVE_OUTCOMES[reward], info=info)

    def demonstrations(self, task: Task) -> list[Message]:
        """One expert call: the smallest immediate win, else the smallest best move."""
        square = expert_move(task.data["board"], "X")
        return [Message("assistant", tool_calls=[ToolCall(_TOOL_NAME, {"square": square})])]


# ------------------------------------------------------------------------ whole game env


EXPERTS = ("minimax", "exploit")  # tictactoe-game's `expert` argument
_GAME_OVER = {"win": "you win.", "draw": "it is a draw.", "loss": "you lose."}
# move_rewards: a move that keeps the best game value for the mover (win > draw > loss, as
# `best_moves`), a legal one that gives value away, an illegal or unparsable one
MOVE_GRADES = {"best": 1.0, "legal": 0.0, "illegal": -1.0}


@dataclass
class _GameState:
    board: str
    agent: Player
    shares: dict[str, float]  # of the opponent's moves, by player (parse_opponent)
    rng: random.Random
    split: str
    moves: list[tuple[Player, int]] = field(default_factory=list)
    done: bool = False


class TicTacToeGame(_TicTacToeEnv):
    """A whole game against an opponent seeded by the task: random, minimax or a mix."""

    name: ClassVar[str] = "tictactoe-game"
    description: ClassVar[str] = "Play a whole tic-tac-toe game against a scripted opponent."
    outcomes: ClassVar[tuple[str, ...]] = ("win", "draw", "loss", "illegal")
    default_prompt: ClassVar[str] = (
        "You are playing tic-tac-toe against an opponent. Squares are numbered 1-9 row by row "
        "from the top left. On each turn call the choose_square tool with the number of an "
        "empty square. An illegal move loses the game."
    )

    def __init__(
        self,
        opponent: str = "mixed:0.5",
        agent_plays: str = "alternate",
        tool_choice: str = "required",
        eval_size: int = 64,
        max_turns: int = 5,
        system_prompt: str | None = None,
        board_view: str = "grid",
        move_rewards: bool = False,
        expert: str = "minimax",
    ) -> None:
        super().__init__(tool_choice, system_prompt, board_view)
        parse_opponent(opponent)
        # Whose moves `demonstrations` makes (the SFT warm start, algo.expert_samples): both
        # play perfectly and never lose. `minimax` plays the smallest best move; `exploit`
        # the best move with the highest expected result against this opponent (its random
        # share's mistakes; a snapshot's moves are modelled as random): `exploit_move`.
        self.expert = check_choice("expert", expert, EXPERTS)
        if not isinstance(move_rewards, bool):
            raise EnvError(f"move_rewards={move_rewards!r} is invalid: expected true or false")
        # Each agent move graded by exact minimax (`StepResult.turn_reward`): MOVE_GRADES.
        # The episode's reward is the game's result either way; algo.turn_reward_weight
        # decides whether training uses the grades.
        self.move_rewards = self.gives_turn_rewards = move_rewards
        self.opponent = opponent
        # against perfect play a draw is the best there is; otherwise only a win
        self.solved_outcomes = ("win", "draw") if opponent == "minimax" else ("win",)
        self.plays_snapshot = parse_opponent(opponent)["snapshot"] > 0
        self.agent_plays = check_choice("agent_plays", agent_plays, ("X", "O", "alternate"))
        self.eval_size = check_int("eval_size", eval_size, 1)
        # X places at most 5 marks, so 5 agent turns always finish the game: the env never
        # truncates, and a smaller limit would cut games short.
        self.max_turns = check_int("max_turns", max_turns, 5)

    def _task(self, split: str, index: int) -> Task:
        # Eval seeds are even and train seeds odd: the two streams can never share a game.
        seed = 2 * index + (0 if split == "eval" else 1)
        agent = "XO"[index % 2] if self.agent_plays == "alternate" else self.agent_plays
        data = {"agent": agent, "opponent": self.opponent}
        return Task(id=f"game-{split}-{index}", data=data, seed=seed)

    def tasks(self, split: str, n: int | None = None, seed: int = 0) -> list[Task]:
        """Eval: game indices 0..eval_size-1. Train: an unbounded stream, so `n` is required."""
        indices = task_indices(self.name, split, n, seed, self.eval_size)
        return [self._task(split, i) for i in indices]

    def reset(self, task: Task) -> Observation:
        agent = check_choice(f"task {task.id!r}: agent", task.data.get("agent"), ("X", "O"))
        shares = parse_opponent(task.data.get("opponent"))
        split = "eval" if task.id.startswith("game-eval-") else "train"
        state = self._state = _GameState(
            EMPTY_BOARD, agent, shares, random.Random(task.seed), split
        )
        if agent == "O":
            intro = f"You play O. The opponent (X) opened on {self._opponent_move(state)}."
        else:
            intro = "You play X and move first."
        return self._observation(f"{intro}\n\n{self._board(state.board)}\n\nYour move?")

    def _opponent_move(self, state: _GameState) -> int:
        # The coin is tossed even when one player makes every move, so that every opponent
        # draws the same number of values from its RNG per move (minimax first: `mixed:P`
        # plays the games it always has).
        coin = state.rng.random()
        shares = state.shares
        player = other(state.agent)
        if coin < shares["minimax"]:
            square = state.rng.choice(best_moves(state.board, player))
        elif coin < shares["minimax"] + shares["random"] or not shares["snapshot"]:
            square = state.rng.choice(legal_moves(state.board))
        else:
            square = self._snapshot_move(state, player)
        state.board = play(state.board, square, player)
        state.moves.append((player, square))
        return square

    def _snapshot_move(self, state: _GameState, player: Player) -> int:
        """The policy snapshot's move, asked as a one-move prompt from its side."""
        choose = SnapshotPlayers.get(state.split)
        obs = self._observation(f"You play {player}.\n\n{self._board(state.board)}\n\nYour move?")
        legal = legal_moves(state.board)
        square = choose(obs.messages, obs.tools, legal, state.rng)
        if square not in legal:
            raise EnvError(f"the snapshot opponent chose {square!r}, not one of {legal}")
        return square

    def step(self, message: Message) -> StepResult:
        state: _GameState = self._live_state()
        call, failure = first_call(message, _TOOL_NAME)
        square = as_square(call.arguments.get("square")) if call else None
        if call is not None and square is None:
            raw = call.arguments.get("square")
            failure = "out_of_range" if type(raw) is int else "bad_arguments"
        elif square is not None and state.board[square - 1] != ".":
            failure = "occupied"
        if failure is not None:
            text = (
                f"Illegal move ({failure}).\n\n{self._board(state.board)}\n\nGame over: you lose."
            )
            return self._reply(state, call, text, "illegal", "illegal", failure=failure)

        assert square is not None and call is not None
        # the move's grade for move_rewards (MOVE_GRADES), only worked out when asked for
        best = self.move_rewards and square in best_moves(state.board, state.agent)
        grade = "best" if best else "legal"
        state.board = play(state.board, square, state.agent)
        state.moves.append((state.agent, square))
        text = f"You played {square}."
        if winner(state.board) is None and "." in state.board:
            text += f" The opponent ({other(state.agent)}) played {self._opponent_move(state)}."
        text += f"\n\n{self._board(state.board)}"
        won = winner(state.board)
        if won is None and "." in state.board:
            return self._reply(state, call, text + "\n\nYour move?", None, grade)
        outcome = "draw" if won is None else "win" if won == state.agent else "loss"
        text = f"{text}\n\nGame over: {_GAME_OVER[outcome]}"
        return self._reply(state, call, text, outcome, grade)

    def demonstrations(self, task: Task) -> list[Message]:
        """Expert calls for the whole game. The opponent is seeded by the task, so playing
        the game once in a scratch env gives the exact replies the real episode will get."""
        scratch = TicTacToeGame(
            self.opponent, self.agent_plays, max_turns=self.max_turns, board_view=self.board_view
        )
        scratch.reset(task)
        calls: list[Message] = []
        while not scratch._state.done:
            state = scratch._state
            if self.expert == "exploit":
                square = exploit_move(state.board, state.agent, state.shares["minimax"])
            else:
                square = expert_move(state.board, state.agent)
            call_id = f"call_{len(calls)}"
            calls.append(
                Message("assistant", tool_calls=[ToolCall(_TOOL_NAME, {"square": square}, call_id)])
            )
            scratch.step(calls[-1])
        return calls

    def _reply(
        self,
        state: _GameState,
        call: ToolCall | None,
        text: str,
        outcome: str | None,
        grade: str,
        **info: Any,
    ) -> StepResult:
        """The tool message answering `call` (also on the last move, so transcripts show how
        the game ended; none after a parse failure, which has no call to answer); with
        move_rewards, the move's `grade` as the turn reward."""
        state.done = outcome is not None
        reward = {"win": 1.0, "draw": 0.0, None: 0.0}.get(outcome, -1.0)  # loss, illegal: -1
        messages = [Message("tool", text, tool_call_id=call.id, name=_TOOL_NAME)] if call else []
        info.update(board=state.board, agent=state.agent, moves=list(state.moves))
        turn_reward = None
        if self.move_rewards:
            info["move_grade"], turn_reward = grade, MOVE_GRADES[grade]
        return StepResult(messages, state.done, reward, outcome, info, turn_reward=turn_reward)


ENVIRONMENTS: dict[str, type] = {"tictactoe-move": TicTacToeMove, "tictactoe-game": TicTacToeGame}
