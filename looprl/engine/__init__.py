"""Rollout engines: turn prompt token ids into sampled completion ids + logprobs.

The protocol is small on purpose, so a vLLM engine (GPU) or a remote engine can take the
place of the default `hf` engine without touching the rollout or the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # extra stop strings (EOS always stops)


@dataclass(frozen=True)
class Thinking:
    """Free text allowed before a forced call: `mode` "off" (none, the call alone),
    "tagged" (`<think>TEXT</think>` then the call) or "plain" (TEXT then the call), of
    at most `max_tokens` tokens; the engine closes the text when the limit is reached.
    `opened`: the prompt itself ends with `<think>` (Qwen3-style templates open the block
    in their generation prompt), so a tagged reply starts inside it, with no opening."""

    mode: str = "off"
    max_tokens: int = 0
    opened: bool = False


@dataclass
class ToolConstraint:
    """Forces the completion to be a valid call: `tool_choice` is "required" (any of
    `tools`) or the name of one tool. `fmt` is the model's call syntax; `thinking` what
    may come before the call."""

    tools: list[dict[str, Any]]
    tool_choice: str
    fmt: str
    thinking: Thinking = field(default_factory=Thinking)


@dataclass
class JsonConstraint:
    """Forces the completion to be one JSON value satisfying `schema` (None: any JSON
    object), as `response_format` asks. With `tools` (tool_choice "auto"), a call of one
    of them in the `fmt` syntax is allowed instead, so an agent can still call tools."""

    schema: dict[str, Any] | None
    tools: list[dict[str, Any]] | None = None
    fmt: str = "hermes"


Constraint = ToolConstraint | JsonConstraint

# Called by the engine for each token of a request as soon as it is chosen: (token id,
# its logprob, its top alternatives as (id, logprob) pairs or None). It runs on the
# engine's thread, between decoding steps, so it must be quick.
TokenCallback = Callable[[int, float, "list[tuple[int, float]] | None"], None]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    constraint: Constraint | None = None
    max_new_tokens: int | None = None  # a tighter limit for this request than the params'
    # multi-turn: the caller may send this request's continuation next; inside an engine
    # session its KV is then kept, so that the next turn prefills only its new tokens
    keep_kv: bool = False
    top_logprobs: int = 0  # also return the k most likely tokens at each position
    on_token: TokenCallback | None = field(
        default=None, compare=False, repr=False
    )  # streaming: told of each token as it is chosen
    # the random stream this request samples from (with `SamplingParams.seed`); default:
    # its position in the list. A caller that splits one batch over several processes
    # gives each request its index in the whole batch, so the split changes no sample
    stream: int | None = None
    # a progress display's hook: called once this request's completion is ready, possibly
    # before `generate` returns; an engine may also never call it (nothing depends on it)
    on_complete: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    # this request's own sampling settings (temperature, top_p, top_k, stop, seed and
    # max_new_tokens) in place of the call's, so that requests with different settings
    # share one running batch (the server's); its seed and `stream` seed the request's
    # random stream. None: the call's `SamplingParams` (training always leaves it so)
    sampling: SamplingParams | None = None
    # token id → a bias added to its logit before sampling (OpenAI's `logit_bias`; -100
    # bans a token, 100 all but forces it); the recorded logprobs stay the model's own
    logit_bias: dict[int, float] | None = None


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]  # unconstrained policy logprob of each sampled token
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    # with `top_logprobs` k > 0: per position, the k most likely (id, logprob) pairs of the
    # same unconstrained distribution `logprobs` is taken from, most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # under a constraint: per token, 1 if the grammar left a choice about it, 0 if it forced
    # it (engine/grammar.py `is_forced`); None without a constraint, or from an engine that
    # does not record it (loop/decisions.py then replays the grammar)
    free: list[int] | None = None


class RolloutEngine(Protocol):
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]: ...

    def load_weights(self, state_dict: dict[str, Any] | None = None) -> None:
        """Make the next `generate` sample from the current policy."""
        ...
