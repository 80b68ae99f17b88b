"""The `hf` rollout engine: batched sampling with a KV cache on any transformers model.

It samples from the very module the trainer updates, so step k's rollouts always come
from the step-k policy (`load_weights` has nothing to copy).

Logprobs under a constraint: when a forced tool call masks the vocabulary, tokens are
*sampled* from the masked distribution, but the logprob we record is the policy's
*unconstrained* `log_softmax(logits / T)` at the sampled token. That is the quantity the
trainer recomputes (it never sees the mask), so `rollout/logprob_gap` measures only
numerical drift between engine and trainer, and the importance ratio starts at 1.
The mask only removes tokens that would break the call, so the policy gradient pushes
probability towards the choices the constraint leaves open (e.g. which square).
"""

from __future__ import annotations

from typing import Any

import torch

from looprl.engine import Completion, GenerationRequest, SamplingParams
from looprl.engine.grammar import GrammarCache


class HFEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: list[int],
        batch_size: int = 64,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._grammars: GrammarCache | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, state_dict: dict[str, Any] | None = None) -> None:
        """Same module as the trainer's: nothing to copy."""

    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._grammars = GrammarCache(self.tokenizer, vocab, self.stop_token_ids)
        return self._grammars

    @torch.inference_mode()
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """Sample one completion per request. Requests are sorted by prompt length and
        decoded in batches of `batch_size` (left padding) to keep padding small."""
        generator = torch.Generator(device="cpu")
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()  # fresh entropy, without touching the global torch RNG
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[Completion | None] = [None] * len(requests)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                outs = self._generate_batch([requests[i] for i in chunk], params, generator)
                for i, out in zip(chunk, outs):
                    results[i] = out
        finally:
            self.model.train(was_training)
        return [r for r in results if r is not None]

    def _generate_batch(
        self, requests: list[GenerationRequest], params: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        batch = len(requests)
        device = self.device
        # Prefix sharing: the G samples of a task have the same prompt. Prefill each
        # distinct prompt once, then copy its KV rows to every request that uses it.
        unique: dict[tuple[int, ...], int] = {}
        rows_of = [unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in requests]
        prompts = list(unique)
        longest = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            attention[row, longest - len(prompt) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        expand = torch.tensor(rows_of, device=device)
        matchers = [
            self.grammars().matcher(r.constraint) if r.constraint is not None else None
            for r in requests
        ]
        bitmask = self._bitmask(batch) if any(m is not None for m in matchers) else None

        from transformers import DynamicCache

        cache = DynamicCache()
        ids: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        limits = [
            min(params.max_new_tokens, r.max_new_tokens or params.max_new_tokens) for r in requests
        ]
        done = torch.zeros(batch, dtype=torch.bool)
        step_input = input_ids
        for _ in range(params.max_new_tokens):
            out = self.model(
                input_ids=step_input,
                attention_mask=attention,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            logits_BV = out.logits[:, -1, :].float()
            if logits_BV.shape[0] != batch:  # after the shared prefill: one row per request
                cache.batch_select_indices(expand)
                logits_BV = logits_BV[expand]
                attention, positions = attention[expand], positions[expand]
            logits_BV = logits_BV.cpu()
            tokens_B, logp_B = self._sample(logits_BV, params, matchers, bitmask, done, generator)
            for row in range(batch):
                if done[row]:
                    continue
                token = int(tokens_B[row])
                ids[row].append(token)
                logprobs[row].append(float(logp_B[row]))
                if matchers[row] is not None:
                    matchers[row].accept_token(token)
                if token in self.stop_token_ids or self._hit_stop_string(ids[row], params):
                    done[row] = True
                    finish[row] = "stop"
                elif len(ids[row]) >= limits[row]:
                    done[row] = True
            if bool(done.all()):
                break
            step_input = tokens_B.view(batch, 1).to(device)
            attention = torch.cat(
                [attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], 1
            )
            positions = positions[:, -1:] + 1
        return [Completion(i, lp, f) for i, lp, f in zip(ids, logprobs, finish)]

    def _bitmask(self, batch: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(batch, self.grammars().info.vocab_size)

    def _sample(
        self,
        logits_BV: torch.Tensor,
        params: SamplingParams,
        matchers: list[Any],
        bitmask: torch.Tensor | None,
        done_B: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token of every row and its unconstrained logprob at temperature T."""
        temperature = params.temperature if params.temperature > 0 else 1.0
        scaled_BV = logits_BV / temperature
        logp_BV = torch.log_softmax(scaled_BV, dim=-1)
        candidates_BV = scaled_BV.clone()
        if bitmask is not None:
            import xgrammar as xgr

            constrained = []
            for row, matcher in enumerate(matchers):
                if matcher is not None and not done_B[row] and not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row)
                    constrained.append(row)
            if constrained:
                rows = torch.tensor(constrained)
                sub = candidates_BV[rows]
                xgr.apply_token_bitmask_inplace(sub, bitmask[rows])
                candidates_BV[rows] = sub
        if params.temperature <= 0:
            tokens_B = candidates_BV.argmax(dim=-1)
        else:
            candidates_BV = _filter_top_k_top_p(candidates_BV, params.top_k, params.top_p)
            probs_BV = torch.softmax(candidates_BV, dim=-1)
            tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
        return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)

    def _hit_stop_string(self, ids: list[int], params: SamplingParams) -> bool:
        if not params.stop:
            return False
        tail = self.tokenizer.decode(ids[-16:])
        return any(s in tail for s in params.stop)


def _filter_top_k_top_p(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits_BV, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass *before* it already reaches top_p (keeps >= 1 token)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV
