"""Bring-your-own agents beyond the async chat client: the Responses API through the
proxy, sync `openai.OpenAI` agents in threads, `n > 1`, and an openai-agents SDK agent.

Scripted-engine tests (fast) check tokens and batching; tiny-model tests run the SDK
example in-process and through the CLI.
"""

from __future__ import annotations

import asyncio
import json
import time
from itertools import count

import openai
import pytest

import looprl.agents.batching as batching
import looprl.agents.runner as agents
from examples.agents_sdk_agent import TicTacToeSDKAgent
from looprl.agents import AgentResult, run_agents
from looprl.engine import SamplingParams
from looprl.types import ENV_ERROR
from tests.test_agents import (
    ASK,
    PICK,
    CountingEngine,
    ScriptedAgentEnv,
    ask,
    converse,
    play,
    run_cli,
    sampled_mask,
)
from tests.test_rollout import ScriptedEngine, encode
from tests.toy_envs import PICK_TOOL

FLAT_PICK = {"type": "function", **PICK_TOOL["function"]}  # the Responses tool format


# ------------------------------------------------------------------ the Responses API


async def respond_turns(client, turns: int, how: str) -> list:
    """`converse` written with `responses.create`: the same conversation as chat calls."""
    items, new, seen, previous = [*ASK], [*ASK], [], None
    for k in range(turns):
        kwargs = dict(model="policy", tools=[FLAT_PICK], tool_choice="required")
        if how == "previous_id":
            kwargs.update(input=new, previous_response_id=previous)
        else:
            kwargs.update(input=items)
        if how == "stream":
            async with client.responses.stream(**kwargs) as stream:
                response = await stream.get_final_response()
        else:
            response = await client.responses.create(**kwargs)
        seen.append(response)
        (call,) = [item for item in response.output if item.type == "function_call"]
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": f"try {k + 2}"}
        new = [answer]
        items += [item.model_dump(exclude_none=True) for item in response.output] + new
        previous = response.id
    return seen


@pytest.mark.parametrize("how", ["items", "previous_id", "stream"])
def test_responses_calls_are_recorded_and_stitched_like_chat_calls(tokenizer, renderer, how):
    seen = []

    async def chat_agent(client, task):
        await converse(client, 3)
        return AgentResult(1.0, "hit")

    async def responses_agent(client, task):
        seen.extend(await respond_turns(client, 3, how))
        return AgentResult(1.0, "hit")

    (reference,), _ = play(chat_agent, tokenizer, renderer)
    (episode,), _ = play(responses_agent, tokenizer, renderer)
    assert "token_mismatch" not in episode.info, episode.info
    assert episode.info["calls"] == episode.info["trajectory_calls"] == 3
    assert episode.token_ids == reference.token_ids
    assert episode.loss_mask == reference.loss_mask == sampled_mask(episode)
    assert [m.role for m in episode.messages] == [m.role for m in reference.messages]
    (call,) = seen[0].output
    assert call.type == "function_call" and json.loads(call.arguments) == {"n": 7}
    assert seen[0].usage.input_tokens == len(episode.turns[0].prompt_ids)
    assert seen[0].usage.output_tokens == len(episode.turns[0].completion_ids)


def test_responses_errors_reach_the_agent_as_openai_errors(tokenizer, renderer):
    errors = {}

    async def agent(client, task):
        for name, kwargs in {
            "chat tool": {"tools": [PICK_TOOL]},
            "unknown id": {"previous_response_id": "resp_nope"},
            "stop": {"extra_body": {"stop": ["x"]}},  # no Responses field: ignored
        }.items():
            try:
                await client.responses.create(model="policy", input="Pick.", **kwargs)
            except openai.BadRequestError as err:
                errors[name] = err
        return AgentResult(1.0, "hit")

    (episode,), _ = play(agent, tokenizer, renderer)
    assert errors["chat tool"].param == "tools[0].name"
    assert errors["unknown id"].param == "previous_response_id"
    assert "stop" not in errors and episode.info["calls"] == 1


# ------------------------------------------------------------------ sync clients


class SyncAgentEnv(ScriptedAgentEnv):
    """An agent env whose `run_agent` is a plain function: it gets an openai.OpenAI."""

    def run_agent(self, client, task):
        return self.agent(client, task)


