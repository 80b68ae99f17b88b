"""Streaming replies token by token, as the engine samples them (server-sent events).

The engine tells the server of each token as soon as it is chosen (`on_token`); the
writers here turn those tokens into OpenAI chunks:
- `TextDeltas`: one choice's text as it grows. A token that ends inside a multi-byte
  character, or text that may be the start of a stop string, is held back until the
  next tokens settle it, so the deltas always add up to the final text;
- `ChatStream`: `chat.completion.chunk` events. Plain replies (no tools: free text or a
  `response_format` JSON reply) stream their content as it is generated; a reply that
  may hold tool calls is sent whole when it is finished, since its text is call syntax
  until parsed (OpenAI clients accept calls arriving in one piece);
- `CompletionStream`: `text_completion` chunks of `/v1/completions`.
Each ends its choices with their `finish_reason` (and `looprl_error`, usage, `[DONE]`).
`stream_events` sends an already finished chat reply as chunks (the agent proxy's way).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

Decode = Callable[[list[int]], str]


def chunk_head(response: dict[str, Any]) -> dict[str, Any]:
    """The fields every `chat.completion.chunk` of a response repeats."""
    keys = ("id", "created", "model", "system_fingerprint")
    return {"object": "chat.completion.chunk", **{key: response.get(key) for key in keys}}


def chunk_event(
    head: dict[str, Any],
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: Any = None,
    error: str | None = None,
    include_usage: bool = False,
) -> str:
    """One server-sent chunk of choice `index` (`error`: the choice's `looprl_error`)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    if error:
        choice["looprl_error"] = error
    chunk = {**head, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def choice_events(
    head: dict[str, Any], choice: dict[str, Any], include_usage: bool, content: bool = True
) -> Iterator[str]:
    """A finished choice of a `chat.completion` body as chunks: its content (unless it
    was streamed already), reasoning, each tool call whole, then the final chunk with
    `finish_reason` and `logprobs`."""
    index, message = choice["index"], choice["message"]

    def event(delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
        error = choice.get("looprl_error") if finish else None
        return chunk_event(head, index, delta, finish, logprobs, error, include_usage)

    if content and message["content"]:
        yield event({"content": message["content"]})
    if message.get("reasoning_content"):
        yield event({"reasoning_content": message["reasoning_content"]})
    for k, call in enumerate(message.get("tool_calls", [])):
        name = {"name": call["function"]["name"], "arguments": ""}
        opening = {"index": k, "id": call["id"], "type": "function", "function": name}
        yield event({"tool_calls": [opening]})
        arguments = {"arguments": call["function"]["arguments"]}
        yield event({"tool_calls": [{"index": k, "function": arguments}]})
    yield event({}, choice["finish_reason"], choice["logprobs"])


def usage_event(head: dict[str, Any], usage: dict[str, Any]) -> str:
    return f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"


def token_logprobs(entries: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """Chat-format logprob entries of (token id, logprob, alternatives or None) triples."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {**entry(token_id, logprob), "top_logprobs": [entry(i, lp) for i, lp in top or []]}
        for token_id, logprob, top in entries
    ]


def stream_events(response: dict[str, Any], include_usage: bool = False) -> Iterator[str]:
    """A finished `chat.completion` body as chunks: per choice a role chunk, one content
    chunk, per tool call a chunk with its id and name and one with its arguments, a final
    chunk with `finish_reason` (and `logprobs`), then `[DONE]`."""
    head = chunk_head(response)
    for choice in response["choices"]:
        role = {"role": "assistant", "content": ""}
        yield chunk_event(head, choice["index"], role, include_usage=include_usage)
        yield from choice_events(head, choice, include_usage)
    if include_usage:
        yield usage_event(head, response["usage"])
    yield "data: [DONE]\n\n"


class TextDeltas:
    """The text of one choice's tokens, handed out in pieces that never need taking back."""

    def __init__(self, decode: Decode, stop: list[str]) -> None:
        self.decode = decode
        self.stop = stop
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """Add a token; return the text that is now certain and was not sent yet."""
        self.ids.append(token)
        text = self.decode(self.ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            ready = text[: min(cuts)]  # the stop string and what follows never reach a client
        else:
            ready = text.rstrip("\ufffd")  # an unfinished multi-byte character
            ready = ready[: len(ready) - _held_back(ready, self.stop)]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent) :], ready
        return delta

    def rest(self, final: str) -> str:
        """What of the final text was not sent yet ("" when the final text is not a
        continuation of what was sent, e.g. a cut-off JSON reply replaced by an error)."""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


def _held_back(text: str, stop: list[str]) -> int:
    """Length of the longest end of `text` that a stop string starts with."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class ChatStream:
    """`chat.completion.chunk` events of one request (see the module doc)."""

    def __init__(
        self,
        head: dict[str, Any],
        n: int,
        live: bool,
        logprobs: bool,
        tokenizer: Any,
        stop: list[str],
        include_usage: bool = False,
    ) -> None:
        self.head = head
        self.n = n
        self.live = live
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        decode = _decoder(tokenizer)
        self.deltas = [TextDeltas(decode, stop) for _ in range(n)]
        self.pending: list[list[tuple[int, float, Any]]] = [[] for _ in range(n)]

    def _event(self, index: int, delta: dict[str, Any], logprobs: Any = None) -> str:
        return chunk_event(self.head, index, delta, None, logprobs, None, self.include_usage)

    def start(self) -> Iterator[str]:
        for index in range(self.n):
            yield self._event(index, {"role": "assistant", "content": ""})

    def token(self, index: int, token: int, logprob: float, top: Any) -> Iterator[str]:
        """Chunks for one newly sampled token of choice `index` (none while held back)."""
        if not self.live:
            return
        self.pending[index].append((token, logprob, top))
        delta = self.deltas[index].push(token)
        if delta:
            yield self._event(index, {"content": delta}, self._take_logprobs(index))

    def finish(self, response: dict[str, Any]) -> Iterator[str]:
        """The rest of every choice, from the finished `chat.completion` body."""
        for choice in response["choices"]:
            index = choice["index"]
            if not self.live:
                yield from choice_events(self.head, choice, self.include_usage)
                continue
            rest = self.deltas[index].rest(choice["message"]["content"] or "")
            if rest:
                yield self._event(index, {"content": rest})
            logprobs = self._take_logprobs(index)
            ending = {**choice, "logprobs": logprobs}
            yield from choice_events(self.head, ending, self.include_usage, content=False)
        if self.include_usage:
            yield usage_event(self.head, response["usage"])
        yield "data: [DONE]\n\n"

    def _take_logprobs(self, index: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        entries, self.pending[index] = self.pending[index], []
        return {"content": token_logprobs(entries, self.tokenizer), "refusal": None}


class CompletionStream:
    """`text_completion` chunks of one `/v1/completions` request: per choice the echoed
    prompt (with `echo`), then its text as it is generated, then `finish_reason`."""

    def __init__(
        self,
        head: dict[str, Any],
        echoes: list[str],
        legacy_logprobs: Callable[[list[tuple[int, float, Any]], int], dict[str, Any]] | None,
        tokenizer: Any,
        stops: list[list[str]],
        include_usage: bool = False,
    ) -> None:
        self.head = head
        self.echoes = echoes  # per choice: the prompt text to send first ("" without echo)
        self.legacy_logprobs = legacy_logprobs  # (tokens, text offset) → the logprobs object
        self.include_usage = include_usage
        decode = _decoder(tokenizer)
        self.deltas = [TextDeltas(decode, stop) for stop in stops]
        self.pending: list[list[tuple[int, float, Any]]] = [[] for _ in stops]
        self.offsets = [len(echo) for echo in echoes]

    def _event(self, index: int, text: str, finish: str | None = None, error: Any = None) -> str:
        logprobs = None
        if self.legacy_logprobs is not None and (text or finish):
            logprobs = self.legacy_logprobs(self.pending[index], self.offsets[index])
            self.pending[index] = []
        self.offsets[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if error:
            choice["looprl_error"] = error
        chunk = {**self.head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        for index, echo in enumerate(self.echoes):
            if echo:
                self.offsets[index] = 0
                yield self._event(index, echo)

    def token(self, index: int, token: int, logprob: float, top: Any) -> Iterator[str]:
        self.pending[index].append((token, logprob, top))
        delta = self.deltas[index].push(token)
        if delta:
            yield self._event(index, delta)

    def finish(self, response: dict[str, Any]) -> Iterator[str]:
        for choice in response["choices"]:
            index = choice["index"]
            final = choice["text"][len(self.echoes[index]) :]
            rest = self.deltas[index].rest(final)
            yield self._event(index, rest, choice["finish_reason"], choice.get("looprl_error"))
        if self.include_usage:
            yield usage_event(self.head, response["usage"])
        yield "data: [DONE]\n\n"


def _decoder(tokenizer: Any) -> Decode:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
