"""Tic-tac-toe: exact minimax, move scoring, task pools and both environments end to end."""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

import pytest

from looprl.envs.base import Environment, demonstrations
from looprl.envs.builtin.tictactoe import (
    CHOOSE_SQUARE_TOOL,
    EMPTY_BOARD,
    ENVIRONMENTS,
    TicTacToeGame,
    TicTacToeMove,
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
    winner,
    winning_moves,
)
from looprl.errors import EnvError
from looprl.types import PARSE_FAILURES, Message, Task, ToolCall

N_POSITIONS = 2423  # unfinished, X to move, reachable from the empty board


# ------------------------------------------------------------------ exhaustive minimax


def _reachable() -> set[str]:
    seen, stack = set(), [EMPTY_BOARD]
    while stack:
        board = stack.pop()
        if board not in seen:
            seen.add(board)
            stack.extend(play(board, m, to_move(board)) for m in legal_moves(board))
    return seen


REACHABLE = _reachable()


def _result(board: str, player: str) -> int | None:
    """Final result for `player` if the game is over: +1 / 0 / -1, else None."""
    won = winner(board)
    if won is not None:
        return 1 if won == player else -1
    return 0 if "." not in board else None


def _solve(board: str, memo: dict[str, int]) -> int:
    """Independent plain negamax: value for the player to move."""
    if board not in memo:
        done = _result(board, to_move(board))
        if done is not None:
            memo[board] = done
        else:
            p = to_move(board)
            memo[board] = max(-_solve(play(board, m, p), memo) for m in legal_moves(board))
    return memo[board]


def test_reachable_position_count() -> None:
    assert len(REACHABLE) == 5478  # the well-known count of legal tic-tac-toe positions


def test_best_moves_match_independent_solver() -> None:
    memo: dict[str, int] = {}
    for board in REACHABLE:
        p = to_move(board)
        moves = legal_moves(board)
        values = {m: -_solve(play(board, m, p), memo) for m in moves}
        top = max(values.values(), default=None)
        assert best_moves(board, p) == [m for m in moves if values[m] == top], board


def test_minimax_player_never_does_worse_than_the_game_value() -> None:
    """Every best move x every opponent reply, from every reachable unfinished position."""
    solved: dict[str, int] = {}
    worst: dict[tuple[str, str], int] = {}

    def worst_case(board: str, me: str) -> int:
        key = (board, me)
        if key not in worst:
            done = _result(board, me)
            if done is not None:
                worst[key] = done
            elif to_move(board) == me:
                worst[key] = min(worst_case(play(board, m, me), me) for m in best_moves(board, me))
            else:
                worst[key] = min(
                    worst_case(play(board, m, other(me)), me) for m in legal_moves(board)
                )
        return worst[key]

    checked = 0
    for board in REACHABLE:
        if _result(board, "X") is None:
            me = to_move(board)
            value = _solve(board, solved)
            assert worst_case(board, me) == value, board
            checked += 1
    assert checked > 4000
    assert worst_case(EMPTY_BOARD, "X") == 0 and worst_case(play(EMPTY_BOARD, 5, "X"), "O") == 0


def test_minimax_vs_minimax_always_draws() -> None:
    results: set[int] = set()
    seen: set[str] = set()
    stack = [EMPTY_BOARD]
    while stack:
        board = stack.pop()
        if board in seen:
            continue
        seen.add(board)
        done = _result(board, "X")
        if done is not None:
            results.add(done)
        else:
            stack.extend(play(board, m, to_move(board)) for m in best_moves(board, to_move(board)))
    assert results == {0}


# ------------------------------------------------------------------------ board helpers


def test_winner_legal_moves_to_move() -> None:
    assert winner(EMPTY_BOARD) is None
    assert winner("XXXOO....") == "X"
    assert winner("XX.OOOX.X") == "O"
    assert winner("O.XOX.X..") == "X"  # anti-diagonal
    assert winner("XOXXOOOXX") is None  # full board, draw
    assert legal_moves(EMPTY_BOARD) == list(range(1, 10))
    assert legal_moves("X...O...X") == [2, 3, 4, 6, 7, 8]
    assert legal_moves("XXXOO....") == []  # game over
    assert to_move(EMPTY_BOARD) == "X" and to_move("X........") == "O"
    assert to_move("XO.......") == "X"


