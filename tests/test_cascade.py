"""Cascade attention keeps shared keys/values once and gives plain attention's results:
the attention function itself (values and gradients, float64), the engine (same tokens
as without it, the head held once, prompts from different heads in one batch) and the
trainer (same logprobs and LoRA gradients)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine import (
    assert_same_scores,
    full_forward_logprobs,
    lora_tiny_model,
    reference_generate,
    scored_with_grads,
)

from looprl.engine import GenerationRequest, SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.extraction import Extraction
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.forward import cascade, cascade_kernels


def plain_attention(query, keys, values, mask, scale):
    """softmax(q k^T) v with the K/V heads repeated per query head (GQA), row by row."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = (query @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ values  # [B, H, Q, D]


@pytest.mark.parametrize("q_len", [1, 4])
def test_attention_equals_plain_attention_over_the_concatenation(q_len):
    torch.manual_seed(0)
    f64 = dict(dtype=torch.float64)
    batch, heads, kv_heads, dim, own = 5, 6, 2, 8, 7
    rows_B = torch.tensor([0, 2, 2, 1, 0])  # which tail each row reads
    query = torch.randn(batch, heads, q_len, dim, **f64, requires_grad=True)
    head_k = torch.randn(1, kv_heads, 9, dim, **f64, requires_grad=True)
    head_v = torch.randn(1, kv_heads, 9, dim, **f64, requires_grad=True)
    tail_k = torch.randn(3, kv_heads, 4, dim, **f64, requires_grad=True)
    tail_v = torch.randn(3, kv_heads, 4, dim, **f64, requires_grad=True)
    valid_NT = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    own_k = torch.randn(batch, kv_heads, own, dim, **f64, requires_grad=True)
    own_v = torch.randn(batch, kv_heads, own, dim, **f64, requires_grad=True)
    causal = torch.arange(own)[None, :] <= torch.arange(q_len)[:, None] + own - q_len
    padded = torch.ones(batch, own, dtype=torch.bool)
    padded[1, :2] = False  # left padding in one row's own columns
    own_mask = (causal[None] & padded[:, None, :])[:, None]  # [B, 1, Q, L]
    prefix = cascade.Prefix([
        cascade.Level([head_k], [head_v]),
        cascade.Level([tail_k], [tail_v], rows_B=rows_B, valid_NT=valid_NT),
    ])  # fmt: skip
    module = SimpleNamespace(layer_idx=0)
    scale = dim**-0.5
    got, _ = cascade.attention(
        module, query, own_k, own_v, own_mask, scaling=scale, looprl_prefix=prefix
    )
    full_k = torch.cat([head_k.expand(batch, -1, -1, -1), tail_k[rows_B], own_k], 2)
    full_v = torch.cat([head_v.expand(batch, -1, -1, -1), tail_v[rows_B], own_v], 2)
    full_mask = torch.cat(
        [
            torch.ones(batch, 1, q_len, 9, dtype=torch.bool),
            valid_NT[rows_B][:, None, None, :].expand(-1, -1, q_len, -1),
            own_mask,
        ],
        -1,
    )
    want = plain_attention(query, full_k, full_v, full_mask, scale).transpose(1, 2)
    torch.testing.assert_close(got, want)
    weights = torch.randn_like(want)
    inputs = (query, head_k, head_v, tail_k, tail_v, own_k, own_v)
    got_grads = torch.autograd.grad((got * weights).sum(), inputs)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_without_a_prefix_it_is_sdpa(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert cascade.enabled(tiny_model) or cascade.enable(tiny_model)
    with torch.no_grad():
        ours = tiny_model(ids).logits
        tiny_model.set_attn_implementation("sdpa")
        try:
            theirs = tiny_model(ids).logits
        finally:
            cascade.enable(tiny_model)
    torch.testing.assert_close(ours, theirs)


def tictactoe_requests(renderer, n=4, seed=11):
    env = TicTacToeMove(tool_choice="auto")
    out = []
    for k, task in enumerate(env.tasks("train", n=n, seed=seed)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        out += [GenerationRequest(prompt, max_new_tokens=5 + 4 * (k % 3)) for _ in range(2)]
    return out


def test_engine_keeps_the_head_once_and_samples_the_same_tokens(tiny_model, tokenizer, renderer):
    from looprl.forward.prefix import shared_prefill

    requests = tictactoe_requests(renderer)
    prompts = [r.prompt_ids for r in requests]
    with torch.no_grad():
        part = shared_prefill(tiny_model, prompts, tokenizer.pad_token_id, torch.device("cpu"))
    head = len(part.prefix.tokens)
    assert head >= 16 and part.prefix.levels[0].keys[0].shape[0] == 1
    assert part.cache.layers[0].keys.shape[2] == max(len(p) for p in prompts) - head
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
    outs = {}
    for flag in (True, False):
        engine = HFEngine(
            tiny_model, tokenizer, renderer.eos_ids, batch_size=3, cascade_attention=flag
        )
        outs[flag] = engine.generate(requests, params)
    cascade.enable(tiny_model)
    assert [o.ids for o in outs[True]] == [o.ids for o in outs[False]]
    for a, b in zip(outs[True], outs[False]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_rows_with_different_heads_share_a_batch(tiny_model, tokenizer, renderer, monkeypatch):
    """Requests of two envs in one call: when parts with different heads merge, each row
    gets its own copy of its head, and the tokens stay those of a cache-free reference."""

    import looprl.engine.running as running

    env = Extraction()
    others = []
    for task in env.tasks("train", n=2, seed=1):
        obs = env.reset(task)
        others.append(GenerationRequest(renderer.prompt_ids(obs.messages, obs.tools)))
    requests = tictactoe_requests(renderer, n=3)[:5] + others
    heads = []
    real_merge = running.merge

    def spy(parts, keep, room, **kwargs):
        heads.append({p.prefix.tokens if p.prefix is not None else () for p in parts})
        return real_merge(parts, keep, room, **kwargs)

    monkeypatch.setattr(running, "merge", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=8)
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, batch_size=4)
    outs = engine.generate(requests, params)
    assert any(len(h) > 1 for h in heads), "no merge of parts with different heads happened"
    for index, (request, out) in enumerate(zip(requests, outs)):
        assert out.ids == reference_generate(engine, request, params, index)
        ref = full_forward_logprobs(tiny_model, request.prompt_ids, out.ids)
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < 1e-4


def test_trainer_logprobs_and_gradients_match_without_cascade(tokenizer, renderer):
    model = lora_tiny_model(seed=0)
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    requests = tictactoe_requests(renderer, n=3)
    outs = engine.generate(requests, SamplingParams(max_new_tokens=10, seed=2))
    sequences, masks = [], []
    for request, out in zip(requests, outs):
        sequences.append(request.prompt_ids + out.ids + [7, 8] + out.ids[:2])  # a 2nd turn
        masks.append([0] * len(request.prompt_ids) + [1] * len(out.ids) + [0, 0, 1, 1])
    model.train()
    assert cascade.enabled(model)
    ours = scored_with_grads(model, sequences, masks, 0.8)
    model.get_base_model().set_attn_implementation("sdpa")
    assert not cascade.enabled(model)
    assert_same_scores(ours, scored_with_grads(model, sequences, masks, 0.8))


def test_half_precision_models_attend_in_float32(tokenizer, renderer):
    """A bfloat16 model: the cascade's scores and softmax run in float32 (as SDPA's do),
    so its logprobs are as close to the float32 model's as with plain SDPA."""
    from looprl.forward.score import sequence_logprobs
    from looprl.model.load import load_causal_lm

    requests = tictactoe_requests(renderer, n=4)
    exact = load_causal_lm("tiny-random", torch.float32).eval()
    half = load_causal_lm("tiny-random", torch.bfloat16).eval()
    outs = HFEngine(exact, tokenizer, renderer.eos_ids).generate(
        requests, SamplingParams(temperature=1.0, max_new_tokens=24, seed=4)
    )
    sequences = [r.prompt_ids + o.ids for r, o in zip(requests, outs)]
    masks = [[0] * len(r.prompt_ids) + [1] * len(o.ids) for r, o in zip(requests, outs)]
    cpu = torch.device("cpu")
    with torch.no_grad():
        want, mask = sequence_logprobs(exact, sequences, masks, 0, cpu, 1.0)
        assert cascade.enable(half)
        ours, _ = sequence_logprobs(half, sequences, masks, 0, cpu, 1.0)
        half.set_attn_implementation("sdpa")
        sdpa, _ = sequence_logprobs(half, sequences, masks, 0, cpu, 1.0)
    gap = (ours.float() - want)[mask].abs().mean()
    sdpa_gap = (sdpa.float() - want)[mask].abs().mean()
    assert gap <= 1.1 * sdpa_gap + 1e-4, (gap, sdpa_gap)


def test_trainer_shares_a_single_prompt_without_copies(tokenizer, renderer, monkeypatch):
    """One distinct prompt (no common head to split off): its KV is still one level that
    all G episodes read, and the results equal the copying path's."""
    from looprl.model.load import load_causal_lm

    torch.manual_seed(1)
    model = load_causal_lm("tiny-random", torch.float32)
    engine = HFEngine(model, tokenizer, renderer.eos_ids)
    request = tictactoe_requests(renderer, n=1)[0]
    outs = engine.generate([request] * 4, SamplingParams(max_new_tokens=10, seed=5))
    sequences = [request.prompt_ids + o.ids for o in outs]
    masks = [[0] * len(request.prompt_ids) + [1] * len(o.ids) for o in outs]
    levels = []
    real = cascade.attention

    def spy(module, *args, **kwargs):
        if kwargs.get(cascade.PREFIX_KWARG) is not None:
            levels.append(len(kwargs[cascade.PREFIX_KWARG].levels))
        return real(module, *args, **kwargs)

    monkeypatch.setattr(cascade, "attention", spy)
    from transformers import AttentionInterface

    AttentionInterface.register(cascade.NAME, spy)
    try:
        ours = scored_with_grads(model, sequences, masks, 1.0)
        model.set_attn_implementation("sdpa")
        plain = scored_with_grads(model, sequences, masks, 1.0)
    finally:
        AttentionInterface.register(cascade.NAME, real)
    assert levels and set(levels) == {1}
    assert_same_scores(ours, plain)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("tail_rows", [[1, 0, 0, 1], [2, 0, 0, 0]])
def test_inference_kernel_path_equals_the_autograd_path(q_len, tail_rows):
    """Without gradients on the CPU each level runs through the flash kernel (the own
    columns too, or as two products for a decode step's few queries: q_len 1 here) and
    the levels merge by log-sum-exp; that equals the autograd function's result,
    including a query that sees none of its own columns (left padding), and a level
    whose rows are read by groups of different sizes or not at all."""
    from looprl.forward.cascade_kernels import FLASH_CPU, Cascade, flash_levels

    if FLASH_CPU is None:
        pytest.skip("this PyTorch has no CPU flash-attention kernel")
    torch.manual_seed(3)
    batch, kv_heads, groups, dim, own = 4, 3, 3, 16, 6
    assert groups * 1 <= cascade_kernels.OWN_PRODUCT_ROWS < groups * 4  # both own paths
    query = torch.randn(batch, kv_heads, groups * q_len, dim)
    own_k, own_v = torch.randn(2, batch, kv_heads, own, dim)
    head_k, head_v = torch.randn(2, 1, kv_heads, 11, dim)
    tail_k, tail_v = torch.randn(2, 3, kv_heads, 5, dim)
    valid_NT = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.arange(own)[None, :] <= torch.arange(q_len)[:, None] + own - q_len
    padded = torch.ones(batch, own, dtype=torch.bool)
    padded[2, : own - q_len + 1] = False  # row 2's first query sees no own column
    mask = (causal[None] & padded[:, None, :])[:, None, None]  # [B, 1, 1, Q, L]
    head = cascade.Level([head_k], [head_v])
    tails = cascade.Level([tail_k], [tail_v], rows_B=torch.tensor(tail_rows), valid_NT=valid_NT)
    specs = [(level.groups, level.valid_NT) for level in (head, tails)]
    tensors = (head_k, head_v, tail_k, tail_v)
    with torch.no_grad():
        want = Cascade.apply(query, own_k, own_v, mask, 0.25, specs, *tensors)
        got = flash_levels(query, own_k, own_v, mask, 0.25, specs, tensors)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [1, 4])
def test_training_kernel_path_equals_the_autograd_path(q_len):
    """With gradients on the CPU the levels run forward through the flash kernel and
    backward through its backward, once per level with the merged output and the total
    log-normaliser; values and every gradient equal the plain autograd function's,
    including a query that sees none of its own columns (left padding)."""
    from looprl.forward.cascade_kernels import FLASH_CPU_BACKWARD, Cascade, FlashCascade

    if FLASH_CPU_BACKWARD is None:
        pytest.skip("this PyTorch has no CPU flash-attention kernel")
    torch.manual_seed(4)
    batch, kv_heads, groups, dim, own = 4, 3, 3, 16, 6
    leaf = dict(requires_grad=True)
    query = torch.randn(batch, kv_heads, groups * q_len, dim, **leaf)
    own_k, own_v = (torch.randn(batch, kv_heads, own, dim, **leaf) for _ in range(2))
    head_k, head_v = (torch.randn(1, kv_heads, 11, dim, **leaf) for _ in range(2))
    tail_k, tail_v = (torch.randn(2, kv_heads, 5, dim, **leaf) for _ in range(2))
    valid_NT = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    causal = torch.arange(own)[None, :] <= torch.arange(q_len)[:, None] + own - q_len
    padded = torch.ones(batch, own, dtype=torch.bool)
    padded[2, : own - q_len + 1] = False  # row 2's first query sees no own column
    mask = (causal[None] & padded[:, None, :])[:, None, None]  # [B, 1, 1, Q, L]
    head = cascade.Level([head_k], [head_v])
    tails = cascade.Level([tail_k], [tail_v], rows_B=torch.tensor([1, 0, 0, 1]), valid_NT=valid_NT)
    specs = [(level.groups, level.valid_NT) for level in (head, tails)]
    inputs = (query, own_k, own_v, head_k, head_v, tail_k, tail_v)
    weights = torch.randn(batch, kv_heads, groups * q_len, dim)
    results = []
    for function in (Cascade, FlashCascade):
        out = function.apply(query, own_k, own_v, mask, 0.25, specs, *inputs[3:])
        results.append((out, *torch.autograd.grad((out * weights).sum(), inputs)))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_head", [True, False])
def test_trainer_packs_suffixes_of_different_lengths(tokenizer, renderer, monkeypatch, split_head):
    """Suffixes of different lengths run as one row of their real tokens (no padding
    through the linear layers); logprobs and LoRA gradients equal the padded call's."""
    from looprl.forward import score

    model = lora_tiny_model(seed=3)
    if not split_head:  # the plain path: full logits from the model, then unpacked
        monkeypatch.setattr(score, "decoder_and_head", lambda model: None)
    assert cascade.enable(model)
    requests = tictactoe_requests(renderer, n=3)
    sequences, masks = [], []
    for i, request in enumerate(requests):
        out = list(range(20, 23 + 4 * i))  # 3, 7 and 11 generated tokens
        turn = [7, 8] * i  # and a second turn of 0, 2 or 4 tokens
        sequences.append(request.prompt_ids + out + turn + out[:i])
        masks.append([0] * len(request.prompt_ids) + [1] * len(out) + [0] * len(turn) + [1] * i)
    shapes = []
    base = model.get_base_model().model
    hook = base.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    model.train()
    packed = scored_with_grads(model, sequences, masks, 0.9)
    hook.remove()
    suffixes = [len(s) - m.index(1) for s, m in zip(sequences, masks)]
    assert (1, sum(suffixes)) in shapes  # the suffix pass ran packed
    padded = scored_with_grads(model, sequences, masks, 0.9, pack=False)
    assert_same_scores(packed, padded)
    model.get_base_model().set_attn_implementation("sdpa")
    assert_same_scores(packed, scored_with_grads(model, sequences, masks, 0.9))


def test_models_with_sliding_windows_keep_their_own_attention():
    """A sliding window would have to cut the shared levels too: such models stay on SDPA."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    small = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    windowed = [
        MistralConfig(sliding_window=8, **small),
        Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **small),
    ]
    for config in windowed:
        model = AutoModelForCausalLM.from_config(config)
        assert not cascade.enable(model)
        assert model.config._attn_implementation == "sdpa"
    assert cascade.enable(AutoModelForCausalLM.from_config(Qwen2Config(**small)))
    module = SimpleNamespace(layer_idx=0)
    query = torch.zeros(1, 2, 1, 8)
    keys = torch.zeros(1, 1, 3, 8)
    level = cascade.Level([torch.zeros(1, 1, 2, 8)], [torch.zeros(1, 1, 2, 8)])
    with pytest.raises(ValueError, match="sliding-window"):
        cascade.attention(
            module, query, keys, keys, None, sliding_window=2,
            looprl_prefix=cascade.Prefix([level]),
        )  # fmt: skip
