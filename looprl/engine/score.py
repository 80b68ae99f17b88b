"""Logprobs of a prompt's own tokens: what `/v1/completions` returns with `echo` and
`logprobs` (language-model evaluation harnesses score texts this way)."""

from __future__ import annotations

from typing import Any

import torch

from looprl.algo.logprobs import token_logprobs


@torch.inference_mode()
def prompt_logprobs(
    model: Any, ids: list[int], temperature: float = 1.0, top_k: int = 0
) -> list[tuple[float | None, list[tuple[int, float]] | None]]:
    """Per prompt token: its logprob given the tokens before it, at `temperature`, and the
    `top_k` most likely tokens there (the engine's convention for sampled tokens). The
    first token has nothing before it: (None, None)."""
    device = next(model.parameters()).device
    logits_1TV = model(input_ids=torch.tensor([ids], device=device)).logits.float().cpu()
    targets_1T = torch.tensor([ids[1:]])
    chosen = token_logprobs(logits_1TV[:, :-1], targets_1T, temperature)[0].tolist()
    tops: list[list[tuple[int, float]] | None] = [None] * len(chosen)
    if top_k:
        logp_TV = torch.log_softmax(logits_1TV[0, :-1] / temperature, -1)
        values_Tk, ids_Tk = logp_TV.topk(top_k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids_Tk.tolist(), values_Tk.tolist())]
    return [(None, None), *zip(chosen, tops)]