def sync_converse(client, turns: int) -> None:
    """`converse` with a sync client."""
    messages = list(ASK)
    for k in range(turns):
        response = client.chat.completions.create(
            model="policy", messages=messages, tools=[PICK_TOOL], tool_choice="required"
        )
        reply = response.choices[0].message
        messages += [
            reply.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": f"try {k + 2}"},
        ]


def play_sync(agent, tokenizer, renderer, n=1, engine=None):
    engine = engine or ScriptedEngine(tokenizer, lambda prompt: encode(tokenizer, PICK))
    tasks = SyncAgentEnv(agent).tasks("train", n)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)
    return run_agents(tasks, lambda: SyncAgentEnv(agent), engine, renderer, params, 4, 2048)


def test_a_sync_agent_gets_an_openai_client_and_the_same_tokens(tokenizer, renderer):
    kinds = []

    def agent(client, task):
        kinds.append(type(client))
        sync_converse(client, 3)
        return AgentResult(1.0, "hit")

    async def async_agent(client, task):
        await converse(client, 3)
        return AgentResult(1.0, "hit")

    (episode,) = play_sync(agent, tokenizer, renderer)
    (reference,), _ = play(async_agent, tokenizer, renderer)
    assert kinds == [openai.OpenAI]
    assert episode.outcome == "hit" and "token_mismatch" not in episode.info
    assert episode.token_ids == reference.token_ids
    assert episode.loss_mask == reference.loss_mask == sampled_mask(episode)


def test_sync_agents_in_threads_share_engine_calls(tokenizer, renderer, monkeypatch):
    """Each batch is sent once every agent thread waits for its reply, not on a timeout."""
    monkeypatch.setattr(batching, "BATCH_WAIT_S", 30.0)

    def agent(client, task):
        sync_converse(client, 1)
        time.sleep(0.01 * task.data["i"])  # a little work between calls
        sync_converse(client, 2)
        return AgentResult(1.0, "hit")

    engine = CountingEngine(tokenizer, lambda prompt: encode(tokenizer, PICK))
    start = time.monotonic()
    episodes = play_sync(agent, tokenizer, renderer, n=6, engine=engine)
    assert time.monotonic() - start < 20  # no batch waited out BATCH_WAIT_S
    assert all(e.outcome == "hit" for e in episodes)
    assert engine.batch_sizes() == [6, 6, 6]


def test_sync_agent_errors_end_only_their_episode(tokenizer, renderer, monkeypatch):
    monkeypatch.setattr(agents, "EPISODE_TIMEOUT_S", 2.0)

    def agent(client, task):
        client.responses.create(model="policy", input="Pick.", tools=[FLAT_PICK])
        i = task.data["i"]
        if i == 1:
            raise ValueError("agent bug")
        if i == 2:
            time.sleep(4)  # past the timeout: left behind, its episode ends
        if i == 3:
            return ask(client)  # a coroutine from a sync agent
        return AgentResult(1.0, "hit")

    episodes = play_sync(agent, tokenizer, renderer, n=4)
    assert [e.outcome for e in episodes] == ["hit", ENV_ERROR, ENV_ERROR, ENV_ERROR]
    assert "ValueError: agent bug" in episodes[1].error
    assert "still running after" in episodes[2].error
    assert "declare it `async def run_agent`" in episodes[3].error
    assert episodes[0].info["calls"] == 1


# ------------------------------------------------------------------ n > 1


def numbered_engine(tokenizer) -> CountingEngine:
    """Each request's reply picks the next number: 1, 2, 3, ..."""
    numbers = count(1)
    reply = '<tool_call>\n{{"name": "pick", "arguments": {{"n": {}}}}}\n</tool_call>'
    return CountingEngine(tokenizer, lambda prompt: encode(tokenizer, reply.format(next(numbers))))


