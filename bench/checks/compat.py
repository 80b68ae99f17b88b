"""Client compatibility: drive `looprl serve` through client libraries' default paths.

    .venv/bin/python bench/checks/compat.py [--model smollm2-135m]    # starts the server itself
    python bench/checks/compat.py --url http://127.0.0.1:8000 --model NAME   # a running server

Each check makes real requests and prints one line: library, what was tried, OK or FAIL
(with the error) or SKIP (library not installed). The official `openai` client is always
checked; openai-agents, langchain-openai, litellm, pydantic-ai, instructor and
llama-index (its OpenAI-like LLM) when they are importable: they are not looprl
dependencies (the `compat` extra installs them). With `--url` the script needs only the
client libraries, so it can run in another environment than the server (pass the
server's `--api-key` too, for the check of the lower-case `bearer` scheme). The replies
are tiny models' replies: the checks test the protocol (the client accepts the reply,
structured output parses into its type, streams arrive in pieces), not what the model
says. Nested pydantic models (`Plan`: their JSON schemas carry `$defs` and `$ref`s) go
through every library's default tool and structured-output paths. Ends with
`RESULT compat_ok=… compat_fail=… compat_skip=…`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, result_line

SQUARE = {
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Put your mark on a square of the tic-tac-toe board.",
        "parameters": {
            "type": "object",
            "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["square"],
        },
    },
}
ASK = [{"role": "user", "content": "Board: X at 1, O at 5. You are X. Which square next?"}]


class Move(BaseModel):
    """A tic-tac-toe move (no free strings, so that even a random model finishes it)."""

    square: int = Field(ge=1, le=9)
    reason: Literal["win", "block", "centre", "other"]


class Square(BaseModel):
    row: int = Field(ge=1, le=3)
    col: int = Field(ge=1, le=3)


class Plan(BaseModel):
    """A move with nested models: its schema refers to Square under $defs."""

    at: Square = Field(description="where to play")
    then: list[Square] = Field(max_length=1)
    reason: Literal["win", "block", "centre", "other"]


def choose_square(square: int) -> str:
    """Put your mark on a square of the tic-tac-toe board (1-9)."""
    return f"X took {square}"


CHECKS: list[tuple[str, str, Callable[[Any], str]]] = []
MODULES = {  # library → its top-level modules: missing, the library's checks are skipped
    "openai": {"openai"},
    "openai-agents": {"agents"},
    "langchain-openai": {"langchain_openai", "langchain_core"},
    "litellm": {"litellm"},
    "pydantic-ai": {"pydantic_ai"},
    "instructor": {"instructor"},
    "llama-index": {"llama_index"},
}


def check(library: str, what: str) -> Callable:
    def register(fn: Callable[[Any], str]) -> Callable[[Any], str]:
        CHECKS.append((library, what, fn))
        return fn

    return register


class Target:
    def __init__(
        self, url: str, model: str, key: str = "none", encode: Callable | None = None
    ) -> None:
        self.url, self.model, self.base, self.key = url, model, f"{url}/v1", key
        self.encode = encode  # text → the served model's token ids (None: unknown)

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base, api_key=self.key, max_retries=0, timeout=600)

    def post(self, path: str, body: dict, authorization: str | None = None) -> tuple[int, Any]:
        """(status, JSON body) of a POST with the given Authorization header."""
        import httpx

        headers = {"Authorization": authorization or f"Bearer {self.key}"}
        reply = httpx.post(self.base + path, json=body, headers=headers, timeout=600)
        return reply.status_code, reply.json()


# ---------------------------------------------------------------- openai


@check("openai", "chat.completions.create")
def _chat(t: Target) -> str:
    reply = t.openai().chat.completions.create(model=t.model, messages=ASK, max_tokens=24)
    return f"finish={reply.choices[0].finish_reason}"


@check("openai", "tools, tool_choice=auto")
def _auto(t: Target) -> str:
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, tools=[SQUARE], tool_choice="auto", max_tokens=48
    )
    calls = reply.choices[0].message.tool_calls or []
    return f"{len(calls)} call(s), finish={reply.choices[0].finish_reason}"


@check("openai", "tools, tool_choice=required")
def _required(t: Target) -> str:
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, tools=[SQUARE], tool_choice="required", max_tokens=48
    )
    (call,) = reply.choices[0].message.tool_calls
    return f"{call.function.name}({call.function.arguments})"


@check("openai", "tools, named tool_choice")
def _named(t: Target) -> str:
    choice = {"type": "function", "function": {"name": "choose_square"}}
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, tools=[SQUARE], tool_choice=choice, max_tokens=48
    )
    (call,) = reply.choices[0].message.tool_calls
    assert 1 <= json.loads(call.function.arguments)["square"] <= 9
    return f"{call.function.name}({call.function.arguments})"


@check("openai", "response_format json_object")
def _json_object(t: Target) -> str:
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, response_format={"type": "json_object"}, max_tokens=64
    )
    choice = reply.choices[0]
    if choice.finish_reason == "length":
        return f"cut off at max_tokens: {choice.model_extra.get('looprl_error')}"
    assert isinstance(json.loads(choice.message.content), dict)
    return choice.message.content[:60]


@check("openai", "response_format json_schema")
def _json_schema(t: Target) -> str:
    schema = {"name": "move", "schema": Move.model_json_schema(), "strict": True}
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    return Move.model_validate_json(reply.choices[0].message.content).model_dump_json()


@check("openai", "chat.completions.parse(Pydantic)")
def _parse(t: Target) -> str:
    reply = t.openai().chat.completions.parse(
        model=t.model, messages=ASK, response_format=Move, max_tokens=64
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Move)
    return parsed.model_dump_json()


@check("openai", "completions.create (+logprobs, echo)")
def _completions(t: Target) -> str:
    client = t.openai()
    reply = client.completions.create(model=t.model, prompt="1, 2, 3,", max_tokens=8, logprobs=2)
    assert len(reply.choices[0].logprobs.tokens) == reply.usage.completion_tokens
    echoed = client.completions.create(model=t.model, prompt="1, 2, 3,", max_tokens=4, echo=True)
    assert echoed.choices[0].text.startswith("1, 2, 3,")
    return repr(reply.choices[0].text[:40])


@check("openai", "models.list / models.retrieve")
def _models(t: Target) -> str:
    client = t.openai()
    ids = [m.id for m in client.models.list()]
    assert client.models.retrieve(t.model).id == t.model
    return ", ".join(ids)


@check("openai", "stream=True (chat, token by token)")
def _stream(t: Target) -> str:
    start, first, pieces = time.perf_counter(), None, 0
    stream = t.openai().chat.completions.create(
        model=t.model, messages=ASK, max_tokens=32, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces += 1
    end = time.perf_counter()
    assert pieces > 1, "the reply came in one piece"
    return f"{pieces} content chunks, first after {1000 * (first - start):.0f} ms of {1000 * (end - start):.0f}"  # noqa: E501


@check("openai", "stream=True with tools (required)")
def _stream_tools(t: Target) -> str:
    arguments = ""
    stream = t.openai().chat.completions.create(
        model=t.model, messages=ASK, tools=[SQUARE], tool_choice="required", max_tokens=48,
        stream=True,
    )  # fmt: skip
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments += call.function.arguments or ""
    return arguments


@check("openai", "logprobs + top_logprobs=5")
def _top_logprobs(t: Target) -> str:
    reply = t.openai().chat.completions.create(
        model=t.model, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=5
    )
    content = reply.choices[0].logprobs.content
    assert all(len(token.top_logprobs) == 5 for token in content)
    return f"{len(content)} tokens x 5 alternatives"


@check("openai", "pydantic_function_tool(nested), required")
def _nested_tool(t: Target) -> str:
    import openai

    reply = t.openai().chat.completions.parse(
        model=t.model, messages=ASK, tools=[openai.pydantic_function_tool(Plan)],
        tool_choice="required", max_tokens=96,
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Plan)
    return call.function.arguments


@check("openai", "chat.completions.parse(nested Pydantic)")
def _nested_parse(t: Target) -> str:
    reply = t.openai().chat.completions.parse(
        model=t.model, messages=ASK, response_format=Plan, max_tokens=96
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Plan)
    return parsed.model_dump_json()


@check("openai", "responses.parse(text_format=nested Pydantic)")
def _nested_responses(t: Target) -> str:
    reply = t.openai().responses.parse(
        model=t.model, input=ASK[0]["content"], text_format=Plan, max_output_tokens=96
    )
    assert isinstance(reply.output_parsed, Plan)
    return reply.output_parsed.model_dump_json()


@check("openai", "response_format + tool_choice=required")
def _format_and_forced(t: Target) -> str:
    """OpenAI's rule: the forced call is the reply; the format is for a text reply."""
    client = t.openai()
    schema = {"name": "plan", "schema": Plan.model_json_schema()}
    reply = client.chat.completions.create(
        model=t.model, messages=ASK, tools=[SQUARE], tool_choice="required", max_tokens=48,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls
    text_format = {"type": "json_schema", **schema}
    response = client.responses.create(
        model=t.model, input=ASK[0]["content"], tools=[{"type": "function", **SQUARE["function"]}],
        tool_choice="required", max_output_tokens=48, text={"format": text_format},
    )  # fmt: skip
    assert [item.type for item in response.output] == ["function_call"]
    return f"chat: {call.function.name}, responses: {response.output[0].name}"


@check("openai", "logit_bias (chat, completions)")
def _logit_bias(t: Target) -> str:
    """+100 on a token id forces it (greedy or sampled), -100 on the greedy reply's first
    token bans it (with the served model's tokenizer), a bad key is a 400."""
    client = t.openai()
    greedy = dict(model=t.model, messages=ASK, max_tokens=4, temperature=0, logprobs=True)
    forced = client.chat.completions.create(**greedy, logit_bias={"28": 100})
    tokens = [token.token for token in forced.choices[0].logprobs.content]
    assert len(tokens) == 4 and len(set(tokens)) == 1, tokens
    text = (
        client.completions.create(
            model=t.model, prompt="1, 2, 3,", max_tokens=3, temperature=1.0, logit_bias={"28": 100}
        )
        .choices[0]
        .text
    )
    assert text == tokens[0] * 3, (text, tokens)
    detail = f"+100 on id 28: {tokens[0] * 4!r} (chat), {text!r} (completions)"
    if t.encode is not None:
        plain = client.chat.completions.create(**greedy)
        first = plain.choices[0].logprobs.content[0].token
        banned = client.chat.completions.create(
            **greedy, logit_bias={str(t.encode(first)[0]): -100}
        )
        assert banned.choices[0].logprobs.content[0].token != first
        detail += f"; -100 bans the greedy {first!r}"
    status, refused = t.post("/chat/completions", {**greedy, "logit_bias": {"x": 1}})
    assert status == 400 and refused["error"]["param"] == "logit_bias", refused
    return detail


@check("openai", "Authorization: bearer KEY (lower case)")
def _bearer(t: Target) -> str:
    body = {"model": t.model, "messages": ASK, "max_tokens": 2}
    status, reply = t.post("/chat/completions", body, f"bearer {t.key}")
    assert status == 200, reply
    status, _ = t.post("/chat/completions", body, "bearer not-the-key")
    assert status == 401, "the server takes any key: start it with --api-key and pass it here"
    return "200 with the key, 401 without"


@check("openai", "Responses over the token limit")
def _responses_limit(t: Target) -> str:
    status, reply = t.post("/responses", {"model": t.model, "input": "hi",
                                          "max_output_tokens": 10**9})  # fmt: skip
    message = reply["error"]["message"]
    assert status == 400 and reply["error"]["param"] == "max_output_tokens", reply
    assert "max_output_tokens" in message and "max_completion_tokens" not in message, message
    return message[:80]


# ---------------------------------------------------------------- openai-agents


def _agents_run(t: Target, api: str, **kwargs: Any) -> Any:
    import asyncio

    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    async def go() -> Any:
        async with openai.AsyncOpenAI(base_url=t.base, api_key=t.key, max_retries=0) as client:
            kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            agent = Agent(
                name="player", instructions="Play tic-tac-toe.", model=kind(t.model, client),
                model_settings=ModelSettings(tool_choice="required", max_tokens=96),
                tool_use_behavior="stop_on_first_tool", **kwargs,
            )  # fmt: skip
            return (await Runner.run(agent, ASK[0]["content"], max_turns=2)).final_output

    return asyncio.run(go())


def _plan_tool(played: list[Any]) -> Any:
    from agents import function_tool

    @function_tool(failure_error_function=None)
    def play(plan: Plan) -> str:
        """Play a planned move."""
        played.append(plan)
        return plan.model_dump_json()

    return play


@check("openai-agents", "function_tool(nested Pydantic arg), required")
def _agents_tool(t: Target) -> str:
    played: list[Any] = []
    out = _agents_run(t, "responses", tools=[_plan_tool(played)])
    assert len(played) == 1 and isinstance(played[0], Plan)
    return out


@check("openai-agents", "output_type + tool_choice=required (chat)")
def _agents_output_chat(t: Target) -> str:
    played: list[Any] = []
    return _agents_run(t, "chat", tools=[_plan_tool(played)], output_type=Plan)


@check("openai-agents", "output_type + tool_choice=required (responses)")
def _agents_output_responses(t: Target) -> str:
    played: list[Any] = []
    return _agents_run(t, "responses", tools=[_plan_tool(played)], output_type=Plan)


# ---------------------------------------------------------------- langchain


def _langchain(t: Target) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=t.model, base_url=t.base, api_key=t.key, max_tokens=64,
                      max_retries=0)  # fmt: skip


