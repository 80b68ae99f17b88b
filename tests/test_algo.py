"""Tests of looprl.algo: advantages, token log-probs, policy-gradient losses."""

from __future__ import annotations

import math

import pytest
import torch

from looprl.algo import (
    LOSSES,
    Normalizer,
    batch_advantages,
    dr_grpo_loss,
    dynamic_sampling_keep,
    episode_advantages,
    group_advantages,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    k3_kl,
    masked_mean,
    masked_sum,
    scoring_temperature,
    tempered_log_softmax,
    tis_weights,
    token_logprobs,
    weight_gradient,
)

ALL_LOSSES = sorted(LOSSES)


def call(name: str, *args, **kwargs):
    """Call a loss by name: every loss takes the same arguments."""
    return LOSSES[name](*args, **kwargs)


def make_batch(b: int = 8, t: int = 6, noise: float = 0.2, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp = (old + noise * torch.randn(b, t, generator=g, dtype=dtype)).requires_grad_(True)
    ref = old + 0.1 * torch.randn(b, t, generator=g, dtype=dtype)
    adv = torch.randn(b, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    return logp, old, adv, mask, ref


# ------------------------------------------------------------------------ GSPO by hand


def test_gspo_hand_values_clip_active_and_inactive():
    # seq 0: logp-old = [0.1, 0.3] (third token masked) -> s0 = exp(0.2) = 1.2214, A=+1:
    #        s0 > 1+eps_high, the clipped branch 1.1*1 wins the min -> clip active, grad 0
    # seq 1: logp-old = [0.02, 0.04, 0.0] -> s1 = exp(0.02) = 1.0202, A=-1: inside [0.9, 1.1]
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0], [0.02, 0.04, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = gspo_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.1)

    s0 = math.exp((0.1 + 0.3) / 2)
    s1 = math.exp((0.02 + 0.04 + 0.0) / 3)
    obj0 = min(s0 * 1.0, min(max(s0, 0.9), 1.1) * 1.0)  # = 1.1
    obj1 = min(s1 * -1.0, min(max(s1, 0.9), 1.1) * -1.0)  # = -s1
    assert obj0 == pytest.approx(1.1) and obj1 == pytest.approx(-s1)
    assert loss.item() == pytest.approx(-(obj0 + obj1) / 2, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)  # seq 0 of 2
    assert stats["ratio_mean"] == pytest.approx((s0 + s1) / 2, rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(s0, rel=1e-6)
    assert stats["ratio_min"] == pytest.approx(s1, rel=1e-6)
    assert stats["count"] == 2.0

    loss.backward()
    # seq 0 clipped: no gradient. seq 1: d/dlogp_1t of -(1/2)(s1 * -1) = s1 / (2 * 3)
    assert torch.equal(logp.grad[0], torch.zeros(3))
    torch.testing.assert_close(logp.grad[1], torch.full((3,), s1 / 6))


def test_gspo_pessimistic_side_is_not_counted_as_clipped():
    # A < 0 and s above 1+eps: min picks the unclipped s*A (more negative), gradient flows
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.5]], requires_grad=True)
    loss, stats = gspo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), eps_high=0.1)
    assert loss.item() == pytest.approx(math.exp(0.5), rel=1e-6)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    assert (logp.grad != 0).all()


def test_gspo_ratio_is_exp_of_mean_not_exp_of_sum():
    # 8 tokens, logp - old = 0.01 each: exp(mean) = 1.01005, exp(sum) = 1.0833
    old = torch.zeros(1, 8, dtype=torch.float64)
    logp = torch.full((1, 8), 0.01, dtype=torch.float64)
    mask = torch.ones(1, 8)
    adv = torch.tensor([1.0], dtype=torch.float64)
    for fn in (gspo_loss, gspo_token_loss):
        loss, stats = fn(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
        assert stats["ratio_mean"] == pytest.approx(math.exp(0.01), abs=1e-9)
        assert stats["ratio_mean"] == pytest.approx(1.01005, abs=1e-5)
        assert abs(stats["ratio_mean"] - math.exp(0.08)) > 0.07
        assert loss.item() == pytest.approx(-math.exp(0.01), abs=1e-9)  # -s * A, unclipped


def test_gspo_empty_row_ratio_stats_when_nothing_is_valid():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = gspo_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert stats["count"] == 0.0 and stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0


# ------------------------------------------------------------------ equivalences


@pytest.mark.parametrize("t", [1, 3])
def test_gspo_equals_grpo_on_one_token_sequences(t: int):
    logp, old, adv, _, _ = make_batch(b=6, t=t, noise=0.3, seed=1)
    mask = torch.zeros(6, t, dtype=torch.float64)
    mask[:, 0] = 1.0  # one generated token per sequence (rest is padding)
    kw = {"eps_low": 0.1, "eps_high": 0.1}
    l_gspo, s_gspo = gspo_loss(logp, old, adv, mask, **kw)
    (g_gspo,) = torch.autograd.grad(l_gspo, logp)
    l_grpo, s_grpo = grpo_loss(logp, old, adv, mask, **kw)
    (g_grpo,) = torch.autograd.grad(l_grpo, logp)
    torch.testing.assert_close(l_gspo, l_grpo)
    torch.testing.assert_close(g_gspo, g_grpo)
    assert s_gspo["clip_frac"] == pytest.approx(s_grpo["clip_frac"])
    assert 0 < s_gspo["clip_frac"] < 1  # the comparison covers clipped and unclipped cases


def test_gspo_token_equals_gspo_value_and_gradient():
    # With one advantage per sequence the two are exactly equal (not only in expectation).
    logp, old, adv, mask, ref = make_batch(b=8, t=7, noise=0.15, seed=2)
    kw = {"eps_low": 0.05, "eps_high": 0.06, "ref_logp_BT": ref, "kl_coef": 0.1}
    l_seq, s_seq = gspo_loss(logp, old, adv, mask, **kw)
    (g_seq,) = torch.autograd.grad(l_seq, logp)
    l_tok, s_tok = gspo_token_loss(logp, old, adv, mask, **kw)
    (g_tok,) = torch.autograd.grad(l_tok, logp)
    torch.testing.assert_close(l_tok, l_seq, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_tok, g_seq, rtol=0, atol=1e-12)
    assert s_tok == pytest.approx(s_seq)
    assert 0 < s_seq["clip_frac"] < 1


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_zero_advantage_gives_zero_gradient(name: str):
    logp, old, _, mask, _ = make_batch(seed=3)
    loss, _ = call(name, logp, old, torch.zeros(8, dtype=torch.float64), mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("splits", [[1] * 8, [4, 4], [3, 5]])
def test_microbatch_sum_equals_full_batch(name: str, splits: list[int]):
    logp, old, adv, mask, ref = make_batch(b=8, t=6, noise=0.2, seed=4)
    mask[5] = 0.0  # an empty row must not break the invariance either
    kw = {"eps_low": 0.1, "eps_high": 0.15, "ref_logp_BT": ref, "kl_coef": 0.05}
    full_loss, stats = call(name, logp, old, adv, mask, **kw)
    (full_grad,) = torch.autograd.grad(full_loss, logp)
    assert 0 < stats["clip_frac"] < 1

    n = Normalizer.of(mask)  # the whole minibatch's counts; each loss picks its own
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for size in splits:
        sl = slice(start, start + size)
        kw_k = {**kw, "ref_logp_BT": ref[sl]}
        part, _ = call(name, logp[sl], old[sl], adv[sl], mask[sl], normalizer=n, **kw_k)
        total = total + part
        start += size
    (micro_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(micro_grad, full_grad, rtol=0, atol=1e-6)


def test_ratio_one_loss_is_minus_mean_advantage():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0]))
    logp = torch.randn(6, 5)
    mask = torch.ones(6, 5)
    for fn in (gspo_loss, gspo_token_loss):
        loss, stats = fn(logp, logp.clone(), adv, mask)
        assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
        assert loss.item() == pytest.approx(0.0, abs=1e-6)  # group-normalised: mean(A) = 0
        assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_logp_with_advantage_sign(name: str, sign: float):
    _, old, _, mask, _ = make_batch(b=4, t=5, seed=5)
    logp = old.clone().requires_grad_(True)
    adv = torch.full((4,), sign, dtype=torch.float64)
    loss, _ = call(name, logp, old, adv, mask)
    loss.backward()
    with torch.no_grad():
        new = logp - 0.1 * logp.grad
    delta_B = masked_sum(new - logp.detach(), mask, dim=-1)
    assert (torch.sign(delta_B) == sign).all()


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_masked_tokens_get_zero_grad_and_empty_row_no_nan(name: str):
    logp, old, adv, mask, ref = make_batch(b=4, t=6, seed=6)
    mask[2] = 0.0  # an all-zero row
    with torch.no_grad():  # garbage where the mask is 0 must not leak anywhere
        off = mask == 0
        logp[off] = -math.inf
        old[off] = -math.inf
        ref[off] = math.nan
    loss, stats = call(name, logp, old, adv, mask, ref_logp_BT=ref, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in stats.values())
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[off], torch.zeros_like(logp.grad[off]))
    assert (logp.grad[~off] != 0).any()


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss])
def test_empty_row_contributes_nothing(fn):
    logp, old, adv, mask, _ = make_batch(b=3, t=4, seed=7)
    mask[1] = 0.0
    loss, _ = fn(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    keep = [0, 2]
    ref_loss, _ = fn(logp[keep], old[keep], adv[keep], mask[keep], eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss * 3, ref_loss * 2)  # same sum, default N = B differs


def test_grpo_and_dr_grpo_hand_values():
    old = torch.zeros(2, 4)
    logp = torch.tensor([[0.1, -0.1, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 1.0])
    e = math.exp
    # token objectives: seq0 (A=1): e^0.1, e^-0.1, 1 (all within [0.8, 1.28]); seq1: clip to 1.28
    objs = [e(0.1), e(-0.1), 1.0, 1.28]
    loss, stats = grpo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-sum(objs) / 4, rel=1e-6)  # token mean over 4 tokens
    assert stats["clip_frac"] == pytest.approx(0.25) and stats["count"] == 4.0
    loss, _ = dr_grpo_loss(logp, old, adv, mask, normalizer=Normalizer.of(mask, max_tokens=10))
    assert loss.item() == pytest.approx(-(sum(objs[:3]) / 10 + objs[3] / 10) / 2, rel=1e-6)
    loss, _ = dr_grpo_loss(logp, old, adv, mask)  # default constant length: T = 4
    assert loss.item() == pytest.approx(-(sum(objs[:3]) / 4 + objs[3] / 4) / 2, rel=1e-6)


def test_normalizer_counts_and_dr_grpo_is_grpo_at_mean_length():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    n = Normalizer.of(mask, max_tokens=64)
    assert (n.sequences, float(n.tokens), n.max_tokens) == (3.0, 4.0, 64)
    assert Normalizer.of(torch.zeros(2, 5)).tokens == 1  # never a division by 0
    assert Normalizer.of(mask).max_tokens == 4.0
    # sum / L_max / N_seq == sum / N_tok when L_max = N_tok / N_seq: the two share one body
    logp, old, adv, mask, _ = make_batch(b=6, t=5, seed=11)
    tokens = mask.sum().item()
    l_grpo, s_grpo = grpo_loss(logp, old, adv, mask)
    (g_grpo,) = torch.autograd.grad(l_grpo, logp)
    l_dr, s_dr = dr_grpo_loss(logp, old, adv, mask, normalizer=Normalizer.of(mask, tokens / 6))
    (g_dr,) = torch.autograd.grad(l_dr, logp)
    torch.testing.assert_close(l_dr, l_grpo)
    torch.testing.assert_close(g_dr, g_grpo)
    assert s_dr == pytest.approx(s_grpo)
    with pytest.raises(ValueError, match="max_tokens"):
        dr_grpo_loss(logp, old, adv, mask, normalizer=Normalizer.of(mask, max_tokens=0))


def test_kl_k3_zero_at_ref_positive_elsewhere_and_in_loss():
    logp = torch.randn(3, 5)
    assert torch.equal(k3_kl(logp, logp.clone()), torch.zeros(3, 5))
    ref = logp + torch.randn(3, 5)
    assert (k3_kl(logp, ref) > 0).all()
    mask = torch.ones(3, 5)
    adv = torch.zeros(3)
    for name in ALL_LOSSES:
        loss0, s0 = call(name, logp, logp.clone(), adv, mask, ref_logp_BT=logp.clone(), kl_coef=1)
        assert s0["kl"] == 0.0 and loss0.item() == 0.0
        loss1, s1 = call(name, logp, logp.clone(), adv, mask, ref_logp_BT=ref, kl_coef=0.5)
        assert s1["kl"] > 0
        assert loss1.item() == pytest.approx(0.5 * s1["kl"], rel=1e-5)  # full mask: means agree
        _, s2 = call(name, logp, logp.clone(), adv, mask)
        assert "kl" not in s2


def test_shape_errors():
    with pytest.raises(ValueError):
        gspo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))


