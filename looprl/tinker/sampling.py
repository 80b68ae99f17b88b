"""Sampling on the Tinker server: a sampler holds a fixed snapshot of the weights it was
made from (the adapter weights copied at `save_weights_for_sampler`, or the base model's
own), and each `asample` runs the `hf` engine (`engine/hf.py`) on those weights, with the
prompt's own logprobs from one plain forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.errors import RequestError
from looprl.tinker.wire import Sequence, encode_sample_response, model_input_tokens

# the sentinel of a top-k row with nothing in it (`tinker.types.topk_logprobs.MASK_LOGPROB`)
MASK_LOGPROB = -99999.0
DEFAULT_MAX_TOKENS = 256


@dataclass
class Sampler:
    """A sampling session: the model it samples (a training client's PEFT model, or a base
    model) and, for a trained one, the adapter weights it was made from."""

    sampler_id: str
    base_model: str
    model: Any
    tokenizer: Any
    snapshot: dict[str, torch.Tensor] | None = None
    model_path: str | None = None

    @contextmanager
    def weights(self) -> Iterator[Any]:
        """The model with this sampler's snapshot in place of the live adapter weights,
        put back afterwards (all model work runs on one thread, one request at a time)."""
        if self.snapshot is None:
            yield self.model
            return
        own = dict(self.model.named_parameters())
        live = {name: own[name].detach().clone() for name in self.snapshot}
        with torch.no_grad():
            for name, value in self.snapshot.items():
                own[name].copy_(value)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, value in live.items():
                    own[name].copy_(value)


def stop_settings(stop: Any, tokenizer: Any) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) of a request's `stop`: None keeps EOS; [] stops on
    nothing; a string or strings; or token ids."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if stop is None:
        return eos, []
    if isinstance(stop, str):
        return eos, [stop]
    if all(isinstance(s, int) for s in stop):
        return [int(s) for s in stop], []
    if all(isinstance(s, str) for s in stop):
        return eos, list(stop)
    raise RequestError("sampling_params.stop: give strings or token ids, not a mix")


def prompt_scores(
    model: Any, ids: list[int], top_k: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """log p(ids[i] | ids[:i]) for every prompt position (NaN at 0, which has no context),
    and with `top_k` the k most likely tokens at each position (the sentinel row at 0)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits_LV = model(input_ids=torch.tensor([ids], device=device)).logits[0].float()
    logp_LV = torch.log_softmax(logits_LV, dim=-1)
    targets_L = torch.tensor(ids[1:], device=device)
    scores = torch.full((len(ids),), float("nan"))
    scores[1:] = logp_LV[:-1].gather(1, targets_L[:, None])[:, 0].cpu()
    if top_k <= 0:
        return scores.numpy(), None
    values_LK, indices_LK = logp_LV[:-1].topk(top_k, dim=-1)
    top_ids = np.zeros((len(ids), top_k), dtype=np.int32)
    top_lps = np.full((len(ids), top_k), MASK_LOGPROB, dtype=np.float32)
    top_ids[1:] = indices_LK.cpu().numpy()
    top_lps[1:] = values_LK.cpu().numpy()
    return scores.numpy(), (top_ids, top_lps)


def sample(sampler: Sampler, request: dict[str, Any]) -> bytes:
    """An `asample` request's `SampleResponse`, serialized."""
    prompt = model_input_tokens(request.get("prompt", {}).get("chunks", []))
    if not prompt:
        raise RequestError("prompt: the model input holds no tokens")
    params = request.get("sampling_params") or {}
    n = int(request.get("num_samples", 1))
    if n < 1:
        raise RequestError(f"num_samples={n}: ask for 1 or more")
    vocab = sampler.model.get_output_embeddings().weight.shape[0]
    if max(prompt) >= vocab or min(prompt) < 0:
        raise RequestError(f"prompt: token ids must lie in [0, {vocab}) for this model")
    stop_ids, stop_strings = stop_settings(params.get("stop"), sampler.tokenizer)
    top_k = int(params.get("top_k", -1))
    settings = SamplingParams(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=max(top_k, 0),
        max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
        seed=params.get("seed"),
        stop=stop_strings,
    )
    k_sample = int(request.get("topk_sample_logprobs") or 0)
    with sampler.weights() as model:
        engine = HFEngine(
            model,
            sampler.tokenizer,
            stop_token_ids=stop_ids,
            batch_size=max(n, 1),
            jump_forward=False,
            cascade_attention=False,
            weight_first_linear=False,
            packed_linear=False,
        )
        requests = [
            GenerationRequest(prompt_ids=list(prompt), top_logprobs=k_sample, stream=i)
            for i in range(n)
        ]
        completions = engine.generate(requests, settings)
        k_prompt = int(request.get("topk_prompt_logprobs") or 0)
        want_prompt = bool(request.get("prompt_logprobs")) or k_prompt > 0
        scores, top = prompt_scores(model, prompt, k_prompt) if want_prompt else (None, None)
    sequences = []
    for completion in completions:
        top_ids = top_lps = None
        if k_sample and completion.top_logprobs:
            top_ids = np.array([[t for t, _ in row] for row in completion.top_logprobs])
            top_lps = np.array([[lp for _, lp in row] for row in completion.top_logprobs])
        sequences.append(
            Sequence(
                tokens=completion.ids,
                logprobs=completion.logprobs,
                stopped=completion.finish_reason == "stop",
                top_ids=top_ids,
                top_logprobs=top_lps,
            )
        )
    return encode_sample_response(
        sequences, scores if request.get("prompt_logprobs") else None, top
    )
