"""`tictactoe-game`'s opponents: the `opponent` argument read as the share of moves each
player makes, and `SnapshotPlayers`, where the `snapshot` opponent finds the policy it plays
as. The game itself is in tictactoe.py."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from looprl.errors import EnvError

OPPONENTS = ("minimax", "random", "snapshot")


def parse_opponent(spec: Any) -> dict[str, float]:
    """The share of the opponent's moves each player makes (OPPONENTS; they add up to 1):
    `random`, `minimax`, `snapshot` (the policy's own snapshot, see `SnapshotPlayers`),
    `mixed:P` (minimax with probability P, else random) or `mix:minimax=A,random=B,
    snapshot=C` (shares that add up to 1, missing ones 0)."""
    if spec in OPPONENTS:
        return {k: float(k == spec) for k in OPPONENTS}
    if isinstance(spec, str) and spec.startswith("mixed:"):
        try:
            p = float(spec[len("mixed:") :])
        except ValueError:
            p = math.nan
        if 0.0 <= p <= 1.0:  # also false for nan
            return {"minimax": p, "random": 1.0 - p, "snapshot": 0.0}
    if isinstance(spec, str) and spec.startswith("mix:"):
        shares = _mix_shares(spec)
        if shares is not None:
            return shares
    raise EnvError(
        f"opponent={spec!r} is invalid: expected 'random', 'minimax', 'snapshot', 'mixed:P' "
        "with 0 <= P <= 1 (e.g. 'mixed:0.5'), or 'mix:NAME=SHARE,...' with names from "
        f"{', '.join(OPPONENTS)} and shares that add up to 1 (e.g. "
        "'mix:minimax=0.5,random=0.25,snapshot=0.25')"
    )


def _mix_shares(spec: str) -> dict[str, float] | None:
    """`mix:minimax=A,random=B,snapshot=C` as shares, or None when it is malformed."""
    shares = dict.fromkeys(OPPONENTS, 0.0)
    for part in spec[len("mix:") :].split(","):
        name, eq, value = part.strip().partition("=")
        try:
            share = float(value)
        except ValueError:
            return None
        if not eq or name not in shares or not 0.0 <= share <= 1.0:
            return None
        shares[name] += share
    return shares if abs(sum(shares.values()) - 1.0) < 1e-6 else None


class SnapshotPlayers:
    """Where `tictactoe-game`'s `snapshot` opponent finds the policy it plays as: a
    callable `(messages, tools, legal_squares, rng) -> square` per split, set by the
    training loop (loop/snapshot.py: train games play the policy of the last checkpoint,
    eval games the model as it was loaded, so that every eval meets the same opponent).
    Module-level because environments are built from their name and arguments alone."""

    players: ClassVar[dict[str, Any]] = {}

    @classmethod
    def set(cls, split: str, player: Any) -> None:
        if player is None:
            cls.players.pop(split, None)
        else:
            cls.players[split] = player

    @classmethod
    def get(cls, split: str) -> Any:
        player = cls.players.get(split)
        if player is None:
            raise EnvError(
                "tictactoe-game's 'snapshot' opponent plays a snapshot of the policy, which "
                f"only `looprl run` provides (no {split} snapshot is set); outside a run use "
                "opponent 'random', 'minimax' or 'mixed:P'"
            )
        return player
