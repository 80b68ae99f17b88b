"""Bring-your-own agents: OpenAI-client agents played through looprl's in-process proxy.

Scripted-engine tests (fast): stitching, token mismatches, errors, limits, the client's
view, batching. Tiny-model tests: the tic-tac-toe agent gives the built-in env's exact
tokens, an agent PickSeven learns, and the example runs through the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

import looprl.agents.batching as batching
import looprl.agents.runner as agents
import looprl.loop.train as train
from examples.tictactoe_agent import TicTacToeAgent
from looprl.agents import AgentResult, run_agents
from looprl.config import config_from_dict
from looprl.engine import SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeGame
from looprl.envs.check import check_env
from looprl.loop.rollout import run_episodes
from looprl.types import ENV_ERROR, TRUNCATED, Task
from tests.test_rollout import ScriptedEngine, encode
from tests.toy_envs import PICK_TOOL

ROOT = Path(__file__).resolve().parents[1]
PICK = '<tool_call>\n{"name": "pick", "arguments": {"n": 7}}\n</tool_call>'
AGENT_EXAMPLE = "examples.tictactoe_agent:TicTacToeAgent"
ASK = [{"role": "user", "content": "Pick a number from 1 to 9."}]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)


class ScriptedAgentEnv:
    """An agent env whose `run_agent` is the coroutine function given to it."""

    name = "scripted-agent"
    description = "test agent"
    outcomes = ("hit", "miss", "no_tool_call")
    reward_range = (-1.0, 1.0)
    max_turns = 4

    def __init__(self, agent) -> None:
        self.agent = agent

    def tasks(self, split, n=None, seed=0):
        return [Task(id=f"{split}-{i}", data={"i": i}, seed=i) for i in range(n or 4)]

    async def run_agent(self, client, task):
        return await self.agent(client, task)


def play(agent, tokenizer, renderer, n=1, text=PICK, max_turns=4, max_tokens=2048, engine=None):
    engine = engine or ScriptedEngine(tokenizer, lambda prompt: encode(tokenizer, text))
    tasks = ScriptedAgentEnv(agent).tasks("train", n)
    episodes = run_agents(
        tasks, lambda: ScriptedAgentEnv(agent), engine, renderer, PARAMS, max_turns, max_tokens
    )
    return episodes, engine


async def ask(client, messages=ASK, **kwargs):
    kwargs.setdefault("tools", [PICK_TOOL])
    kwargs.setdefault("tool_choice", "required")
    return await client.chat.completions.create(model="policy", messages=messages, **kwargs)


async def converse(client, turns: int, edit=None) -> list:
    """`turns` calls of one growing conversation; `edit(k, messages)` may tamper first."""
    messages, seen = list(ASK), []
    for k in range(turns):
        if edit is not None:
            messages = edit(k, messages)
        response = await ask(client, messages)
        reply = response.choices[0].message
        seen.append(reply)
        messages = messages + [
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": f"try {k + 2}"},
        ]
    return seen


def sampled_mask(episode) -> list[int]:
    """1 exactly at the positions of the trajectory calls' completion ids."""
    mask = [0] * len(episode.token_ids)
    for turn in episode.turns[: episode.info["trajectory_calls"]]:
        start = len(turn.prompt_ids)
        mask[start : start + len(turn.completion_ids)] = [1] * len(turn.completion_ids)
    return mask


# ------------------------------------------------------------------ stitching


def test_calls_of_one_conversation_stitch_into_one_trajectory(tokenizer, renderer):
    async def agent(client, task):
        await converse(client, 3)
        return AgentResult(1.0, "hit")

    (episode,), _ = play(agent, tokenizer, renderer)
    assert episode.outcome == "hit" and "token_mismatch" not in episode.info
    assert episode.info["calls"] == episode.info["trajectory_calls"] == 3
    last = episode.turns[-1]
    assert episode.token_ids == last.prompt_ids + last.completion_ids
    for before, after in zip(episode.turns, episode.turns[1:]):  # each prompt extends the last
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.completion_ids)] == (
            before.prompt_ids + before.completion_ids
        )
    assert episode.loss_mask == sampled_mask(episode)
    sampled = [lp for lp, m in zip(episode.logprobs, episode.loss_mask) if m]
    assert sampled == [lp for t in episode.turns for lp in t.completion_logprobs]
    roles = [m.role for m in episode.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_episodes_record_the_sampling_temperature(tokenizer, renderer):
    async def agent(client, task):
        await converse(client, 2)
        return AgentResult(1.0, "hit")

    engine = ScriptedEngine(tokenizer, lambda prompt: encode(tokenizer, PICK))
    env = ScriptedAgentEnv(agent)
    params = SamplingParams(temperature=0.3, max_new_tokens=64, seed=0)
    episodes = run_agents(env.tasks("train", 2), lambda: env, engine, renderer, params, 4, 2048)
    assert [e.temperature for e in episodes] == [0.3, 0.3]
    assert {used.temperature for _, used in engine.calls} == {0.3}


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, renderer):
    return HFEngine(tiny_model, tokenizer, renderer.eos_ids)


