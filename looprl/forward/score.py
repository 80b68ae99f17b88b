"""Scoring: log-probabilities of given tokens under a model, in one place for the
trainer's forward (`sequence_logprobs`), the vLLM engine's rescoring of constrained
completions (`completion_logprobs`) and a prompt's own tokens (`prompt_logprobs`, what
`/v1/completions` returns with `echo`). Batches of sequences are split for one forward
pass each by `micro_batches`, the same split for the update and the rescoring."""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from looprl.algo import head_logprobs, token_logprobs
from looprl.forward import cascade
from looprl.forward.kv import bufferable
from looprl.forward.prefix import prefix_kwargs, shared_prefill
from looprl.model.arch import fast_paths
from looprl.model.load import base_model

SPLIT_HEAD = "_looprl_split_head"  # decoder_and_head's verdict, cached on the base model


def micro_batches(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    temperatures: Sequence[float],
    token_budget: int,
) -> list[list[int]]:
    """Indices of `sequences` split greedily, in order, into micro-batches whose forward
    pass stays within `token_budget` tokens: each distinct prompt (the first
    `prompt_lengths[i]` tokens) once plus rows × longest suffix. A forward pass scores at
    one temperature: a sequence whose scoring temperature differs from its micro-batch's
    first starts a new one. A sequence over the budget on its own is a micro-batch alone."""
    chunks: list[list[int]] = []
    current: list[int] = []

    def cost(chunk: list[int]) -> int:
        prompts = {tuple(sequences[i][: prompt_lengths[i]]) for i in chunk}
        suffix = max(len(sequences[i]) - prompt_lengths[i] for i in chunk)
        return sum(len(p) for p in prompts) + len(chunk) * suffix

    for i in range(len(sequences)):
        if current and (
            temperatures[i] != temperatures[current[0]] or cost(current + [i]) > token_budget
        ):
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks


def completion_logprobs(
    model: Any,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float,
    pad_id: int,
    device: torch.device,
    token_budget: int,
) -> list[list[float]]:
    """Each completion's logprobs after its prompt under `model`, unconstrained, at
    `temperature`, in `micro_batches` of about `token_budget` tokens (prompts shared as in
    the update); an empty completion gets []. The model is scored in eval mode, without
    gradients, and left in the mode it was in."""
    out: list[list[float]] = [[] for _ in prompts]
    todo = [i for i, c in enumerate(completions) if c]
    sequences = [prompts[i] + completions[i] for i in todo]
    lengths = [len(prompts[i]) for i in todo]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for chunk in micro_batches(sequences, lengths, [temperature] * len(todo), token_budget):
                logp_BS, mask_BS = sequence_logprobs(
                    model,
                    [sequences[j] for j in chunk],
                    [[0] * lengths[j] + [1] * (len(sequences[j]) - lengths[j]) for j in chunk],
                    pad_id,
                    device,
                    temperature,
                )
                for row, j in enumerate(chunk):
                    out[todo[j]] = logp_BS[row][mask_BS[row]].float().tolist()
    finally:
        model.train(was_training)
    return out


def prompt_length(mask: list[int]) -> int:
    """Tokens before the first generated one: the episode's initial prompt."""
    return mask.index(1) if 1 in mask else len(mask)


def sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    masks: list[list[int]],
    pad_id: int,
    device: torch.device,
    temperature: float,
    pack: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of the tokens after each sequence's initial prompt.

    Prefix sharing, exact gradients included: the prompts run through `shared_prefill`
    (each distinct prompt once, their common head once). With cascade attention the
    episodes' suffixes (all turns after the prompt, right-padded) attend to the head and
    to their prompt's tail where they are, one copy each; otherwise the prompt KV rows
    are copied to every episode that uses them (an indexing op). Either way the gradients
    from all G episodes flow back into the one prompt pass. With cascade attention and
    `pack`, suffixes of different lengths are packed: the model runs their real tokens
    as one row (no padding through the linear layers), and only attention unpacks them
    (`cascade.Packing`). Positions follow the engine's
    convention, so trainer and engine logprobs agree. A model training under gradient
    checkpointing cannot use a cache (transformers drops it), and a model whose cache is
    not plain keys and values (`arch.fast_paths`: sliding windows, linear attention, an
    architecture outside the tested matrix) does not share it: both run whole sequences.

    Logits are computed only where the loss needs them: at the loss-masked positions,
    in chunks (`head_logprobs`), never as a [B, S, vocab] tensor, when the model's logits
    are a plain projection of its last hidden state (checked once per model).
    Returns logp_BS (with grad if enabled; 0 off the mask) and mask_BS (bool); callers
    use only the masked entries, in order.
    """
    whole = _cache_dropped(model) or is_sharded(model)
    if whole or not fast_paths(base_model(model).config).trainer_prefix:
        return _whole_sequence_logprobs(model, sequences, masks, pad_id, device, temperature)
    starts = [prompt_length(m) for m in masks]
    prefill = shared_prefill(
        model, [seq[:st] for seq, st in zip(sequences, starts)], pad_id, device
    )
    ids_BS, attention_BS, mask_BS = _right_padded(
        [seq[st:] for seq, st in zip(sequences, starts)],
        [m[st:] for m, st in zip(masks, starts)],
        pad_id,
        device,
    )
    width = ids_BS.shape[1]
    rows = prefill.cache_rows
    packing = None
    if cascade.enabled(model) and bufferable(prefill.cache):
        # cascade attention: the head and each distinct prompt's tail stay one copy each
        shared = prefill.prefix.levels if prefill.prefix is not None else []
        tails = cascade.Level(
            [layer.keys for layer in prefill.cache.layers],
            [layer.values for layer in prefill.cache.layers],
            rows_B=rows,
            valid_NT=prefill.attention_CL[:, : prefill.width].bool(),
        )
        positions_BS = prefill.next_pos_C[rows][:, None] + torch.arange(width, device=device)
        lengths = attention_BS.sum(1).tolist()
        call_ids, call_mask, call_positions = ids_BS, attention_BS, positions_BS
        if pack and 0 < sum(lengths) < len(lengths) * width:
            # one row of the real tokens: no linear layer or norm runs on padding
            packing = cascade.Packing.of(lengths, device)
            call_ids = ids_BS[packing.valid_BS][None]
            call_mask = packing.causal_mask()
            call_positions = positions_BS[packing.valid_BS][None]
        inputs = dict(
            input_ids=call_ids,
            attention_mask=call_mask,
            position_ids=call_positions,
            use_cache=False,
            **prefix_kwargs(cascade.Prefix([*shared, tails], packing)),
        )
        logits_BV = prefill.logits_CV[rows]
    else:
        prefill = prefill.expand()
        inputs = dict(
            input_ids=ids_BS,
            attention_mask=torch.cat([prefill.attention_CL, attention_BS], dim=1),
            position_ids=prefill.next_pos_C[:, None] + torch.arange(width, device=device),
            cache=prefill.cache,
            use_cache=True,
        )
        logits_BV = prefill.logits_CV
    # the prompt's last logits predict suffix token 0; suffix position t predicts t + 1
    first_B = token_logprobs(logits_BV[:, None, :], ids_BS[:, :1], temperature)[:, 0]
    rest_BS = _next_token_logprobs(model, inputs, ids_BS, mask_BS, temperature, packing)
    return torch.cat([first_B[:, None], rest_BS], dim=1), mask_BS


def _whole_sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    masks: list[list[int]],
    pad_id: int,
    device: torch.device,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """No cache: each sequence in full (right-padded); position t predicts token t + 1."""
    ids_BT, attention_BT, mask_BT = _right_padded(sequences, masks, pad_id, device)
    positions_BT = torch.arange(ids_BT.shape[1], device=device).expand_as(ids_BT)
    inputs = dict(input_ids=ids_BT, attention_mask=attention_BT, position_ids=positions_BT)
    logp_BT = _next_token_logprobs(model, inputs, ids_BT, mask_BT, temperature)
    return logp_BT, mask_BT[:, 1:]


def _next_token_logprobs(
    model: Any,
    inputs: dict[str, Any],
    ids_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    temperature: float,
    packing: cascade.Packing | None = None,
) -> torch.Tensor:
    """logprobs of ids_BS[:, 1:] from the model's outputs at positions 0..S-2 (a packed
    call's outputs are one row of real tokens: `packing` maps them back)."""
    split = decoder_and_head(model)
    if split is None and is_sharded(model):
        split = getattr(base_model(model), SPLIT_HEAD, None)  # taken before it was sharded
        if split:  # the root's weights gathered for the two parts, as for `model(...)`
            return root_call(model, _head_logprobs, split, inputs, ids_BS, mask_BS, temperature)
    if split is None:
        logits = model(**inputs).logits
        logits_BSV = (logits if packing is None else logits[0][packing.index_BS])[:, :-1, :]
        return token_logprobs(logits_BSV, ids_BS[:, 1:], temperature=temperature)
    return _head_logprobs(split, inputs, ids_BS, mask_BS, temperature, packing)


