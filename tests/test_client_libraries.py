"""What agent libraries send `looprl serve` by default, through the libraries themselves:
nested pydantic models in tools and structured outputs (their JSON schemas carry `$defs`
and `$ref`s), a forced call with a response format, `logit_bias`, a lower-case `bearer`
scheme and the Responses API's token limit. The real server on the tiny random model;
forced calls and JSON replies are grammar-constrained, so they parse even from random
weights. Unit tests first (the schema relocation, every call syntax, the engine's bias),
then the official client, openai-agents and pydantic-ai against the server.

instructor and llama-index are not among the test dependencies (their pins conflict
with ours: instructor's jiter, llama-index's openai < 3): the request each sends by
default is made here with the official client (`test_instructor_and_llama_index_...`),
and `bench/checks/compat.py` runs the libraries themselves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from looprl.apps.checks import logit_bias_ids
from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.chat.formats import format_tool_call
from looprl.chat.parsers import parse_tool_calls, validate_arguments
from looprl.engine import GenerationRequest, JsonConstraint, SamplingParams, ToolConstraint
from looprl.engine.grammar import GrammarCache, build_grammar
from looprl.engine.hf import HFEngine
from looprl.engine.json_schema import relocated
from looprl.engine.requests import json_constraint
from looprl.errors import ChatError, RequestError
from looprl.openai.responses_input import renamed
from looprl.openai.wire import APIError
from looprl.types import ToolCall
from tests.test_serve import client_for, http

FORMATS = ("hermes", "llama3", "mistral", "glm")
MODEL = "tiny-random"
KEY = "sesame"
LIMIT = 600  # the server's --max-tokens-limit


class Square(BaseModel):
    row: int = Field(ge=1, le=3)
    col: int = Field(ge=1, le=3)


class Move(BaseModel):
    """A move with nested models: pydantic puts Square under $defs and refers to it."""

    at: Square = Field(description="where to play")  # a $ref with a sibling keyword
    alternatives: list[Square] = Field(max_length=2)
    reason: Literal["win", "block", "other"]


class Node(BaseModel):
    """A recursive model: `kids` refers back to Node itself."""

    value: int = Field(ge=0, le=9)
    kids: list[Node] = Field(max_length=1)


class Tree(BaseModel):
    root: Node


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


MOVE = function("play", Move.model_json_schema())
TREE = function("grow", Tree.model_json_schema())
# the same $defs name as Move's, for another type: each tool's references stay its own
OTHER = function(
    "mark",
    {
        "$defs": {"Square": {"type": "integer", "minimum": 1, "maximum": 9}},
        "type": "object",
        "properties": {"square": {"$ref": "#/$defs/Square"}},
        "required": ["square"],
    },
)
GOOD_MOVE = {"at": {"row": 1, "col": 3}, "alternatives": [{"row": 2, "col": 2}], "reason": "win"}
GOOD_TREE = {"root": {"value": 1, "kids": [{"value": 2, "kids": []}]}}


# ---------------------------------------------------------------- the schemas (units)


def test_relocated_prefixes_every_reference_and_nothing_else():
    schema = {
        "$defs": {"A": {"type": "object", "properties": {"self": {"$ref": "#"}}}},
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "old": {"$ref": "#/definitions/B"},
            "default": {"$ref": "#/$defs/A"},  # a property named like a data keyword
            "far": {"$ref": "https://example.com/x.json"},
        },
        "default": {"$ref": "#/not/a/reference"},
        "enum": [{"$ref": "#/data"}],
    }
    out = relocated(schema, "/properties/arguments")
    assert out["$defs"]["A"]["properties"]["self"]["$ref"] == "#/properties/arguments"
    assert out["properties"]["a"]["$ref"] == "#/properties/arguments/$defs/A"
    assert out["properties"]["old"]["$ref"] == "#/properties/arguments/definitions/B"
    assert out["properties"]["default"]["$ref"] == "#/properties/arguments/$defs/A"
    assert out["properties"]["far"]["$ref"] == "https://example.com/x.json"
    assert out["default"] == schema["default"] and out["enum"] == schema["enum"]


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(grammars, tokenizer, constraint: ToolConstraint, call: ToolCall) -> bool:
    """Whether the forced grammar takes the call, written in its syntax, as a whole reply."""
    matcher = grammars.matcher(constraint)
    text = format_tool_call(call, constraint.fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
        tokenizer.eos_token_id
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["required", "play"])
def test_forced_calls_with_defs_compile_and_hold_the_schema(grammars, tokenizer, fmt, choice):
    """Every call syntax, tool_choice required or named: a nested model's call is taken,
    one that breaks the nested schema is not, and each tool's $defs stay its own."""
    forced = ToolConstraint([MOVE, OTHER], choice, fmt)
    assert accepts(grammars, tokenizer, forced, ToolCall("play", GOOD_MOVE))
    bad_nested = {**GOOD_MOVE, "at": {"row": 7, "col": 1}}
    assert not accepts(grammars, tokenizer, forced, ToolCall("play", bad_nested))
    missing = {**GOOD_MOVE, "at": {"row": 1}}
    assert not accepts(grammars, tokenizer, forced, ToolCall("play", missing))
    if choice == "required":  # OTHER's Square is an integer, Move's an object
        assert accepts(grammars, tokenizer, forced, ToolCall("mark", {"square": 4}))
        assert not accepts(
            grammars, tokenizer, forced, ToolCall("mark", {"square": GOOD_MOVE["at"]})
        )  # noqa: E501


