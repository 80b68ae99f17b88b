"""The OpenAI (legacy) completions wire format: `POST /v1/completions`.

A completion continues raw prompts, with no chat template: each prompt is a text, or a
list of token ids, and a request holds one prompt or a list of them. Each prompt gets
`n` choices, numbered prompt by prompt (choice `i * n + k` is prompt i's k-th sample).
`logprobs: k` returns OpenAI's legacy logprobs object per choice: `tokens` (each token's
text), `token_logprobs`, `top_logprobs` (per position a {token text: logprob} map of the
k most likely tokens, plus the sampled one) and `text_offset` (where each token starts in
the choice's `text`). `echo` puts the prompt before the generated text; with `logprobs`
too, the prompt's tokens lead the logprobs object (the first with `null`), as evaluation
harnesses that score texts expect (not when streaming: that is refused).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field

from looprl.openai.wire import (
    APIError,
    ChatChoice,
    ChatRequest,
    StreamOptions,
    _Strict,
    stop_strings,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class CompletionRequest(_Strict):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


def prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each a text or a list of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list; send a text or token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def completion_requests(request: CompletionRequest, variant: str) -> list[ChatRequest]:
    """The typed requests of this body, one per prompt."""
    unsupported = {
        "suffix": request.suffix,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
    }
    for name, value in unsupported.items():
        if value:
            raise APIError(400, f"{name} is not supported; leave it unset", name)
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "best_of is not supported; leave it unset (or equal to n)", "best_of")
    if request.echo and request.logprobs is not None and request.stream:
        raise APIError(
            400,
            "echo with logprobs is not available when streaming; leave out stream",
            "stream",
        )
    return [
        ChatRequest(
            prompt=prompt,
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
            stop=stop_strings(request.stop),
            seed=request.seed,
            variant=variant,
            top_logprobs=request.logprobs or 0,
            logit_bias=request.logit_bias,
            prompt_logprobs=bool(request.echo and request.logprobs is not None),
        )
        for prompt in prompts(request)
    ]


def echo_text(prompt: str | list[int], tokenizer: Any) -> str:
    """The text `echo` puts before a choice's completion: the prompt as written."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)


def legacy_logprobs(
    entries: list[tuple[int, float | None, Any]], offset: int, tokenizer: Any
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object of (token id, logprob, alternatives) entries whose
    text starts at character `offset` of the choice's text (a prompt's first token has
    no logprob: None, and no alternatives)."""
    tokens, offsets, tops = [], [], []
    for token_id, logprob, top in entries:
        token = tokenizer.decode([token_id])
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if logprob is None:
            tops.append(None)
            continue
        alternatives: dict[str, float] = {}
        for other, other_logprob in top or []:
            alternatives.setdefault(tokenizer.decode([other]), other_logprob)
        alternatives.setdefault(token, logprob)  # the sampled token is always there
        tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def text_completion(
    choices: list[list[ChatChoice]],
    echoes: list[str],
    model_id: str,
    tokenizer: Any,
    logprobs: bool,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """The `text_completion` body: `choices[i]` are prompt i's samples, `echoes[i]` the
    text put before each of them ("" without echo)."""
    out, prompt_tokens, completion_tokens = [], 0, 0
    for samples, echo in zip(choices, echoes):
        prompt_tokens += len(samples[0].prompt_ids) if samples else 0
        for c in samples:
            completion_tokens += len(c.completion_ids)
            tops = c.top_logprobs or [None] * len(c.completion_ids)
            entries: list[tuple[int, float | None, Any]] = []
            start = len(echo)
            if c.prompt_logprobs is not None:  # echo + logprobs: the prompt's tokens first
                entries += [(t, lp, top) for t, (lp, top) in zip(c.prompt_ids, c.prompt_logprobs)]
                start = 0
            entries += list(zip(c.completion_ids, c.logprobs, tops))
            choice = {
                "index": len(out),
                "text": echo + c.text,
                "logprobs": legacy_logprobs(entries, start, tokenizer) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            out.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": fingerprint,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