def test_tictactoe_agent_gives_the_builtin_envs_exact_tokens(engine, renderer):
    tasks = TicTacToeGame().tasks("eval", n=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3)
    builtin = run_episodes(tasks, TicTacToeGame, engine, renderer, params, 5, 2048)
    mine = run_agents(tasks, TicTacToeAgent, engine, renderer, params, 5, 2048)
    assert max(len(e.turns) for e in mine) >= 3  # multi-call games happened
    for ref, ep in zip(builtin, mine):
        assert ep.token_ids == ref.token_ids
        assert ep.loss_mask == ref.loss_mask == sampled_mask(ep)
        assert ep.logprobs == pytest.approx(ref.logprobs, abs=1e-5)  # float summation order
        assert (ep.outcome, ep.reward) == (ref.outcome, ref.reward)
        assert ep.token_ids == ep.turns[-1].prompt_ids + ep.turns[-1].completion_ids


# ------------------------------------------------------------------ token mismatch


def test_an_edited_history_is_a_counted_and_explained_mismatch(tokenizer, renderer):
    def edit(k, messages):
        if k == 1:  # rewrite the first user message before the second call
            return [{"role": "user", "content": "Pick a number from 1 to 10."}, *messages[1:]]
        return messages

    async def agent(client, task):
        await converse(client, 3, edit)
        return AgentResult(0.0, "miss")

    (episode,), _ = play(agent, tokenizer, renderer)
    mismatch = episode.info["token_mismatch"]
    assert mismatch["call"] == 1 and mismatch["message"] == 0
    assert "from 1 to 9" in mismatch["reason"] and "from 1 to 10" in mismatch["reason"]
    assert "9" in mismatch["expected"] and "10" in mismatch["got"]
    assert isinstance(mismatch["token"], int)
    # Trained on the consistent prefix only: the first call.
    first = episode.turns[0]
    assert episode.info["trajectory_calls"] == 1 and episode.info["calls"] == 3
    assert episode.token_ids == first.prompt_ids + first.completion_ids
    assert episode.loss_mask == sampled_mask(episode)
    # The third call continues the second, so it is still stitched token-in/token-out.
    second, third = episode.turns[1], episode.turns[2]
    assert third.prompt_ids[: len(second.prompt_ids) + len(second.completion_ids)] == (
        second.prompt_ids + second.completion_ids
    )


def test_a_retry_of_the_same_request_is_a_mismatch(tokenizer, renderer):
    async def agent(client, task):
        await ask(client)
        await ask(client)  # the reply of the first call is dropped
        return AgentResult(1.0, "hit")

    (episode,), _ = play(agent, tokenizer, renderer)
    assert "earlier point" in episode.info["token_mismatch"]["reason"]
    assert episode.info["trajectory_calls"] == 1


def test_token_mismatch_metric_counts_episodes(tmp_path, monkeypatch):
    counted = []
    real = train.MetricsLogger.log

    def log(self, metrics):
        counted.append(metrics["rollout/token_mismatch"])
        return real(self, metrics)

    monkeypatch.setattr(train.MetricsLogger, "log", log)
    cfg = {
        "model": {"name": "tiny-random", "lora": {"enabled": False}},
        "env": {"name": "tests.test_agents:RetryingAgent"},
        "rollout": {"tasks_per_step": 2, "group_size": 2, "max_new_tokens": 24},
        "train": {"steps": 1, "checkpoint_every": 0},
        "eval": {"tasks": 2},
        "logging": {"tensorboard": False},
    }
    train.run_training(config_from_dict(cfg), tmp_path / "run")
    assert counted == [4]


class RetryingAgent(ScriptedAgentEnv):
    """Every episode asks twice with the same messages: one mismatch each."""

    def __init__(self) -> None:
        super().__init__(self.retry)

    @staticmethod
    async def retry(client, task):
        await ask(client)
        await ask(client)
        return AgentResult(0.0, "miss")


# ------------------------------------------------------------------ errors and limits


