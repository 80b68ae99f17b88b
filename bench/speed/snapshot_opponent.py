"""What a `snapshot` opponent costs: whole `tictactoe-game` games played by the expert
against `random` and against `snapshot` (the default model, frozen), side by side.

    .venv/bin/python bench/speed/snapshot_opponent.py [--model smollm2-135m] [--games 16]

Loads the policy as `looprl run` does, sets the snapshot players (loop/snapshot.py), then
plays the same games (the env's eval tasks, the expert's moves) against each opponent and
times the environment's steps. Ends with

    RESULT ms_per_snapshot_move=X game_s_random=Y game_s_snapshot=Z ratio=Z/Y

Not a test: it loads the real model; about a minute on a 2-core CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from looprl.config import config_from_dict
from looprl.envs import make_env
from looprl.envs.builtin.tictactoe_board import expert_move
from looprl.loop.policy import load_policy
from looprl.loop.snapshot import start_snapshots
from looprl.types import Message, ToolCall

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, result_line


def play_games(env: Any, games: int) -> tuple[float, int]:
    """Seconds for `games` expert games against env's opponent, and the opponent's moves."""
    opponent_moves = 0
    started = time.perf_counter()
    for task in env.tasks("eval", n=games, seed=0):
        env.reset(task)
        state = env._state
        for turn in range(env.max_turns):
            square = expert_move(state.board, state.agent)
            call = ToolCall("choose_square", {"square": square}, f"c{turn}")
            if env.step(Message("assistant", tool_calls=[call])).done:
                break
        opponent_moves += sum(player != state.agent for player, _ in state.moves)
    return time.perf_counter() - started, opponent_moves


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--games", type=int, default=16)
    args = parser.parse_args()
    policy = load_policy(config_from_dict({"model": {"name": args.model}}))
    start_snapshots(policy, uses_snapshot=True)
    play_games(
        make_env("tictactoe-game", {"opponent": "snapshot"}), 1
    )  # warm-up: first forward, caches
    random_s, _ = play_games(make_env("tictactoe-game", {"opponent": "random"}), args.games)
    snapshot_s, moves = play_games(make_env("tictactoe-game", {"opponent": "snapshot"}), args.games)
    per_move = (snapshot_s - random_s) / max(moves, 1) * 1000
    print(f"{args.games} expert games as X and O, {moves} snapshot moves, {args.model}")
    print(f"  vs random:   {random_s / args.games:.3f} s a game")
    print(f"  vs snapshot: {snapshot_s / args.games:.3f} s a game ({per_move:.0f} ms a move)")
    print(result_line({
        "ms_per_snapshot_move": f"{per_move:.1f}",
        "game_s_random": f"{random_s / args.games:.4f}",
        "game_s_snapshot": f"{snapshot_s / args.games:.4f}",
        "ratio": f"{snapshot_s / max(random_s, 1e-9):.0f}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