def test_score_move() -> None:
    assert score_move("XX.OO....", 3) == 1.0  # immediate win
    assert score_move("XX.OO....", 7) == 0.0  # lets O win at 6
    # O threatens 3, X has no threat: blocking is the only optimal move.
    assert best_moves("OO.X...X.", "X") == [3]
    assert score_move("OO.X...X.", 3) == 0.8
    assert score_move("OO.X...X.", 9) == 0.0
    assert score_move(EMPTY_BOARD, 5) == 0.8  # every opening draws
    for bad in (None, 0, 10, -3, "5", 5.0, True, 1):  # square 1 is occupied
        assert score_move("OO.X...X.", bad) == -1.0


def test_expert_move_prefers_immediate_win() -> None:
    board = "X.XOO.X.O"  # X wins at 2 now; other moves may also win later
    assert expert_move(board, "X") == 2
    assert expert_move("OO.X...X.", "X") == 3


def test_render_board() -> None:
    expected = " X | 2 | O\n---+---+---\n 4 | X | 6\n---+---+---\n O | 8 | 9"
    assert render_board("X.O.X.O..") == expected


def test_render_lines() -> None:
    text = render_lines("X.O.X.O..")
    assert text.splitlines() == [
        "row 1: X 2 O",
        "row 2: 4 X 6",
        "row 3: O 8 9",
        "column 1: X 4 O",
        "column 2: 2 X 8",
        "column 3: O 6 9",
        "diagonal 1-5-9: X X 9",  # X wins on 9: two marks and a number on one line
        "diagonal 3-5-7: O X O",
    ]


def test_render_threats() -> None:
    assert render_threats("X.O.X.O..") == "diagonal 1-5-9: X X 9"  # X's win; O's 3-5-7 is full
    assert render_threats(".........") == "none"
    assert render_threats("XX.OO....") == "row 1: X X 3; row 2: O O 6"  # both sides, in line order
    # two of one mark and one of the other is dead: nothing to win or block there
    assert render_threats("XOX.O.X..") == "column 1: X 4 X; column 2: O O 8"
    assert render_threats("XXOOOXXOX") == "none"  # a full board


@pytest.mark.parametrize("cls", [TicTacToeMove, TicTacToeGame])
def test_board_view_threats(cls: type) -> None:
    plain, threats = cls(), cls(board_view="grid+threats")
    task = plain.tasks("eval", n=1)[0]
    a, b = plain.reset(task).messages[1].content, threats.reset(task).messages[1].content
    grid = a.split("\n\n")[1] if cls is TicTacToeGame else a.split("\n\n")[0]
    assert "Two in a line" not in a and grid in b and "\n\nTwo in a line: " in b
    if cls is TicTacToeGame:  # every tool result names the board's open twos
        for message in threats.demonstrations(task):
            result = threats.step(message)
            text = result.messages[0].content
            assert f"Two in a line: {render_threats(result.info['board'])}" in text
        assert result.done and result.outcome in ("win", "draw")
    with pytest.raises(EnvError, match="board_view"):
        cls(board_view="threats")


@pytest.mark.parametrize("cls", [TicTacToeMove, TicTacToeGame])
def test_board_view_lines(cls: type) -> None:
    plain, lined = cls(), cls(board_view="grid+lines")
    task = plain.tasks("eval", n=1)[0]
    a, b = plain.reset(task).messages[1].content, lined.reset(task).messages[1].content
    assert "Lines:" not in a and "row 1:" not in a
    grid = a.split("\n\n")[1] if cls is TicTacToeGame else a.split("\n\n")[0]
    assert grid in b and "\nLines:\nrow 1: " in b and "diagonal 3-5-7: " in b
    if cls is TicTacToeGame:  # every tool result shows the lines too; demos still replay
        for message in lined.demonstrations(task):
            result = lined.step(message)
            assert "diagonal 1-5-9: " in result.messages[0].content
        assert result.done and result.outcome in ("win", "draw")


def test_positions() -> None:
    everything = positions(N_POSITIONS)
    assert len(set(everything)) == N_POSITIONS
    assert EMPTY_BOARD in everything
    assert set(everything) == {
        b for b in REACHABLE if to_move(b) == "X" and winner(b) is None and "." in b
    }
    for b in everything:
        assert b.count("X") == b.count("O") and winner(b) is None and "." in b
    assert positions(100) == positions(100) == everything[:100]
    assert positions(100, seed=1) != positions(100)
    assert sorted(positions(N_POSITIONS, seed=1)) == sorted(everything)
    with pytest.raises(ValueError, match="2423"):
        positions(N_POSITIONS + 1)