# -------------------------------------------------------------------- advantages


def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])  # mean 0.5, population std 0.5
    torch.testing.assert_close(
        group_advantages(r), torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0
    )
    r = torch.tensor([3.0, 1.0, 2.0])  # mean 2, std sqrt(2/3)
    expected = torch.tensor([1.0, -1.0, 0.0]) / (math.sqrt(2 / 3) + 1e-6)
    torch.testing.assert_close(group_advantages(r), expected)
    torch.testing.assert_close(group_advantages(r, scale=False), torch.tensor([1.0, -1.0, 0.0]))


def test_group_advantages_equal_rewards_are_exactly_zero():
    for r in ([0.1, 0.1, 0.1], [1.0], [0.7] * 16):
        assert torch.equal(group_advantages(torch.tensor(r)), torch.zeros(len(r)))
    assert group_advantages(torch.tensor([1, 0])).dtype == torch.float32


def test_batch_advantages_and_zero_std_flag():
    adv_B, zero_std_G = batch_advantages([[1.0, 0.0], [0.5, 0.5, 0.5], [2.0, 0.0, 1.0]])
    assert adv_B.shape == (8,) and adv_B.dtype == torch.float32
    torch.testing.assert_close(adv_B[:2], torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)
    assert torch.equal(adv_B[2:5], torch.zeros(3))
    torch.testing.assert_close(adv_B[5:], group_advantages(torch.tensor([2.0, 0.0, 1.0])))
    assert zero_std_G.tolist() == [False, True, False]
    adv_B, _ = batch_advantages([[2.0, 0.0]], scale=False)
    torch.testing.assert_close(adv_B, torch.tensor([1.0, -1.0]))


