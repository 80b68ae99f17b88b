"""The `hf` engine's sampler on the logits' device: each row's counter-based random stream
(engine/random_stream.py) against exact integer arithmetic and for uniformity, the grammar
mask's plain-torch fallback against xgrammar's kernel, the inverse CDF's vectorized
fallback, and a row's tokens as a function of its own stream alone."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from looprl.engine import GenerationRequest, SamplingParams, ToolConstraint
from looprl.engine.hf import HFEngine
from looprl.engine.random_stream import MULTIPLIERS, SALTS, stream_uniforms
from looprl.engine.sampling import CDF_BLOCK, Row, inverse_cdf
from looprl.envs.builtin.tictactoe import TicTacToeMove
from looprl.seeds import stream_seed


def exact_uniform(key: int, position: int) -> float:
    """The stream's uniform in Python's unbounded integers (no int64 to overflow)."""

    def round32(x: int) -> int:
        x ^= x >> 16
        x = (x * MULTIPLIERS[0]) % 2**32
        x ^= x >> 15
        x = (x * MULTIPLIERS[1]) % 2**32
        return x ^ (x >> 15)

    words = []
    for salt in SALTS:
        word = round32((position % 2**32) ^ salt)
        word = round32(word ^ (key % 2**32))
        words.append(round32(word ^ (key >> 32)))
    return ((words[0] >> 5) * 2**26 + (words[1] >> 6)) / 2**53


def test_stream_uniforms_equal_exact_integer_arithmetic():
    """The int64 tensor ops give the exact 32-bit hash, for keys up to 2^63 - 1 (both
    halves with their top bit set) and large positions, whatever rows sit beside."""
    keys = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 0xFFFFFFFF80000000 >> 1, stream_seed(7, 3)]
    positions = [0, 1, 2**31 - 1, 2**31, 5_000_000, 17, 2**32 - 1, 3]
    got = stream_uniforms(torch.tensor(keys), torch.tensor(positions))
    assert got.dtype == torch.float64
    assert got.tolist() == [exact_uniform(k, p) for k, p in zip(keys, positions)]
    assert stream_uniforms(torch.tensor(keys[5:6]), torch.tensor(positions[5:6])).item() == got[5]
    # the stream a seeded run draws from (the counter hash), pinned: a change to it
    # changes every seeded sample, so it must be a deliberate one
    keys = torch.tensor([stream_seed(0, 0), stream_seed(0, 0), stream_seed(9, 5)])
    pinned = stream_uniforms(keys, torch.tensor([0, 1, 7])).tolist()
    assert pinned == [0.012766961163280466, 0.016431776695634226, 0.35765327772522537]


def test_stream_uniforms_are_uniform_and_uncorrelated():
    """~1e5 uniforms over 40 seeds x 25 streams x 100 positions: in [0, 1) on the 2^-53
    grid, a Kolmogorov-Smirnov distance and a 100-bin chi-square within their 0.1%
    critical values, and no correlation between neighbouring positions or streams."""
    keys = torch.tensor([stream_seed(s, i) for s in range(40) for i in range(25)])
    positions = torch.arange(100)
    uniform_SP = stream_uniforms(
        keys.repeat_interleave(len(positions)), positions.repeat(len(keys))
    ).view(len(keys), len(positions))
    flat = uniform_SP.flatten()
    n = flat.numel()
    assert flat.min() >= 0 and flat.max() < 1
    assert torch.equal(flat * 2**53, (flat * 2**53).floor())
    ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert (ecdf - flat.sort().values).abs().max() < 1.95 / math.sqrt(n)
    counts = torch.bincount((flat * 100).long(), minlength=100).double()
    assert ((counts - n / 100) ** 2 / (n / 100)).sum() < 148.2  # chi-square, 99 df
    for a, b in ((uniform_SP[:, :-1], uniform_SP[:, 1:]), (uniform_SP[:-1], uniform_SP[1:])):
        correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(correlation) < 3.5 / math.sqrt(a.numel())


def test_sampled_frequencies_follow_the_distribution_along_one_stream(tiny_model, tokenizer):
    """Tokens drawn at successive positions of few streams (the counter, not the key, is
    what varies): their frequencies pass a chi-square test against softmax(logits / T)."""
    engine = HFEngine(tiny_model, tokenizer, [tokenizer.eos_token_id])
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    rows = [Row(0, [1], 10**6, None, stream_seed(3, s)) for s in range(4)]
    params = SamplingParams(temperature=0.8)
    drawn = []
    for position in range(1500):
        for row in rows:
            row.ids = [0] * position
        tokens, _ = engine._sample(logits.expand(len(rows), -1).clone(), params, rows)
        drawn.append(tokens)
    counts = torch.bincount(torch.cat(drawn), minlength=len(logits)).double()
    want = torch.softmax(logits / params.temperature, -1).double() * counts.sum()
    assert counts[4] == 0
    keep = want > 0
    chi = ((counts[keep] - want[keep]) ** 2 / want[keep]).sum()
    assert chi < 18.47  # 4 df, 0.1%


def test_the_torch_bitmask_fallback_matches_xgrammar():
    """`mask_unpacked` masks the tokens xgrammar's CPU kernel masks: random int32 words
    (negative ones included), a vocabulary that ends inside a word, logits beyond the
    bitmask's width left alone; `apply_bitmask` on chosen rows of a batch."""
    import xgrammar as xgr

    from looprl.engine.grammar import apply_bitmask, mask_unpacked

    gen = torch.Generator().manual_seed(0)
    mask_NW = torch.randint(-(2**31), 2**31, (6, 5), generator=gen, dtype=torch.int32)
    mask_NW[0] = -1  # all allowed
    mask_NW[1] = 0  # none allowed
    logits_NV = torch.randn(6, 5 * 32 + 9, generator=gen)
    for width in (5 * 32 - 7, 5 * 32):
        theirs, ours = logits_NV.clone(), logits_NV.clone()
        xgr.apply_token_bitmask_inplace(theirs, mask_NW, vocab_size=width)
        mask_unpacked(ours, mask_NW, width)
        assert torch.equal(theirs, ours)
        assert torch.equal(ours[:, width:], logits_NV[:, width:])
    assert torch.isinf(ours[1, : 5 * 32]).all() and torch.isfinite(ours[0]).all()
    batch = logits_NV.clone()
    apply_bitmask(batch, mask_NW[2:4], [1, 4])
    alone = logits_NV[[1, 4]].clone()
    mask_unpacked(alone, mask_NW[2:4], 5 * 32)
    assert torch.equal(batch[[1, 4]], alone)
    assert torch.equal(batch[[0, 2, 3, 5]], logits_NV[[0, 2, 3, 5]])