@pytest.mark.parametrize("fmt", FORMATS)
def test_recursive_references_are_forced(grammars, tokenizer, fmt):
    forced = ToolConstraint([TREE], "required", fmt)
    assert accepts(grammars, tokenizer, forced, ToolCall("grow", GOOD_TREE))
    deeper = {"root": {"value": 1, "kids": [{"value": 2, "kids": [{"value": 10, "kids": []}]}]}}
    assert not accepts(grammars, tokenizer, forced, ToolCall("grow", deeper))


def test_a_recursive_model_at_the_top_is_forced_or_refused_clearly():
    """pydantic writes a recursive top-level model as a root `$ref`: the JSON syntaxes
    force it; glm, whose arguments are one object's properties, refuses it by name."""
    node = function("node", Node.model_json_schema())
    assert "$ref" in node["function"]["parameters"]
    for fmt in ("hermes", "llama3", "mistral"):
        build_grammar(ToolConstraint([node], "required", fmt))
    with pytest.raises(ChatError, match=r"tool 'node'.*\$ref cannot be forced"):
        build_grammar(ToolConstraint([node], "required", "glm"))


def test_a_json_reply_or_a_nested_call_under_tool_choice_auto(grammars, tokenizer):
    """response_format with tools and tool_choice auto: the grammar is the JSON or one
    call, and the call's references resolve as in a forced call."""
    constraint = JsonConstraint(Tree.model_json_schema(), [MOVE, OTHER], "hermes")
    for text in (json.dumps(GOOD_TREE),
                 format_tool_call(ToolCall("play", GOOD_MOVE), "hermes")):  # fmt: skip
        matcher = grammars.matcher(constraint)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(
            tokenizer.eos_token_id
        ), text
    matcher = grammars.matcher(constraint)
    bad = format_tool_call(ToolCall("play", {**GOOD_MOVE, "at": 3}), "hermes")
    assert not all(matcher.accept_token(t) for t in tokenizer.encode(bad, add_special_tokens=False))


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_calls_against_defs_parse_and_validate(fmt):
    """tool_choice auto: a call is read back and checked against its tool's schema, whose
    references resolve against the tool's own $defs."""
    good = parse_tool_calls(format_tool_call(ToolCall("play", GOOD_MOVE), fmt), [MOVE, OTHER], fmt)
    assert good.failure is None and good.calls[0].arguments == GOOD_MOVE
    wrong = {**GOOD_MOVE, "alternatives": [{"row": 1, "col": "x"}]}
    bad = parse_tool_calls(format_tool_call(ToolCall("play", wrong), fmt), [MOVE, OTHER], fmt)
    assert bad.failure == "bad_arguments" and "alternatives/0/col" in bad.detail
    assert validate_arguments(ToolCall("mark", {"square": 3}), [MOVE, OTHER]) is None
    assert validate_arguments(ToolCall("mark", {"square": 30}), [MOVE, OTHER]) is not None