@check("langchain-openai", "ChatOpenAI.invoke")
def _lc_invoke(t: Target) -> str:
    return repr(_langchain(t).invoke("Say hi.").content[:40])


@check("langchain-openai", "bind_tools(tool_choice=named)")
def _lc_tools(t: Target) -> str:
    from langchain_core.tools import tool

    llm = _langchain(t).bind_tools([tool(choose_square)], tool_choice="choose_square")
    (call,) = llm.invoke(ASK[0]["content"]).tool_calls
    return f"{call['name']}({call['args']})"


@check("langchain-openai", "with_structured_output(Pydantic)")
def _lc_structured(t: Target) -> str:
    return _langchain(t).with_structured_output(Move).invoke(ASK[0]["content"]).model_dump_json()


@check("langchain-openai", "with_structured_output(nested Pydantic)")
def _lc_nested(t: Target) -> str:
    return _langchain(t).with_structured_output(Plan).invoke(ASK[0]["content"]).model_dump_json()


@check("langchain-openai", "stream")
def _lc_stream(t: Target) -> str:
    pieces = [chunk.content for chunk in _langchain(t).stream("Count to five.") if chunk.content]
    assert len(pieces) > 1
    return f"{len(pieces)} chunks"


# ---------------------------------------------------------------- litellm


