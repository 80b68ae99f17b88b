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


@dataclass
class Asked:
    """One `asample` request, read and checked."""

    prompt: list[int]
    n: int
    stop_ids: tuple[int, ...]
    settings: SamplingParams
    k_sample: int
    k_prompt: int
    prompt_logprobs: bool


def read_request(sampler: Sampler, request: dict[str, Any]) -> Asked:
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
    seed = params.get("seed")
    if seed is None:  # its own fresh stream: unseeded requests batched together must not
        seed = torch.Generator().seed()  # share one (a group's one-sample requests)
    settings = SamplingParams(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=max(int(params.get("top_k", -1)), 0),
        max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
        seed=int(seed),
        stop=stop_strings,
    )
    return Asked(
        prompt=prompt,
        n=n,
        stop_ids=tuple(stop_ids),
        settings=settings,
        k_sample=int(request.get("topk_sample_logprobs") or 0),
        k_prompt=int(request.get("topk_prompt_logprobs") or 0),
        prompt_logprobs=bool(request.get("prompt_logprobs")),
    )


def sample_batch(sampler: Sampler, requests: list[dict[str, Any]]) -> list[bytes | Exception]:
    """Several `asample` requests on one sampler, each one's `SampleResponse` serialized
    (or the error that refuses it). The requests' samples run as one running batch of the
    engine (one per distinct set of stop token ids); each sample draws from its own random
    stream (its request's seed, fresh entropy when it has none, and its index), so batching
    changes no sample."""
    asked: list[Asked | Exception] = []
    for request in requests:
        try:
            asked.append(read_request(sampler, request))
        except RequestError as err:
            asked.append(err)
    served = [a for a in asked if isinstance(a, Asked)]
    completions: dict[int, list[Any]] = {}
    with sampler.weights() as model:
        for stop_ids in dict.fromkeys(a.stop_ids for a in served):
            group = [a for a in served if a.stop_ids == stop_ids]
            engine = HFEngine(
                model,
                sampler.tokenizer,
                stop_token_ids=list(stop_ids),
                batch_size=sum(a.n for a in group),
                jump_forward=False,
                cascade_attention=False,
                weight_first_linear=False,
                packed_linear=False,
            )
            rows = [
                GenerationRequest(
                    prompt_ids=list(a.prompt),
                    top_logprobs=a.k_sample,
                    stream=i,
                    sampling=a.settings,
                )
                for a in group
                for i in range(a.n)
            ]
            done = iter(engine.generate(rows, group[0].settings))
            for a in group:
                completions[id(a)] = [next(done) for _ in range(a.n)]
        out: list[bytes | Exception] = []
        for a in asked:
            if isinstance(a, Exception):
                out.append(a)
                continue
            want = a.prompt_logprobs or a.k_prompt > 0
            scores, top = prompt_scores(model, a.prompt, a.k_prompt) if want else (None, None)
            sequences = [as_sequence(c, a.k_sample) for c in completions[id(a)]]
            out.append(
                encode_sample_response(sequences, scores if a.prompt_logprobs else None, top)
            )
    return out


def as_sequence(completion: Any, k_sample: int) -> Sequence:
    top_ids = top_lps = None
    if k_sample and completion.top_logprobs:
        top_ids = np.array([[t for t, _ in row] for row in completion.top_logprobs])
        top_lps = np.array([[lp for _, lp in row] for row in completion.top_logprobs])
    return Sequence(
        tokens=completion.ids,
        logprobs=completion.logprobs,
        stopped=completion.finish_reason == "stop",
        top_ids=top_ids,
        top_logprobs=top_lps,
    )