def test_agent_errors_and_bad_results_end_only_their_episode(tokenizer, renderer):
    async def agent(client, task):
        await ask(client)
        i = task.data["i"]
        if i == 0:
            raise ValueError("agent bug")
        return [AgentResult(1.0, "hit"), {"reward": 1}, AgentResult(5.0, "hit"),
                AgentResult(0.0, "bogus")][i]  # fmt: skip

    episodes, _ = play(agent, tokenizer, renderer, n=4)
    assert [e.outcome for e in episodes] == [ENV_ERROR, ENV_ERROR, ENV_ERROR, ENV_ERROR]
    crash, not_a_result, out_of_range, undeclared = (e.error for e in episodes)
    assert "Traceback" in crash and "ValueError: agent bug" in crash
    assert "must return looprl.agents.AgentResult" in not_a_result
    assert "outside the env's reward_range [-1.0, 1.0]" in out_of_range
    assert "'bogus' is not one of the env's outcomes" in undeclared
    assert all(not e.trainable for e in episodes)

    async def fine(client, task):
        return await agent(client, task) if task.data["i"] else AgentResult(1.0, "hit")

    episodes, _ = play(fine, tokenizer, renderer, n=2)
    assert episodes[0].outcome == "hit" and episodes[1].outcome == ENV_ERROR


def test_calls_past_the_limits_are_refused_and_truncate(tokenizer, renderer):
    errors = []

    async def agent(client, task):
        try:
            await converse(client, 3)
        except openai.BadRequestError as err:
            errors.append(err)
            if task.data["i"] == 0:
                raise  # unhandled: still truncated, not env_error
        return AgentResult(1.0, "hit")

    episodes, _ = play(agent, tokenizer, renderer, n=2, max_turns=2)
    assert [e.outcome for e in episodes] == [TRUNCATED, TRUNCATED]
    assert [e.reward for e in episodes] == [0.0, 1.0]
    assert all(e.info["calls"] == 2 for e in episodes)
    assert errors[0].code == "looprl_episode_limit" and "max_turns=2" in str(errors[0])

    limit = len(episodes[1].turns[1].prompt_ids)  # no room left for the second call
    (short,), _ = play(agent, tokenizer, renderer, max_tokens=limit)
    assert short.outcome == TRUNCATED and short.info["calls"] == 1
    assert f"max_episode_tokens={limit}" in short.info["truncated"]


def test_a_hung_agent_times_out_and_an_engine_failure_is_raised(tokenizer, renderer, monkeypatch):
    monkeypatch.setattr(agents, "EPISODE_TIMEOUT_S", 0.05)

    async def hangs(client, task):
        await ask(client)
        await asyncio.sleep(10)

    (episode,), _ = play(hangs, tokenizer, renderer)
    assert episode.outcome == ENV_ERROR and "still running after" in episode.error

    class Broken(ScriptedEngine):
        def generate(self, requests, params):
            raise RuntimeError("engine bug")

    async def asks(client, task):
        await ask(client)
        return AgentResult(1.0, "hit")

    # A generous timeout, so that a loaded machine cannot time the agents out first.
    monkeypatch.setattr(agents, "EPISODE_TIMEOUT_S", 60)
    with pytest.raises(RuntimeError, match="engine bug"):  # no agent's fault: not env_error
        play(asks, tokenizer, renderer, n=2, engine=Broken(tokenizer, None))


# ------------------------------------------------------------------ the client's view