def _head_logprobs(
    split: tuple[Any, Any],
    inputs: dict[str, Any],
    ids_BS: torch.Tensor,
    mask_BS: torch.Tensor,
    temperature: float,
    packing: cascade.Packing | None = None,
) -> torch.Tensor:
    """The body's hidden states, then the head's logprobs at the loss positions only, a
    chunk of rows at a time (`head_logprobs`): no [B, S, vocab] logits."""
    decoder, head = split
    hidden = decoder(**inputs).last_hidden_state
    needed_BS = mask_BS[:, 1:]
    if packing is None:
        hidden_NH = hidden[:, :-1, :][needed_BS]
    else:  # only the needed rows of the packed output: no padded copy
        hidden_NH = hidden[0][packing.index_BS[:, :-1][needed_BS]]
    picked_N = head_logprobs(hidden_NH, head, ids_BS[:, 1:][needed_BS], temperature)
    rest_BS = torch.zeros(needed_BS.shape, dtype=picked_N.dtype, device=ids_BS.device)
    return rest_BS.masked_scatter(needed_BS, picked_N)


def _right_padded(
    seqs: list[list[int]], masks: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (seq, m) in enumerate(zip(seqs, masks)):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[row, : len(seq)] = 1
        mask[row, : len(seq)] = torch.tensor(m, dtype=torch.bool)
    return ids.to(device), attention.to(device), mask.to(device)


def is_sharded(model: Any) -> bool:
    """An FSDP2 module (train.shard=fsdp): every forward of it is one collective per unit,
    so a micro-batch is one call of the whole model (whole sequences, no shared prefill,
    whose number of calls depends on the prompts)."""
    return isinstance(model, FSDPModule)


ROOT_CALL = "_looprl_root_call"


def root_call(model: Any, fn: Any, *args: Any) -> Any:
    """`fn(*args)` run as a forward of a sharded model's root unit (FSDP2's
    `register_fsdp_forward_method`): the root's weights (embeddings, final norm, head)
    gathered before it, its gradients' reduction hooked to its output, the collectives
    those of `model(...)`. The trainer's body-then-head split runs so under sharding."""
    if not hasattr(model, ROOT_CALL):
        setattr(model, ROOT_CALL, MethodType(lambda _, call, *rest: call(*rest), model))
        register_fsdp_forward_method(model, ROOT_CALL)
    return getattr(model, ROOT_CALL)(fn, *args)


def _cache_dropped(model: Any) -> bool:
    """transformers drops the KV cache of a model training under gradient checkpointing."""
    base = base_model(model)
    name = "is_activation_checkpointing"  # newer transformers; the older name warns there
    if not hasattr(type(base), name):
        name = "is_gradient_checkpointing"
    checkpointing = getattr(base, name, False)
    return bool(checkpointing) and model.training and torch.is_grad_enabled()


def decoder_and_head(model: Any) -> tuple[Any, Any] | None:
    """The model's body (returning its final hidden states) and output projection, if
    its logits are exactly `head(hidden)`: checked once per model on a short input, so a
    model that scales or soft-caps its logits keeps the plain path. None for a sharded
    model: FSDP2 gathers the root's weights only when the root runs, so its trainer
    passes run the split through `root_call` (the verdict taken before it was sharded)."""
    if is_sharded(model):
        return None
    base = base_model(model)
    verdict = getattr(base, SPLIT_HEAD, None)
    if verdict is None:
        verdict = False
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
        head = base.get_output_embeddings()
        if decoder is not None and head is not None and decoder is not base:
            device = next(base.parameters()).device
            ids = torch.tensor([[1, 2, 3, 4]], device=device)
            was_training = model.training
            model.eval()  # no dropout in the comparison
            with torch.no_grad():
                want = model(input_ids=ids).logits.float()
                got = head(decoder(input_ids=ids).last_hidden_state).float()
            model.train(was_training)
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                verdict = (decoder, head)
        setattr(base, SPLIT_HEAD, verdict)
    return verdict or None


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
