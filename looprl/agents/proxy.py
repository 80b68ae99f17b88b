"""The in-process OpenAI endpoint that bring-your-own agents talk to during rollouts.

An agent gets a real `openai.AsyncOpenAI` client whose HTTP layer is a `ProxyTransport`:
no port and no server, but every call goes through the client's own JSON encoding and
response parsing, so the agent runs exactly as it would against a real endpoint. Each
episode has its own transport and `AgentSession`, which serves the calls and turns them
into one token trajectory.

Stitching (token-in/token-out, as in rollout.py). For a new call we look for an earlier
call of the episode whose messages plus the reply we returned are a prefix of the new
request's messages (tools unchanged). Its prompt ids + its sampled completion ids +
`renderer.continuation_ids(...)` of the new messages are the new prompt, so the model's
own tokens are never re-tokenised. The trajectory grows while each call extends the
previous one; its token ids are then exactly `prompt_ids + completion_ids` of the last
call, and the loss mask marks exactly the sampled ids.

Token mismatch. When the agent edits its history (rewrites, drops or reorders earlier
messages, changes the tools), or the template cannot render the new messages as a
continuation, the call does not extend the trajectory. It is served from a prompt
rendered afresh (or stitched onto another earlier call it does extend), the episode's
`info["token_mismatch"]` explains the first such call, and the trajectory stops there:
we train on its consistent prefix only, since the later calls' tokens are no
continuation of it and the trainer scores one token sequence per episode.

What the request decides and what it does not, while looprl trains:
- sampling is the rollout's (`SamplingParams` from the config): the request's
  `temperature`, `top_p` and `seed` are ignored, so the recorded logprobs are those the
  trainer recomputes; `stop` must be unset (a cut completion would not be the sampled
  tokens);
- `n` > 1 samples n replies in the same batch; the trajectory keeps choice 0 and the
  others are returned but not trained on: choice 0 is a plain sample of the policy,
  while the choice an agent goes on with may be a selection (the best of n), and
  training on a selected sample as if the policy had drawn it would bias the update.
  A call that continues another choice is a token mismatch, explained as such;
- `tool_choice` "required" or a named tool, and `response_format` (json_object,
  json_schema), are honoured (constrained decoding);
- `POST /v1/responses` (the Responses API, looprl/openai/responses.py) is translated to
  a chat call and served, recorded and stitched as one;
- `max_tokens` is capped by `rollout.max_new_tokens` and the episode's token room;
- a call beyond `max_turns`, or with no token room left (`rollout.max_episode_tokens`),
  gets HTTP 400 with code `looprl_episode_limit` (`openai.BadRequestError`), and the
  episode ends `truncated` whatever the agent does next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pydantic

from looprl.agents.messages import (
    ModelCall,
    alternative,
    history,
    is_prefix,
    short,
    turn_key,
)
from looprl.agents.routes import answer, httpx
from looprl.chat import ChatRenderer
from looprl.engine import Completion, GenerationRequest
from looprl.engine.requests import check_tools, generation_request
from looprl.errors import ChatError, RequestError
from looprl.openai.replies import chat_choice
from looprl.openai.responses import ResponseStore
from looprl.openai.wire import (
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatRequest,
    chat_request,
    completion_response,
    validation_error,
)
from looprl.types import Message

PROXY_URL = "http://looprl-proxy/v1"
LIMIT_CODE = "looprl_episode_limit"


@dataclass
class AgentCall:
    """One agent call, validated and stitched, ready for the engine (nothing recorded yet)."""

    request: ChatRequest
    tools: list[dict[str, Any]] | None  # those rendered and parsed
    generation: GenerationRequest
    extends: bool  # the call continues the trajectory
    mismatch: dict[str, Any] | None  # why it does not, when it is the first to break it
    tip: int  # trajectory length (in calls) it was stitched onto


@dataclass
class AgentSession:
    """The calls of one episode, and the trajectory they stitch into."""

    renderer: ChatRenderer
    generate: Callable[[GenerationRequest], Awaitable[Completion]]
    max_turns: int
    max_episode_tokens: int
    max_new_tokens: int
    engine: Any = None  # to compile forced-call grammars up front, when it has them
    calls: list[ModelCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trajectory_calls: int = 0
    mismatch: dict[str, Any] | None = None
    truncated: str | None = None  # why the episode was cut off
    accepted: int = 0  # calls accepted so far, those still being generated included
    closed: bool = False  # the agent has returned: later calls are refused
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id

    # ------------------------------------------------------------ serving

    async def chat(self, body: bytes) -> tuple[int, dict[str, Any], ChatCompletionRequest | None]:
        """Answer one `/v1/chat/completions` body: (HTTP status, JSON body, request)."""
        try:
            request = ChatCompletionRequest.model_validate_json(body)
        except pydantic.ValidationError as err:
            return 400, validation_error(err.errors()).body(), None
        try:
            return 200, await self.complete(request), request
        except APIError as err:
            return err.status, err.body(), request

    async def complete(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The `chat.completion` body for a parsed request (APIError when refused); the
        Responses route answers through it too."""
        prepared = self._prepare(request)
        first = prepared.generation  # n > 1: copies of it, sampled in the same batch
        requests = [first, *(replace(first) for _ in range(request.n - 1))]
        completions = await asyncio.gather(*(self.generate(r) for r in requests))
        choices = self._record(prepared, list(completions))
        tokenizer = self.renderer.tokenizer
        logprobs = bool(request.logprobs)
        return completion_response(choices, request.model, tokenizer, logprobs, "looprl-rollout")

    def _prepare(self, body: ChatCompletionRequest) -> AgentCall:
        """Validate, apply the limits and build the prompt; nothing is recorded yet."""
        if self.closed:
            raise APIError(400, "this episode is over: its agent has returned", code=LIMIT_CODE)
        if self.truncated:
            raise APIError(400, self.truncated, code=LIMIT_CODE)
        request = chat_request(body, "policy", self.max_new_tokens)
        if request.stop:
            raise APIError(
                400,
                "stop strings are not supported while looprl trains: the trainer needs the "
                "sampled tokens whole; stop in your agent's code instead",
                "stop",
            )
        tool_choice = request.tool_choice
        try:
            tools = check_tools(request.tools, tool_choice)
        except RequestError as err:
            raise APIError(400, str(err), err.param) from None
        if self.accepted >= self.max_turns:
            self._truncate(f"the episode reached max_turns={self.max_turns} model calls")
        messages = request.messages or []
        prompt_ids, extends, mismatch = self._prompt(messages, tools)
        room = self.max_episode_tokens - len(prompt_ids)
        if room < 1:
            self._truncate(
                f"the prompt has {len(prompt_ids)} tokens, the episode's limit is "
                f"rollout.max_episode_tokens={self.max_episode_tokens}"
            )
        limit = min(request.max_tokens, self.max_new_tokens, room)
        try:
            generation = generation_request(
                prompt_ids,
                tools,
                tool_choice,
                self.renderer.format,
                limit,
                self.engine,
                request.response_format,
            )
        except RequestError as err:
            raise APIError(400, str(err), err.param) from None
        self.accepted += 1
        return AgentCall(request, tools, generation, extends, mismatch, self.trajectory_calls)

    def _truncate(self, why: str) -> None:
        self.truncated = f"{why}; looprl ends this episode as truncated"
        raise APIError(400, self.truncated, code=LIMIT_CODE)

    # ------------------------------------------------------------ stitching

    def _prompt(
        self, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> tuple[list[int], bool, dict[str, Any] | None]:
        """(prompt ids, extends the trajectory, mismatch explanation or None)."""
        base, problem = None, None
        for previous in reversed(self.calls):
            if previous.tools != tools or not is_prefix(history(previous), messages):
                continue
            try:
                ids = previous.prompt_ids + previous.completion_ids
                ids += self.renderer.continuation_ids(
                    history(previous),
                    messages[len(previous.messages) + 1 :],
                    tools,
                    previous.completion_ids,
                )
            except ChatError as err:
                problem = str(err)
                break
            base = previous
            break
        if base is None:
            try:
                ids = self.renderer.prompt_ids(messages, tools)
            except ChatError as err:
                raise APIError(400, str(err), "messages") from None
        tip = self.calls[self.trajectory_calls - 1] if self.trajectory_calls else None
        consistent = self.mismatch is None
        if not self.calls:
            return ids, True, None
        if consistent and base is tip:
            return ids, True, None
        mismatch = None
        if consistent:
            assert tip is not None
            mismatch = self._explain(tip, messages, tools, problem)
        return ids, False, mismatch

    def _explain(
        self,
        tip: ModelCall,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        problem: str | None,
    ) -> dict[str, Any]:
        """Which call broke the trajectory, where, and the decoded tokens around it."""
        call = len(self.calls)
        expected = history(tip)
        out: dict[str, Any] = {"call": call}
        if problem is not None:
            out["reason"] = f"call {call}: the chat template cannot continue: {problem}"
        elif tip.tools != tools:
            out["reason"] = f"call {call} changed the tools of the conversation"
        else:
            i = next(
                (
                    k
                    for k, (a, b) in enumerate(zip(expected, messages))
                    if turn_key(a) != turn_key(b)
                ),
                min(len(expected), len(messages)),
            )
            out["message"] = i
            choice = alternative(tip, messages, i)
            if choice:
                out["reason"] = (
                    f"call {call} continues choice {choice} of call {self.trajectory_calls - 1} "
                    "(n > 1); the trajectory keeps choice 0, a plain sample of the policy"
                )
            elif i < min(len(expected), len(messages)):
                out["reason"] = (
                    f"call {call}: message {i} ({messages[i].role}) differs from the "
                    f"conversation so far: expected {short(expected[i])}, got "
                    f"{short(messages[i])}"
                )
            else:
                out["reason"] = (
                    f"call {call} sent {len(messages)} messages, but the conversation so far "
                    f"has {len(expected)}: it goes back to an earlier point (a retry or a "
                    "branch) instead of continuing the conversation"
                )
        try:
            fresh = self.renderer.prompt_ids(messages, tools)
        except ChatError:
            return out
        recorded = tip.prompt_ids + tip.completion_ids
        pos = next(
            (k for k, (a, b) in enumerate(zip(recorded, fresh)) if a != b),
            min(len(recorded), len(fresh)),
        )
        decode = self.renderer.tokenizer.decode
        out["token"] = pos
        out["expected"] = decode(recorded[max(0, pos - 8) : pos + 8])
        out["got"] = decode(fresh[max(0, pos - 8) : pos + 8])
        return out

    def _record(self, prepared: AgentCall, completions: list[Completion]) -> list[ChatChoice]:
        """Keep the call (choice 0; the others as alternatives), grow the trajectory, and
        build the replies the agent sees."""
        k = len(self.calls)
        choices = [self._choice(prepared, c, k, i) for i, c in enumerate(completions)]
        first, completion = choices[0], completions[0]
        prompt_ids = prepared.generation.prompt_ids
        self.calls.append(
            ModelCall(
                list(prepared.request.messages or []),
                prepared.tools,
                first.message,
                list(prompt_ids),
                list(completion.ids),
                list(completion.logprobs),
                first.text,
                completion.finish_reason,
                [c.message for c in choices[1:]],
            )
        )
        extends = prepared.extends and self.mismatch is None
        if extends and prepared.tip != self.trajectory_calls:
            # Two concurrent calls continued the same conversation: keep the first.
            extends = False
            prepared.mismatch = {
                "call": len(self.calls) - 1,
                "reason": f"call {len(self.calls) - 1} ran concurrently with another call "
                "continuing the same conversation; the trajectory keeps the one answered first",
            }
        if prepared.mismatch is not None and self.mismatch is None:
            self.mismatch = prepared.mismatch
        if extends:
            assert prompt_ids[: len(self.token_ids)] == self.token_ids, "stitching bug"
            new = prompt_ids[len(self.token_ids) :]
            self.token_ids += new + list(completion.ids)
            self.loss_mask += [0] * len(new) + [1] * len(completion.ids)
            self.logprobs += [0.0] * len(new) + list(completion.logprobs)
            self.trajectory_calls = len(self.calls)
        return choices

    def _choice(self, prepared: AgentCall, completion: Completion, k: int, i: int) -> ChatChoice:
        """Choice `i` of call `k` as the agent sees it (tool call ids `call_K_J`, or
        `call_K_I_J` for the choices after the first): the policy's text as sampled."""
        prefix = f"call_{k}" if i == 0 else f"call_{k}_{i}"
        g = prepared.generation
        return chat_choice(
            self.renderer,
            completion,
            g.prompt_ids,
            prepared.tools,
            g.constraint,
            g.max_new_tokens or self.max_new_tokens,
            lambda j, _call: f"{prefix}_{j}",
            as_sampled=True,
        )

    def trajectory_messages(self) -> list[Message]:
        """The conversation the trajectory's tokens spell: its last call plus the reply."""
        if not self.trajectory_calls:
            return []
        return history(self.calls[self.trajectory_calls - 1])


class ProxyTransport(httpx.AsyncBaseTransport):
    """httpx transport answering the OpenAI routes from an `AgentSession`, in-process."""

    def __init__(self, session: AgentSession) -> None:
        self.session = session

    async def handle_async_request(self, request: Any) -> Any:
        return await answer(self.session, request.method, request.url.path, await request.aread())


def openai_client(session: AgentSession) -> Any:
    """An `openai.AsyncOpenAI` whose requests are answered by `session`, in-process."""
    import openai

    http = httpx.AsyncClient(transport=ProxyTransport(session), base_url=PROXY_URL)
    # No retries: a refused call (limits, bad request) is an answer, not a network fault.
    return openai.AsyncOpenAI(
        base_url=PROXY_URL, api_key="looprl", http_client=http, max_retries=0, timeout=None
    )
