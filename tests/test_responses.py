"""`POST /v1/responses` on `looprl serve`: the real server driven by the official client's
`responses.create` and `responses.stream`, checked against the chat path it translates to."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from looprl.apps.inference import ChatModel
from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app
from looprl.openai.responses import ResponseStore
from looprl.openai.wire import APIError, ChatMessage
from tests.test_inference import RESIGN, SQUARE
from tests.test_serve import client_for, http, serving

FLAT = [{"type": "function", **tool["function"]} for tool in (SQUARE, RESIGN)]  # Responses tools
CALL = {"type": "function_call", "call_id": "call_a", "name": "choose_square",
        "arguments": '{"square": 5}'}  # fmt: skip
TURNS = [
    {"role": "user", "content": "Your move."},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "I take the centre.", "annotations": []}]},
    CALL,
    {"type": "function_call_output", "call_id": "call_a", "output": "O took 1. Your move?"},
    {"role": "developer", "content": [{"type": "input_text", "text": "Be quick."}]},
]  # fmt: skip
CHAT_TURNS = [
    {"role": "system", "content": "You play X."},
    {"role": "user", "content": "Your move."},
    {"role": "assistant", "content": "I take the centre.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "choose_square", "arguments": '{"square": 5}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "O took 1. Your move?"},
    {"role": "system", "content": "Be quick."},
]  # fmt: skip


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


def greedy(**kwargs):
    return dict(model="tiny-random", temperature=0, **kwargs)


# ---------------------------------------------------------------- the translation


def test_a_text_reply_is_the_chat_reply(client):
    """Greedy, so the same prompt gives the same tokens: the translation is exact."""
    response = client.responses.create(
        **greedy(input="Your move.", instructions="You play X.", max_output_tokens=12)
    )
    chat = client.chat.completions.create(
        **greedy(messages=CHAT_TURNS[:2], max_completion_tokens=12)
    )
    assert response.object == "response" and response.id.startswith("resp_")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    (part,) = item.content
    assert part.type == "output_text" and part.text == chat.choices[0].message.content
    assert response.output_text == part.text
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == "You play X." and response.model == "tiny-random"


@pytest.mark.parametrize(
    "tool_choice, name",
    [("required", None), ({"type": "function", "name": "resign"}, "resign")],
)
def test_function_calls_come_back_as_items(client, tool_choice, name):
    response = client.responses.create(
        model="tiny-random", input=TURNS, instructions="You play X.", tools=FLAT,
        tool_choice=tool_choice, max_output_tokens=64,
    )  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.name in ("choose_square", "resign") and (name is None or call.name == name)
        assert isinstance(json.loads(call.arguments), dict)
    assert response.tool_choice == "required" or response.tool_choice.name == name
    assert [t.name for t in response.tools] == ["choose_square", "resign"]


def test_input_items_render_as_the_chat_messages(client):
    """Items (assistant text + function_call merged into one turn, the tool output, a
    developer message) give the very prompt of the equivalent chat messages."""
    chat_tools = [SQUARE, RESIGN]
    chat = client.chat.completions.create(
        **greedy(messages=CHAT_TURNS, tools=chat_tools, max_tokens=1)
    )
    response = client.responses.create(
        **greedy(input=TURNS, instructions="You play X.", tools=FLAT, max_output_tokens=1)
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == (chat.choices[0].message.content or "")


def test_previous_response_id_continues_a_stored_conversation(client):
    first = client.responses.create(
        model="tiny-random", input="Your move.", instructions="You play X.", tools=FLAT,
        tool_choice="required", max_output_tokens=64,
    )  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "O took 1."}
    chained = client.responses.create(
        **greedy(input=[answer], previous_response_id=first.id, instructions="You play X.",
                 tools=FLAT, max_output_tokens=4)
    )  # fmt: skip
    whole = [{"role": "user", "content": "Your move."}, *first.output, answer]
    explicit = client.responses.create(
        **greedy(input=[_item(i) for i in whole], instructions="You play X.", tools=FLAT,
                 max_output_tokens=4)
    )  # fmt: skip
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text

    unstored = client.responses.create(model="tiny-random", input="Hi", store=False,
                                       max_output_tokens=2)  # fmt: skip
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="tiny-random", input="Hi", previous_response_id=missing)
        assert err.value.param == "previous_response_id" and "unknown" in err.value.message


def _item(item):
    return item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else item


def test_the_store_keeps_the_newest_responses():
    store = ResponseStore(limit=2)
    for k in range(3):
        store.put(f"r{k}", [ChatMessage(role="user", content=str(k))])
    assert [m.content for m in store.conversation("r2")] == ["2"]
    store.conversation("r1")
    with pytest.raises(APIError, match="newest 2 responses"):
        store.conversation("r0")


# ---------------------------------------------------------------- streaming


def test_streamed_calls_follow_the_documented_events(client):
    kwargs = greedy(input=TURNS, tools=FLAT, tool_choice="required", max_output_tokens=64)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    per_call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    calls = [item for item in whole.output if item.type == "function_call"]
    text = [] if len(whole.output) == len(calls) else [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    expected = ["response.created", "response.in_progress", *text, *per_call * len(calls)]
    assert kinds == [*expected, "response.completed"]
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    assert final.usage.total_tokens == whole.usage.total_tokens


def test_streamed_text_reassembles_and_a_cut_reply_ends_incomplete(client):
    kwargs = greedy(input="Tell me a story.", max_output_tokens=6)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == whole.output_text
    last = events[-1]
    assert whole.status == "incomplete"  # six tokens cut the story
    assert last.type == "response.incomplete" and last.response.output_text == deltas
    assert last.response.incomplete_details.reason == "max_output_tokens"


# ---------------------------------------------------------------- errors


def _body(**fields):
    return {"model": "tiny-random", "input": "Hi", **fields}


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        ({"model": "tiny-random"}, 400, "input"),
        (_body(input=7), 400, "input"),
        (_body(input=[]), 400, "input"),
        (_body(model="gpt-9"), 404, "model"),
        (_body(input=[{"type": "item_reference", "id": "x"}]), 400, "input[0].type"),
        (_body(input=[{"role": "robot", "content": "hi"}]), 400, "input[0].role"),
        (_body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
         400, "input[0].content[0].type"),
        (_body(input=[{**CALL, "arguments": "{oops"}]), 400, "input[0].arguments"),
        (_body(input=[{"type": "function_call", "name": "f"}]), 400, "input[0].call_id"),
        (_body(input=[{"type": "function_call_output", "output": "x"}]), 400, "input[0].call_id"),
        (_body(tools=[{"type": "web_search"}]), 400, "tools[0].type"),
        (_body(tools=[SQUARE]), 400, "tools[0].name"),  # the chat format
        (_body(tools=[{**FLAT[0], "parameters": {"type": "nope"}}]), 400, "tools[0].parameters"),
        (_body(tools=FLAT, tool_choice={"type": "function", "name": "fly"}), 400, "tool_choice"),
        (_body(tool_choice="required"), 400, "tool_choice"),
        (_body(tools=FLAT, tool_choice={"type": "file_search"}), 400, "tool_choice"),
        (_body(max_output_tokens=0), 400, "max_output_tokens"),
        (_body(temperature=3), 400, "temperature"),
        (_body(include=["reasoning.encrypted_content"]), 400, "include"),
        (_body(background=True), 400, "background"),
        (_body(conversation="conv_1"), 400, "conversation"),
        (_body(text={"format": {"type": "xml"}}), 400, "text.format.type"),
    ],
)  # fmt: skip
def test_malformed_requests_get_openai_errors(url, body, status, param):
    got, reply = http(f"{url}/v1/responses", body)
    assert got == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert "Traceback" not in error["message"]


def test_text_format_is_answered_as_the_chat_path_answers_response_format(url):
    """`text.format` json_schema is the chat request's `response_format`: a 400 naming
    text.format where the chat path refuses it, a JSON reply where it supports it."""
    schema = {"type": "object", "properties": {"square": {"type": "integer"}},
              "required": ["square"]}  # fmt: skip
    fmt = {"type": "json_schema", "name": "move", "schema": schema, "strict": True}
    chat_format = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                          if k != "type"}}  # fmt: skip
    chat_status, _ = http(
        f"{url}/v1/chat/completions",
        {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi"}],
         "response_format": chat_format, "max_tokens": 128},
    )  # fmt: skip
    # room for the whole object: a forced reply cut at its limit comes back empty, and a
    # random model's integer or whitespace can run long
    status, reply = http(f"{url}/v1/responses", _body(text={"format": fmt}, max_output_tokens=128))
    assert status == chat_status, reply
    if status == 400:
        assert reply["error"]["param"] == "text.format"
        assert "response_format" not in reply["error"]["message"]
    else:
        assert reply["text"]["format"]["name"] == "move"
        assert "square" in json.loads(reply["output"][0]["content"][0]["text"])