def test_a_forced_call_with_a_response_format_is_the_call():
    """As the OpenAI API: the forced call is the reply; the format is still checked."""
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "m", "schema": Move.model_json_schema()},
    }  # noqa: E501
    for choice in ("required", "play"):
        assert json_constraint(schema, [MOVE], choice, "hermes") is None
    with pytest.raises(RequestError, match="not a valid JSON schema"):
        bad = {"type": "json_schema", "json_schema": {"name": "m", "schema": {"type": "blob"}}}
        json_constraint(bad, [MOVE], "required", "hermes")


def test_responses_errors_name_max_output_tokens():
    err = renamed(
        APIError(400, "max_completion_tokens=9 is more than ...", "max_completion_tokens")
    )
    assert (
        err.param == "max_output_tokens" and err.message == "max_output_tokens=9 is more than ..."
    )


@pytest.mark.parametrize(
    "bias, words",
    [({"x": 1}, "key 'x'"), ({"-1": 1}, "key '-1'"), ({"50": 1}, "[0, 50)"),
     ({"1": 100.5}, "[-100, 100]"), ({"1": True}, "[-100, 100]"), ({"1": "5"}, "[-100, 100]")],
)  # fmt: skip
def test_bad_logit_bias_is_refused(bias, words):
    with pytest.raises(RequestError) as err:
        logit_bias_ids(bias, 50)
    assert err.value.param == "logit_bias" and words in str(err.value)
    assert logit_bias_ids({"7": -100, 3: 2.5}, 50) == {7: -100.0, 3: 2.5}
    assert logit_bias_ids({}, 50) is None and logit_bias_ids(None, 50) is None


def test_the_engine_adds_the_bias_before_sampling(tiny_model, tokenizer, renderer):
    """+100 forces a token and -100 bans one, greedy or sampled, per row (a row without a
    bias samples as it would alone); the recorded logprobs stay the model's own."""
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    prompt = tokenizer.encode("one two three", add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    (plain,) = engine.generate([GenerationRequest(prompt)], greedy)
    banned = plain.ids[0]
    rows = [
        GenerationRequest(prompt, logit_bias={42: 100.0}),
        GenerationRequest(prompt, logit_bias={banned: -100.0}),
        GenerationRequest(prompt),
    ]
    with torch.no_grad():
        logits_V = tiny_model(torch.tensor([prompt])).logits[0, -1].float()
    for params, scale in ((greedy, 1.0), (SamplingParams(1.5, max_new_tokens=6, seed=3), 1.5)):
        forced, without, free = engine.generate(rows, params)
        assert forced.ids == [42] * 6
        assert banned not in without.ids
        expected = torch.log_softmax(logits_V / scale, -1)[42].item()
        assert forced.logprobs[0] == pytest.approx(expected, abs=1e-4)
    assert engine.generate(rows, greedy)[2].ids == plain.ids


# ---------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def model() -> ChatModel:
    return load_chat_model(MODEL, device="cpu")


@pytest.fixture(scope="module")
def url(model) -> Iterator[str]:
    with serving(create_app(model, api_key=KEY, max_tokens_limit=LIMIT)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return client_for(url, KEY)


ASK = [{"role": "user", "content": "Your move on the 3x3 board?"}]


def check_move(arguments: str) -> Move:
    move = Move.model_validate_json(arguments)
    jsonschema.validate(json.loads(arguments), Move.model_json_schema())
    return move


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Move"}}])
def test_openai_pydantic_function_tool_with_nested_models(client, choice):
    tool = openai.pydantic_function_tool(Move)
    assert "$defs" in tool["function"]["parameters"]
    reply = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[tool], tool_choice=choice, max_tokens=120, n=2, seed=1
    )
    for c in reply.choices:
        (call,) = c.message.tool_calls
        assert isinstance(call.function.parsed_arguments, Move)
        assert check_move(call.function.arguments) == call.function.parsed_arguments


def test_openai_parse_and_responses_parse_with_nested_models(client):
    chat = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Tree, max_tokens=160, seed=2
    )
    assert isinstance(chat.choices[0].message.parsed, Tree)
    response = client.responses.parse(
        model=MODEL, input="Your move?", text_format=Move, max_output_tokens=120
    )
    assert isinstance(response.output_parsed, Move)
    forced = client.responses.parse(
        model=MODEL, input="Your move?", tools=[openai.pydantic_function_tool(Move)],
        tool_choice="required", max_output_tokens=120,
    )  # fmt: skip
    (call,) = [item for item in forced.output if item.type == "function_call"]
    assert isinstance(call.parsed_arguments, Move)


