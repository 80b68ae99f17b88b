"""Chat inference on a model or a run: the layer under `looprl serve` and `looprl play`.
A request is one typed `ChatRequest` (openai/wire.py); `chat()` and `complete()` build
it from their arguments, `chat_many` takes it as the server built it.

`load_chat_model(spec)` (apps/loading.py) takes a model (alias, hub id, local folder,
`gguf:PATH`) or a run folder. A run is served as two *variants* of one model: "trained"
(the base model plus the run's newest checkpoint) and "baseline" (the base model as it
was before training). For a LoRA run the baseline is the same module with its adapters
switched off; for a full fine-tune it is a second copy of the base weights, loaded on
first use.

`tool_choice` decides how tools are used:
- "auto": tools are in the prompt; calls are parsed when the text has any;
- "none": no tools are rendered and nothing is parsed;
- "required" / a tool's name: the engine's constrained decoding forces one valid call
  (of any tool / of that tool), so the reply always parses.
`response_format` (OpenAI's json_object / json_schema) forces a JSON reply the same way.
`complete(prompt)` continues a raw text or token-id prompt, with no chat template.
`on_token` streams: it hears of each token as the engine chooses it.

Sampling is the rollout engine's, so replies come from exactly the policy the trainer
updates. `logprobs` are the engine's sampling logprobs (at temperature T, or T=1 when
greedy; unconstrained even when a call is forced; see engine/hf.py).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from looprl.apps.checks import (
    check_messages,
    check_sampling,
    for_choice,
    logit_bias_ids,
    raw_prompt_ids,
)
from looprl.chat import ChatRenderer
from looprl.config import Config
from looprl.engine import Completion, GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.engine.requests import check_tools, generation_request
from looprl.errors import ChatError, LoopRLError, RequestError
from looprl.forward.score import prompt_logprobs
from looprl.loop.policy import Policy, make_engine, pick_device, pick_dtype
from looprl.openai.replies import chat_choice
from looprl.openai.wire import ChatChoice, ChatRequest
from looprl.types import Message, ToolCall


@dataclass
class Prepared:
    """One validated request, rendered to prompt ids, with its engine request."""

    request: ChatRequest
    variant: str
    tools: list[dict[str, Any]] | None  # tools rendered and parsed (None for "none")
    generation: GenerationRequest  # prompt ids, constraint, token limit: each choice's

    def batch_key(self) -> tuple:
        """Requests with equal keys share one engine call (per-request max_tokens and
        constraints are per-row in the engine; the rest are call-wide settings)."""
        r = self.request
        return (self.variant, float(r.temperature), float(r.top_p), tuple(r.stop), r.seed)


class ChatModel:
    """A loaded model (or run) answering chat requests. Thread-safe: one lock around
    the engine, so concurrent callers take turns; batch them with `chat_many`. The
    server instead prepares each request on its own thread (`prepare`) and keeps one
    running batch per variant on the engine (apps/batcher.py), holding `engine_lock`
    for each step."""

    def __init__(
        self,
        name: str,
        policy: Policy,
        cfg: Config,
        variants: tuple[str, ...],
        checkpoint: Path | None = None,
    ) -> None:
        self.name = name  # what /v1/models lists, e.g. "smollm2-135m" or the run name
        self.variants = variants  # ("trained", "baseline") for a trained run, else ("base",)
        self.checkpoint = checkpoint  # the run checkpoint behind "trained", if any
        self.policy = policy
        self.renderer: ChatRenderer = policy.renderer
        self.tokenizer = policy.tokenizer
        self.engine: HFEngine = policy.engine  # the "trained" / "base" engine
        self.context_length = getattr(policy.model.config, "max_position_embeddings", None)
        self._cfg = cfg
        self._baseline_engine: HFEngine | None = None
        self._lock = threading.Lock()
        self.engine_lock = self._lock  # held while the engine generates
        self._grammar_lock = threading.Lock()  # compiling into the engine's grammar cache
        self._longest_token: int | None = None  # characters of the vocabulary's longest

    # ------------------------------------------------------------ public

    @property
    def config(self) -> Config:
        """The run's config (a plain model: the one it was loaded with)."""
        return self._cfg

    def chat(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        tool_choice: str = "auto",
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        stop: list[str] | None = None,
        seed: int | None = None,
        variant: str | None = None,
        response_format: dict[str, Any] | None = None,
        top_logprobs: int = 0,
        on_token: Callable[[int, int, float, Any], None] | None = None,
    ) -> list[ChatChoice]:
        """`n` sampled replies to one conversation (the fields are `ChatRequest`'s)."""
        request = ChatRequest(
            messages=messages,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop=list(stop or []),
            seed=seed,
            top_logprobs=top_logprobs,
            variant=variant,
            on_token=on_token,
        )
        return self.chat_many([request])[0]  # type: ignore[return-value]

    def complete(
        self,
        prompt: str | list[int],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 16,
        stop: list[str] | None = None,
        seed: int | None = None,
        variant: str | None = None,
        top_logprobs: int = 0,
        on_token: Callable[[int, int, float, Any], None] | None = None,
        prompt_logprobs: bool = False,
    ) -> list[ChatChoice]:
        """`n` continuations of a raw prompt (text, or token ids), no chat template.
        `prompt_logprobs`: also score the prompt's own tokens (`ChatChoice.prompt_logprobs`)."""
        request = ChatRequest(
            prompt=prompt,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop=list(stop or []),
            seed=seed,
            top_logprobs=top_logprobs,
            variant=variant,
            on_token=on_token,
            prompt_logprobs=prompt_logprobs,
        )
        return self.chat_many([request])[0]  # type: ignore[return-value]

    def chat_many(
        self, requests: list[ChatRequest], return_exceptions: bool = False
    ) -> list[list[ChatChoice]]:
        """Several requests (chats, or raw prompts) batched into one engine call where their
        sampling settings and variant agree. Every request is validated and rendered
        before anything is generated. A seeded request gets an engine call of its own, so
        its samples do not depend on what else was asked at the same time.

        With `return_exceptions`, a request that fails puts its exception in its slot
        instead of failing the others (the server relies on this)."""
        with self._lock:
            prepared: list[Prepared | Exception] = []
            for request in requests:
                try:
                    prepared.append(self.prepare(request))
                except LoopRLError as err:
                    if not return_exceptions:
                        raise
                    prepared.append(err)
            groups: dict[tuple, list[int]] = {}
            for i, item in enumerate(prepared):
                if isinstance(item, Prepared):
                    key = item.batch_key() if item.request.seed is None else (item.batch_key(), i)
                    groups.setdefault(key, []).append(i)
            results: list[Any] = list(prepared)
            for indices in groups.values():
                try:
                    outs = self._generate([prepared[i] for i in indices])  # type: ignore[misc]
                except Exception as err:
                    if not return_exceptions:
                        raise
                    outs = [err] * len(indices)
                for i, out in zip(indices, outs):
                    results[i] = out
        return results

    # ------------------------------------------------------------ preparing

    def prepare(self, request: ChatRequest) -> Prepared:
        """Validate one request, render its prompt and build its engine request. Any
        thread, several at once (only grammar compiling takes turns), so that a huge
        prompt being tokenized holds up no other request."""
        r = request
        variant = self.variants[0] if r.variant is None else r.variant
        if variant not in self.variants:
            raise RequestError(
                f"unknown variant {variant!r}; {self.name} has: {', '.join(self.variants)}",
                "model",
            )
        check_sampling(r.n, r.temperature, r.top_p, r.max_tokens, r.stop, r.top_logprobs)
        if r.prompt is not None:
            tools, tool_choice, response_format = None, "none", None
            self._check_length(r)
            prompt_ids = raw_prompt_ids(self.tokenizer, r.prompt)
        else:
            check_messages(r.messages)  # type: ignore[arg-type]
            self._check_length(r)
            tool_choice, response_format = r.tool_choice, r.response_format
            tools = check_tools(r.tools, tool_choice)
            try:
                prompt_ids = self.renderer.prompt_ids(r.messages, tools)  # type: ignore[arg-type]
            except ChatError as err:
                raise RequestError(str(err), "messages") from None
        with self._grammar_lock:
            generation = generation_request(
                prompt_ids,
                tools,
                tool_choice,
                self.renderer.format,
                r.max_tokens,
                self.engine,
                response_format,
            )
        generation.top_logprobs = r.top_logprobs
        generation.logit_bias = logit_bias_ids(r.logit_bias, len(self.tokenizer))
        if self.context_length is not None:
            room = self.context_length - len(prompt_ids)
            if room < 1:
                raise RequestError(
                    f"the prompt has {len(prompt_ids)} tokens, and {self.name} reads at "
                    f"most {self.context_length}; shorten the conversation",
                    "messages",
                )
            generation.max_new_tokens = min(r.max_tokens, room)
        return Prepared(request, variant, tools, generation)

    def _check_length(self, r: ChatRequest) -> None:
        """Refuse, before tokenizing it, a prompt whose text alone is surely longer than
        the context: no token spells more characters than the vocabulary's longest, so
        a text of C characters has at least C / longest tokens (a 5 MB prompt is refused
        at once instead of after seconds of tokenizing)."""
        if self.context_length is None:
            return
        if isinstance(r.prompt, str):
            chars = len(r.prompt)
        elif r.prompt is None:
            chars = sum(len(m.content) for m in r.messages or [] if isinstance(m.content, str))
        else:
            return  # token ids: counted exactly below
        if self._longest_token is None:
            self._longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)
        fewest = chars // max(1, self._longest_token)
        if fewest > self.context_length:
            raise RequestError(
                f"the prompt has at least {fewest} tokens, and {self.name} reads at most "
                f"{self.context_length}; shorten the conversation",
                "messages" if r.prompt is None else "prompt",
            )

    # ------------------------------------------------------------ generating

    def _generate(self, batch: list[Prepared]) -> list[list[ChatChoice]]:
        first = batch[0].request
        params = SamplingParams(
            temperature=float(first.temperature),
            top_p=float(first.top_p),
            max_new_tokens=max(p.generation.max_new_tokens for p in batch),  # type: ignore[type-var]
            seed=first.seed,
            stop=list(first.stop),
        )
        requests = [
            replace(
                p.generation,
                prompt_ids=list(p.generation.prompt_ids),
                on_token=None if p.request.on_token is None else for_choice(p.request.on_token, k),
            )
            for p in batch
            for k in range(p.request.n)
        ]
        with self.engine_for(batch[0].variant) as engine:
            completions = engine.generate(requests, params)
            out: list[list[ChatChoice]] = []
            pos = 0
            for p in batch:
                out.append(self.choices(p, completions[pos : pos + p.request.n], engine))
                pos += p.request.n
        return out

    def choice_requests(self, p: Prepared) -> list[GenerationRequest]:
        """The engine requests of a prepared request's choices, each carrying the
        request's own sampling settings, so that requests with any settings share one
        running batch. A seeded request's choice k samples from stream k of its seed:
        the stream `generate` gives it when the request runs alone."""
        r = p.request
        sampling = SamplingParams(
            temperature=float(r.temperature),
            top_p=float(r.top_p),
            max_new_tokens=p.generation.max_new_tokens or r.max_tokens,
            seed=r.seed,
            stop=list(r.stop),
        )
        return [
            replace(
                p.generation,
                prompt_ids=list(p.generation.prompt_ids),
                on_token=None if r.on_token is None else for_choice(r.on_token, k),
                sampling=sampling,
                stream=k if r.seed is not None else None,
            )
            for k in range(r.n)
        ]

    def choices(
        self, p: Prepared, completions: list[Completion], engine: HFEngine
    ) -> list[ChatChoice]:
        """A request's choices from its completions (with its prompt's own logprobs when
        it asked for them: one more forward pass, on `engine`)."""
        scores = None
        if p.request.prompt_logprobs:
            temperature = float(p.request.temperature) if p.request.temperature > 0 else 1.0
            prompt = p.generation.prompt_ids
            scores = prompt_logprobs(engine.model, prompt, temperature, p.request.top_logprobs)
        out = [self._choice(p, c) for c in completions]
        for choice in out:
            choice.prompt_logprobs = scores
        return out

    def _choice(self, p: Prepared, completion: Completion) -> ChatChoice:
        g = p.generation
        return chat_choice(
            self.renderer,
            completion,
            g.prompt_ids,
            p.tools,
            g.constraint,
            g.max_new_tokens or p.request.max_tokens,
            _call_id,
            p.request.stop,
            parallel_tool_calls=p.request.parallel_tool_calls,
        )

    @contextlib.contextmanager
    def engine_for(self, variant: str) -> Iterator[HFEngine]:
        """The engine that samples `variant`, set up for it while the block runs (a LoRA
        run's baseline is the same engine with its adapters off)."""
        if variant != "baseline":
            yield self.engine
        elif self._cfg.model.lora.enabled:
            with self.policy.model.disable_adapter():  # the base weights, as before training
                yield self.engine
        else:
            yield self._load_baseline_engine()

    def _load_baseline_engine(self) -> HFEngine:
        """Full fine-tune: the untouched base weights, as a second model (first use only)."""
        if self._baseline_engine is None:
            from looprl.model.load import load_causal_lm

            model_cfg = self._cfg.model
            device = pick_device(model_cfg.device)
            model = load_causal_lm(
                model_cfg.name, pick_dtype(model_cfg.dtype, device), model_cfg.trust_remote_code
            ).to(device)
            model.eval()
            self._baseline_engine = make_engine(self._cfg, model, self.tokenizer, self.renderer)
        return self._baseline_engine


def _call_id(j: int, call: ToolCall) -> str:
    """A served tool call's id: the one the template wrote, else a fresh `call_…`."""
    return call.id or f"call_{uuid.uuid4().hex[:24]}"
