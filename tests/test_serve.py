"""`looprl serve`: the real server (uvicorn in a thread) driven by the official client."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.errors import RequestError
from tests.test_inference import RESIGN, SQUARE

TOOLS = [SQUARE, RESIGN]
HI = [{"role": "user", "content": "Your move."}]


def client_for(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def http(url: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, decoded JSON) of a GET (no body) or POST."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model("tiny-random", device="cpu")


@pytest.fixture(scope="module")
def url(model) -> Iterator[str]:
    with serving(create_app(model)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url)


# ---------------------------------------------------------------- happy paths


def test_health_and_models(url, client):
    status, health = http(f"{url}/health")
    assert status == 200
    assert health == {
        "status": "ok",
        "model": "tiny-random",
        "variants": ["base"],
        "live_rows": 0,  # nothing is generating
        "decode_steps": health["decode_steps"],  # a counter (tests/test_serve_cancel.py)
    }
    assert isinstance(health["decode_steps"], int)
    assert [m.id for m in client.models.list()] == ["tiny-random", "tiny-random:base"]


def test_plain_chat(client):
    reply = client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=8, seed=0)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "tiny-random" and reply.object == "chat.completion"


@pytest.mark.parametrize(
    "tool_choice, name",
    [
        ({"type": "function", "function": {"name": "choose_square"}}, "choose_square"),
        ({"type": "function", "function": {"name": "resign"}}, "resign"),
        ("required", None),
    ],
)
def test_forced_tool_calls_always_parse(client, tool_choice, name):
    reply = client.chat.completions.create(
        model="tiny-random", messages=HI, tools=TOOLS, tool_choice=tool_choice,
        n=4, max_tokens=64, temperature=1.0,
    )  # fmt: skip
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("choose_square", "resign")
        assert name is None or call.function.name == name
        arguments = json.loads(call.function.arguments)
        if call.function.name == "choose_square":
            assert 1 <= arguments["square"] <= 9


def test_multi_turn_agent_conversation(client):
    history = HI + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "choose_square", "arguments": '{"square": 5}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Board: ....X.... O took 1."},
        {"role": "developer", "content": "Be quick."},
    ]
    reply = client.chat.completions.create(
        model="tiny-random", messages=history, tools=TOOLS, tool_choice="required", max_tokens=64
    )
    assert reply.choices[0].message.tool_calls


def test_n_seed_and_logprobs(client):
    def ask(seed):
        return client.chat.completions.create(
            model="tiny-random", messages=HI, n=3, max_tokens=10, seed=seed, logprobs=True
        )

    first, again, other = ask(11), ask(11), ask(12)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts != [c.message.content for c in other.choices]
    assert sum(len(c.logprobs.content) for c in first.choices) == first.usage.completion_tokens
    for c in first.choices:
        for token in c.logprobs.content:
            assert token.logprob <= 0 and token.top_logprobs == []
            assert bytes(token.bytes).decode("utf-8", "replace") == token.token


@pytest.mark.parametrize("tools", [False, True])
def test_streaming_reassembles_to_the_same_reply(client, tools):
    kwargs = dict(model="tiny-random", messages=HI, n=2, max_tokens=40, seed=5)
    if tools:
        kwargs.update(tools=TOOLS, tool_choice="required")
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    content = {0: "", 1: ""}
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finish, roles, usage = {}, set(), None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            roles.add(delta.role)
            content[choice.index] += delta.content or ""
            for call in delta.tool_calls or []:
                slot = calls[choice.index].setdefault(call.index, {"name": "", "arguments": ""})
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert "assistant" in roles
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens
    for choice in whole.choices:
        assert content[choice.index] == (choice.message.content or "")
        assert finish[choice.index] == choice.finish_reason
        expected = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        assert [calls[choice.index][k] for k in sorted(calls[choice.index])] == expected


def test_concurrent_requests_decode_in_one_batch(model):
    widths: list[int] = []
    hook = model.engine.model.register_forward_hook(
        lambda m, a, kw, out: widths.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        with serving(create_app(model, batch_window_s=1.0)) as base:
            client = client_for(base)
            replies: list = [None, None]

            def ask(i):
                replies[i] = client.chat.completions.create(
                    model="tiny-random", messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=4 + i,
                )  # fmt: skip

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
    finally:
        hook.remove()
    assert all(r is not None and len(r.choices) == 1 for r in replies)
    assert max(widths) == 2  # both rows in one forward pass


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        ({"model": "tiny-random"}, 400, "messages"),
        ({"model": "tiny-random", "messages": []}, 400, "messages"),
        ({"model": "tiny-random", "messages": HI, "n": "2"}, 400, "n"),
        ({"model": "tiny-random", "messages": "hello"}, 400, "messages"),
        ({"model": "gpt-9", "messages": HI}, 404, "model"),
        ({"model": "tiny-random", "messages": HI, "n": 0}, 400, "n"),
        ({"model": "tiny-random", "messages": HI, "temperature": -0.5}, 400, "temperature"),
        ({"model": "tiny-random", "messages": HI, "stop": 3}, 400, "stop"),
        ({"model": "tiny-random", "messages": HI, "tool_choice": "sometimes"}, 400, "tool_choice"),
        (
            {"model": "tiny-random", "messages": HI, "tools": TOOLS,
             "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            400, "tool_choice",
        ),
        ({"model": "tiny-random", "messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "tiny-random", "messages": [{"role": "robot", "content": "hi"}]},
         400, "messages[0].role"),
        (
            {"model": "tiny-random", "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]},
            400, "messages[0].content[0].type",
        ),
        (
            {"model": "tiny-random", "messages": [{"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
            ]}]},
            400, "messages[0].tool_calls[0].function.arguments",
        ),
        ({"model": "tiny-random", "messages": HI, "top_logprobs": 3}, 400, "top_logprobs"),
        ({"model": "tiny-random", "messages": HI, "logprobs": True, "top_logprobs": 21},
         400, "top_logprobs"),
        ({"model": "tiny-random", "messages": HI, "response_format": {"type": "xml"}},
         400, "response_format.type"),
        ({"model": "tiny-random", "messages": HI,
          "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         400, "response_format.json_schema"),
        ({"model": "tiny-random", "messages": HI, "tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "blob"}}}},
         400, "response_format.json_schema.schema"),
        ({"model": "tiny-random", "messages": HI, "max_tokens": 5000}, 400, "max_tokens"),
    ],
)  # fmt: skip
def test_malformed_requests_get_openai_errors(url, body, status, param):
    got, reply = http(f"{url}/v1/chat/completions", body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert "Traceback" not in error["message"]


def test_client_raises_bad_request_and_not_found(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-random", messages=HI, n=0)
    assert err.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HI)


def test_unknown_route_and_server_bug_are_openai_errors(url, model, monkeypatch):
    status, reply = http(f"{url}/v1/embeddings", {"input": "x"})
    assert status == 404 and reply["error"]["code"] == "not_found"

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(model, "prepare", broken)
    status, reply = http(f"{url}/v1/chat/completions", {"model": "tiny-random", "messages": HI})
    assert status == 500 and reply["error"]["type"] == "server_error"
    assert "Traceback" not in reply["error"]["message"]


def test_max_tokens_above_the_context_length_is_refused_naming_it(model, client):
    limit = model.context_length  # this server was started without --max-tokens-limit
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-random", messages=HI, max_tokens=limit + 1)
    message = err.value.body["message"]
    assert f"max_tokens={limit + 1}" in message
    assert f"at most {limit} tokens (the model's context length)" in message
    assert "--max-tokens-limit" not in message  # a flag nobody gave


def test_api_key(model):
    with serving(create_app(model, api_key="sekret")) as base:
        with pytest.raises(openai.AuthenticationError) as err:
            client_for(base, "wrong").models.list()
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key"
        status, _ = http(f"{base}/v1/models")
        assert status == 401
        assert [m.id for m in client_for(base, "sekret").models.list()][0] == "tiny-random"
        assert http(f"{base}/health")[0] == 200


# ---------------------------------------------------------------- CLI and runs


def test_cli_serve_help_and_early_errors():
    from typer.testing import CliRunner

    from looprl.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--api-key", "--checkpoint", "--variant"):
        assert option in result.output
    result = runner.invoke(app, ["serve", "tiny-random", "--variant", "best"])
    assert result.exit_code == 2 and "trained or baseline" in result.output
    result = runner.invoke(app, ["serve", "tiny-random", "--checkpoint", "step_000001"])
    assert result.exit_code == 2 and "run folder" in result.output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from looprl.config import config_from_dict
    from looprl.loop.train import run_training

    cfg = config_from_dict(
        {
            "model": {"name": "tiny-random", "device": "cpu"},
            "rollout": {"tasks_per_step": 1, "group_size": 2, "max_new_tokens": 40},
            "train": {"steps": 1},
            "eval": {"tasks": 1, "samples_per_task": 1},
            "logging": {"tensorboard": False},
        }
    )
    run = tmp_path_factory.mktemp("serve") / "tinyrun"
    run_training(cfg, run)
    return run


def test_serving_a_run_answers_as_trained_and_baseline(run_dir):
    run = load_chat_model(str(run_dir), device="cpu")
    with pytest.raises(RequestError, match="variants"):
        create_app(run, default_variant="base")
    with serving(create_app(run)) as base:
        client = client_for(base)
        ids = [m.id for m in client.models.list()]
        assert ids == ["tinyrun", "tinyrun:trained", "tinyrun:baseline"]
        for model_id, variant in [
            ("tinyrun", "trained"),
            ("tinyrun:trained", "trained"),
            ("tinyrun:baseline", "baseline"),
        ]:
            reply = client.chat.completions.create(
                model=model_id, messages=HI, tools=TOOLS, tool_choice="required", max_tokens=64
            )
            assert reply.system_fingerprint == f"looprl-{variant}"
            assert reply.choices[0].message.tool_calls
    with serving(create_app(run, default_variant="baseline")) as base:
        reply = client_for(base).chat.completions.create(model="tinyrun", messages=HI, max_tokens=4)
        assert reply.system_fingerprint == "looprl-baseline"
