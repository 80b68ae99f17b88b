"""Client compatibility: drive `looprl serve` through client libraries' default paths.

    .venv/bin/python bench/checks/compat.py [--model smollm2-135m]    # starts the server itself
    python bench/checks/compat.py --url http://127.0.0.1:8000 --model NAME   # a running server

Each check makes real requests and prints one line: library, what was tried, OK or FAIL
(with the error) or SKIP (library not installed). The official `openai` client is always
checked; langchain-openai, litellm, pydantic-ai, instructor and llama-index (its
OpenAI-like LLM) when they are importable: they are not looprl dependencies (the
`compat` extra installs them). With `--url` the script needs only the client libraries,
so it can run in another environment than the server. The replies are tiny models'
replies: the checks test the protocol (the client accepts the reply, structured output
parses into its type, streams arrive in pieces), not what the model says. Ends with
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


def choose_square(square: int) -> str:
    """Put your mark on a square of the tic-tac-toe board (1-9)."""
    return f"X took {square}"


CHECKS: list[tuple[str, str, Callable[[Any], str]]] = []
MODULES = {  # library → its top-level modules: missing, the library's checks are skipped
    "openai": {"openai"},
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
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.base = url, model, f"{url}/v1"

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base, api_key="none", max_retries=0, timeout=600)


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


# ---------------------------------------------------------------- langchain


def _langchain(t: Target) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=t.model, base_url=t.base, api_key="none", max_tokens=64,
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


@check("langchain-openai", "stream")
def _lc_stream(t: Target) -> str:
    pieces = [chunk.content for chunk in _langchain(t).stream("Count to five.") if chunk.content]
    assert len(pieces) > 1
    return f"{len(pieces)} chunks"


# ---------------------------------------------------------------- litellm


def _litellm(t: Target, **kwargs: Any) -> Any:
    import litellm

    return litellm.completion(
        model=f"openai/{t.model}", api_base=t.base, api_key="none", messages=ASK,
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


@check("litellm", "stream")
def _ll_stream(t: Target) -> str:
    pieces = [c.choices[0].delta.content for c in _litellm(t, stream=True)
              if c.choices and c.choices[0].delta.content]  # fmt: skip
    assert len(pieces) > 1
    return f"{len(pieces)} chunks"


# ---------------------------------------------------------------- pydantic-ai


def _pydantic_ai(t: Target, **kwargs: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(t.model, provider=OpenAIProvider(base_url=t.base, api_key="none"))
    return Agent(model, model_settings={"max_tokens": 64}, **kwargs)


@check("pydantic-ai", "Agent.run_sync (text)")
def _pa_text(t: Target) -> str:
    return repr(_pydantic_ai(t).run_sync("Say hi.").output[:40])


@check("pydantic-ai", "Agent(output_type=Pydantic)")
def _pa_structured(t: Target) -> str:
    return _pydantic_ai(t, output_type=Move).run_sync(ASK[0]["content"]).output.model_dump_json()


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


# ---------------------------------------------------------------- llama-index


def _llama_index(t: Target) -> Any:
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(model=t.model, api_base=t.base, api_key="none", max_tokens=64,
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


# ---------------------------------------------------------------- running


@contextlib.contextmanager
def own_server(model: str, device: str) -> Iterator[Target]:
    from looprl.apps.inference import load_chat_model
    from looprl.apps.serve import create_app, serving

    chat_model = load_chat_model(model, device=device)
    with serving(create_app(chat_model)) as url:
        yield Target(url, chat_model.name)


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
        print(f"{library:17} {what:42} {status:4} {seconds:5.1f}s  {line}", flush=True)
    return counts["OK"], counts["FAIL"], counts["SKIP"]


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--url", help="a running server (default: start one on 127.0.0.1)")
    parser.add_argument("--model", default="smollm2-135m", help="model id (or model to serve)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="", help="comma-separated libraries to check")
    args = parser.parse_args()
    libraries = set(filter(None, args.only.split(",")))
    if args.url:
        ok, failed, skipped = run(Target(args.url.rstrip("/"), args.model), libraries)
    else:
        with own_server(args.model, args.device) as target:
            ok, failed, skipped = run(target, libraries)
    print(result_line({"compat_ok": ok, "compat_fail": failed, "compat_skip": skipped}))


if __name__ == "__main__":
    main()
