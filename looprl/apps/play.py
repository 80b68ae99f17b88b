"""`looprl play`: tic-tac-toe against a model, in the terminal (here) or a browser (play_web).

How the model is asked. Each model turn is one prompt in the style of the `tictactoe-move`
environment, so a model post-trained on that env sees exactly what it was trained on: the
env's system prompt, "Current board:\\n{board}\\n\\nYou are X. Your move?", the
`choose_square` tool, forced (tool_choice="choose_square"), greedy unless --temperature.
There is no game history in the prompt, as in the env: only the current board. A run
trained on a tic-tac-toe env with `board_view` or `system_prompt` in its `env.args` is
shown the board and the system prompt that way (`run_prompt_args`).

The model as O. The move env always has X to move, so when the model plays O the board it
is shown has X and O swapped: it sees itself as X. Its answer is a square number, which
needs no mapping back. The swapped board holds one more O than X, a position the move env
never shows, so a model trained there plays O a little out of distribution.

An illegal answer ends the game: an occupied square, a square outside 1-9 or a call that
could not be parsed means the model forfeits, as in the `tictactoe-game` env ("An illegal
move loses the game"). We do not let it retry: what you see is what the model does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from looprl.envs.builtin.tictactoe import BOARD_VIEWS, CHOOSE_SQUARE_TOOL, TicTacToeMove, show_board
from looprl.envs.builtin.tictactoe_board import (
    EMPTY_BOARD,
    Player,
    as_square,
    other,
    play,
    winner,
)
from looprl.errors import LoopRLError
from looprl.types import Message

if TYPE_CHECKING:
    from looprl.apps.inference import ChatModel

MAX_TOKENS = 64  # a forced choose_square call takes ~25 tokens in any call syntax
STATUS_TEXT = {
    "human_to_move": "Your move.",
    "model_to_move": "The model is thinking.",
    "human_won": "You win.",
    "model_won": "The model wins.",
    "draw": "Draw.",
    "model_forfeit": "The model made an illegal move and forfeits: you win.",
}


class PlayError(LoopRLError):
    """A move the rules refuse (occupied, out of range, not your turn, game over) or a
    play option that does not fit the model."""


@dataclass
class ModelTurn:
    """One answer of the model, as it gave it."""

    mark: Player  # the model's mark on the real board
    text: str  # the raw completion: the tool call text as the model wrote it
    square: int | None  # the square it chose; None when the call had no usable square
    legal: bool
    reason: str = ""  # why it is illegal: occupied, out_of_range or a parse failure label
    variant: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mark": self.mark,
            "text": self.text,
            "square": self.square,
            "legal": self.legal,
            "reason": self.reason,
            "variant": self.variant,
        }


def swap_marks(board: str) -> str:
    """The board with X and O exchanged (what the model sees when it plays O)."""
    return board.translate(str.maketrans("XO", "OX"))


def move_prompt(
    board_as_x: str, board_view: str = "grid", system_prompt: str | None = None
) -> list[Message]:
    """The `tictactoe-move` env's prompt for a board where the model plays X, with the
    env's `board_view` and `system_prompt` (None: the env's own)."""
    user = f"Current board:\n{show_board(board_as_x, board_view)}\n\nYou are X. Your move?"
    system = system_prompt or TicTacToeMove.default_prompt
    return [Message("system", system), Message("user", user)]


def run_prompt_args(model: Any) -> tuple[str, str | None]:
    """The board view and system prompt a run's model was trained with: its config's
    `env.args` when the env is tic-tac-toe; else the plain grid and the env's prompt."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.env.name not in ("tictactoe-move", "tictactoe-game"):
        return "grid", None
    view = cfg.env.args.get("board_view", "grid")
    if view not in BOARD_VIEWS:
        raise PlayError(f"the run's env.args.board_view {view!r} is not one of {BOARD_VIEWS}")
    return view, cfg.env.args.get("system_prompt")


def check_variant(model: ChatModel, variant: str | None) -> str:
    """`variant`, or the model's default one (the trained model of a run)."""
    if variant is None:
        return model.variants[0]
    if variant not in model.variants:
        hint = " (trained and baseline: a run folder with a checkpoint)"
        raise PlayError(
            f"--variant {variant}: {model.name} has the variants {', '.join(model.variants)}"
            + (hint if model.variants == ("base",) else "")
        )
    return variant


def check_human(human: str) -> Player:
    mark = human.upper()
    if mark not in ("X", "O"):
        raise PlayError(f"--human {human}: expected X (you move first) or O")
    return mark  # type: ignore[return-value]


def check_temperature(temperature: float) -> float:
    if not 0.0 <= temperature <= 5.0:  # also false for nan
        raise PlayError(f"--temperature {temperature}: expected 0 (greedy) to 5")
    return temperature