def test_inverse_cdf_past_the_total_takes_the_last_token_with_mass():
    """A target at the total (U = 1) with empty blocks after the mass: the last token with
    p > 0, in whichever block it lies, for every row at once."""
    probs = torch.zeros(3, 3 * CDF_BLOCK + 5)
    probs[0, :10] = 0.1
    probs[1, CDF_BLOCK + 3] = 1.0
    probs[2, [0, 2 * CDF_BLOCK + 1, 3 * CDF_BLOCK + 4]] = torch.tensor([0.5, 0.25, 0.25])
    chosen = inverse_cdf(probs, torch.ones(3, dtype=torch.float64))
    assert chosen.tolist() == [9, CDF_BLOCK + 3, 3 * CDF_BLOCK + 4]


@pytest.fixture()
def mixed_requests(renderer):
    """Different prompts and token limits (rows finish early), one with a logit bias, one
    with its own sampling settings and one forced to call a tool (the grammar's mask)."""
    env = TicTacToeMove(tool_choice="auto")
    out = []
    for n, task in enumerate(env.tasks("train", n=3, seed=4)):
        obs = env.reset(task)
        prompt = renderer.prompt_ids(obs.messages, obs.tools)
        out += [GenerationRequest(prompt[n:], max_new_tokens=3 + 5 * g) for g in range(2)]
    out[1] = replace(out[1], logit_bias={5: 3.0, 9: -2.0})
    out[4] = replace(out[4], sampling=SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9))
    forced = ToolConstraint(obs.tools, "required", renderer.format)
    out[5] = replace(out[5], constraint=forced, max_new_tokens=20)
    return out


def test_a_row_samples_the_same_tokens_alone_and_in_any_batch(
    tiny_model, tokenizer, renderer, mixed_requests
):
    """Each request played alone (its `stream` = its index in the batch) gets the tokens
    it gets inside the whole batch; the same call again gives them again. Jump-forward is
    off: it writes a forced span's canonical tokens only when every live row is forced,
    so with it the forced row alone would take other tokens than in the batch."""
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=21)
    engine = HFEngine(tiny_model, tokenizer, renderer.eos_ids, jump_forward=False)
    whole = [o.ids for o in engine.generate(mixed_requests, params)]
    assert len({len(ids) for ids in whole}) > 1  # rows finished at different steps
    assert [o.ids for o in engine.generate(mixed_requests, params)] == whole
    for index, request in enumerate(mixed_requests):
        alone = engine.generate([replace(request, stream=index)], params)
        assert alone[0].ids == whole[index], index