def test_tool_schema() -> None:
    fn = CHOOSE_SQUARE_TOOL["function"]
    assert fn["name"] == "choose_square"
    assert fn["parameters"]["required"] == ["square"]
    assert fn["parameters"]["properties"]["square"]["maximum"] == 9


# ----------------------------------------------------------------------- move env


def _call(square: object, call_id: str | None = "c1") -> Message:
    return Message("assistant", tool_calls=[ToolCall("choose_square", {"square": square}, call_id)])


def test_registry_and_protocol() -> None:
    assert len(ENVIRONMENTS) == 2 and ENVIRONMENTS["tictactoe-move"] is TicTacToeMove
    assert ENVIRONMENTS["tictactoe-game"] is TicTacToeGame
    for cls in ENVIRONMENTS.values():
        env = cls()
        assert isinstance(env, Environment)
        assert env.name in ENVIRONMENTS and env.description


def test_move_tasks_splits_and_determinism() -> None:
    env = TicTacToeMove()
    ev, tr = env.tasks("eval"), env.tasks("train")
    assert len(ev) == 256 and len(tr) == 2048 - 256
    assert [t.data["board"] for t in ev] == positions()[:256]
    assert not {t.id for t in ev} & {t.id for t in tr}
    assert env.tasks("train", n=32, seed=3) == TicTacToeMove().tasks("train", n=32, seed=3)
    assert env.tasks("train", n=32, seed=3) != env.tasks("train", n=32, seed=4)
    assert len({t.id for t in env.tasks("eval", n=256, seed=9)}) == 256
    small = TicTacToeMove(eval_size=3, pool_size=10)
    counts = Counter(t.id for t in small.tasks("eval", n=7, seed=1))
    assert len(counts) == 3 and sorted(counts.values()) == [2, 2, 3]  # cycles evenly
    with pytest.raises(EnvError, match="split"):
        env.tasks("test")


def test_move_outcomes_all_reachable() -> None:
    env = TicTacToeMove()
    task = Task("t", {"board": "XX.OO...."})
    expected = {3: ("win", 1.0), 7: ("legal", 0.0), 4: ("illegal", -1.0)}
    for square, (outcome, reward) in expected.items():
        obs = env.reset(task)
        assert obs.tools == [CHOOSE_SQUARE_TOOL] and obs.tool_choice == "required"
        assert render_board("XX.OO....") in obs.messages[-1].content
        res = env.step(_call(square))
        assert (res.done, res.outcome, res.reward) == (True, outcome, reward)
        assert res.info["square"] == square and res.info["best_moves"] == [3]
    env.reset(Task("t", {"board": "OO.X...X."}))
    assert env.step(_call(3)).outcome == "optimal"
    for failure in PARSE_FAILURES:
        env.reset(task)
        res = env.step(Message("assistant", parse_failure=failure))
        assert (res.done, res.outcome, res.reward) == (True, failure, -1.0)
    env.reset(task)
    two = Message("assistant", tool_calls=[_call(3).tool_calls[0], _call(4).tool_calls[0]])
    assert env.step(two).outcome == "win"  # the first call counts
    env.reset(task)
    assert env.step(Message("assistant")).outcome == "no_tool_call"
    with pytest.raises(EnvError, match="step"):
        env.step(_call(3))  # episode already over


def test_move_demonstrations_are_optimal() -> None:
    env = TicTacToeMove()
    for task in env.tasks("eval") + env.tasks("train", n=200):
        (msg,) = demonstrations(env, task)
        env.reset(task)
        assert env.step(msg).reward >= 0.8


# ----------------------------------------------------------------------- game env


def _last_board(text: str) -> str:
    cells = re.findall(r"^ (\S) \| (\S) \| (\S)$", text, flags=re.MULTILINE)[-3:]
    return "".join(c if c in "XO" else "." for row in cells for c in row)