def _litellm(t: Target, **kwargs: Any) -> Any:
    import litellm

    return litellm.completion(
        model=f"openai/{t.model}", api_base=t.base, api_key=t.key, messages=ASK,
        max_tokens=64, **kwargs,
    )  # fmt: skip


@check("litellm", "completion")
def _ll_chat(t: Target) -> str:
    return f"finish={_litellm(t).choices[0].finish_reason}"


@check("litellm", "tools, tool_choice=required")
def _ll_tools(t: Target) -> str:
    (call,) = _litellm(t, tools=[SQUARE], tool_choice="required").choices[0].message.tool_calls
    return f"{call.function.name}({call.function.arguments})"


@check("litellm", "response_format=Pydantic")
def _ll_structured(t: Target) -> str:
    content = _litellm(t, response_format=Move).choices[0].message.content
    return Move.model_validate_json(content).model_dump_json()


@check("litellm", "tools (nested Pydantic), tool_choice=required")
def _ll_nested(t: Target) -> str:
    import openai

    tool = openai.pydantic_function_tool(Plan)
    (call,) = _litellm(t, tools=[tool], tool_choice="required").choices[0].message.tool_calls
    return Plan.model_validate_json(call.function.arguments).model_dump_json()


@check("litellm", "stream")
def _ll_stream(t: Target) -> str:
    pieces = [c.choices[0].delta.content for c in _litellm(t, stream=True)
              if c.choices and c.choices[0].delta.content]  # fmt: skip
    assert len(pieces) > 1
    return f"{len(pieces)} chunks"


