"""Progress: the phase lines and bars a run shows, and the episode counts that rollouts
report to them as episodes end (without changing a single token)."""

from __future__ import annotations

import io
import re
import time

import pytest
from rich.console import Console

from looprl.agents import AgentResult, run_agents
from looprl.engine import SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeGame, TicTacToeMove
from looprl.loop.progress import Progress, duration, remaining
from looprl.loop.rollout import run_episodes
from tests.test_agents import PARAMS, ScriptedAgentEnv, ask
from tests.test_rollout import ScriptedEngine, encode, lowest_legal


def captured(terminal: bool = False, quiet: bool = False) -> tuple[Progress, io.StringIO]:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=terminal, width=200, color_system=None)
    return Progress(quiet=quiet, console=console), buffer


# ------------------------------------------------------------------ display


def test_phases_write_a_start_a_count_and_a_closing_line_when_not_a_terminal():
    progress, buffer = captured()
    progress.note("looprl run: header")
    with progress.phase("baseline eval", total=3, unit="episode") as phase:
        for n in (1, 2, 3):
            phase.update(n)  # faster than PLAIN_EVERY_S: the 2nd count line is left out
        phase.done("reward +0.500 [+0.100, +0.900]")
    with progress.phase("training", total=2, unit="step") as phase:
        phase.update(advance=1, detail="step 1 · reward +0.1")
        phase.update(advance=1, detail="step 2 · reward +0.2")
    with progress.phase("one more", total=1, unit="step") as phase:
        phase.update(1)
    lines = buffer.getvalue().splitlines()
    assert "\r" not in buffer.getvalue()  # a log gets whole lines, never a redrawn bar
    assert lines[0] == "looprl run: header"
    assert lines[1] == "▶ baseline eval (3 episodes)"
    assert re.fullmatch(r"  baseline eval · 1/3 episodes · ETA \d+\.\d s", lines[2])
    assert lines[3] == "  baseline eval · 3/3 episodes"  # the last: nothing left, no ETA
    assert lines[4].startswith("✓ baseline eval: reward +0.500 [+0.100, +0.900] (")
    assert lines[5] == "▶ training (2 steps)"
    assert re.fullmatch(
        r"  training · 1/2 steps · step 1 · reward \+0\.1 · ETA \d+\.\d s", lines[6]
    )
    assert lines[7] == "  training · 2/2 steps · step 2 · reward +0.2"
    # without an explicit summary the closing line says how far it got and the last detail
    assert lines[8].startswith("✓ training: 2/2 steps · step 2 · reward +0.2 (")
    assert lines[9:] == ["▶ one more (1 step)", "  one more · 1/1 step", lines[11]]
    assert lines[11].startswith("✓ one more: 1/1 step (")
    assert len(lines) == 12


def test_count_lines_come_once_per_unit_when_units_are_slow_and_at_most_every_few_seconds():
    progress, buffer = captured()
    progress.every = 0.0  # as if each step took longer than PLAIN_EVERY_S
    with progress.phase("training", total=4, unit="step") as phase:
        for _ in range(4):
            phase.update(advance=1)
            phase.update(advance=0, detail="same count: no second line")
    counts = [x for x in buffer.getvalue().splitlines() if x.startswith("  ")]
    assert [x.split(" · ")[1] for x in counts] == [f"{n}/4 steps" for n in (1, 2, 3, 4)]

    progress, buffer = captured()
    with progress.phase("eval", total=200, unit="episode") as phase:
        for n in range(1, 201):
            phase.update(n)
    counts = [x for x in buffer.getvalue().splitlines() if x.startswith("  ")]
    assert [x.split(" · ")[1] for x in counts] == ["1/200 episodes", "200/200 episodes"]


def test_a_resumed_phase_counts_its_earlier_units_but_times_only_its_own():
    progress, buffer = captured()
    with progress.phase("training", total=10, unit="step", start=8) as phase:
        assert phase.eta() == ""  # no step of this process yet: no pace to go by
        time.sleep(0.2)
        phase.update(advance=1)
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "▶ training (10 steps)"
    seconds = float(re.fullmatch(r"  training · 9/10 steps · ETA (\S+) s", lines[1]).group(1))
    assert 0.2 <= seconds < 1.0  # one step of ~0.2 s to go, not 9 steps' worth


def test_episodes_played_together_show_no_eta_before_a_quarter_of_them_ended():
    progress, _ = captured()
    with progress.phase("eval", total=16, unit="episode", concurrent=True) as phase:
        shown = []
        for n in range(1, 17):
            phase.update(n)
            shown.append(phase.eta())
    assert shown[:3] == ["", "", ""] and shown[-1] == ""  # before 4 of 16, and after all
    assert all(re.fullmatch(r"ETA \d+\.\d s", eta) for eta in shown[3:-1])
    with progress.phase("eval", total=12, unit="episode", concurrent=True, start=4) as phase:
        phase.update(5)
        assert phase.eta() == ""  # a quarter of the 8 it plays is 2: 1 is not enough
        phase.update(6)
        assert phase.eta().startswith("ETA ")


