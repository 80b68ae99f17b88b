"""`looprl serve` beyond plain chat: `response_format`, `/v1/completions`,
`/v1/models/{id}`, `top_logprobs`, forced replies cut off by `max_tokens`, the
`max_tokens` limit, and token-by-token streaming. The real server, the official client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from tests.test_serve import HI, TOOLS, client_for, http

LIMIT = 600  # the server's --max-tokens-limit in these tests


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model("tiny-random", device="cpu")


@pytest.fixture(scope="module")
def url(model) -> Iterator[str]:
    with serving(create_app(model, max_tokens_limit=LIMIT)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url)


# ---------------------------------------------------------------- response_format


class Move(BaseModel):
    square: int = Field(ge=1, le=9)
    reason: Literal["win", "block", "centre", "other"]
    sure: bool
    note: str = Field(max_length=6)


def test_parse_returns_a_pydantic_object(client):
    reply = client.chat.completions.parse(
        model="tiny-random", messages=HI, response_format=Move, max_tokens=80, n=2, seed=4
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        move = choice.message.parsed
        assert isinstance(move, Move) and 1 <= move.square <= 9
        assert Move.model_validate_json(choice.message.content) == move


def test_json_object_and_schema_through_the_client(client):
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                       "n": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["tags", "n"],
        "additionalProperties": False,
    }  # fmt: skip
    reply = client.chat.completions.create(
        model="tiny-random", messages=HI, max_tokens=80, n=3, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "t", "schema": schema, "strict": True}},
    )  # fmt: skip
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    square = {
        "type": "object",
        "properties": {"square": {"type": "integer"}},
        "required": ["square"],
    }
    cut = client.chat.completions.create(
        model="tiny-random", messages=HI, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": square}},
    )  # fmt: skip
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and not choice.message.content
    assert "max_tokens=3" in choice.model_extra["looprl_error"]


def test_json_reply_or_a_tool_call_with_tool_choice_auto(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.chat.completions.create(
        model="tiny-random", messages=HI, tools=TOOLS, tool_choice="auto", max_tokens=64,
        n=4, seed=2, response_format={"type": "json_schema",
                                      "json_schema": {"name": "ok", "schema": schema}},
    )  # fmt: skip
    for choice in reply.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and not choice.message.content
        else:
            assert json.loads(choice.message.content) in ({"ok": True}, {"ok": False})


# ---------------------------------------------------------------- forced replies cut off


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_off_by_max_tokens_leaks_no_markup(client, stream):
    kwargs = dict(model="tiny-random", messages=HI, tools=TOOLS, tool_choice="required")
    if not stream:
        reply = client.chat.completions.create(**kwargs, max_tokens=3)
        (choice,) = reply.choices
        message, error = choice.message, choice.model_extra.get("looprl_error")
        content, calls, finish = message.content, message.tool_calls, choice.finish_reason
    else:
        content, calls, finish, error = "", None, None, None
        for chunk in client.chat.completions.create(**kwargs, max_tokens=3, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls = calls or choice.delta.tool_calls
                finish = finish or choice.finish_reason
                error = error or (choice.model_extra or {}).get("looprl_error")
    assert finish == "length" and not content and not calls
    assert "forced tool call" in error and "max_tokens=3" in error


def test_max_tokens_above_the_limit_is_refused(url, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=LIMIT + 1)
    message = err.value.body["message"]
    assert f"at most {LIMIT} tokens (the server's --max-tokens-limit)" in message
    status, body = http(
        f"{url}/v1/completions", {"model": "tiny-random", "prompt": "x", "max_tokens": LIMIT + 1}
    )
    assert status == 400 and body["error"]["param"] == "max_tokens"
    reply = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=LIMIT)
    assert reply.usage.completion_tokens <= LIMIT


# ---------------------------------------------------------------- models, logprobs


def test_models_retrieve(client):
    found = client.models.retrieve("tiny-random:base")
    assert found.id == "tiny-random:base" and found.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found"


def test_chat_top_logprobs_are_the_most_likely_tokens(client):
    reply = client.chat.completions.create(
        model="tiny-random", messages=HI, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=5,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for token in content:
        alternatives = [t.logprob for t in token.top_logprobs]
        assert len(alternatives) == 5 and alternatives == sorted(alternatives, reverse=True)
        # greedy: the sampled token is the most likely one, with the same logprob
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-5)


# ---------------------------------------------------------------- completions


@pytest.mark.parametrize(
    "prompt, prompts", [("Once upon", 1), (["Once", "Twice"], 2), ([1, 2, 3], 1),
                        ([[1, 2], [3, 4, 5]], 2)],
)  # fmt: skip
def test_completions_prompt_forms(client, prompt, prompts):
    reply = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=5, n=2, seed=1)
    assert reply.object == "text_completion"
    assert [c.index for c in reply.choices] == list(range(2 * prompts))
    assert reply.usage.completion_tokens <= 10 * prompts and reply.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=5, n=2, seed=1)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]


def test_completions_logprobs_echo_and_stop(client):
    reply = client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=8, logprobs=3, seed=5
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == reply.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
    echoed = client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=8, seed=5, echo=True
    )
    assert echoed.choices[0].text == "Hello" + choice.text
    stop = choice.text[3:6]
    cut = client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=8, seed=5, stop=[stop]
    )
    assert cut.choices[0].text == choice.text[: choice.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_echo_with_logprobs_scores_the_prompt(model, client):
    """An evaluation harness's way to score a text: the prompt's logprobs (echo) agree
    with the logprobs the engine recorded when it sampled those same tokens."""
    prompt = [1, 504, 3458, 314]
    (sampled,) = model.complete(prompt, max_tokens=4, temperature=0)
    ids = prompt + sampled.completion_ids
    scored = client.completions.create(
        model="tiny-random", prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True
    ).choices[0]
    lp = scored.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.token_logprobs[len(prompt) : len(ids)] == pytest.approx(sampled.logprobs, abs=1e-3)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, -4]}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "stream"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({}, "prompt"),
    ],
)
def test_bad_completions_get_openai_errors(url, body, param):
    status, reply = http(f"{url}/v1/completions", {"model": "tiny-random", **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and "Traceback" not in reply["error"]["message"]


# ---------------------------------------------------------------- streaming


def test_text_deltas_hold_back_split_characters_and_stop_string_starts():
    from looprl.openai.streaming import TextDeltas

    def stream(text: str, stop: list[str]) -> list[str]:
        deltas = TextDeltas(lambda ids: bytes(ids).decode("utf-8", "replace"), stop)
        return [deltas.push(byte) for byte in text.encode()]  # one token per byte

    pieces = stream("aé€b", [])
    assert "".join(pieces) == "aé€b" and "\ufffd" not in "".join(pieces)
    assert pieces == ["a", "", "é", "", "", "€", "b"]
    pieces = stream("x<en", ["<end>"])  # "<en" may become the stop string: held back
    assert "".join(pieces) == "x"
    pieces = stream("x<e!<end>more", ["<end>"])  # "<e!" cannot: sent; the stop cuts the rest
    assert "".join(pieces) == "x<e!"


def test_chat_streams_tokens_before_the_reply_is_finished(client):
    start = time.monotonic()
    arrivals: list[tuple[float, str | None, str | None]] = []
    stream = client.chat.completions.create(
        model="tiny-random", messages=HI, max_tokens=60, seed=9, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            arrivals.append((time.monotonic() - start, choice.delta.content, choice.finish_reason))
    content = [t for t, text, _ in arrivals if text]
    finished = [t for t, _, finish in arrivals if finish]
    assert len(content) > 2 and finished
    assert content[0] < 0.5 * finished[0], arrivals  # tokens come while it is generated
    whole = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=60, seed=9)
    assert "".join(text for _, text, _ in arrivals if text) == whole.choices[0].message.content


def test_streaming_with_stop_strings_and_logprobs_matches_the_whole_reply(client):
    kwargs = dict(model="tiny-random", messages=HI, max_tokens=30, seed=3, logprobs=True)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = text[10:14]
    whole = client.chat.completions.create(**kwargs, stop=[stop])
    content, tokens = "", []
    for chunk in client.chat.completions.create(**kwargs, stop=[stop], stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            tokens += choice.logprobs.content if choice.logprobs else []
    assert content == whole.choices[0].message.content == text[: text.index(stop)]
    assert [t.logprob for t in tokens] == [t.logprob for t in whole.choices[0].logprobs.content]


def test_completions_stream_reassembles(client):
    kwargs = dict(model="tiny-random", prompt=["Hi", "Yo"], max_tokens=12, n=2, seed=8)
    whole = client.completions.create(**kwargs, logprobs=2)
    texts, logprob_tokens, finish = ["", "", "", ""], [[], [], [], []], {}
    for chunk in client.completions.create(**kwargs, logprobs=2, stream=True, echo=False):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs:
                logprob_tokens[choice.index] += choice.logprobs.tokens
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices]
    assert logprob_tokens == [c.logprobs.tokens for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