def test_the_client_gets_openai_responses_and_openai_errors(tokenizer, renderer):
    seen = {}

    async def agent(client, task):
        response = await ask(client, logprobs=True)
        seen["response"] = response
        stream = await ask(client, stream=True)
        seen["chunks"] = [chunk async for chunk in stream]
        seen["models"] = [m.id async for m in client.models.list()]
        for name, kwargs in {
            "unknown tool": {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "no messages": {"messages": []},
            "bad role": {"messages": [{"role": "robot", "content": "hi"}]},
            "stop": {"stop": ["x"]},
        }.items():
            try:
                await ask(client, **kwargs)
            except openai.BadRequestError as err:
                seen[name] = err
        return AgentResult(1.0, "hit")

    (episode,), _ = play(agent, tokenizer, renderer)
    assert episode.outcome == "hit"
    choice = seen["response"].choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "pick" and call.id
    assert json.loads(call.function.arguments) == {"n": 7}
    assert len(choice.logprobs.content) == len(episode.turns[0].completion_ids)
    assert seen["response"].usage.prompt_tokens == len(episode.turns[0].prompt_ids)
    deltas = [c.choices[0].delta for c in seen["chunks"] if c.choices]
    assert any(d.tool_calls and d.tool_calls[0].function.name == "pick" for d in deltas)
    assert seen["models"] == ["looprl-policy"]
    assert "not one of the tools" in seen["unknown tool"].message
    assert seen["no messages"].param == "messages"
    assert seen["bad role"].status_code == 400
    assert seen["stop"].param == "stop"
    assert episode.info["calls"] == 2  # refused requests are no calls


# ------------------------------------------------------------------ batching


class CountingEngine(ScriptedEngine):
    def batch_sizes(self) -> list[int]:
        return [len(requests) for requests, _ in self.calls]


def test_concurrent_agents_share_engine_calls(tokenizer, renderer, monkeypatch):
    async def agent(client, task):
        await converse(client, 1)
        await asyncio.sleep(0.01 * task.data["i"])  # a little I/O between calls
        await converse(client, 2)
        return AgentResult(1.0, "hit")

    engine = CountingEngine(tokenizer, lambda prompt: encode(tokenizer, PICK))
    episodes, _ = play(agent, tokenizer, renderer, n=6, engine=engine)
    assert all(e.outcome == "hit" for e in episodes)
    assert engine.batch_sizes() == [6, 6, 6]
    seeds = [params.seed for _, params in engine.calls]
    assert seeds == [0, 7919, 2 * 7919]  # batch k is seeded like turn k of run_episodes

    # An agent slower than the wait guard does not hold the others back.
    monkeypatch.setattr(batching, "BATCH_WAIT_S", 0.02)

    async def slow(client, task):
        if task.data["i"] == 0:
            await asyncio.sleep(0.3)
        await converse(client, 1)
        return AgentResult(1.0, "hit")

    engine = CountingEngine(tokenizer, lambda prompt: encode(tokenizer, PICK))
    play(slow, tokenizer, renderer, n=4, engine=engine)
    assert engine.batch_sizes() == [3, 1]


# ------------------------------------------------------------------ training and the CLI


def test_agent_pick_seven_learns(tmp_path):
    from tests.test_learning import _config, _hit_rate

    cfg = _config(steps=16)
    cfg["env"]["name"] = "toy_envs:PickSevenAgent"
    result = train.run_training(config_from_dict(cfg), tmp_path / "run")
    early, late = _hit_rate(tmp_path / "run", 4, 4)
    assert late > early + 0.2, (early, late)
    assert result["final"]["reward_mean"] > result["baseline"]["reward_mean"] + 0.2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(r["rollout/token_mismatch"] == 0 for r in rows)


def run_cli(env_name: str, run: Path) -> None:
    """`looprl run` for one step of a tiny-random run on `env_name`, in a subprocess."""
    cmd = [
        sys.executable, "-m", "looprl.cli", "run", "--out", str(run),
        "--set", f"env.name={env_name}",
        "--set", "model.name=tiny-random", "--set", "train.steps=1",
        "--set", "rollout.tasks_per_step=2", "--set", "rollout.group_size=2",
        "--set", "rollout.max_new_tokens=48", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as conftest does: the model is tiny
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_tictactoe_agent_example_runs_through_the_cli(tmp_path):
    report = check_env("examples.tictactoe_agent:TicTacToeAgent", n=8)
    assert report.ok and "agent env" in report.checks[-1].name
    run = tmp_path / "run"
    run_cli("examples.tictactoe_agent:TicTacToeAgent", run)
    final = json.loads((run / "eval" / "final.json").read_text())
    assert final["n"] == 2 and set(final["outcomes"]) <= set(TicTacToeAgent.outcomes)
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert row["rollout/token_mismatch"] == 0 and row["rollout/env_errors"] == 0


def test_agent_envs_refuse_sft_and_envs_show_clearly(tmp_path):
    from typer.testing import CliRunner

    from looprl.cli import app

    runner = CliRunner()
    out = tmp_path / "run"
    sets = ["model.name=tiny-random", f"env.name={AGENT_EXAMPLE}", "sft.enabled=true"]
    sft = runner.invoke(app, ["run", "--out", str(out), *[x for s in sets for x in ("--set", s)]])
    assert sft.exit_code == 2 and "has no demonstrations" in sft.output
    assert not out.exists()
    show = runner.invoke(app, ["envs", "show", AGENT_EXAMPLE])
    assert show.exit_code == 2 and "agent environment" in show.output


def test_agent_calls_reuse_their_kv_between_calls(tiny_model, tokenizer, renderer):
    """The agent path keeps each agent's KV between its calls (an engine session): the
    same episodes as with a session-less engine, with far fewer positions prefilled."""
    tasks = TicTacToeGame().tasks("eval", n=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=5)

    class NoSession:
        def __init__(self, engine):
            self.generate = engine.generate

    results = {}
    for kept in (True, False):
        engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
        fed = [0]
        hook = tiny_model.register_forward_hook(
            lambda m, a, kw, out, fed=fed: fed.__setitem__(0, fed[0] + kw["input_ids"].numel()),
            with_kwargs=True,
        )
        try:
            runner = engine if kept else NoSession(engine)
            episodes = run_agents(tasks, TicTacToeAgent, runner, renderer, params, 5, 2048)
        finally:
            hook.remove()
        results[kept] = ([e.token_ids for e in episodes], fed[0], episodes)
    assert max(len(e.turns) for e in results[True][2]) >= 3
    assert results[True][0] == results[False][0]
    assert results[True][1] < 0.75 * results[False][1], (results[True][1], results[False][1])
