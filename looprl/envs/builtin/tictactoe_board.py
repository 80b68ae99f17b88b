"""Tic-tac-toe rules and exact minimax, shared by the tic-tac-toe environments.

Boards are 9-character strings of "X", "O" and "." in row-major order; squares are numbered
1-9 row-major (1 top left, 9 bottom right). The game is small enough to solve exactly, so
rewards come from a memoised minimax rather than from a heuristic: a move is "optimal" iff
it keeps the best game-theoretic value.
"""

from __future__ import annotations

import random
from fractions import Fraction
from functools import cache
from typing import Any, Literal

Player = Literal["X", "O"]
EMPTY_BOARD = "." * 9
_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))

# Rewards of the single-move task; an immediate win outranks a merely optimal move so the
# policy learns to finish games instead of postponing a forced win.
WIN_REWARD, OPTIMAL_REWARD, LEGAL_REWARD, ILLEGAL_REWARD = 1.0, 0.8, 0.0, -1.0


def winner(board: str) -> Player | None:
    """The player with three in a row, or None (legal boards never have two winners)."""
    for a, b, c in _LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]  # type: ignore[return-value]
    return None


def legal_moves(board: str) -> list[int]:
    """Empty squares (1-based); empty once someone has won, since the game is over."""
    if winner(board) is not None:
        return []
    return [i + 1 for i, mark in enumerate(board) if mark == "."]


def to_move(board: str) -> Player:
    """X moves first, so X is to move exactly when both players have placed as many marks."""
    return "X" if board.count("X") == board.count("O") else "O"


def other(player: Player) -> Player:
    return "O" if player == "X" else "X"


def play(board: str, square: int, player: Player) -> str:
    """`board` with `player`'s mark on `square` (1-based); the caller checks legality."""
    return board[: square - 1] + player + board[square:]


@cache
def _value(board: str, player: Player) -> int:
    """Game value for `player`, who is to move: +1 forced win, 0 draw, -1 forced loss.

    Negamax: value(b, p) = max over moves m of -value(b + m, other(p)).
    """
    won = winner(board)
    if won is not None:
        return 1 if won == player else -1
    moves = legal_moves(board)
    if not moves:
        return 0
    return max(-_value(play(board, m, player), other(player)) for m in moves)


@cache
def _best_moves(board: str, player: Player) -> tuple[int, ...]:
    values = {m: -_value(play(board, m, player), other(player)) for m in legal_moves(board)}
    top = max(values.values(), default=0)
    return tuple(m for m, v in values.items() if v == top)


def best_moves(board: str, player: Player) -> list[int]:
    """Every legal move keeping the best game value for `player` (win > draw > loss).

    Only the game-theoretic value counts: a slower forced win is as good as an immediate one,
    so a won position usually has several best moves. Empty for a finished board.
    """
    return list(_best_moves(board, player))


def winning_moves(board: str, player: Player) -> list[int]:
    """Moves that complete a line for `player` right now."""
    return [m for m in legal_moves(board) if winner(play(board, m, player)) == player]


def _perfect_moves(board: str, player: Player) -> list[int]:
    """The immediate wins if there are any, else the best moves, in ascending order.

    Taking an immediate win first keeps an expert from dawdling in won positions.
    """
    moves = winning_moves(board, player) or best_moves(board, player)
    if not moves:
        raise ValueError(f"no legal move on finished board {board!r}")
    return moves


def expert_move(board: str, player: Player) -> int:
    """A deterministic perfect move: the smallest immediate win, else the smallest best move."""
    return _perfect_moves(board, player)[0]


def exploit_move(board: str, player: Player, minimax_share: float = 0.0) -> int:
    """A perfect move that profits most from an imperfect opponent.

    The smallest immediate win, else the best move (`best_moves`: it never gives game value
    away, so the player never loses) with the highest expected result against an opponent
    who plays one of its own best moves with probability `minimax_share` and a uniformly
    random legal move otherwise; the smallest such move on ties. Against a perfect opponent
    (share 1) every best move is worth the game value, so this is `expert_move`.
    """
    share = _share(minimax_share)
    # an immediate win is worth 1, the most there is; max keeps the first of equal values
    return max(
        _perfect_moves(board, player),
        key=lambda m: _expected(play(board, m, player), player, share),
    )


def expected_result(board: str, player: Player, minimax_share: float = 0.0) -> Fraction:
    """`exploit_move`'s exact expected result for `player` from `board` (either side to
    move) against the opponent its docstring describes: win +1, draw 0, loss -1."""
    return _expected(board, player, _share(minimax_share))


