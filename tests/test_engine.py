"""The hf engine's fast paths keep exactness: prefix sharing and jump-forward decoding
record the policy's own logprobs, and forced calls are always valid."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
import torch

from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove


def full_forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def lora_tiny_model(seed: int):
    """The tiny model with LoRA adapters whose B matrices are non-zero (a real gradient
    path through every adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        load_causal_lm_fresh(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    return model


def scored_with_grads(model, sequences, masks, temperature: float, pack: bool = True):
    """The trainer's logprobs at the loss-masked positions, and the gradients of their
    sum with respect to the trainable parameters."""
    from looprl.forward.score import sequence_logprobs

    model.zero_grad()
    logp_BS, mask_BS = sequence_logprobs(
        model, sequences, masks, 0, torch.device("cpu"), temperature, pack=pack
    )
    (logp_BS * mask_BS).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return logp_BS[mask_BS].detach(), grads


def assert_same_scores(got, want, grad_atol: float = 1e-6) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=grad_atol)


@pytest.fixture()
def forced_requests(renderer):
    env = TicTacToeMove()
    requests = []
    for task in env.tasks("eval", n=3):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        constraint = ToolConstraint(obs.tools, "required", renderer.format)
        requests += [GenerationRequest(prompt, constraint) for _ in range(2)]  # shared prompts
    return env, requests


@pytest.mark.parametrize("jump_forward", [True, False])
def test_forced_calls_are_valid_and_logprobs_exact(
    tiny_model, tokenizer, renderer, forced_requests, jump_forward
):
    env, requests = forced_requests
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump_forward)
    outs = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=96, seed=3))
    tools = env.reset(env.tasks("eval", n=1)[0]).tools
    for request, out in zip(requests, outs):
        assert out.finish_reason == "stop"
        result = renderer.parse(renderer.decode(out.ids), tools)
        assert result.failure is None and result.calls[0].name == "choose_square"
        ref = full_forward_logprobs(tiny_model, request.prompt_ids, out.ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_jump_forward_uses_fewer_passes(tiny_model, tokenizer, renderer, forced_requests):
    _, requests = forced_requests
    counts = {}
    for jump in (True, False):
        engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=jump)
        calls: list[int] = []
        decoder = tiny_model.get_decoder()  # every pass runs it (a jump's runs it alone)
        hook = decoder.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        try:
            engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=96, seed=3))
        finally:
            hook.remove()
        counts[jump] = len(calls)
    assert counts[True] * 3 < counts[False], counts