# ---------------------------------------------------------------- pydantic-ai


def _pydantic_ai(t: Target, max_tokens: int = 64, **kwargs: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(t.model, provider=OpenAIProvider(base_url=t.base, api_key=t.key))
    return Agent(model, model_settings={"max_tokens": max_tokens}, **kwargs)


@check("pydantic-ai", "Agent.run_sync (text)")
def _pa_text(t: Target) -> str:
    return repr(_pydantic_ai(t).run_sync("Say hi.").output[:40])


@check("pydantic-ai", "Agent(output_type=Pydantic)")
def _pa_structured(t: Target) -> str:
    return _pydantic_ai(t, output_type=Move).run_sync(ASK[0]["content"]).output.model_dump_json()


@check("pydantic-ai", "Agent(output_type=nested Pydantic)")
def _pa_nested(t: Target) -> str:
    agent = _pydantic_ai(t, max_tokens=96, output_type=Plan)
    return agent.run_sync(ASK[0]["content"]).output.model_dump_json()


# ---------------------------------------------------------------- instructor


@check("instructor", "from_openai, response_model (TOOLS mode)")
def _in_tools(t: Target) -> str:
    import instructor

    client = instructor.from_openai(t.openai())
    move = client.chat.completions.create(
        model=t.model, messages=ASK, response_model=Move, max_tokens=64, max_retries=0
    )
    return move.model_dump_json()


@check("instructor", "response_model (JSON_SCHEMA mode)")
def _in_json(t: Target) -> str:
    import instructor

    client = instructor.from_openai(t.openai(), mode=instructor.Mode.JSON_SCHEMA)
    move = client.chat.completions.create(
        model=t.model, messages=ASK, response_model=Move, max_tokens=64, max_retries=0
    )
    return move.model_dump_json()


@check("instructor", "response_model=nested Pydantic (TOOLS mode)")
def _in_nested(t: Target) -> str:
    import instructor

    client = instructor.from_openai(t.openai())
    plan = client.chat.completions.create(
        model=t.model, messages=ASK, response_model=Plan, max_tokens=96, max_retries=0
    )
    return plan.model_dump_json()


@check("instructor", "response_model (RESPONSES_TOOLS mode)")
def _in_responses(t: Target) -> str:
    import instructor

    client = instructor.from_openai(t.openai(), mode=instructor.Mode.RESPONSES_TOOLS)
    plan = client.responses.create(
        model=t.model, input=ASK[0]["content"], response_model=Plan, max_output_tokens=96,
        max_retries=0,
    )  # fmt: skip
    return plan.model_dump_json()


# ---------------------------------------------------------------- llama-index


def _llama_index(t: Target) -> Any:
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(model=t.model, api_base=t.base, api_key=t.key, max_tokens=64,
                      is_chat_model=True, is_function_calling_model=True,
                      context_window=2048, max_retries=0)  # fmt: skip


@check("llama-index", "OpenAILike.complete / chat")
def _li_chat(t: Target) -> str:
    from llama_index.core.llms import ChatMessage

    llm = _llama_index(t)
    text = llm.complete("Say hi.").text
    reply = llm.chat([ChatMessage(role="user", content="Say hi.")])
    return repr((text + " | " + str(reply.message.content))[:50])


@check("llama-index", "stream_complete")
def _li_stream(t: Target) -> str:
    pieces = [r.delta for r in _llama_index(t).stream_complete("Count to five.") if r.delta]
    assert len(pieces) > 1
    return f"{len(pieces)} chunks"


@check("llama-index", "structured_predict(Pydantic)")
def _li_structured(t: Target) -> str:
    from llama_index.core.prompts import PromptTemplate

    prompt = PromptTemplate(ASK[0]["content"])
    return _llama_index(t).structured_predict(Move, prompt).model_dump_json()


@check("llama-index", "structured_predict / as_structured_llm (nested)")
def _li_nested(t: Target) -> str:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    llm = _llama_index(t)
    plan = llm.structured_predict(Plan, PromptTemplate(ASK[0]["content"]))
    reply = llm.as_structured_llm(Plan).chat([ChatMessage(role="user", content="Your move?")])
    assert isinstance(plan, Plan) and isinstance(reply.raw, Plan)
    return plan.model_dump_json()


# ---------------------------------------------------------------- running


@contextlib.contextmanager
def own_server(model: str, device: str) -> Iterator[Target]:
    from looprl.apps.loading import load_chat_model
    from looprl.apps.serve import create_app, serving

    chat_model = load_chat_model(model, device=device)
    key = "compat-check-key"
    with serving(create_app(chat_model, api_key=key)) as url:
        encode = lambda text: chat_model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        yield Target(url, chat_model.name, key, encode)


def run(target: Target, libraries: set[str] | None) -> tuple[int, int, int]:
    counts = {"OK": 0, "FAIL": 0, "SKIP": 0}
    for library, what, fn in CHECKS:
        if libraries and library not in libraries:
            continue
        start = time.perf_counter()
        try:
            detail, status = fn(target), "OK"
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in MODULES[library]:
                raise  # the library is there but broken: a crash worth seeing
            detail, status = f"not installed ({err.name})", "SKIP"
        except Exception as err:  # a failed check is a result, not a crash
            last = traceback.extract_tb(err.__traceback__)[-1]
            detail = f"{type(err).__name__}: {str(err)[:160]} (at {last.name})"
            status = "FAIL"
        counts[status] += 1
        seconds = time.perf_counter() - start
        line = " ".join(str(detail).split())[:110]
        print(f"{library:17} {what:48} {status:4} {seconds:5.1f}s  {line}", flush=True)
    return counts["OK"], counts["FAIL"], counts["SKIP"]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--url", help="a running server (default: start one on 127.0.0.1)")
    parser.add_argument("--model", default="smollm2-135m", help="model id (or model to serve)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--api-key", default="none", help="the running server's --api-key")
    parser.add_argument("--only", default="", help="comma-separated libraries to check")
    args = parser.parse_args()
    libraries = set(filter(None, args.only.split(",")))
    if args.url:
        target = Target(args.url.rstrip("/"), args.model, args.api_key)
        ok, failed, skipped = run(target, libraries)
    else:
        with own_server(args.model, args.device) as target:
            ok, failed, skipped = run(target, libraries)
    print(result_line({"compat_ok": ok, "compat_fail": failed, "compat_skip": skipped}))


if __name__ == "__main__":
    main()
