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

from dataclasses import dataclass
from typing import Any

import torch

from looprl.engine import Completion, GenerationRequest, SamplingParams
from looprl.engine.grammar import GrammarCache


@dataclass
class SharedPrefill:
    """A prefilled batch, one row per request: KV cache, the left-padded prompt's
    attention mask and positions, and the logits that predict the first new token."""

    cache: Any
    attention_BP: torch.Tensor
    positions_BP: torch.Tensor
    last_logits_BV: torch.Tensor


def shared_prefill(
    model: Any, prompts: list[list[int]], pad_id: int, device: torch.device
) -> SharedPrefill:
    """Prefix sharing: the G samples of a task have the same prompt. Each distinct prompt
    is prefilled once (left-padded, batch U) and its KV rows are then copied to every row
    that uses it. The copy is an indexing op, so under autograd the gradients of all
    rows flow back into the one prompt pass (the trainer relies on that)."""
    unique: dict[tuple[int, ...], int] = {}
    rows_of = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    longest = max(len(p) for p in unique)
    ids_UP = torch.full((len(unique), longest), pad_id, dtype=torch.long)
    attention_UP = torch.zeros((len(unique), longest), dtype=torch.long)
    for row, prompt in enumerate(unique):
        ids_UP[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_UP[row, longest - len(prompt) :] = 1
    ids_UP, attention_UP = ids_UP.to(device), attention_UP.to(device)
    positions_UP = (attention_UP.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids_UP,
        attention_mask=attention_UP,
        position_ids=positions_UP,
        use_cache=True,
        logits_to_keep=1,
    )
    expand = torch.tensor(rows_of, device=device)
    out.cache.batch_select_indices(expand)
    return SharedPrefill(
        out.cache, attention_UP[expand], positions_UP[expand], out.logits[expand, -1, :]
    )


class HFEngine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_token_ids: list[int],
        batch_size: int = 64,
        jump_forward: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids)
        self.batch_size = batch_size
        self.jump_forward = jump_forward
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
        matchers = [
            self.grammars().matcher(r.constraint) if r.constraint is not None else None
            for r in requests
        ]
        bitmask = self._bitmask(batch) if any(m is not None for m in matchers) else None

        ids: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        limits = [
            min(params.max_new_tokens, r.max_new_tokens or params.max_new_tokens) for r in requests
        ]
        done = torch.zeros(batch, dtype=torch.bool)
        temperature = params.temperature if params.temperature > 0 else 1.0
        prefill = shared_prefill(self.model, [r.prompt_ids for r in requests], self.pad_id, device)
        cache, attention, positions = prefill.cache, prefill.attention_BP, prefill.positions_BP
        next_BV = prefill.last_logits_BV.float().cpu()
        while True:
            jump = self._jump_forward(matchers, done, [lim - len(x) for lim, x in zip(limits, ids)])
            if jump is not None:
                tokens_BK = torch.tensor(jump, dtype=torch.long)
                first_B = torch.log_softmax(next_BV / temperature, -1).gather(-1, tokens_BK[:, :1])
            else:
                tokens_B, first_B = self._sample(
                    next_BV, params, matchers, bitmask, done, generator
                )
                tokens_BK, first_B = tokens_B[:, None], first_B[:, None]
            k = tokens_BK.shape[1]
            finished = self._finished(tokens_BK, ids, limits, done, params)
            logp_BK = first_B
            if k > 1 or not finished.all():
                out = self.model(
                    input_ids=tokens_BK.to(device),
                    attention_mask=torch.cat(
                        [attention, torch.ones((batch, k), dtype=attention.dtype, device=device)], 1
                    ),
                    position_ids=positions[:, -1:] + 1 + torch.arange(k, device=device),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=k,
                )
                cache = out.cache
                attention = torch.cat(
                    [attention, torch.ones((batch, k), dtype=attention.dtype, device=device)], 1
                )
                positions = positions[:, -1:] + 1 + torch.arange(k, device=device)
                logits_BKV = out.logits.float().cpu()
                if k > 1:  # forced tokens 2..k: their logprobs come from this pass
                    rest_BK = torch.log_softmax(logits_BKV[:, :-1] / temperature, -1)
                    rest_BK = rest_BK.gather(-1, tokens_BK[:, 1:, None]).squeeze(-1)
                    logp_BK = torch.cat([first_B, rest_BK], dim=1)
                next_BV = logits_BKV[:, -1]
            for row in range(batch):
                if done[row]:
                    continue
                for token, logp in zip(tokens_BK[row].tolist(), logp_BK[row].tolist()):
                    ids[row].append(token)
                    logprobs[row].append(logp)
                    if matchers[row] is not None and not matchers[row].is_terminated():
                        matchers[row].accept_token(token)
                if finished[row]:
                    done[row] = True
                    last = ids[row][-1]
                    stopped = last in self.stop_token_ids or self._hit_stop_string(ids[row], params)
                    finish[row] = "stop" if stopped else "length"
            if bool(done.all()):
                break
        return [Completion(i, lp, f) for i, lp, f in zip(ids, logprobs, finish)]

    def _finished(
        self,
        tokens_BK: torch.Tensor,
        ids: list[list[int]],
        limits: list[int],
        done: torch.Tensor,
        params: SamplingParams,
    ) -> torch.Tensor:
        """Which rows end once `tokens_BK` is appended (EOS, stop string or token limit)."""
        out = done.clone()
        for row in range(len(ids)):
            if done[row]:
                continue
            new = tokens_BK[row].tolist()
            hit_eos = new[-1] in self.stop_token_ids
            full = len(ids[row]) + len(new) >= limits[row]
            out[row] = hit_eos or full or self._hit_stop_string(ids[row] + new, params)
        return out

    def _jump_forward(
        self, matchers: list[Any], done: torch.Tensor, room: list[int]
    ) -> list[list[int]] | None:
        """Jump-forward decoding: when the grammar allows only one continuing *string* for
        every live row, append its tokens in one forward pass instead of sampling them one
        by one. The string is tokenized canonically (sampling would pick that tokenization
        almost surely); the recorded logprobs are the policy's, as for sampled tokens.
        Returns k ≥ 2 tokens per row (pad for finished rows), or None."""
        if not self.jump_forward:
            return None
        live = [row for row in range(len(matchers)) if not done[row]]
        if not live or any(matchers[row] is None for row in live):
            return None
        forced: dict[int, list[int]] = {}
        for row in live:
            text = matchers[row].find_jump_forward_string()
            if not text:
                return None
            forced[row] = self.tokenizer.encode(text, add_special_tokens=False)
        k = min(min(len(t) for t in forced.values()), min(room[row] for row in live))
        if k < 2:
            return None
        return [
            forced[row][:k] if row in forced else [self.pad_id] * k for row in range(len(matchers))
        ]

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