def test_a_jump_scores_its_forced_tokens_a_few_rows_at_a_time(
    tiny_model, tokenizer, renderer, forced_requests, monkeypatch
):
    """A jump-forward step computes the logits of its forced tokens a few rows at a time
    (never [rows, k, vocab] at once): the same tokens, logprobs and top alternatives as
    the whole-batch logits, with each request's own temperature."""
    import looprl.engine.forward_step as forward_step

    _, requests = forced_requests
    requests = [
        replace(r, top_logprobs=3, sampling=SamplingParams(temperature=t, max_new_tokens=96))
        for r, t in zip(requests, [1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=96, seed=3)
    head = tiny_model.get_output_embeddings()
    widths: dict[str, list[int]] = {"chunked": [], "plain": []}
    seen = widths["chunked"]
    hook = head.register_forward_hook(lambda m, i, o: seen.append(o.numel() // o.shape[-1]))
    monkeypatch.setattr(forward_step, "FORCED_LOGIT_ROWS", 8)
    try:
        chunked = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(requests, params)
        seen = widths["plain"]
        with monkeypatch.context() as whole:
            whole.setattr(forward_step, "decoder_and_head", lambda model: None)
            plain = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(requests, params)
    finally:
        hook.remove()
    # positions a head call holds: one row's jump at most, against every row's
    assert 3 * max(widths["chunked"]) <= max(widths["plain"])
    for a, b in zip(chunked, plain):
        assert a.ids == b.ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip
        assert len(a.top_logprobs) == len(a.ids)
        for mine, theirs in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in mine] == [t for t, _ in theirs]


def test_canonical_tokens_under_jump_forward(tiny_model, tokenizer, renderer, forced_requests):
    _, requests = forced_requests
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    out = engine.generate(requests[:1], SamplingParams(temperature=0.0, max_new_tokens=96))[0]
    text = renderer.decode(out.ids)
    assert out.ids[:-1] == tokenizer.encode(text, add_special_tokens=False)


def test_forced_grammar_keeps_the_schema_property_order(tokenizer, renderer):
    """A call written in the schema's property order (as demonstrations are) is accepted."""
    from looprl.chat.formats import format_tool_call
    from looprl.engine.grammar import GrammarCache
    from looprl.types import ToolCall

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["zeta", "alpha"], "additionalProperties": False,
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}}}  # fmt: skip
    cache = GrammarCache(tokenizer, len(tokenizer), renderer.eos_ids)
    matcher = cache.matcher(ToolConstraint([tool], "required", "hermes"))
    text = format_tool_call(ToolCall("f", {"zeta": 1, "alpha": 2}), "hermes")
    assert all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_forced_length_limited_strings_stay_valid_json(tokenizer, renderer):
    """xgrammar lets raw control characters into maxLength strings; the rewritten
    pattern keeps the limit and keeps the JSON valid."""
    from looprl.engine.grammar import GrammarCache

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["s"], "additionalProperties": False,
        "properties": {"s": {"type": "string", "maxLength": 5}}}}}  # fmt: skip
    cache = GrammarCache(tokenizer, len(tokenizer), renderer.eos_ids)

    def accepted(text: str) -> bool:
        matcher = cache.matcher(ToolConstraint([tool], "required", "llama3"))
        return all(
            matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)
        )

    assert accepted('{"name": "f", "parameters": {"s": "ab"}}')
    assert not accepted('{"name": "f", "parameters": {"s": "a\tb"}}')
    assert not accepted('{"name": "f", "parameters": {"s": "abcdefg"}}')


# ---- the decoding loop: static KV buffer, shared prefixes, continuous batching


def reference_generate(engine, request, params, index) -> list[int]:
    """The plain path: no cache, no batch, a full forward of the whole sequence for every
    token, and the engine's sampler on one row with the stream of request `index`."""
    row = engine._row(index, request, params, params.seed)
    while True:
        with torch.no_grad():
            logits = engine.model(torch.tensor([request.prompt_ids + row.ids])).logits[:, -1]
        token, _ = engine._sample(logits.float(), params, [row])
        row.ids.append(int(token[0]))
        if row.ids[-1] in engine.stop_token_ids or len(row.ids) >= row.limit:
            return row.ids


@pytest.fixture()
def free_requests(renderer):
    """Tic-tac-toe prompts (a long shared head, distinct tails), some repeated (groups),
    with different token limits so that rows finish at different times."""
    env = TicTacToeMove(tool_choice="auto")
    requests = []
    for n, task in enumerate(env.tasks("train", n=5, seed=11)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        for g in range(2):
            requests.append(GenerationRequest(prompt, max_new_tokens=6 + 7 * ((n + g) % 3)))
    return requests


@pytest.mark.parametrize("batch_size", [64, 3])
def test_fast_path_matches_the_plain_path(
    tiny_model, tokenizer, renderer, free_requests, batch_size
):
    """Same seed, same tokens as one-request-at-a-time full forwards; logprobs within
    float tolerance of a full forward. batch_size 3 < 10 requests: rows leave and join."""
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=5)
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=batch_size)
    outs = engine.generate(free_requests, params)
    for index, (request, out) in enumerate(zip(free_requests, outs)):
        assert out.ids == reference_generate(engine, request, params, index)
        ref = full_forward_logprobs(tiny_model, request.prompt_ids, out.ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_seeded_results_do_not_depend_on_the_batch(tiny_model, tokenizer, renderer, free_requests):
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=9)
    results = []
    for batch_size in (1, 4, 64):
        engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=batch_size)
        results.append([o.ids for o in engine.generate(free_requests, params)])
    assert results[0] == results[1] == results[2]
    again = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(free_requests[:3], params)
    assert [o.ids for o in again] == results[0][:3]  # fewer requests alongside: same tokens
    other = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(
        free_requests, SamplingParams(temperature=1.0, max_new_tokens=32, seed=10)
    )
    assert [o.ids for o in other] != results[0]


