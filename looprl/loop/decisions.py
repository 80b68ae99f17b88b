"""Decision tokens: the tokens of a forced call that its grammar leaves free.

Of the ≈ 20 tokens of `{"name": "choose_square", "arguments": {"square": 5}}` one, the
digit, is the model's decision; the rest are fixed by the call's grammar and sampled with
probability 1 whatever the model's logits say. A token is forced when it lies inside the
string the grammar allows next (its jump-forward string) or when it is the only token the
grammar allows; every other token (a digit, free text before the call, text inside a
string argument) is free (engine/grammar.py `is_forced`). The `hf` engine records which
tokens were forced as it samples them (`Turn.free`); for turns without that record
(demonstrations, the `vllm` engine's completions) `free_tokens` replays the turn's
grammar over its tokens and finds the same flags.

Three places use this: the SFT warm start with `sft.loss_on: free` (loop/sft.py), the
entropy bonus `algo.experimental.entropy_coef` (`decision_surprisal`), and the policy update with
`algo.loss_on: free` (`decision_view`): the loss, its importance ratios
and its length normalisation then cover each call's decision span only (its first free
token to its last: one token for a square). Under the grammar-constrained sampler a
forced token's probability is 1, so its true log-ratio is 0 and it carries no gradient;
scored by the unconstrained model it only dilutes a sequence-level ratio (GSPO) and the
mean of the gradient, by the call's length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from looprl.engine.grammar import is_forced
from looprl.types import Episode


def grammar_cache(policy: Any) -> Any:
    """The rollout engine's grammar cache where it keeps one (`hf`), else one built for
    the policy's tokenizer (the grammar is the same: engine/grammar.py)."""
    own = getattr(policy.engine, "grammars", None)
    if own is not None:
        return own()
    from looprl.engine.grammar import GrammarCache
    from looprl.model.load import base_model

    vocab = base_model(policy.model).get_output_embeddings().weight.shape[0]
    return GrammarCache(policy.tokenizer, vocab, list(policy.renderer.eos_ids))


def decision_view(episode: Episode, grammars: Any, tokenizer: Any) -> Episode:
    """A copy of `episode` whose loss mask keeps only its decision tokens: in each turn
    sampled under a grammar (`Turn.constraint`), the span from the first token that grammar
    left free to the last (`decision_span`); a turn sampled without one keeps all its
    tokens. Everything else is shared with `episode`."""
    return grammar_masked(episode, grammars, tokenizer, decision_span)


def grammar_masked(
    episode: Episode,
    grammars: Any,
    tokenizer: Any,
    shape: Callable[[list[int]], list[int]] = list,
) -> Episode:
    """A copy of `episode` whose loss mask over each turn sampled under a grammar is
    `shape(flags)` (the free tokens themselves by default), the flags being those the
    engine recorded (`Turn.free`) or, where it recorded none, `free_tokens`' replay of the
    grammar; turns sampled without one keep their mask. Everything else is shared with
    `episode`."""
    mask = list(episode.loss_mask)
    for turn in episode.turns:
        if turn.constraint is None:
            continue
        flags = turn.free
        if flags is None:
            flags = free_tokens(
                grammars.matcher(turn.constraint),
                turn.completion_ids,
                tokenizer,
                grammars.info.vocab_size,
            )
        start = len(turn.prompt_ids)
        mask[start : start + len(flags)] = shape(flags)
    return replace(episode, loss_mask=mask)


def decision_span(flags: list[int]) -> list[int]:
    """1 from the first free token of a call to its last, 0 outside. A turn stays one run of
    masked tokens (turn-level GSPO reads turns off the mask's runs, algo/turns.py): a call
    with free text before it, or with two free arguments, keeps the forced tokens between
    them. A call with a single free stretch (a square's digit) is exactly that stretch."""
    free = [i for i, f in enumerate(flags) if f]
    if not free:
        return [0] * len(flags)
    return [int(free[0] <= i <= free[-1]) for i in range(len(flags))]


def decision_surprisal(view: Episode) -> float:
    """−log π of an episode's decision tokens as sampled (summed over its turns), from its
    `decision_view`: a forced call's decision span, every token of a call sampled without a
    grammar. Within a group (one prompt) it ranks the choices as the grammar-constrained
    sampler's own logprobs do: renormalising over the allowed tokens shifts every sample of
    a position alike."""
    return -sum(lp for lp, m in zip(view.logprobs, view.loss_mask) if m)


def decision_metrics(episodes: list[Episode], views: list[Episode]) -> dict[str, float]:
    """The step's metrics over the policy's trainable samples among `episodes` (expert
    episodes are not samples), from their decision `views`: `rollout/decision_tokens`
    (decision tokens per episode) and `rollout/decision_entropy` (their mean −log π, the
    sampled estimate of the per-decision entropy, free of the forced tokens' surprisal)."""
    sampled = [v for e, v in zip(episodes, views) if e.trainable and not e.expert]
    surprisal = [-lp for v in sampled for lp, m in zip(v.logprobs, v.loss_mask) if m]
    return {
        "rollout/decision_tokens": len(surprisal) / max(len(sampled), 1),
        "rollout/decision_entropy": sum(surprisal) / len(surprisal) if surprisal else 0.0,
    }


def free_tokens(matcher: Any, completion: list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    """1 for each token of `completion` the grammar left a choice about, 0 for a forced one
    (`is_forced`), by replaying the grammar over the tokens: the flags of a turn without
    recorded ones (`Turn.free`), a demonstration's or a `vllm` completion's; the `hf`
    engine records these very flags as it samples. Past the grammar's end the tokens are
    the chat template's: forced. If the grammar rejects a token (a demonstration written
    differently), the rest count as free: nothing is known about them."""
    import xgrammar as xgr

    bitmask_1W = xgr.allocate_token_bitmask(1, vocab_size)
    flags: list[int] = []
    for k, token in enumerate(completion):
        if matcher.is_terminated():
            return flags + [0] * (len(completion) - k)
        flags.append(0 if is_forced(matcher, token, tokenizer, bitmask_1W) else 1)
        if not matcher.accept_token(token):
            return flags[:-1] + [1] * (len(completion) - k)
    return flags
