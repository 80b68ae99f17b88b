"""The objectives past GSPO: CISPO, the importance-sampling corrections (algo.is_correction)
and the KL estimators (algo.kl_estimator), on hand-computed values and exact KLs of small
distributions; and each of them end to end in a short run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from looprl.algo import (
    LOSSES,
    Normalizer,
    cispo_loss,
    correct,
    correction_stats,
    grpo_loss,
    kl_tokens,
    masked_counts,
    opd_loss,
)
from looprl.algo.kl import kl_term
from looprl.cli import app
from looprl.config import AlgoConfig, load_config
from looprl.loop.offpolicy import corrected

# ------------------------------------------------------------------------------ CISPO


def test_cispo_hand_values_and_gradient():
    # r = exp(logp - old): row 0 tokens 1.1 (inside), 1.5 (clipped to 1.28), 0.2 (no lower
    # bound at eps_low = 1: the weight stays 0.2); row 1 one token at r = 1, A = -2
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor(
        [[math.log(1.1), math.log(1.5), math.log(0.2)], [0.0, 5.0, 5.0]],
        dtype=torch.float64,
        requires_grad=True,
    )
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, stats = cispo_loss(logp, old, adv, mask)  # defaults: eps_low 1, eps_high 0.28

    w = [1.1, 1.28, 0.2]
    want = -(sum(wi * math.log(r) for wi, r in zip(w, [1.1, 1.5, 0.2])) + 1.0 * -2.0 * 0.0) / 4
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    # dL/dlogp_it = -m_it clip(r_it) A_i / N_tok: the clipped token keeps its gradient
    want_grad = torch.tensor(
        [[-1.1 / 4, -1.28 / 4, -0.2 / 4], [2.0 / 4, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(logp.grad, want_grad)
    assert stats["clip_frac"] == pytest.approx(1 / 4)  # 1.5 > 1.28
    assert stats["count"] == 4.0 and stats["ratio_max"] == pytest.approx(1.5)


def test_cispo_micro_batches_add_up_to_the_minibatch():
    torch.manual_seed(0)
    old = torch.randn(4, 5, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(4, 5, dtype=torch.float64)).requires_grad_(True)
    mask = (torch.rand(4, 5) > 0.3).to(torch.float64)
    adv = torch.randn(4, dtype=torch.float64)
    whole, _ = cispo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    (g_whole,) = torch.autograd.grad(whole, logp)
    n = Normalizer.of(mask)
    parts = [cispo_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2],
                        eps_low=0.2, eps_high=0.2, normalizer=n)[0] for i in (0, 2)]  # fmt: skip
    (g_parts,) = torch.autograd.grad(sum(parts), logp)
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(g_parts, g_whole)


def test_cispo_is_selectable_with_its_published_clip():
    cfg = AlgoConfig(name="cispo")
    assert (cfg.eps_low, cfg.eps_high) == (1.0, 0.28)
    assert LOSSES["cispo"] is cispo_loss


# ---------------------------------------------------------- importance-sampling corrections

OLD = torch.tensor([-1.0, -1.0, -2.0, -0.5])
ENGINE = torch.tensor([-1.5, -2.5, -1.0, -0.5])  # rho = e^0.5, e^1.5, e^-1, 1


def test_token_modes_hand_values():
    rho = torch.exp(OLD - ENGINE)  # 1.6487, 4.4817, 0.3679, 1
    truncate = correct(OLD, ENGINE, "token_truncate", 2.0)
    torch.testing.assert_close(truncate.weight_T, torch.tensor([rho[0], 2.0, rho[2], 1.0]))
    assert truncate.keep_T.all() and truncate.truncated_T.tolist() == [False, True, False, False]
    mask = correct(OLD, ENGINE, "token_mask", 2.0)
    torch.testing.assert_close(mask.weight_T, rho)
    assert mask.keep_T.tolist() == [True, False, True, True]
    icepop = correct(OLD, ENGINE, "icepop", 2.0)  # band [0.5, 2]: e^1.5 and e^-1 are out
    assert icepop.keep_T.tolist() == [True, False, False, True]
    torch.testing.assert_close(icepop.weight_T, rho)


def test_sequence_modes_weigh_every_token_by_the_product():
    rho_i = math.exp(float((OLD - ENGINE).sum()))  # e^(0.5 + 1.5 - 1 + 0) = e^1 = 2.718
    truncate = correct(OLD, ENGINE, "sequence_truncate", 2.0)
    torch.testing.assert_close(truncate.weight_T, torch.full((4,), 2.0))
    assert truncate.keep_T.all()
    keep = correct(OLD, ENGINE, "sequence_mask", 3.0)
    torch.testing.assert_close(keep.weight_T, torch.full((4,), rho_i))
    assert keep.keep_T.all()
    assert not correct(OLD, ENGINE, "sequence_mask", 2.0).keep_T.any()  # all or nothing


def test_correction_stats_and_counts():
    a = correct(OLD, ENGINE, "icepop", 2.0)  # 2 of 4 out
    b = correct(OLD[:2], OLD[:2], "icepop", 2.0)  # rho = 1: both kept
    stats = correction_stats([a, b])
    assert stats["is_masked_frac"] == pytest.approx(2 / 6)
    assert stats["is_weight_mean"] == pytest.approx((math.exp(0.5) + 1 + 1 + 1) / 4)
    gone = correct(OLD, ENGINE, "sequence_mask", 2.0)
    assert masked_counts([a, None, gone]) == (1, 2 + 4)


def test_bad_bounds_and_modes_are_refused():
    with pytest.raises(ValueError, match="unknown importance-sampling correction"):
        correct(OLD, ENGINE, "token_clip", 2.0)
    with pytest.raises(ValueError, match="icepop"):
        correct(OLD, ENGINE, "icepop", 0.5)


def test_masked_tokens_leave_the_denominator():
    # A batch where icepop masks a token trains exactly like the batch without that
    # token: the kept tokens' gradients are not shrunk by a denominator that still counts it
    old_BT = torch.tensor([[-1.0, -1.0, -2.0, -0.5]])
    engine_BT = torch.tensor([[-1.0, -2.5, -2.0, -0.5]])  # token 1: rho = e^1.5, masked
    mask_BT = torch.ones(1, 4, dtype=torch.bool)
    adv_B = torch.tensor([1.0])
    logp = old_BT.clone().requires_grad_(True)
    fix = correct(old_BT[0], engine_BT[0], "icepop", 2.0)
    logp_w, loss_mask = corrected(logp, mask_BT, [fix])
    tokens = int(mask_BT.sum()) - masked_counts([fix])[1]
    norm = Normalizer(sequences=1.0, tokens=tokens, max_tokens=4.0)
    loss, _ = grpo_loss(logp_w, old_BT, adv_B, loss_mask.float(), normalizer=norm)
    loss.backward()

    kept = torch.tensor([0, 2, 3])
    alone = old_BT[:, kept].clone().requires_grad_(True)
    want, _ = grpo_loss(alone, old_BT[:, kept], adv_B, torch.ones(1, 3))
    want.backward()
    assert loss.item() == pytest.approx(want.item())
    torch.testing.assert_close(logp.grad[:, kept], alone.grad)
    assert logp.grad[0, 1] == 0.0


def test_truncation_scales_each_token_gradient():
    logp = OLD[None].clone().requires_grad_(True)
    fix = correct(OLD, ENGINE, "token_truncate", 2.0)
    out, keep = corrected(logp, torch.ones(1, 4, dtype=torch.bool), [fix])
    assert keep.all() and torch.equal(out.detach(), logp.detach())
    out.sum().backward()
    torch.testing.assert_close(logp.grad[0], fix.weight_T)


def test_config_spellings_of_the_correction():
    assert AlgoConfig(tis_cap=1.5).is_correction == "token_truncate"
    assert AlgoConfig(tis_cap=1.5).is_bound == 1.5
    icepop = AlgoConfig(is_correction="icepop")
    assert icepop.is_bound == 2.0 and icepop.tis_cap is None
    again = AlgoConfig(**AlgoConfig(tis_cap=1.5).model_dump())  # a run folder's config
    assert (again.is_correction, again.is_bound) == ("token_truncate", 1.5)
    with pytest.raises(ValueError, match="keep one of them"):
        AlgoConfig(tis_cap=2.0, is_correction="icepop")
    with pytest.raises(ValueError, match="is_correction, which is unset"):
        AlgoConfig(is_bound=2.0)
    with pytest.raises(ValueError, match="must be > 1"):
        AlgoConfig(is_correction="icepop", is_bound=1.0)


# ----------------------------------------------------------------------- KL estimators


def _exact(probs: torch.Tensor, ref: torch.Tensor) -> float:
    return float((probs * (probs.log() - ref.log())).sum())


def test_estimators_against_the_exact_kl_of_small_distributions():
    # E_{y ~ pi}[k(y)], summed exactly over the 5 outcomes
    pi = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)
    for ref in (torch.tensor([0.3, 0.1, 0.2, 0.2, 0.2], dtype=torch.float64),
                torch.tensor([0.12, 0.18, 0.3, 0.24, 0.16], dtype=torch.float64)):  # fmt: skip
        exact = _exact(pi, ref)
        mean = {
            k: float((pi * kl_tokens(pi.log(), ref.log(), k)).sum()) for k in ("k1", "k2", "k3")
        }
        assert mean["k1"] == pytest.approx(exact, rel=1e-12)  # unbiased
        assert mean["k3"] == pytest.approx(exact, rel=1e-12)  # unbiased
        assert mean["k2"] == pytest.approx(exact, rel=0.2)  # biased, close for close policies
        assert (kl_tokens(pi.log(), ref.log(), "k3") >= 0).all()
    assert mean["k2"] != pytest.approx(exact, rel=1e-6)


def _expected_gradient(estimator: str, logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E_{y ~ pi}[grad of the loss's KL term on the one-token sequence y], exactly."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, dim=-1)
    total = logits.new_zeros(())
    for y in range(logits.numel()):
        term, _ = kl_term(logp[y].view(1, 1), ref.log()[y].view(1, 1),
                          torch.ones(1, 1, dtype=torch.bool), 1.0, True, estimator)  # fmt: skip
        total = total + logp[y].exp().detach() * term
    (grad,) = torch.autograd.grad(total, logits)
    return grad


def test_k1_in_the_reward_and_k2_follow_the_reverse_kl_k3_the_forward():
    logits = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=torch.float64)
    ref = torch.tensor([0.4, 0.3, 0.1, 0.2], dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    pi = torch.softmax(x, -1)
    (reverse,) = torch.autograd.grad((pi * (pi.log() - ref.log())).sum(), x)
    x = logits.clone().requires_grad_(True)
    pi = torch.softmax(x, -1)
    (forward,) = torch.autograd.grad((ref * (ref.log() - pi.log())).sum(), x)
    torch.testing.assert_close(_expected_gradient("k1", logits, ref), reverse)
    torch.testing.assert_close(_expected_gradient("k2", logits, ref), reverse)
    torch.testing.assert_close(_expected_gradient("k3", logits, ref), forward)
    assert not torch.allclose(reverse, forward)


def test_k1_term_value_is_the_estimate():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    value, stat = kl_term(logp, ref, mask, 1.0, True, "k1")
    assert value.item() == pytest.approx((0.5 - 1.0) / 2) and stat.item() == value.item()
    tokens, _ = kl_term(logp, ref, mask, 2.0, False, "k1")
    assert tokens.item() == pytest.approx((0.5 - 1.0) / 2)


def test_the_estimator_needs_a_kl_penalty():
    assert AlgoConfig(kl_coef=0.1, kl_estimator="k1").kl_estimator == "k1"
    with pytest.raises(ValueError, match="kl_coef=0"):
        AlgoConfig(kl_estimator="k2")


# ------------------------------------------------------------------- end to end, tiny

TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=4", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]", "--set", "train.steps=2",
        "--set", "train.lr=0.02"]  # fmt: skip


def _run(out: Path, *args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 2 and all(r["train/updates"] > 0 for r in rows)
    return rows


def test_cispo_with_k1_in_the_reward_runs(tmp_path):
    rows = _run(tmp_path / "cispo", "--set", "algo.name=cispo", "--set", "algo.kl_coef=0.1",
                "--set", "algo.kl_estimator=k1", "--set", "model.lora.enabled=true")  # fmt: skip
    assert all(math.isfinite(r["train/kl"]) for r in rows)
    assert all(math.isfinite(r["train/loss"]) for r in rows)


def test_icepop_under_overlapped_rollouts_logs_what_it_masked(tmp_path):
    # four groups a step, not two: both steps must draw a group of unequal rewards to
    # update at all (with two groups of four, a seed may draw equal rewards in both)
    rows = _run(tmp_path / "icepop", "--set", "rollout.max_staleness=1",
                "--set", "algo.is_correction=icepop", "--set", "algo.name=grpo",
                "--set", "rollout.tasks_per_step=4")  # fmt: skip
    assert all(0.0 <= r["train/is_masked_frac"] <= 1.0 for r in rows)
    assert all(r["train/is_weight_mean"] > 0 for r in rows)
    assert rows[1]["rollout/staleness_max"] == 1


def test_a_kl_anchor_to_the_warm_start(tmp_path):
    # after an SFT stage, `start` anchors to the warm-started weights: at step 1 (one
    # minibatch, before any RL update) the policy *is* the reference, KL exactly 0; the
    # base model is some way off. The start's weights are kept in RUN/checkpoints/rl_start.
    args = ["--set", "sft.enabled=true", "--set", "sft.steps=2", "--set", "sft.lr=0.05",
            "--set", "model.lora.enabled=true", "--set", "algo.kl_coef=0.1",
            "--set", "algo.num_minibatches=1", "--set", "algo.kl_estimator=k2"]  # fmt: skip
    start = _run(tmp_path / "start", *args, "--set", "algo.kl_reference=start")
    base = _run(tmp_path / "base", *args)
    assert start[0]["train/kl"] == 0.0
    assert base[0]["train/kl"] > 1e-6
    kept = tmp_path / "start" / "checkpoints" / "rl_start" / "trainable.safetensors"
    sft = tmp_path / "start" / "checkpoints" / "step_000000" / "trainable.safetensors"
    a, b = load_file(str(kept)), load_file(str(sft))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_warm_started_run_is_anchored_to_its_warm_start_unless_told_otherwise():
    warm = ["sft.enabled=true", "model.lora.enabled=true"]
    algo = load_config(overrides=warm).algo
    assert (algo.kl_coef, algo.kl_reference, algo.kl_estimator) == (0.1, "start", "k2")
    assert load_config(overrides=[*warm, "algo.kl_coef=0"]).algo.kl_coef == 0.0
    chosen = load_config(overrides=[*warm, "algo.kl_estimator=k3"]).algo
    assert (chosen.kl_coef, chosen.kl_estimator) == (0.1, "k3")  # what was set stays
    assert load_config(overrides=["model.lora.enabled=true"]).algo.kl_coef == 0.0  # no SFT
    full = load_config(overrides=["sft.enabled=true", "model.lora.enabled=false"]).algo
    assert full.kl_coef == 0.0  # the KL reference needs LoRA
    opd = load_config(overrides=[*warm, "algo.name=opd", "algo.teacher=tiny-random"]).algo
    assert opd.kl_coef == 0.0


# ------------------------------------------------------------- on-policy distillation


def test_opd_hand_values_and_gradient():
    # at r = 1 each token's advantage is -(old - teacher): dL/dlogp = (old - teacher) / N_tok
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-3.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    loss, stats = opd_loss(logp, old, teacher, mask)
    d = [-0.5, 0.5, 0.0, 1.5]  # old - teacher on the 4 masked tokens
    assert loss.item() == pytest.approx(sum(d) / 4)  # -sum(r A)/N with r = 1, A = -d
    assert stats["distill_kl"] == pytest.approx(sum(d) / 4)
    loss.backward()
    want = torch.tensor([[-0.5, 0.5, 0.0], [1.5, 0.0, 0.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(logp.grad, want)


def test_distillation_config_rules():
    assert AlgoConfig(name="opd", teacher="tiny-random").distills
    assert AlgoConfig(distill_coef=0.5, teacher="tiny-random").distills
    assert (
        AlgoConfig(name="opd", teacher="t").eps_low,
        AlgoConfig(name="opd", teacher="t").eps_high,
    ) == (0.2, 0.28)
    with pytest.raises(ValueError, match="set algo.teacher"):
        AlgoConfig(name="opd")
    with pytest.raises(ValueError, match="only used by on-policy distillation"):
        AlgoConfig(teacher="tiny-random")
    with pytest.raises(ValueError, match="drop algo.distill_coef"):
        AlgoConfig(name="opd", teacher="t", distill_coef=0.1)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from looprl.model.load import load_tokenizer

    other = load_tokenizer("tiny-random")
    other.add_tokens(["<only-in-the-teacher>"])
    other.save_pretrained(tmp_path / "teacher")
    result = CliRunner().invoke(
        app,
        [
            "run",
            *TINY,
            "--set",
            "algo.name=opd",
            "--set",
            f"algo.teacher={tmp_path / 'teacher'}",
            "--out",
            str(tmp_path / "run"),
        ],  # fmt: skip
    )
    assert result.exit_code == 2, result.output
    assert "another tokenizer than the student" in result.output
    assert "<only-in-the-teacher>" in result.output
    assert not (tmp_path / "run").exists()


def test_opd_from_a_run_folder_teacher(tmp_path):
    # the teacher: a tiny run whose SFT moved its weights; the student starts from the base
    _run(tmp_path / "teacher", "--set", "sft.enabled=true", "--set", "sft.steps=3",
         "--set", "sft.lr=0.05")  # fmt: skip
    rows = _run(tmp_path / "opd", "--set", "algo.name=opd",
                "--set", f"algo.teacher={tmp_path / 'teacher'}")  # fmt: skip
    # (the tokens of a forced call are drawn under its grammar, not from pi itself, so the
    # k1 mean there is an estimate that can fall below 0)
    assert all(abs(r["train/distill_kl"]) > 1e-3 for r in rows)
    # the same model as the teacher: nothing to distil (to the engine's float rounding)
    same = _run(tmp_path / "same", "--set", "algo.name=grpo", "--set", "algo.distill_coef=1",
                "--set", "algo.teacher=tiny-random")  # fmt: skip
    assert abs(same[0]["train/distill_kl"]) < 1e-4