def test_a_request_stream_makes_a_split_batch_sample_the_whole_one(
    tiny_model, tokenizer, renderer, free_requests
):
    """The second half of a batch, played alone with `stream` = its index in the whole
    batch (as one rank of several plays its share), samples the same tokens."""
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=9)
    whole = [o.ids for o in HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(
        free_requests, params)]  # fmt: skip
    half = len(free_requests) // 2
    tail = [replace(r, stream=half + i) for i, r in enumerate(free_requests[half:])]
    alone = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(tail, params)
    assert [o.ids for o in alone] == whole[half:]
    unshifted = HFEngine(tiny_model, tokenizer, renderer.eos_ids).generate(
        free_requests[half:], params
    )
    assert [o.ids for o in unshifted] != whole[half:]  # without it, other streams


def test_finished_rows_leave_and_waiting_ones_join(tiny_model, tokenizer, renderer, free_requests):
    """With 4 slots, a row that stops early frees its slot for a waiting request: no
    pass is ever wider than 4 rows, and there are fewer passes than fixed batches of 4
    (each as long as its longest request) would need."""
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=4)
    stops = SamplingParams(temperature=1.0, max_new_tokens=32, seed=5)
    widths: list[int] = []

    def record(module, args, kwargs, output):
        widths.append(kwargs["input_ids"].shape[0])

    hook = tiny_model.register_forward_hook(record, with_kwargs=True)
    try:
        outs = engine.generate(free_requests, stops)
    finally:
        hook.remove()
    assert max(widths) <= 4
    by_length = sorted(range(len(free_requests)), key=lambda i: len(free_requests[i].prompt_ids))
    fixed = sum(
        max(len(outs[i].ids) for i in by_length[s : s + 4]) for s in range(0, len(by_length), 4)
    )
    decode_passes = sum(1 for w in widths) - 2 * 3  # minus the prefill passes, <= 2 per join
    assert decode_passes < fixed, (decode_passes, fixed)