def test_episode_advantages_by_hand():
    # group_size 3: [1, 0, (untrainable)] -> mean 0.5, std 0.5; [0.5]*3 -> all equal;
    # [0, 2, 1] -> mean 1, std sqrt(2/3); an all-untrainable group is no group at all
    rewards = [1.0, 0.0, 5.0, 0.5, 0.5, 0.5, 0.0, 2.0, 1.0, 3.0, 3.0, 3.0]
    trainable = [True, True, False] + [True] * 6 + [False] * 3
    s = math.sqrt(2 / 3) + 1e-6
    h = 0.5 / (0.5 + 1e-6)
    adv, zero_std = episode_advantages(rewards, trainable, 3)
    assert adv[2] is None and adv[9:] == [None] * 3 and zero_std == 1
    assert adv[:2] == pytest.approx([h, -h]) and adv[3:6] == [0.0] * 3
    assert adv[6:9] == pytest.approx([-1 / s, 1 / s, 0.0])
    adv, _ = episode_advantages(rewards, trainable, 3, scale=False)
    assert adv[:2] == [0.5, -0.5] and adv[6:9] == [-1.0, 1.0, 0.0]
    adv, zero_std = episode_advantages(rewards, trainable, 3, dynamic_sampling=True)
    assert adv[3:6] == [None] * 3 and zero_std == 1  # dropped, and still counted
    assert adv[:2] == pytest.approx([h, -h]) and adv[6:9] == pytest.approx([-1 / s, 1 / s, 0.0])
    # a short last group: one episode, so one reward, so all equal
    adv, zero_std = episode_advantages([1.0, 0.0, 7.0], [True] * 3, 2)
    assert adv == pytest.approx([h, -h, 0.0]) and zero_std == 1
    with pytest.raises(ValueError):
        episode_advantages([1.0, 0.0], [True], 2)