def test_a_forced_call_with_response_format_or_text_format_is_the_call(client):
    """OpenAI's rule: the forced call wins that turn; the format is for a text reply."""
    tool = openai.pydantic_function_tool(Move, name="play")
    chat = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[tool], tool_choice="required", response_format=Tree,
        max_tokens=120,
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.parsed is None
    check_move(choice.message.tool_calls[0].function.arguments)
    response = client.responses.parse(
        model=MODEL, input="Your move?", tools=[tool], tool_choice="required", text_format=Tree,
        max_output_tokens=120,
    )  # fmt: skip
    assert [item.type for item in response.output] == ["function_call"]
    check_move(response.output[0].arguments)


def test_instructor_and_llama_index_default_requests(client):
    """instructor's TOOLS mode and llama-index's `as_structured_llm` / `structured_predict`
    send pydantic's own schema (not the strict one: titles, `$ref` with a description
    beside it) as the one tool, named in tool_choice."""
    spec = {"name": "Move", "description": Move.__doc__, "parameters": Move.model_json_schema()}
    tool = {"type": "function", "function": spec}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[tool], max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "Move"}},
    )  # fmt: skip
    check_move(reply.choices[0].message.tool_calls[0].function.arguments)


def test_openai_agents_nested_tool_arguments_and_output_type_with_a_forced_call(url):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    played: list[Move] = []

    @function_tool(failure_error_function=None)
    def play(move: Move) -> str:
        """Play a move."""
        played.append(move)
        return "played"

    async def run_both() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        outputs = []
        for model in (
            OpenAIResponsesModel(MODEL, client),
            OpenAIChatCompletionsModel(MODEL, client),
        ):  # noqa: E501
            agent = Agent(
                name="player", instructions="Play tic-tac-toe.", model=model, tools=[play],
                output_type=Move,  # a response format beside the forced call
                model_settings=ModelSettings(tool_choice="required", max_tokens=120),
                tool_use_behavior="stop_on_first_tool",
            )  # fmt: skip
            outputs.append((await Runner.run(agent, "Your move?", max_turns=2)).final_output)
        return outputs

    assert asyncio.run(run_both()) == ["played", "played"]
    assert len(played) == 2 and all(isinstance(move, Move) for move in played)


def test_pydantic_ai_structured_output_with_nested_models(url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{url}/v1", api_key=KEY)
    agent = Agent(
        OpenAIChatModel(MODEL, provider=provider), output_type=Move,
        model_settings={"max_tokens": 120},
    )  # fmt: skip
    assert isinstance(agent.run_sync("Your move?").output, Move)


def test_logit_bias_through_the_client(client, model):
    greedy = dict(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**greedy, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    token = model.tokenizer.convert_tokens_to_ids(":")
    forced = client.chat.completions.create(**greedy, logit_bias={str(token): 100})
    assert forced.choices[0].message.content == "::::"
    banned_id = model.tokenizer.encode(first, add_special_tokens=False)[0]
    banned = client.chat.completions.create(**greedy, logit_bias={str(banned_id): -100})
    assert not banned.choices[0].message.content.startswith(first)
    text = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0.7,
        logit_bias={str(token): 100}, seed=5,
    )  # fmt: skip
    assert text.choices[0].text == ":::"
    for bias in ({"one": 1}, {str(token): 250}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**greedy, logit_bias=bias)
        assert err.value.body["param"] == "logit_bias"


def test_the_bearer_scheme_is_case_insensitive(url):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):
        status, _ = http(f"{url}/v1/chat/completions", body, {"Authorization": header})
        assert status == 200, header
    for header in (f"Basic {KEY}", KEY, "bearer wrong", f"Bearer{KEY}"):
        status, reply = http(f"{url}/v1/chat/completions", body, {"Authorization": header})
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", header


def test_a_responses_request_over_the_limit_is_told_max_output_tokens(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=LIMIT + 1)
    message = err.value.body["message"]
    assert err.value.body["param"] == "max_output_tokens"
    assert f"max_output_tokens={LIMIT + 1}" in message and "max_completion_tokens" not in message