def test_shared_prefix_runs_once(tiny_model, tokenizer, renderer, free_requests):
    """The tic-tac-toe prompts share their system prompt and tool schema: prefill runs it
    once at batch 1, then only the distinct tails (5 of them)."""
    from looprl.forward.prefix import shared_prefill

    shapes: list[tuple[int, ...]] = []
    hook = tiny_model.register_forward_hook(
        lambda m, a, kw, out: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    prompts = [r.prompt_ids for r in free_requests]
    try:
        with torch.no_grad():
            part = shared_prefill(tiny_model, prompts, tokenizer.pad_token_id, torch.device("cpu"))
    finally:
        hook.remove()
    head = len(os.path.commonprefix(prompts))
    assert shapes[0] == (1, head)
    assert shapes[1][0] == 5 and shapes[1][1] == max(len(p) for p in prompts) - head
    assert len(part) == len(prompts) and part.cache_rows.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_models_with_other_cache_layers_keep_working(tokenizer, renderer, free_requests):
    """A sliding-window model's cache cannot move into buffers: the loop falls back to
    transformers' own layers (no joining while rows run) and stays exact. (The window is
    wider than the sequences: transformers counts a window in cache columns, so with
    left padding any batched decoding shifts a window shorter than the sequence.)"""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4096,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=2)
    engine = HFEngine(model, tokenizer, renderer.eos_ids, batch_size=3)
    outs = engine.generate(free_requests[:6], params)
    for index, (request, out) in enumerate(zip(free_requests[:6], outs)):
        assert out.ids == reference_generate(engine, request, params, index)
        ref = full_forward_logprobs(model, request.prompt_ids, out.ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_trainer_logprobs_only_at_masked_positions(tiny_model, tokenizer, renderer, free_requests):
    """The trainer's masked-position path (hidden states, then the output projection
    in chunks) gives the plain full-logits path's values and gradients."""
    from looprl.forward.score import decoder_and_head

    model = lora_tiny_model(seed=0)
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    outs = engine.generate(free_requests[:4], SamplingParams(max_new_tokens=12, seed=1))
    sequences, masks = [], []
    for request, out in zip(free_requests[:4], outs):
        sequences.append(request.prompt_ids + out.ids + [7, 8] + out.ids[:3])  # a 2nd turn
        masks.append([0] * len(request.prompt_ids) + [1] * len(out.ids) + [0, 0] + [1] * 3)
    assert decoder_and_head(model) is not None
    split = scored_with_grads(model, sequences, masks, 0.7)
    model.get_base_model()._looprl_split_head = False  # force the plain path
    assert_same_scores(split, scored_with_grads(model, sequences, masks, 0.7))


def load_causal_lm_fresh():
    from looprl.model.load import load_causal_lm

    return load_causal_lm("tiny-random", torch.float32)


def test_trainer_logprobs_under_gradient_checkpointing(tokenizer, renderer, free_requests):
    """transformers drops the KV cache of a model training under gradient checkpointing;
    the trainer then scores whole sequences, with the same values and gradients."""

    model = load_causal_lm_fresh()
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    outs = engine.generate(free_requests[:3], SamplingParams(max_new_tokens=10, seed=4))
    sequences = [r.prompt_ids + o.ids for r, o in zip(free_requests[:3], outs)]
    masks = [[0] * len(r.prompt_ids) + [1] * len(o.ids) for r, o in zip(free_requests[:3], outs)]
    model.train()
    cached = scored_with_grads(model, sequences, masks, 1.0)
    model.gradient_checkpointing_enable()
    model.train()
    assert_same_scores(cached, scored_with_grads(model, sequences, masks, 1.0), grad_atol=1e-5)


def test_low_precision_sampler_follows_the_policy(tokenizer, renderer, free_requests):
    """sampler_dtype=bfloat16 samples from a bf16 copy that picks up every weight update,
    and its logprobs stay close to the float32 policy's."""
    model = load_causal_lm_fresh()
    engine = HFEngine(model, tokenizer, renderer.eos_ids, sampler_dtype="bfloat16")
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    requests = free_requests[:4]

    def gap(outs) -> float:
        return max(
            abs(a - b)
            for r, o in zip(requests, outs)
            for a, b in zip(full_forward_logprobs(model, r.prompt_ids, o.ids), o.logprobs)
        )

    first = engine.generate(requests, params)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    assert 0 < gap(first) < 0.1
    with torch.no_grad():  # an optimizer step, in place
        model.get_output_embeddings().weight.mul_(3.0)
    after = engine.generate(requests, params)
    assert gap(after) < 0.1  # would be large had the copy kept the old weights
    assert [o.ids for o in after] != [o.ids for o in first]


def test_session_reuses_each_episodes_kv_across_turns(
    tiny_model, tokenizer, renderer, free_requests
):
    """Inside `engine.session()`, a turn-2 request that extends a turn-1 row prefills only
    its new tokens; tokens and logprobs are those of the plain path."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=6)
    requests = [GenerationRequest(r.prompt_ids, keep_kv=True) for r in free_requests[:6]]

    def two_turns(session: bool) -> tuple[list, int]:
        engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=4)
        fed: list[int] = []
        hook = tiny_model.register_forward_hook(
            lambda m, a, kw, out: fed.append(kw["input_ids"].numel()), with_kwargs=True
        )
        try:
            with engine.session() if session else contextlib.nullcontext():
                first = engine.generate(requests, params)
                before = sum(fed)
                second = [
                    GenerationRequest(r.prompt_ids + o.ids + [198, 2683, 359])  # a tool result
                    for r, o in zip(requests, first)
                ]
                again = engine.generate(second, params)
        finally:
            hook.remove()
        for request, out in zip(second, again):
            ref = full_forward_logprobs(tiny_model, request.prompt_ids, out.ids)
            assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4
        return [o.ids for o in first + again], sum(fed) - before

    plain_ids, plain_fed = two_turns(session=False)
    kept_ids, kept_fed = two_turns(session=True)
    assert kept_ids == plain_ids
    longest_prompt = max(len(r.prompt_ids) for r in requests)
    assert kept_fed < plain_fed - longest_prompt, (kept_fed, plain_fed)


def test_session_keeps_only_rows_marked_keep_kv(tiny_model, tokenizer, renderer, free_requests):
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    with engine.session():
        engine.generate([GenerationRequest(r.prompt_ids) for r in free_requests[:4]], params)
        assert engine._retained == []  # single-turn requests: nothing kept
        marked = [GenerationRequest(r.prompt_ids, keep_kv=True) for r in free_requests[:4]]
        engine.generate(marked, params)
        assert len(engine._retained) == 4
    assert engine._retained is None


def test_sampler_draws_from_the_distribution(tiny_model, tokenizer, renderer):
    """Each row's draw follows softmax(logits / T) (and its top-k filter): frequencies
    over 6,000 rows with their own streams, and a zero-probability token is never drawn."""
    from looprl.engine.sampling import Row as _Row

    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    n = 6000
    rows = [_Row(i, [1], 8, None, i) for i in range(n)]
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3)):
        tokens, logp = engine._sample(logits.expand(n, -1).clone(), params, rows)
        scaled = logits / params.temperature
        if params.top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(params.top_k).values[-1], -1e9)
        want = torch.softmax(scaled, -1)
        got = torch.bincount(tokens, minlength=len(logits)).float() / n
        assert got[4] == 0 and (got[want == 0] == 0).all()
        assert torch.allclose(got, want, atol=4 * (0.25 / n) ** 0.5)  # 4 standard errors
        torch.testing.assert_close(logp, torch.log_softmax(logits / params.temperature, -1)[tokens])


def test_inverse_cdf_matches_a_full_float64_cumsum():
    """The two-level inverse CDF picks the token a full float64 cumsum over the vocabulary
    would (random rows, masked tokens, trailing zeros, a vocabulary that is no multiple of
    the block, targets exactly on block boundaries), never a zero-probability token, and
    the last token with p > 0 when the target reaches the total."""
    from looprl.engine.sampling import CDF_BLOCK, inverse_cdf

    def full(probs, uniform):
        cdf = probs.cumsum(-1, dtype=torch.float64)
        chosen = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
        return torch.minimum(chosen.squeeze(-1), (cdf < cdf[:, -1:]).sum(-1))

    gen = torch.Generator().manual_seed(0)
    vocab = 3 * CDF_BLOCK + 77
    for scale in (0.5, 3.0, 12.0):
        logits = torch.randn(64, vocab, generator=gen) * scale
        logits[:16, torch.rand(vocab, generator=gen) < 0.9] = float("-inf")
        logits[16:32, -CDF_BLOCK - 100 :] = float("-inf")
        probs = torch.softmax(logits, -1)
        uniform = torch.rand(64, generator=gen, dtype=torch.float64)
        uniform[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
        blocks = probs[32:48, : 2 * CDF_BLOCK].to(torch.float64).sum(-1)
        uniform[32:48] = blocks / probs[32:48].to(torch.float64).sum(-1)  # on a boundary
        chosen = inverse_cdf(probs, uniform)
        off = list(range(32)) + list(range(48, 64))
        assert torch.equal(chosen[off], full(probs, uniform)[off])
        assert (probs[torch.arange(64), chosen] > 0).all()
        # on a boundary either side is right up to float64 rounding: the target lies
        # between the cumulative sums before and after the chosen token
        cdf = probs[32:48].cumsum(-1, dtype=torch.float64)
        target = uniform[32:48] * cdf[:, -1]
        rows = torch.arange(16)
        below = torch.where(chosen[32:48] > 0, cdf[rows, chosen[32:48] - 1], 0.0)
        assert (below <= target + 1e-12).all() and (cdf[rows, chosen[32:48]] > target - 1e-12).all()
    probs = torch.softmax(torch.tensor([[1.0, 2.0, 0.5, float("-inf"), float("-inf")]]), -1)
    assert inverse_cdf(probs, torch.tensor([1.0], dtype=torch.float64)).tolist() == [2]
    assert inverse_cdf(probs, torch.tensor([0.0], dtype=torch.float64)).tolist() == [0]
