"""Tic-tac-toe against a seeded opponent, written as an OpenAI-client agent.

The same game, prompt and tool as the built-in `tictactoe-game` env, but the game loop is
ordinary agent code: it calls `client.chat.completions.create`, reads the tool call,
plays the move and appends the tool result. looprl hands it a client answered by the
policy it trains and records the exact tokens of every call.

looprl run --set env.name=examples.tictactoe_agent:TicTacToeAgent --set model.name=tiny-random
"""

import json
import random

from looprl.agents import AgentResult
from looprl.envs.builtin.tictactoe import CHOOSE_SQUARE_TOOL, TicTacToeGame, parse_opponent
from looprl.envs.builtin.tictactoe_board import (
    EMPTY_BOARD,
    as_square,
    best_moves,
    legal_moves,
    other,
    play,
    render_board,
    winner,
)
from looprl.errors import EnvError

GAME_OVER = {"win": "you win.", "draw": "it is a draw.", "loss": "you lose."}
REWARDS = {"win": 1.0, "draw": 0.0, "loss": -1.0, "illegal": -1.0}


class TicTacToeAgent:
    name = "tictactoe-agent"
    description = "A whole tic-tac-toe game, played by an OpenAI-client agent."
    outcomes = ("win", "draw", "loss", "illegal")
    reward_range = (-1.0, 1.0)
    max_turns = 5  # X places at most 5 marks: every game ends within 5 model calls

    def __init__(self, opponent="mixed:0.5", agent_plays="alternate", eval_size=64):
        # The tasks (and their opponent seeds) are the built-in game's.
        self.game = TicTacToeGame(opponent, agent_plays, eval_size=eval_size)
        if parse_opponent(opponent)["snapshot"]:
            raise EnvError("this example's opponent is random, minimax or mixed:P, not a snapshot")

    def tasks(self, split, n=None, seed=0):
        return self.game.tasks(split, n=n, seed=seed)

    async def run_agent(self, client, task):
        me, rng = task.data["agent"], random.Random(task.seed)
        minimax_p = parse_opponent(task.data["opponent"])["minimax"]
        board, moves = EMPTY_BOARD, []

        def opponent_move():
            nonlocal board
            use_minimax = rng.random() < minimax_p  # tossed always, as the built-in env does
            player = other(me)
            square = rng.choice(best_moves(board, player) if use_minimax else legal_moves(board))
            board = play(board, square, player)
            moves.append((player, square))
            return square

        if me == "O":
            intro = f"You play O. The opponent (X) opened on {opponent_move()}."
        else:
            intro = "You play X and move first."
        messages = [
            {"role": "system", "content": TicTacToeGame.default_prompt},
            {"role": "user", "content": f"{intro}\n\n{render_board(board)}\n\nYour move?"},
        ]
        while True:
            response = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CHOOSE_SQUARE_TOOL],
                tool_choice="required",
            )
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            call = reply.tool_calls[0] if reply.tool_calls else None
            if call is None or call.function.name != "choose_square":
                failure = "no_tool_call" if call is None else "unknown_tool"
                return AgentResult(-1.0, "illegal", {"board": board, "failure": failure})
            raw = json.loads(call.function.arguments).get("square")
            square = as_square(raw)
            if square is None or board[square - 1] != ".":
                failure = (
                    "occupied"
                    if square
                    else "out_of_range"
                    if type(raw) is int
                    else "bad_arguments"
                )
                return AgentResult(-1.0, "illegal", {"board": board, "failure": failure})
            board = play(board, square, me)
            moves.append((me, square))
            text = f"You played {square}."
            if winner(board) is None and "." in board:
                text += f" The opponent ({other(me)}) played {opponent_move()}."
            text += f"\n\n{render_board(board)}"
            won = winner(board)
            if won is not None or "." not in board:
                outcome = "draw" if won is None else "win" if won == me else "loss"
                info = {"board": board, "agent": me, "moves": moves}
                return AgentResult(REWARDS[outcome], outcome, info)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": text + "\n\nYour move?"}
            )