@dataclass
class PlaySession:
    """One game between a human and a model; the board is 9 chars of X, O and '.'."""

    model: ChatModel
    human: Player = "X"
    variant: str | None = None  # None: the model's default variant
    temperature: float = 0.0
    seed: int | None = None
    board: str = EMPTY_BOARD
    moves: list[tuple[Player, int]] = field(default_factory=list)
    turns: list[ModelTurn] = field(default_factory=list)
    forfeit: bool = False
    _prompt_args: tuple[str, str | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.human = check_human(self.human)
        self.variant = check_variant(self.model, self.variant)
        check_temperature(self.temperature)
        self._prompt_args = run_prompt_args(self.model)

    @property
    def model_mark(self) -> Player:
        return other(self.human)

    @property
    def status(self) -> str:
        """human_to_move, model_to_move, human_won, model_won, draw or model_forfeit."""
        if self.forfeit:
            return "model_forfeit"
        won = winner(self.board)
        if won is not None:
            return "human_won" if won == self.human else "model_won"
        if "." not in self.board:
            return "draw"
        x_to_move = self.board.count("X") == self.board.count("O")
        return "human_to_move" if (self.human == "X") == x_to_move else "model_to_move"

    @property
    def over(self) -> bool:
        return self.status not in ("human_to_move", "model_to_move")

    def human_move(self, square: Any) -> ModelTurn | None:
        """Play the human's `square` (1-9), then the model's answer (None if the game ended)."""
        self._check_turn("human_to_move", "it is the model's turn")
        sq = as_square(square)
        if sq is None:
            raise PlayError(f"square {square!r}: expected a number 1-9")
        if self.board[sq - 1] != ".":
            free = ", ".join(str(i + 1) for i, m in enumerate(self.board) if m == ".")
            raise PlayError(f"square {sq} is taken; empty squares: {free}")
        self._play(sq, self.human)
        return None if self.over else self.model_move()

    def model_move(self) -> ModelTurn:
        """Ask the model for its move and play it; an illegal answer forfeits the game."""
        self._check_turn("model_to_move", "it is your turn")
        seen = self.board if self.model_mark == "X" else swap_marks(self.board)
        seed = None if self.seed is None else self.seed + len(self.moves)
        single = len(self.model.variants) == 1  # a plain model: no variant to pick
        choice = self.model.chat(
            move_prompt(seen, *self._prompt_args),
            tools=[CHOOSE_SQUARE_TOOL],
            tool_choice="choose_square",
            temperature=self.temperature,
            max_tokens=MAX_TOKENS,
            seed=seed,
            variant=None if single else self.variant,
        )[0]
        square, reason = self._read_call(choice.message)
        turn = ModelTurn(self.model_mark, choice.text, square, not reason, reason, self.variant)
        self.turns.append(turn)
        if reason:
            self.forfeit = True
        else:
            assert square is not None
            self._play(square, self.model_mark)
        return turn

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON for the web page."""
        return {
            "board": self.board,
            "status": self.status,
            "message": STATUS_TEXT[self.status],
            "human": self.human,
            "model_mark": self.model_mark,
            "variant": self.variant,
            "over": self.over,
            "turns": [t.to_dict() for t in self.turns],
        }

    def _read_call(self, message: Message) -> tuple[int | None, str]:
        """The square of the model's call and, when it cannot be played, why not."""
        if message.parse_failure is not None:
            return None, message.parse_failure
        if not message.tool_calls or message.tool_calls[0].name != "choose_square":
            return None, "no_tool_call" if not message.tool_calls else "unknown_tool"
        raw = message.tool_calls[0].arguments.get("square")
        square = as_square(raw)
        if square is None:
            return None, "out_of_range" if type(raw) is int else "bad_arguments"
        return square, "occupied" if self.board[square - 1] != "." else ""

    def _check_turn(self, expected: str, wrong_turn: str) -> None:
        if self.over:
            raise PlayError(f"the game is over ({STATUS_TEXT[self.status]}); start a new one")
        if self.status != expected:
            raise PlayError(wrong_turn)

    def _play(self, square: int, mark: Player) -> None:
        self.board = play(self.board, square, mark)
        self.moves.append((mark, square))


# ------------------------------------------------------------------------- terminal UI

MARK_STYLE = {"X": "bold cyan", "O": "bold magenta"}


def board_table(board: str) -> Table:
    """The board as a rich grid: marks in colour, empty squares by their number."""
    table = Table(show_header=False, show_lines=True, padding=(0, 1))
    for _ in range(3):
        table.add_column(justify="center", width=1)
    cells = [
        Text(mark, style=MARK_STYLE[mark]) if mark != "." else Text(str(i + 1), style="dim")
        for i, mark in enumerate(board)
    ]
    for row in (0, 3, 6):
        table.add_row(*cells[row : row + 3])
    return table


def show_turn(console: Console, turn: ModelTurn) -> None:
    console.print(Text(f"model ({turn.mark}) tool call:", style=MARK_STYLE[turn.mark]))
    console.print(Text(turn.text.strip() or "(empty completion)"), highlight=False)
    if turn.legal:
        console.print(f"the model plays {turn.square}")
    else:
        console.print(f"[bold red]illegal move ({turn.reason})[/]: the model forfeits")


def play_in_terminal(
    session_factory: Callable[[], PlaySession],
    console: Console,
    ask: Callable[[str], str] | None = None,
) -> None:
    """Play games until the human quits (q, end of input, or no to "play again")."""
    ask = ask or console.input
    try:
        while True:
            _play_one_game(session_factory(), console, ask)
            if not ask("play again? (y/n) ").strip().lower().startswith("y"):
                return
    except (EOFError, _Quit):
        console.print("bye")


class _Quit(Exception):
    pass


def _play_one_game(session: PlaySession, console: Console, ask: Callable[[str], str]) -> None:
    model = session.model
    console.rule(
        f"you: {session.human} · model: {session.model_mark} ({model.name}, {session.variant})"
    )
    if session.status == "model_to_move":
        show_turn(console, session.model_move())
    console.print(board_table(session.board))
    while not session.over:
        answer = ask("your square (1-9, q to quit): ").strip().lower()
        if answer in ("q", "quit", "exit"):
            raise _Quit
        try:
            turn = session.human_move(int(answer) if answer.isdigit() else answer)
        except PlayError as err:
            console.print(Text(str(err), style="red"))
            continue
        if turn is not None:
            show_turn(console, turn)
        console.print(board_table(session.board))
    console.print(f"[bold]{STATUS_TEXT[session.status]}[/]")
