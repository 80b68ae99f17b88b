"""`parallel_tool_calls: false` with `tool_choice: "auto"`: of a reply in which the model
writes two calls, the client gets the first only, on chat completions (streamed or not)
and the Responses API; by default it gets both. The model is tiny-random taught, in a
few hundred optimizer steps on the one reply, to answer the test's prompt with two
calls, then saved and served like any local model; the official `openai` client asks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F

from looprl.apps.loading import load_chat_model
from looprl.apps.serve import create_app, serving
from looprl.chat import ChatRenderer
from looprl.model.load import load_causal_lm, load_tokenizer
from looprl.types import Message, ToolCall
from tests.test_inference import RESIGN, SQUARE

TOOLS = [SQUARE, RESIGN]
ASK = "Your move."
CALLS = [ToolCall("choose_square", {"square": 5}), ToolCall("resign", {})]


def teach_two_calls(folder: Path) -> Path:
    """tiny-random trained until its greedy reply to ASK (with TOOLS) is the two CALLS,
    saved to `folder` with its tokenizer."""
    tokenizer = load_tokenizer("tiny-random")
    renderer = ChatRenderer(tokenizer, model_name="tiny-random")
    prompt = renderer.prompt_ids([Message(role="user", content=ASK)], TOOLS)
    reply = renderer.assistant_ids(Message(role="assistant", tool_calls=CALLS))
    ids = torch.tensor([prompt + reply])
    model = load_causal_lm("tiny-random", torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(400):  # about 90 steps
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
        logits = model.lm_head(hidden)  # the reply's positions only
        loss = F.cross_entropy(logits, ids[0, len(prompt) :])
        # well past the first step whose argmax is the reply (loss ≈ 0.2), so that the
        # server's kernels, which round differently, pick the same tokens
        if loss.item() < 0.05:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert logits.argmax(-1).tolist() == reply, "the tiny model did not learn the reply"
    model.eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    folder = teach_two_calls(tmp_path_factory.mktemp("models") / "taught")
    with serving(create_app(load_chat_model(str(folder), device="cpu"))) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="taught",
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        max_tokens=64,
        **kwargs,
    )


def test_chat_keeps_every_call_unless_parallel_tool_calls_is_false(client):
    both = chat(client)
    assert calls_of(both.choices[0].message) == [("choose_square", {"square": 5}), ("resign", {})]
    one = chat(client, parallel_tool_calls=False)
    assert calls_of(one.choices[0].message) == [("choose_square", {"square": 5})]
    assert one.choices[0].finish_reason == "tool_calls"
    assert calls_of(chat(client, parallel_tool_calls=True).choices[0].message) == calls_of(
        both.choices[0].message
    )


def test_a_streamed_chat_reply_keeps_the_first_call_only(client):
    names = []
    for chunk in chat(client, parallel_tool_calls=False, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta.function and delta.function.name:
                names.append(delta.function.name)
    assert names == ["choose_square"]


def test_responses_keep_the_first_call_only_when_asked(client):
    def calls(**kwargs) -> list[tuple[str, dict]]:
        reply = client.responses.create(
            model="taught",
            input=ASK,
            tools=[flat(SQUARE), flat(RESIGN)],
            temperature=0,
            max_output_tokens=64,
            **kwargs,
        )
        assert reply.parallel_tool_calls is kwargs.get("parallel_tool_calls", True)
        items = [item for item in reply.output if item.type == "function_call"]
        return [(item.name, json.loads(item.arguments)) for item in items]

    assert calls() == [("choose_square", {"square": 5}), ("resign", {})]
    assert calls(parallel_tool_calls=False) == [("choose_square", {"square": 5})]


def flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}