def _share(minimax_share: float) -> Fraction:
    share = Fraction(str(minimax_share))
    if not 0 <= share <= 1:
        raise ValueError(f"minimax_share={minimax_share!r} is not in [0, 1]")
    return share


@cache
def _expected(board: str, player: Player, share: Fraction) -> Fraction:
    """Exact expected result for `player` (win +1, draw 0, loss -1) from `board` when
    `player` plays `exploit_move` and the opponent as `exploit_move`'s docstring says."""
    won = winner(board)
    if won is not None:
        return Fraction(1 if won == player else -1)
    moves = legal_moves(board)
    if not moves:
        return Fraction(0)
    mover = to_move(board)
    if mover == player:  # an immediate win is worth 1, as much as any best move can be
        children = (play(board, m, player) for m in _best_moves(board, player))
        return max(_expected(child, player, share) for child in children)

    def mean(squares: tuple[int, ...] | list[int]) -> Fraction:
        total = sum((_expected(play(board, m, mover), player, share) for m in squares), Fraction(0))
        return total / len(squares)

    return share * mean(_best_moves(board, mover)) + (1 - share) * mean(moves)


def as_square(value: Any) -> int | None:
    """`value` as a square number 1-9, or None; bools are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 1 <= value <= 9 else None


def score_move(board: str, square: Any) -> float:
    """Reward of X playing `square` on `board` (X to move).

    -1.0 not an int in 1..9, or occupied; +1.0 wins at once; +0.8 another minimax-optimal
    move; 0.0 any other legal move.
    """
    sq = as_square(square)
    if sq is None or board[sq - 1] != ".":
        return ILLEGAL_REWARD
    if winner(play(board, sq, "X")) == "X":
        return WIN_REWARD
    return OPTIMAL_REWARD if sq in _best_moves(board, "X") else LEGAL_REWARD


@cache
def unfinished_x_to_move() -> tuple[str, ...]:
    """Sorted positions reachable by legal play with X to move and the game not over."""
    seen: set[str] = set()
    stack = [EMPTY_BOARD]
    while stack:
        board = stack.pop()
        if board in seen:
            continue
        seen.add(board)
        player = to_move(board)
        stack.extend(play(board, m, player) for m in legal_moves(board))
    return tuple(sorted(b for b in seen if to_move(b) == "X" and winner(b) is None and "." in b))


def positions(n: int = 2048, seed: int = 2026) -> list[str]:
    """`n` distinct unfinished positions with X to move, in a seed-determined order.

    There are 2423 such positions reachable from the empty board (the empty board included);
    they are sorted, shuffled with random.Random(seed), and the first `n` returned.
    """
    pool = list(unfinished_x_to_move())
    if not 0 <= n <= len(pool):
        raise ValueError(f"n={n}: only {len(pool)} unfinished X-to-move positions exist")
    random.Random(seed).shuffle(pool)
    return pool[:n]


def _cells(board: str) -> list[str]:
    return [mark if mark != "." else str(i + 1) for i, mark in enumerate(board)]


def render_board(board: str) -> str:
    """Three rows with marks shown and empty squares shown by their number."""
    cells = _cells(board)
    rows = [" " + " | ".join(cells[r : r + 3]) for r in (0, 3, 6)]
    return "\n---+---+---\n".join(rows)


_LINE_NAMES = ("row 1", "row 2", "row 3", "column 1", "column 2", "column 3")
_LINE_NAMES += ("diagonal 1-5-9", "diagonal 3-5-7")


def _render_line(cells: list[str], name: str, line: tuple[int, ...]) -> str:
    return f"{name}: {' '.join(cells[i] for i in line)}"


def render_lines(board: str) -> str:
    """The eight lines of three, one per row of text, marks shown and empty squares by
    their number. A win or a block becomes local: two equal marks and a number on one
    row of text (`row 2: X X 6`), instead of three squares spread over a drawn grid."""
    cells = _cells(board)
    return "\n".join(_render_line(cells, name, line) for name, line in zip(_LINE_NAMES, _LINES))


def render_threats(board: str) -> str:
    """Only the lines that one more mark completes: two equal marks and an empty square
    (`row 2: X X 6`), joined by "; ", or "none". The part of `render_lines` that decides
    an immediate win or block, in a few tokens; which of them is the mover's to take or
    to block is left to the reader."""
    cells = _cells(board)
    open_twos = [
        _render_line(cells, name, line)
        for name, line in zip(_LINE_NAMES, _LINES)
        if "".join(sorted(board[i] for i in line)) in (".OO", ".XX")
    ]
    return "; ".join(open_twos) or "none"