def _play(env: TicTacToeGame, task: Task, agent) -> tuple[list, object]:
    """Run one game with `agent(board, mark) -> square`; returns (all messages, last result)."""
    obs = env.reset(task)
    mark = task.data["agent"]
    transcript, board = list(obs.messages), _last_board(obs.messages[-1].content)
    for turn in range(env.max_turns):
        msg = _call(agent(board, mark), f"call-{turn}")
        res = env.step(msg)
        transcript += [msg, *res.messages]
        if res.done:
            return transcript, res
        (tool_msg,) = res.messages
        assert tool_msg.role == "tool" and tool_msg.tool_call_id == f"call-{turn}"
        board = _last_board(tool_msg.content)
    raise AssertionError("game did not end within max_turns")


def _lowest(board: str, mark: str) -> int:
    return legal_moves(board)[0]


def test_game_outcomes_all_reachable() -> None:
    seen = Counter()
    for opponent, agent in (("random", expert_move), ("minimax", expert_move)):
        env = TicTacToeGame(opponent=opponent)
        for task in env.tasks("eval"):
            _, res = _play(env, task, agent)
            seen[res.outcome] += 1
            assert res.outcome != "loss"  # the expert never loses
            if opponent == "minimax":
                assert res.outcome == "draw" and res.reward == 0.0
            assert res.messages and res.messages[0].role == "tool"  # the end is shown
            assert res.info["board"] == _last_board(res.messages[0].content)
    assert seen["win"] > 0
    env = TicTacToeGame(opponent="minimax", agent_plays="X")
    _, res = _play(env, env.tasks("eval")[0], _lowest)
    assert (res.outcome, res.reward) == ("loss", -1.0)
    assert winner(res.info["board"]) == "O"


def test_game_illegal_moves() -> None:
    env = TicTacToeGame(agent_plays="O")
    task = env.tasks("eval")[0]
    opened = env.reset(task)
    first = re.search(r"opened on (\d)", opened.messages[-1].content)
    res = env.step(_call(int(first.group(1))))
    assert (res.done, res.outcome, res.reward) == (True, "illegal", -1.0)
    assert res.info["failure"] == "occupied" and res.messages[0].tool_call_id == "c1"
    for square, failure in ((10, "out_of_range"), (0, "out_of_range"), ("5", "bad_arguments")):
        env.reset(task)
        res = env.step(_call(square))
        assert res.outcome == "illegal" and res.info["failure"] == failure
    for failure in PARSE_FAILURES:
        env.reset(task)
        res = env.step(Message("assistant", parse_failure=failure))
        assert (res.outcome, res.info["failure"], res.messages) == ("illegal", failure, [])


def test_game_move_rewards_grade_every_move_by_minimax() -> None:
    env = TicTacToeGame(opponent="minimax", agent_plays="X", move_rewards=True)
    assert env.gives_turn_rewards and not TicTacToeGame().gives_turn_rewards
    task = env.tasks("eval")[0]
    # the expert keeps the draw with every move: each graded best, the game a draw
    env.reset(task)
    grades = []
    while True:
        state = env._state
        res = env.step(_call(expert_move(state.board, state.agent)))
        grades.append((res.turn_reward, res.info["move_grade"]))
        if res.done:
            break
    assert grades == [(1.0, "best")] * len(grades) and res.outcome == "draw"
    assert res.reward == 0.0  # the episode's reward is still the game's result
    # an illegal move and a parse failure: -1, and the game is over
    env.reset(task)
    res = env.step(_call(10))
    assert (res.turn_reward, res.info["move_grade"], res.outcome) == (-1.0, "illegal", "illegal")
    env.reset(task)
    res = env.step(Message("assistant", parse_failure="bad_json"))
    assert res.turn_reward == -1.0 and res.reward == -1.0
    # without move_rewards nothing is graded
    plain = TicTacToeGame(opponent="minimax", agent_plays="X")
    plain.reset(task)
    res = plain.step(_call(5))
    assert res.turn_reward is None and "move_grade" not in res.info


def test_game_move_rewards_match_best_moves_and_find_blunders() -> None:
    # the highest free square on every move, as X and as O: a move is graded 1 iff it
    # keeps the mover's game value, else 0; some of these moves give the draw away
    env = TicTacToeGame(opponent="minimax", move_rewards=True)
    grades = Counter()
    for task in env.tasks("eval")[:8]:
        env.reset(task)
        while True:
            board, agent = env._state.board, env._state.agent
            square = legal_moves(board)[-1]
            res = env.step(_call(square))
            assert res.turn_reward == (1.0 if square in best_moves(board, agent) else 0.0)
            grades[res.turn_reward] += 1
            if res.done:
                break
    assert grades[1.0] > 0 and grades[0.0] > 0