def test_remaining_is_the_mean_pace_times_the_units_left():
    assert remaining(elapsed=30.0, done=3, left=7) == pytest.approx(70.0)
    assert remaining(elapsed=5.0, done=0, left=7) is None  # no pace before the first unit
    assert remaining(elapsed=5.0, done=7, left=0) is None  # nothing left
    assert [duration(remaining(600.0, 1, n)) for n in (1, 3, 30)] == ["10.0 min", "30.0 min",
                                                                      "5.0 h"]  # fmt: skip


def test_a_phase_left_by_an_error_writes_no_closing_line():
    progress, buffer = captured()
    with pytest.raises(RuntimeError), progress.phase("load model"):
        raise RuntimeError("no such model")
    assert buffer.getvalue().splitlines() == ["▶ load model"]


def test_quiet_writes_nothing_and_a_terminal_gets_a_live_bar():
    progress, buffer = captured(quiet=True)
    with progress.phase("final eval", total=2, unit="episode") as phase:
        phase.update(2)
    progress.note("nothing")
    assert buffer.getvalue() == ""

    progress, buffer = captured(terminal=True)
    assert progress.live
    with progress.phase("final eval", total=4, unit="episode") as phase:
        time.sleep(0.1)
        phase.update(3)
        phase.done("reward -0.250")
    text = buffer.getvalue()
    assert "3/4 episodes" in text  # the bar was drawn, then cleared
    assert re.search(r"3/4 episodes .*ETA 0\.\d s", text)  # one episode at ~0.03 s each
    assert "✓ final eval: reward -0.250 (" in text
    assert "▶" not in text  # the live line takes the start line's place


def test_duration_reads_naturally():
    assert [duration(s) for s in (3.21, 150, 9000)] == ["3.2 s", "2.5 min", "2.5 h"]


# ------------------------------------------------------------------ counts from rollouts


def test_rollout_reports_each_ended_episode_once_and_changes_nothing(tokenizer, renderer):
    make = lambda: TicTacToeGame(opponent="random", agent_plays="X")  # noqa: E731
    tasks = make().tasks("eval", n=5)
    params = SamplingParams(max_new_tokens=64, seed=3)
    counts: list[int] = []
    plain = run_episodes(
        tasks, make, ScriptedEngine(tokenizer, lowest_legal(tokenizer)), renderer, params, 5, 4096
    )
    shown = run_episodes(
        tasks, make, ScriptedEngine(tokenizer, lowest_legal(tokenizer)), renderer, params, 5, 4096,
        on_progress=counts.append,
    )  # fmt: skip
    assert counts == [1, 2, 3, 4, 5]
    assert [(e.token_ids, e.outcome, e.reward) for e in shown] == [
        (e.token_ids, e.outcome, e.reward) for e in plain
    ]


def test_the_hf_engine_reports_last_turns_before_its_batch_returns(tiny_model, tokenizer, renderer):
    """A single-turn eval is one `generate` call: without the engine's word, a bar
    would sit at 0 until every episode is back."""
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=2)
    tasks = TicTacToeMove().tasks("eval", n=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=0)
    returned = []
    generate = engine.generate

    def timed_generate(requests, p):
        out = generate(requests, p)
        returned.append(time.monotonic())
        return out

    engine.generate = timed_generate
    heard: list[tuple[int, float]] = []
    shown = run_episodes(
        tasks, TicTacToeMove, engine, renderer, params, 1, 2048,
        on_progress=lambda n: heard.append((n, time.monotonic())),
    )  # fmt: skip
    assert [n for n, _ in heard] == [1, 2, 3, 4, 5, 6]
    assert heard[0][1] < returned[0]  # heard while the batch was still being decoded
    plain = run_episodes(tasks, TicTacToeMove, engine, renderer, params, 1, 2048)
    assert [e.token_ids for e in shown] == [e.token_ids for e in plain]


def test_agent_rollouts_report_ended_episodes(tokenizer, renderer):
    async def picks(client, task):
        await ask(client)
        return AgentResult(1.0, "hit")

    engine = ScriptedEngine(tokenizer, lambda prompt: encode(tokenizer, "7"))
    tasks = ScriptedAgentEnv(picks).tasks("train", 3)
    counts: list[int] = []
    episodes = run_agents(
        tasks, lambda: ScriptedAgentEnv(picks), engine, renderer, PARAMS, 4, 2048,
        on_progress=counts.append,
    )  # fmt: skip
    assert counts == [1, 2, 3]
    assert [e.outcome for e in episodes] == ["hit"] * 3