@pytest.mark.parametrize("continued", [0, 2])
def test_n_samples_are_returned_and_choice_0_is_trained(tokenizer, renderer, continued):
    seen = []

    async def agent(client, task):
        response = await ask(client, n=3)
        seen.append(response)
        reply = response.choices[continued].message
        call = reply.tool_calls[0]
        messages = [*ASK, reply.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "try again"}]  # fmt: skip
        await ask(client, messages)
        return AgentResult(1.0, "hit")

    engine = numbered_engine(tokenizer)
    (episode,), _ = play(agent, tokenizer, renderer, engine=engine)
    (response,) = seen
    picks = [json.loads(c.message.tool_calls[0].function.arguments)["n"] for c in response.choices]
    assert picks == [1, 2, 3] and [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.tool_calls[0].id for c in response.choices}) == 3
    first = episode.turns[0]
    assert response.usage.completion_tokens == 3 * len(first.completion_ids)
    assert engine.batch_sizes() == [3, 1]  # the n samples share one engine call
    assert episode.info["calls"] == 2 and episode.loss_mask == sampled_mask(episode)
    assert '"n": 1' in tokenizer.decode(first.completion_ids)  # choice 0 is recorded
    if continued == 0:
        assert "token_mismatch" not in episode.info
        assert episode.info["trajectory_calls"] == 2
    else:
        assert "continues choice 2 of call 0" in episode.info["token_mismatch"]["reason"]
        assert episode.info["trajectory_calls"] == 1
        assert episode.token_ids == first.prompt_ids + first.completion_ids


# ------------------------------------------------------------------ openai-agents SDK


def test_the_agents_sdk_example_plays_whole_games(engine, renderer):
    tasks = TicTacToeSDKAgent().tasks("eval", n=6)
    params = SamplingParams(temperature=1.0, max_new_tokens=48, seed=3)
    episodes = run_agents(tasks, TicTacToeSDKAgent, engine, renderer, params, 5, 2048)
    assert all(e.outcome in TicTacToeSDKAgent.outcomes for e in episodes), [
        e.error for e in episodes
    ]
    assert max(e.info["calls"] for e in episodes) >= 2  # multi-call games happened
    for episode in episodes:
        assert "token_mismatch" not in episode.info
        assert episode.info["trajectory_calls"] == episode.info["calls"]
        assert sum(episode.loss_mask) > 0 and episode.loss_mask == sampled_mask(episode)
        tool_results = [m for m in episode.messages if m.role == "tool"]
        assert all(m.content.startswith(("You played", "Illegal move")) for m in tool_results)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, renderer):
    from looprl.engine.hf import HFEngine

    return HFEngine(tiny_model, tokenizer, renderer.eos_ids)


def test_the_agents_sdk_example_trains_through_the_cli(tmp_path):
    run = tmp_path / "run"
    run_cli("examples.agents_sdk_agent:TicTacToeSDKAgent", run)
    for name in ("config.yaml", "eval/baseline.json", "eval/final.json", "report.md"):
        assert (run / name).is_file(), name
    final = json.loads((run / "eval" / "final.json").read_text())
    assert final["n"] == 2 and set(final["outcomes"]) <= set(TicTacToeSDKAgent.outcomes)
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert row["rollout/token_mismatch"] == 0 and row["rollout/env_errors"] == 0
    assert row["response_len"] > 0  # sampled, loss-masked tokens were trained on
    samples = [json.loads(line) for f in (run / "samples").glob("*.jsonl") for line in f.open()]
    assert any(m["role"] == "tool" for s in samples for m in s["messages"])


def test_run_agents_works_inside_a_running_event_loop(tokenizer, renderer):
    """Sync agents too, when run_agents is itself called from an event loop (a notebook)."""

    def agent(client, task):
        sync_converse(client, 1)
        return AgentResult(1.0, "hit")

    async def main():
        return play_sync(agent, tokenizer, renderer, n=2)

    assert [e.outcome for e in asyncio.run(main())] == ["hit", "hit"]


def test_the_sync_client_refuses_to_block_the_event_loop(renderer):
    """Called on the rollout's loop, it would wait for that very loop: an error instead."""
    from looprl.agents.proxy import AgentSession
    from looprl.agents.sync_proxy import sync_openai_client

    async def main():
        session = AgentSession(renderer, None, max_turns=1, max_episode_tokens=64,
                               max_new_tokens=8)  # fmt: skip
        with sync_openai_client(session, asyncio.get_running_loop()) as client:
            client.models.list()

    with pytest.raises(RuntimeError, match="called from the rollout's event loop"):
        asyncio.run(asyncio.wait_for(main(), 10))