def test_game_tasks_and_agent_marks() -> None:
    env = TicTacToeGame()
    ev = env.tasks("eval")
    assert [t.id for t in ev] == [f"game-eval-{i}" for i in range(64)]
    assert [t.data["agent"] for t in ev[:4]] == ["X", "O", "X", "O"]
    assert all(t.data["opponent"] == "mixed:0.5" for t in ev)
    tr = env.tasks("train", n=500, seed=0)
    assert len({t.id for t in tr}) == 500
    assert not {t.seed for t in ev} & {t.seed for t in tr}
    assert not {t.id for t in ev} & {t.id for t in tr}
    assert tr == TicTacToeGame().tasks("train", n=500, seed=0)
    assert tr != env.tasks("train", n=500, seed=1)
    assert env.tasks("eval", n=10, seed=5) == env.tasks("eval", n=10, seed=5)
    assert {t.data["agent"] for t in TicTacToeGame(agent_plays="O").tasks("eval")} == {"O"}
    with pytest.raises(EnvError, match="pass n"):
        env.tasks("train")


def test_game_replays_are_identical() -> None:
    env = TicTacToeGame(opponent="mixed:0.5")
    finals = set()
    for task in env.tasks("eval", n=16) + env.tasks("train", n=16, seed=2):
        a, res_a = _play(env, task, _lowest)
        b, res_b = _play(TicTacToeGame(opponent="mixed:0.5"), task, _lowest)
        assert a == b and res_a == res_b
        finals.add(res_a.info["board"])
    assert len(finals) > 1  # the opponent is not the same game every time


@pytest.mark.parametrize(
    ("cls", "kwargs", "needle"),
    [
        (TicTacToeGame, {"opponent": "smart"}, "opponent='smart'"),
        (TicTacToeGame, {"opponent": "mixed:1.5"}, "0 <= P <= 1"),
        (TicTacToeGame, {"opponent": "mixed:abc"}, "mixed:P"),
        (TicTacToeGame, {"opponent": "mix:minimax=0.5,random=0.6"}, "add up to 1"),
        (TicTacToeGame, {"opponent": "mix:minimax=0.5,expert=0.5"}, "minimax, random, snapshot"),
        (TicTacToeGame, {"opponent": "mix:minimax=half,random=0.5"}, "mix:NAME=SHARE"),
        (TicTacToeGame, {"opponent": "mix:minimax"}, "mix:NAME=SHARE"),
        (TicTacToeGame, {"agent_plays": "Z"}, "agent_plays='Z'.*X, O, alternate"),
        (TicTacToeGame, {"tool_choice": "sometimes"}, "tool_choice='sometimes'.*auto, required"),
        (TicTacToeGame, {"max_turns": 4}, "max_turns=4"),
        (TicTacToeGame, {"eval_size": 0}, "eval_size=0"),
        (TicTacToeMove, {"tool_choice": "sometimes"}, "tool_choice='sometimes'"),
        (TicTacToeMove, {"pool_size": 5000}, "pool_size=5000.*2423"),
        (TicTacToeMove, {"eval_size": 2048}, "eval_size=2048"),
        (TicTacToeMove, {"pool_seed": "x"}, "pool_seed='x'"),
        (TicTacToeMove, {"board_view": "lines"}, "board_view='lines'.*grid, grid\\+lines"),
        (TicTacToeGame, {"board_view": 3}, "board_view=3"),
        (TicTacToeGame, {"move_rewards": "yes"}, "move_rewards='yes'"),
    ],
)
def test_constructor_validation(cls: type, kwargs: dict, needle: str) -> None:
    with pytest.raises(EnvError, match=needle):
        cls(**kwargs)


def test_tool_choice_auto_and_custom_prompt() -> None:
    env = TicTacToeGame(tool_choice="auto", system_prompt="Be brief.")
    obs = env.reset(env.tasks("eval")[0])
    assert obs.tool_choice == "auto" and obs.messages[0].content == "Be brief."


