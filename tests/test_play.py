"""`looprl play`: the game session with a scripted model (no model, milliseconds), the
terminal UI, and whole games against tiny-random through the CLI."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from looprl.apps.play import PlayError, PlaySession, move_prompt, play_in_terminal, swap_marks
from looprl.cli import app
from looprl.envs.builtin.tictactoe import CHOOSE_SQUARE_TOOL, TicTacToeMove
from looprl.envs.builtin.tictactoe_board import render_board
from looprl.types import Message, Task, ToolCall

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
END_TEXTS = ("You win.", "The model wins.", "Draw.", "forfeits: you win.")

# ============================================================================ a scripted model


@dataclass
class FakeChoice:
    message: Message
    text: str


class ScriptedModel:
    """A ChatModel that answers with the given squares in turn (an int: a choose_square
    call; a str: unparseable text) and records every call."""

    def __init__(self, squares: list[Any], variants: tuple[str, ...] = ("base",)) -> None:
        self.name = "scripted"
        self.variants = variants
        self.squares = list(squares)
        self.calls: list[dict[str, Any]] = []

    def chat(self, messages: list[Message], tools=None, tool_choice="auto", **kw) -> list:
        self.calls.append({"messages": messages, "tools": tools, "tool_choice": tool_choice, **kw})
        answer = self.squares.pop(0)
        if isinstance(answer, str):
            message = Message("assistant", answer, parse_failure="bad_json")
            return [FakeChoice(message, answer)]
        call = ToolCall("choose_square", {"square": answer}, id="call_0")
        text = json.dumps({"name": "choose_square", "arguments": {"square": answer}})
        message = Message("assistant", tool_calls=[call])
        return [FakeChoice(message, f"<tool_call>{text}</tool_call>")]


def user_text(model: ScriptedModel, i: int = -1) -> str:
    return model.calls[i]["messages"][1].content


# ============================================================================ the session


def test_prompt_is_the_move_envs_prompt_with_the_tool_forced():
    board = "X.O......"
    obs = TicTacToeMove().reset(Task("t", {"board": board}))
    assert [m.to_dict() for m in move_prompt(board)] == [m.to_dict() for m in obs.messages]
    model = ScriptedModel([5])
    session = PlaySession(model, human="O")  # the model plays X and opens
    session.model_move()
    call = model.calls[0]
    assert call["tools"] == [CHOOSE_SQUARE_TOOL] and call["tool_choice"] == "choose_square"
    assert call["temperature"] == 0.0 and call["variant"] is None  # a plain model
    assert render_board("." * 9) in user_text(model) and session.board == "....X...."


def test_a_run_is_shown_the_board_view_and_system_prompt_it_trained_with():
    """`make demo` trains on the board with its open twos: playing its run, the model reads
    the board that way (and a run's own system prompt), exactly as the env shows it."""
    from looprl.config import load_config

    board = "XX.OO...."
    args = {"board_view": "grid+threats", "system_prompt": "Win if you can."}
    obs = TicTacToeMove(**args).reset(Task("t", {"board": board}))
    prompt = move_prompt(board, "grid+threats", "Win if you can.")
    assert [m.to_dict() for m in prompt] == [m.to_dict() for m in obs.messages]
    assert "Two in a line: row 1: X X 3; row 2: O O 6" in prompt[1].content

    model = ScriptedModel([1, 3])
    model.config = load_config(None, [f"env.args.{k}={v}" for k, v in args.items()])  # type: ignore[attr-defined]
    session = PlaySession(model, human="O")  # the model is X
    session.model_move()
    session.human_move(4)
    seen = model.calls[1]["messages"]
    assert [m.to_dict() for m in seen] == [m.to_dict() for m in move_prompt("X..O.....", **args)]

    # another env's run, or a plain model: the move env's own prompt
    other_run = ScriptedModel([1])
    other_run.config = load_config(None, ["env.name=workflow"])  # type: ignore[attr-defined]
    PlaySession(other_run, human="O").model_move()
    assert other_run.calls[0]["messages"][1].content == move_prompt(".........")[1].content
    bad = ScriptedModel([1])
    bad.config = load_config(None, ["env.args.board_view=sideways"])  # type: ignore[attr-defined]
    with pytest.raises(PlayError, match="board_view 'sideways'"):
        PlaySession(bad)


def test_a_whole_game_the_human_wins():
    model = ScriptedModel([4, 5])
    session = PlaySession(model, human="X")
    assert session.status == "human_to_move" and session.model_mark == "O"
    turn = session.human_move(1)
    assert turn is not None and turn.legal and turn.square == 4 and turn.mark == "O"
    assert "choose_square" in turn.text
    session.human_move(2)
    assert session.board == "XX.OO...."
    assert session.human_move(3) is None  # X wins: the model is not asked again
    assert session.status == "human_won" and session.over and len(model.calls) == 2
    assert session.moves == [("X", 1), ("O", 4), ("X", 2), ("O", 5), ("X", 3)]
    with pytest.raises(PlayError, match="the game is over"):
        session.human_move(9)


def test_the_model_as_o_sees_the_marks_swapped():
    model = ScriptedModel([1, 2])
    session = PlaySession(model, human="X")
    session.human_move(5)
    # the model (O) is shown itself as X: the human's X on 5 appears as an O
    assert render_board("....O....") in user_text(model)
    session.human_move(9)
    assert render_board("X...O...O") in user_text(model)  # board "O...X...X", swapped
    assert session.board == "OO..X...X" and session.status == "human_to_move"
    assert swap_marks("XO.OX") == "OX.XO"


def test_the_model_wins_and_a_draw():
    session = PlaySession(ScriptedModel([1, 2, 3]), human="O")  # the model is X
    session.model_move()
    session.human_move(4)
    session.human_move(5)
    assert session.status == "model_won" and session.board == "XXXOO...."
    draw = PlaySession(ScriptedModel([2, 4, 9, 7]), human="X")
    for square in (1, 3, 5, 6, 8):
        draw.human_move(square)
    assert draw.status == "draw" and draw.board == "XOXOXXOXO"


@pytest.mark.parametrize(
    ("answer", "reason"), [(1, "occupied"), (12, "out_of_range"), ("no call", "bad_json")]
)
def test_an_illegal_answer_forfeits(answer, reason):
    session = PlaySession(ScriptedModel([answer]), human="X")
    turn = session.human_move(1)
    assert turn is not None and not turn.legal and turn.reason == reason
    assert session.status == "model_forfeit" and session.board == "X........"
    assert session.to_dict()["turns"][0]["reason"] == reason
    with pytest.raises(PlayError, match="game is over"):
        session.human_move(2)


def test_the_humans_bad_moves_are_refused_and_change_nothing():
    model = ScriptedModel([5])
    session = PlaySession(model, human="X")
    for square in (0, 10, "a", True, None, 2.0):
        with pytest.raises(PlayError, match="expected a number 1-9"):
            session.human_move(square)
    session.human_move(1)
    with pytest.raises(PlayError, match="square 5 is taken; empty squares: 2, 3, 4, 6, 7, 8, 9"):
        session.human_move(5)
    with pytest.raises(PlayError, match="it is your turn"):
        session.model_move()
    assert session.board == "X...O...." and len(model.calls) == 1
    waiting = PlaySession(ScriptedModel([]), human="O")
    with pytest.raises(PlayError, match="the model's turn"):
        waiting.human_move(1)


def test_variants_seed_and_temperature_reach_the_model():
    model = ScriptedModel([5, 6], variants=("trained", "baseline"))
    assert PlaySession(model).variant == "trained"  # a run's default: the trained model
    session = PlaySession(model, human="x", variant="baseline", temperature=0.7, seed=10)
    session.human_move(1)
    session.human_move(2)
    assert [(c["variant"], c["seed"], c["temperature"]) for c in model.calls] == [
        ("baseline", 11, 0.7),
        ("baseline", 13, 0.7),
    ]
    assert session.to_dict()["turns"][0]["variant"] == "baseline"
    with pytest.raises(PlayError, match="scripted has the variants base"):
        PlaySession(ScriptedModel([]), variant="trained")
    with pytest.raises(PlayError, match="--human Z"):
        PlaySession(ScriptedModel([]), human="Z")
    with pytest.raises(PlayError, match="--temperature -1"):
        PlaySession(ScriptedModel([]), temperature=-1)


# ============================================================================ terminal UI


def terminal(squares: list[Any], answers: list[str], human: str = "X") -> tuple[str, ScriptedModel]:
    model = ScriptedModel(squares)
    out = io.StringIO()
    console = Console(file=out, width=100, color_system=None)
    pending = list(answers)

    def ask(prompt: str) -> str:
        console.print(prompt, end="")
        if not pending:
            raise EOFError
        answer = pending.pop(0)
        console.print(answer)
        return answer

    play_in_terminal(lambda: PlaySession(model, human=human), console, ask)  # type: ignore[arg-type]
    return out.getvalue(), model


def test_terminal_game_shows_board_calls_errors_and_result():
    out, _ = terminal([4, 5, 1], ["1", "x", "1", "2", "3", "y", "q"])
    assert "model (O) tool call:" in out and '"square": 4' in out and "the model plays 4" in out
    assert "expected a number 1-9" in out and "square 1 is taken" in out
    assert "You win." in out and out.count("play again? (y/n)") == 1
    assert out.rstrip().endswith("bye")  # q in the second game
    assert "│ X │ X │ X │" in out  # the rich board, marks in place


def test_terminal_model_first_forfeit_and_end_of_input():
    out, model = terminal([5, 5], ["1"], human="O")
    assert len(model.calls) == 2 and "illegal move (occupied): the model forfeits" in out
    assert "The model made an illegal move and forfeits: you win." in out
    assert out.rstrip().endswith("bye")  # input ran out at "play again?"


# ============================================================================ the CLI, tiny-random


@pytest.fixture(scope="module")
def runner():
    return CliRunner(env=ENV)


def test_cli_refuses_bad_options_before_loading_a_model(runner):
    res = runner.invoke(app, ["play", "no-such-model-anywhere", "--human", "Z"])
    assert res.exit_code == 2 and "--human Z: expected X" in res.output
    res = runner.invoke(app, ["play", "no-such-model-anywhere", "--variant", "best"])
    assert res.exit_code == 2 and "--variant best: expected trained or baseline" in res.output


@pytest.mark.parametrize("human", ["X", "O"])
def test_cli_plays_a_whole_game_against_tiny_random(runner, human):
    # the human tries every square in order (refused ones are asked again); whatever the
    # model answers, the game ends, and the next line answers "play again?" with no
    script = "\n".join(str(s) for s in range(1, 10)) + "\nn\n"
    res = runner.invoke(app, ["play", "tiny-random", "--human", human], input=script)
    assert res.exit_code == 0, res.output
    assert res.output.count("tool call:") >= 1 and "choose_square" in res.output
    assert sum(text in res.output for text in END_TEXTS) == 1, res.output
    assert "play again? (y/n)" in res.output


def test_cli_plain_model_has_no_trained_variant(runner):
    res = runner.invoke(app, ["play", "tiny-random", "--variant", "trained"], input="q\n")
    assert res.exit_code == 2 and "tiny-random has the variants base" in res.output
