"""Checks of `ChatModel.chat` / `complete` arguments: each bad value is a `RequestError`
naming its field, so that the server answers it with a 400 that says what to change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from looprl.errors import RequestError
from looprl.types import Message

ROLES = ("system", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_LOGIT_BIAS = 100  # as OpenAI's API: each bias lies in [-100, 100]


def raw_prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """A raw prompt's ids: token ids as given, text tokenized as the model's own
    tokenizer does (its BOS included, where it adds one)."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        vocab = len(tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                "prompt",
            )
    else:
        raise RequestError("prompt must be a text or a list of token ids", "prompt")
    if not ids:
        raise RequestError("prompt is empty", "prompt")
    return ids


def check_sampling(
    n: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    stop: list[str] | None,
    top_logprobs: int = 0,
) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError(f"n must be an integer >= 1, not {n!r}", "n")
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 5:
        raise RequestError(f"temperature must be in [0, 5], not {temperature!r}", "temperature")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], not {top_p!r}", "top_p")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, not {max_tokens!r}", "max_tokens")
    for s in stop or []:
        if not isinstance(s, str) or not s:
            raise RequestError(f"stop strings must be non-empty strings, not {s!r}", "stop")
    if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], not {top_logprobs!r}",
            "top_logprobs",
        )


def logit_bias_ids(bias: dict[Any, Any] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids, as strings in JSON, → a bias in [-100, 100]
    added to the token's logit before sampling) as the engine takes it: int keys; None
    when there is none."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must map token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        text = str(key).strip()
        if isinstance(key, bool) or not text.isdigit() or not int(text) < vocab:
            raise RequestError(
                f"logit_bias has the key {key!r}: keys are token ids of this model's "
                f"vocabulary, integers in [0, {vocab})",
                "logit_bias",
            )
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias[{key!r}] is {value!r}: a bias is a number in [-{MAX_LOGIT_BIAS}, "
                f"{MAX_LOGIT_BIAS}] (-100 bans the token, 100 all but forces it)",
                "logit_bias",
            )
        out[int(text)] = float(value)
    return out


def for_choice(on_token: Callable[..., None], k: int) -> Callable[[int, float, Any], None]:
    """The engine's per-request token callback, telling `on_token` which choice it is."""
    return lambda token, logprob, top: on_token(k, token, logprob, top)


def check_messages(messages: list[Message]) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Message):
            raise RequestError(f"messages[{i}] is a {type(m).__name__}, not a Message", "messages")
        if m.role not in ROLES:
            raise RequestError(
                f"messages[{i}] has role {m.role!r}; known roles: {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