def _demonstrated(env: TicTacToeGame, task: Task):
    """The task's game played through `env` with the env's demonstrations: the last step."""
    env.reset(task)
    for message in env.demonstrations(task):
        result = env.step(message)
    assert result.done
    return result


@pytest.mark.parametrize("opponent", ["random", "minimax", "mixed:0.5"])
def test_game_demonstrations_never_lose_and_draw_perfect_play(opponent):
    env = TicTacToeGame(opponent=opponent)
    outcomes = {_demonstrated(env, task).outcome for task in env.tasks("eval")}
    assert outcomes <= {"win", "draw"}
    if opponent == "minimax":
        assert outcomes == {"draw"}


def _vs_random(board: str, player: str, policy, memo: dict) -> Fraction:
    """Independent exact expected result (+1 / 0 / -1) for `player` playing `policy`
    against a uniformly random opponent."""
    key = board, player
    if key not in memo:
        done = _result(board, player)
        if done is not None:
            memo[key] = Fraction(done)
        elif to_move(board) == player:
            memo[key] = _vs_random(play(board, policy(board, player), player), player, policy, memo)
        else:
            moves = legal_moves(board)
            children = [play(board, m, other(player)) for m in moves]
            results = [_vs_random(child, player, policy, memo) for child in children]
            memo[key] = sum(results, Fraction(0)) / len(moves)
    return memo[key]


def test_exploit_move_plays_perfectly_for_the_random_opponents_mistakes() -> None:
    # X opened on an edge (8): O's best moves are 2, 5, 7 and 9. The minimax expert plays
    # the smallest, the far edge; the centre keeps the draw too and wins far more often.
    board = ".......X."
    assert best_moves(board, "O") == [2, 5, 7, 9] and expert_move(board, "O") == 2
    assert exploit_move(board, "O") == 5
    assert expected_result(play(board, 5, "O"), "O") == Fraction(33, 35)
    assert expected_result(play(board, 2, "O"), "O") == Fraction(22, 35)
    assert exploit_move("X.XOO.X.O", "X") == 2  # an immediate win first, as expert_move
    minimax_memo, exploit_memo = {}, {}
    for board in REACHABLE:
        if _result(board, "X") is not None:
            with pytest.raises(ValueError, match="finished board"):
                exploit_move(board, "X")
            continue
        p = to_move(board)
        square = exploit_move(board, p)
        # it never gives game value away, and against a perfect opponent it is the expert
        assert square in best_moves(board, p) or square in winning_moves(board, p)
        assert exploit_move(board, p, 1.0) == expert_move(board, p)
        # its expected result against random play: as computed by exploit_move, and never
        # below the minimax expert's (an independent evaluation of both policies)
        exploit = _vs_random(board, p, exploit_move, exploit_memo)
        assert exploit == expected_result(board, p)
        assert exploit >= _vs_random(board, p, expert_move, minimax_memo)
    openings = [play(EMPTY_BOARD, m, "X") for m in range(1, 10)]
    as_o = {name: sum(_vs_random(b, "O", f, memo) for b in openings) / 9
            for name, f, memo in (("minimax", expert_move, minimax_memo),
                                  ("exploit", exploit_move, exploit_memo))}  # fmt: skip
    assert as_o["exploit"] > as_o["minimax"] + Fraction(1, 10)  # 0.916 against 0.806
    with pytest.raises(ValueError, match="minimax_share"):
        exploit_move(EMPTY_BOARD, "X", 1.5)


def test_game_exploit_expert_wins_more_and_still_never_loses() -> None:
    """`expert: exploit` demonstrations on the 64 held-out games: more wins than the
    minimax expert's against the random opponent, never a loss; against perfect play the
    same games as the minimax expert's."""

    def play_out(env: TicTacToeGame, task: Task) -> tuple[str, tuple]:
        result = _demonstrated(env, task)
        return result.outcome, tuple(result.info["moves"])

    wins = {}
    for expert in ("minimax", "exploit"):
        env = TicTacToeGame(opponent="random", expert=expert)
        outcomes = Counter(play_out(env, task)[0] for task in env.tasks("eval"))
        assert set(outcomes) <= {"win", "draw"}
        wins[expert] = outcomes["win"]
    assert wins["exploit"] > wins["minimax"]
    for opponent in ("minimax", "mixed:0.5"):
        exploit = TicTacToeGame(opponent=opponent, expert="exploit")
        minimax = TicTacToeGame(opponent=opponent)
        games = [(play_out(exploit, t), play_out(minimax, t)) for t in exploit.tasks("eval")]
        assert all(e[0] in ("win", "draw") for e, _ in games)
        if opponent == "minimax":
            assert all(e == m for e, m in games)
    with pytest.raises(EnvError, match="expert"):
        TicTacToeGame(expert="greedy")


