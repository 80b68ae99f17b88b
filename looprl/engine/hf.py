"""The `hf` rollout engine: batched sampling with a KV cache on any transformers model.

It samples from the very module the trainer updates, so step k's rollouts always come
from the step-k policy (`load_weights` has nothing to copy). Optionally (`sampler_dtype`)
it samples from a lower-precision copy instead, refreshed whenever the policy's trainable
weights have changed: faster on CPUs with bf16 units, at the price of sampling from a
slightly different distribution than the one the trainer scores (the trainer computes
its own old logprobs, so the importance ratios stay exact; `rollout/logprob_gap` shows
the mismatch).

Logprobs under a constraint: when a forced tool call masks the vocabulary, tokens are
*sampled* from the masked distribution, but the logprob we record is the policy's
*unconstrained* `log_softmax(logits / T)` at the sampled token. That is the quantity the
trainer recomputes (it never sees the mask), so `rollout/logprob_gap` measures only
numerical drift between engine and trainer, and the importance ratio starts at 1.
The mask only removes tokens that would break the call, so the policy gradient pushes
probability towards the choices the constraint leaves open (e.g. which square). Each
token generated under a grammar is also marked as free or forced by it
(`Completion.free`, engine/grammar.py `is_forced`), so nobody has to replay the grammar
to find a call's decision tokens (loop/decisions.py).

The running batch's forward pass (k tokens appended to every row, the jump-forward's
forced logprobs a chunk of rows at a time) is `engine/forward_step.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from looprl.algo.logprobs import scoring_temperature
from looprl.engine import Completion, GenerationRequest, SamplingParams
from looprl.engine.compiled_step import CompiledStep
from looprl.engine.deferred import Pending, deferrable, deferred_step
from looprl.engine.forward_step import batch_forward
from looprl.engine.grammar import GrammarCache, jump_forward_tokens
from looprl.engine.running import CHUNK_TOKENS, RunningBatch
from looprl.engine.sampling import (
    Row,
    advance_grammar,
    advance_thinking,
    choose,
    sample_rows,
    settings,
    thinking_fields,
)
from looprl.forward import cascade, fast_linear
from looprl.forward.kv import Part, Retained, bufferable
from looprl.model.arch import fast_paths
from looprl.model.load import base_model
from looprl.model.memory import release_free_memory
from looprl.seeds import stream_seed


class HFEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: list[int],
        batch_size: int = 64,
        jump_forward: bool = True,
        sampler_dtype: str | torch.dtype | None = None,
        cascade_attention: bool = True,
        weight_first_linear: bool = True,
        packed_linear: bool = True,
        compile_step: str = "off",
    ) -> None:
        self.policy_model = model
        self.model = model  # the module that samples: the policy or its low-precision copy
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.batch_size = batch_size
        # the fast paths that are exact for this architecture (the others are skipped)
        self.paths = fast_paths(base_model(model).config)
        self.jump_forward = jump_forward and self.paths.jump_forward
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._grammars: GrammarCache | None = None
        self._bitmask_rows: torch.Tensor | None = None
        self.sampler_dtype = (
            getattr(torch, sampler_dtype) if isinstance(sampler_dtype, str) else sampler_dtype
        )
        self._sampler_versions: list[int] | None = None
        self._retained: list[Retained] | None = None  # inside `session()`: the last call's rows
        # the prompts' shared head kept once per batch (cascade attention), where it applies
        self.cascade = cascade.enable(model) if cascade_attention and self.paths.cascade else False
        # the decode step at fixed shapes, compiled (engine/compiled_step.py)
        self.compiled = CompiledStep(compile_step, self.device)
        # sampling's linear layers in the faster forms of this machine (forward/fast_linear.py);
        # not oneDNN's packed weights under compile: inductor cannot lower them
        self.weight_first_linear = weight_first_linear
        self.packed_linear = packed_linear and not self.compiled.on
        forms = self._linear_forms(model)
        self.weight_first, self.packed = forms.weight_first, forms.packed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, Any] | None = None) -> None:
        """Same module as the trainer's: nothing to copy (a low-precision sampler copy
        refreshes itself when the policy's weights change)."""

    @contextmanager
    def session(self) -> Iterator[None]:
        """Multi-turn rollouts: within the session, each `generate` keeps the KV of its
        finished rows whose request says `keep_kv`, and the next call's requests that
        extend one of them (the same episode's next turn) prefill only their new tokens.
        Kept KV lives until the next call has prefilled its requests. Weights must not change
        inside a session; the kept KV is freed when it ends."""
        self._retained = []
        try:
            yield
        finally:
            self._retained = None
            fast_linear.unpack(self.model)

    def _refresh_sampler(self) -> None:
        """Point `self.model` at the module to sample from. With `sampler_dtype`, that is
        a copy of the policy in that dtype, whose weights are re-copied when any policy
        weight has changed since (in-place updates bump a tensor's version counter)."""
        policy = self.policy_model
        if self.sampler_dtype is None or next(policy.parameters()).dtype == self.sampler_dtype:
            self.model = policy
            return
        params = list(policy.parameters())
        versions = [p._version for p in params]
        if self.model is policy:
            self.model = copy.deepcopy(policy).to(self.sampler_dtype).eval()
            self.model.requires_grad_(False)
            self._linear_forms(self.model)  # measured again: the copy has its own dtype
        elif versions != self._sampler_versions:
            with torch.no_grad():
                for mine, theirs, old, new in zip(
                    self.model.parameters(), params, self._sampler_versions or [], versions
                ):
                    if old != new:
                        mine.copy_(theirs)
            fast_linear.unpack(self.model)  # inference tensors: no version to tell it by
        self._sampler_versions = versions

    def _linear_forms(self, model: Any) -> fast_linear.Forms:
        """Switch `model`'s linear layers to the forms this machine runs faster (each
        timed, or off where the engine's settings turn it off)."""
        return fast_linear.enable(
            model,
            weight_first=None if self.weight_first_linear else False,
            packed=None if self.packed_linear else False,
        )

    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._grammars = GrammarCache(self.tokenizer, vocab, self.stop_token_ids)
        return self._grammars

    @torch.inference_mode()
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """Sample one completion per request.

        Continuous batching (engine/running.py): requests wait in order of prompt
        length; up to `batch_size` decode together. Finished rows leave the batch once a
        quarter of it has finished, and waiting requests join when a quarter of the
        slots are free (their prompts prefilled together, sharing prefixes). Every
        request samples from its own random stream, seeded from `params.seed` and its
        index in `requests` (or its `stream`), so a seeded result does not depend on the
        batch size or on which requests run alongside it."""
        if not requests:
            return []
        previous, keep_rows = self._retained or [], self._retained is not None
        if keep_rows:
            self._retained = []
        batch = self.open_batch(params)
        batch.previous, batch.keep_rows = previous, keep_rows
        batch.add(requests)
        results: list[Completion | None] = [None] * len(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            while batch.busy:
                for index, completion in batch.step():
                    results[index] = completion
        finally:
            self.model.train(was_training)
            batch.close()
            if not keep_rows:  # a session keeps the packed weights until it ends
                fast_linear.unpack(self.model)
            release_free_memory()
        return [r for r in results if r is not None]

    def open_batch(
        self, params: SamplingParams, eager: bool = False, chunk_tokens: int = CHUNK_TOKENS
    ) -> RunningBatch:
        """A running batch on this engine (engine/running.py): `generate` steps one to the
        end; a server keeps an `eager` one open, adds requests as they arrive and steps
        it (under `torch.inference_mode()`) while it is busy. Requests that carry their
        own `sampling` settings need no common `params`."""
        self._refresh_sampler()
        fast_linear.pack(self.model)  # layers whose packed form is on (until unpacked)
        seed = params.seed
        if seed is None:
            seed = torch.Generator().seed()  # fresh entropy, global RNG untouched
        return RunningBatch(self, params, seed, eager=eager, chunk_tokens=chunk_tokens)

    def _plain(self, cache: Any) -> bool:
        """Whether the rows of this cache may move into buffers, merge and be kept."""
        return self.paths.kv_buffers and bufferable(cache)

    def _row(
        self, index: int, request: GenerationRequest, params: SamplingParams, base_seed: int
    ) -> Row:
        matcher = None
        if request.constraint is not None:
            matcher = self.grammars().matcher(request.constraint)
        own = request.sampling or params
        limit = min(own.max_new_tokens, request.max_new_tokens or own.max_new_tokens)
        if own.seed is not None:
            base_seed = own.seed
        stream = index if request.stream is None else request.stream
        return Row(
            index,
            request.prompt_ids,
            limit,
            matcher,
            stream_seed(base_seed, stream),
            request.keep_kv,
            request.top_logprobs,
            request.on_token,
            free=None if matcher is None else [],
            sampling=request.sampling,
            logit_bias=request.logit_bias,
            **thinking_fields(request.constraint),
        )

    def _step(
        self,
        running: Part,
        rows: list[Row],
        params: SamplingParams,
        early: Callable[[list[Row]], None] | None = None,
        pending: Pending | None = None,
    ) -> list[Row]:
        """Choose the next token(s) of every live row, run them through the model, and
        return the rows that finished. `early` hears of the rows that finish with a
        sampled token before the model runs the others' (their results are final).
        `pending`: tokens kept on the device a few steps (engine/deferred.py)."""
        if pending is not None and (pending.steps or deferrable(rows, params, bool(early))):
            return deferred_step(self, running, rows, params, pending)
        temperature = self._temperatures(rows, params)
        top_k = max((row.top_k for row in rows if not row.done), default=0)
        jump = jump_forward_tokens(rows, self.tokenizer, self.pad_id) if self.jump_forward else None
        tokens_CK, logp_CK, tops = choose(
            running.logits_CV.float(),  # sampled where it lies: only the choices cross
            rows,
            jump,
            lambda logits_CV: self._sample(logits_CV, params, rows),
            temperature,
            top_k,
        )
        k = tokens_CK.shape[1]
        finished = self._finished(tokens_CK, rows, params)
        if k == 1:  # before the next forward pass, so that a streaming caller hears sooner
            self._append(rows, tokens_CK, logp_CK, tops)
            if early is not None:
                now = [row for j, row in enumerate(rows) if finished[j] and not row.done]
                for row in now:
                    row.finish = self._finish_reason(row, params)
                early(now)
        if k > 1 or not all(finished[j] or row.done for j, row in enumerate(rows)):
            step = (running, tokens_CK, rows, temperature, top_k, self.compiled)
            rest_CK, rest_tops = batch_forward(self.model, self.device, *step)
            if k > 1:  # forced tokens 2..k: their logprobs come from this pass
                logp_CK = torch.cat([logp_CK, rest_CK], dim=1)
                if tops is not None:
                    tops = [first + later for first, later in zip(tops, rest_tops)]
        if k > 1:
            self._append(rows, tokens_CK, logp_CK, tops)
        advance_thinking(rows, self.tokenizer)
        ended = []
        for j, row in enumerate(rows):
            if row.done:
                continue
            if finished[j]:
                row.done = True
                row.finish = self._finish_reason(row, params)
                ended.append(row)
        return ended

    def _finish_reason(self, row: Row, params: SamplingParams) -> str:
        """ "stop" for a row that ended at EOS or a stop string, else "length"."""
        stop = settings(row, params).stop
        stopped = row.ids[-1] in self.stop_token_ids or self._hit_stop_string(row.ids, stop)
        return "stop" if stopped else "length"

    @staticmethod
    def _temperatures(rows: list[Row], params: SamplingParams) -> float | list[float]:
        """The temperature the rows' logprobs are taken at: the call's, or (where requests
        carry their own settings) each row's."""
        if all(row.sampling is None for row in rows):
            return scoring_temperature(params.temperature)
        return [scoring_temperature(settings(row, params).temperature) for row in rows]

    def _append(
        self, rows: list[Row], tokens_CK: torch.Tensor, logp_CK: torch.Tensor, tops: list | None
    ) -> None:
        """Give each live row its new tokens (advancing its grammar), and tell a streaming
        caller of each one."""
        for j, row in enumerate(rows):
            if row.done:
                continue
            for pos, (token, logp) in enumerate(zip(tokens_CK[j].tolist(), logp_CK[j].tolist())):
                row.ids.append(token)
                row.logprobs.append(logp)
                if row.forced and row.forced[0] == token:
                    row.forced.pop(0)
                top = tops[j][pos][: row.top_k] if tops is not None and row.top_k else None
                if top is not None:
                    row.top.append(top)
                if row.on_token is not None:
                    row.on_token(token, logp, top)
                if row.matcher is not None:
                    advance_grammar(row, token, self.tokenizer, self._bitmask(1)[:1])

    def _finished(
        self, tokens_CK: torch.Tensor, rows: list[Row], params: SamplingParams
    ) -> list[bool]:
        """Which live rows end once `tokens_CK` is appended (EOS, stop string, limit)."""
        out = []
        for j, row in enumerate(rows):
            if row.done:
                out.append(False)
                continue
            new = tokens_CK[j].tolist()
            out.append(
                new[-1] in self.stop_token_ids
                or len(row.ids) + len(new) >= row.limit
                or self._hit_stop_string(row.ids + new, settings(row, params).stop)
            )
        return out

    def _sample(
        self, logits_CV: torch.Tensor, params: SamplingParams, rows: list[Row], ahead: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_rows(logits_CV, params, rows, self.pad_id, self._bitmask, ahead)

    def _bitmask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask_rows is None or self._bitmask_rows.shape[0] < rows:
            self._bitmask_rows = xgr.allocate_token_bitmask(
                max(rows, 8), self.grammars().info.vocab_size
            )
        return self._bitmask_rows

    def _hit_stop_string(self, ids: list[int], stop: list[str]) -> bool:
        if not stop:
            return False
        tail = self.tokenizer.decode(ids[-16:])
        return any(s in tail for s in stop)