def test_dynamic_sampling_keep():
    assert dynamic_sampling_keep([[1, 1, 1], [0, 1, 0], [0, 0], [0.5], [0.2, 0.3]]) == [
        False,
        True,
        False,
        False,
        True,
    ]


# ---------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_log_softmax_and_chunking(temperature: float):
    g = torch.Generator().manual_seed(9)
    logits = (3 * torch.randn(5, 7, 13, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 13, (5, 7), generator=g)
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    for chunk in (1, 2, 3, 5, 100):
        out = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk)
        torch.testing.assert_close(out, ref)
        (grad,) = torch.autograd.grad(out.sum(), logits)
        torch.testing.assert_close(grad, ref_grad)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(logits, targets, temperature, 2), ref)


def test_scoring_temperature_and_tempered_log_softmax():
    assert [scoring_temperature(t) for t in (0.0, 0.7, 1.0, 2.0)] == [1.0, 0.7, 1.0, 2.0]
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(12))
    for t in (0.7, 1.0):
        scaled, logp = tempered_log_softmax(logits, t)
        assert torch.equal(scaled, logits / t)  # bit for bit: the ops the engine records
        assert torch.equal(logp, torch.log_softmax(logits / t, dim=-1))
    assert tempered_log_softmax(logits, 1.0)[0] is logits  # no copy at T = 1


def test_token_logprobs_bf16_returns_float32():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 3, 11, generator=g).bfloat16()
    targets = torch.randint(0, 11, (2, 3), generator=g)
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(out, ref)


def test_masked_mean_and_sum():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert masked_sum(x, m).item() == 3.0
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, m).item() == 1.5


def test_tis_weights_hand_computed():
    # w = min(exp(old - engine), cap): exp(0.5) = 1.6487 under the cap 2; exp(1.0) = 2.718
    # is truncated to 2; exp(-0.5) = 0.6065 stays; masked-off positions weigh 1
    old_BT = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    engine_BT = torch.tensor([[-1.5, -2.0, -1.5], [-0.5, 0.0, 0.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w_BT = tis_weights(old_BT, engine_BT, mask_BT, cap=2.0)
    want = torch.tensor([[1.6487213, 2.0, 0.6065307], [1.0, 1.0, 1.0]])
    assert torch.allclose(w_BT, want, atol=1e-6)


def test_weight_gradient_keeps_values_and_scales_each_token_gradient():
    logp_BT = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    w_BT = torch.tensor([[0.5, 2.0, 1.0]])
    out_BT = weight_gradient(logp_BT, w_BT)
    assert torch.equal(out_BT.detach(), logp_BT.detach())
    (out_BT * torch.tensor([[1.0, 10.0, 100.0]])).sum().backward()
    assert torch.allclose(logp_BT.grad, torch.tensor([[0.5, 20.0, 100.0]]))


def test_tis_weighted_grpo_gradient_equals_weighted_token_terms():
    # GRPO at ratio 1 (logp = old, unclipped): dL/dlogp_t = -A m_t / N_tok; with TIS
    # each token's gradient is that times w_t
    torch.manual_seed(0)
    old_BT = torch.randn(2, 4)
    engine_BT = old_BT + 0.3 * torch.randn(2, 4)
    mask_BT = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv_B = torch.tensor([1.0, -0.5])
    logp_BT = old_BT.clone().requires_grad_(True)
    w_BT = tis_weights(old_BT, engine_BT, mask_BT, cap=1.5)
    loss, _ = grpo_loss(weight_gradient(logp_BT, w_BT), old_BT, adv_B, mask_BT)
    loss.backward()
    want_BT = -adv_B[:, None] * mask_BT * w_BT / mask_BT.sum()
    assert torch.allclose(logp_BT.grad, want_BT, atol=1e-6)