def test_minimax_opponent_is_not_memorisable() -> None:
    """The minimax opponent breaks its ties at random, seeded per episode: one fixed agent
    (the expert) meets many different games on the 64 held-out tasks, where a
    deterministic opponent would give exactly two (one per side the agent plays)."""
    env = TicTacToeGame(opponent="minimax")
    games = set()
    for task in env.tasks("eval"):
        games.add(tuple(_demonstrated(env, task).info["moves"]))
    assert len(games) >= 20  # 27 of 64 with the built-in seeds
    # the same task replays the same game: the variety comes from the seeds, not chance
    task = env.tasks("eval")[3]
    replays = {tuple(_demonstrated(env, task).info["moves"]) for _ in range(2)}
    assert len(replays) == 1


# ------------------------------------------------------------- the snapshot opponent


def test_opponent_shares() -> None:
    from looprl.envs.builtin.tictactoe import parse_opponent

    assert parse_opponent("snapshot") == {"minimax": 0.0, "random": 0.0, "snapshot": 1.0}
    assert parse_opponent("mixed:0.25") == {"minimax": 0.25, "random": 0.75, "snapshot": 0.0}
    assert parse_opponent("mix:minimax=0.5, snapshot=0.5") == {
        "minimax": 0.5, "random": 0.0, "snapshot": 0.5,
    }  # fmt: skip


def test_games_against_a_policy_snapshot() -> None:
    """The env asks the registered player for the opponent's moves, from the opponent's
    side, among the legal squares, with the game's random stream; train and eval games
    ask their own player; a mix keeps the other players' moves."""
    from looprl.envs.builtin.tictactoe import SnapshotPlayers

    asked = []

    def highest(split):
        def choose(messages, tools, legal, rng):
            asked.append((split, messages[-1].content, list(legal)))
            rng.random()
            return legal[-1]

        return choose

    env = TicTacToeGame(opponent="snapshot")
    assert env.plays_snapshot and not TicTacToeGame(opponent="mixed:0.5").plays_snapshot
    task = env.tasks("eval")[0]  # the agent plays X
    env.reset(task)
    with pytest.raises(EnvError, match="only `looprl run` provides"):
        env.step(_call(1, "c0"))
    try:
        SnapshotPlayers.set("eval", highest("eval"))
        SnapshotPlayers.set("train", highest("train"))
        _, res = _play(env, task, _lowest)
        # X plays 1, 2, 3 (lowest), the snapshot O plays 9, 8: X wins on the top row
        assert res.outcome == "win" and res.info["moves"] == [
            ("X", 1), ("O", 9), ("X", 2), ("O", 8), ("X", 3),
        ]  # fmt: skip
        assert {split for split, _, _ in asked} == {"eval"}
        first = asked[0][1]
        assert first.startswith("You play O.") and "Your move?" in first
        assert asked[0][2] == [2, 3, 4, 5, 6, 7, 8, 9]
        asked.clear()
        _play(env, env.tasks("train", n=1, seed=3)[0], _lowest)
        assert asked and {split for split, _, _ in asked} == {"train"}
        # half and half with minimax: the same coin decides who moves, so the minimax
        # moves of the mix are those of a pure minimax game up to the first snapshot move
        mix = TicTacToeGame(opponent="mix:minimax=0.5,snapshot=0.5")
        asked.clear()
        counts = Counter()
        for t in mix.tasks("eval", n=16):
            _, res = _play(mix, t, _lowest)
            counts[res.outcome] += 1
        assert 0 < len(asked) < 16 * 4  # some moves by the snapshot, not all
        # a player that answers an occupied square is the env's error, said plainly
        SnapshotPlayers.set("eval", lambda messages, tools, legal, rng: 10)
        env.reset(task)
        with pytest.raises(EnvError, match="chose 10, not one of"):
            env.step(_call(1, "c0"))
    finally:
        SnapshotPlayers.set("eval", None)
        SnapshotPlayers.set("train", None)
