"""The update's old logprobs taken from the engine when it samples from the policy module
itself (loop/update.py), and the frozen output head's logprobs whose gradient is formed in
the forward pass (algo/logprobs.py `head_logprobs`)."""

from __future__ import annotations

import copy

import pytest
import torch

from looprl.algo.logprobs import head_logprobs, token_logprobs
from looprl.config import AlgoConfig, TrainConfig, config_from_dict
from looprl.engine import SamplingParams
from looprl.engine.hf import HFEngine
from looprl.envs.builtin.tictactoe import TicTacToeMove, positions, winning_moves
from looprl.forward.score import decoder_and_head
from looprl.loop.groups import Group
from looprl.loop.offpolicy import has_dropout, samples_policy_exactly
from looprl.loop.policy import Policy, load_policy
from looprl.loop.rollout import run_episodes
from looprl.loop.update import UpdateState, update_policy
from looprl.types import Task


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_head_logprobs_and_gradient_match_autograd(temperature, bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 300, bias=bias).requires_grad_(False)
    hidden = torch.randn(130, 24, requires_grad=True)  # chunks of 64, 64, 2
    targets = torch.randint(0, 300, (130,))
    weights = torch.randn(130)

    got = head_logprobs(hidden, head, targets, temperature, chunk_tokens=64)
    (got * weights).sum().backward()
    got_grad, hidden.grad = hidden.grad, None
    want = token_logprobs(head(hidden)[None], targets[None], temperature)[0]
    (want * weights).sum().backward()
    with torch.no_grad():  # the plain chunked path, as the old-logprob pass runs it
        plain = head_logprobs(hidden, head, targets, temperature, chunk_tokens=64)

    assert torch.equal(got.detach(), plain)  # the same values, bit for bit
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.allclose(got_grad, hidden.grad, atol=1e-6, rtol=1e-5)


def test_head_logprobs_with_a_trained_head_keep_its_gradient():
    """A head that takes a gradient (a full fine-tune) gets it, through checkpointing."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(20, 16, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    head_logprobs(hidden, head, targets, chunk_tokens=8).sum().backward()
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_head_logprobs_of_no_positions_are_empty():
    head = torch.nn.Linear(8, 10).requires_grad_(False)
    hidden = torch.zeros(0, 8, requires_grad=True)
    out = head_logprobs(hidden, head, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
    out.sum().backward()  # nothing to do, and no error


# ------------------------------------------------------------------ the update


def lora_policy(dropout: float = 0.0) -> Policy:
    torch.manual_seed(0)
    cfg = config_from_dict({
        "model": {"name": "tiny-random", "lora": {"enabled": True, "rank": 4, "dropout": dropout}},
        "rollout": {"batch_size": 8},
    })  # fmt: skip
    return load_policy(cfg)


def sampled_groups(policy: Policy) -> list[Group]:
    """Two tasks x 4 episodes sampled by the policy's engine, advantages +-1."""
    boards = [b for b in positions(400, seed=7) if winning_moves(b, "X")][:2]
    tasks = [Task(id=f"t{i}", data={"board": b}, seed=i) for i, b in enumerate(boards)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    episodes = run_episodes(
        [t for t in tasks for _ in range(4)], TicTacToeMove, policy.engine, policy.renderer,
        params, 1, 512,
    )  # fmt: skip
    return [
        Group(task, episodes[4 * i : 4 * i + 4], [1.0, -1.0, 1.0, -1.0])
        for i, task in enumerate(tasks)
    ]


def twin(policy: Policy) -> Policy:
    """The same weights in another module, with its own engine over it."""
    model = copy.deepcopy(policy.model)
    engine = HFEngine(model, policy.tokenizer, policy.renderer.eos_ids, batch_size=8)
    return Policy(model, policy.tokenizer, policy.renderer, engine, policy.device)


def update(policy: Policy, groups: list[Group], fresh: bool) -> tuple[dict, list[bool]]:
    """One update with plain SGD (linear in the gradient); returns its stats and, per
    forward pass of the model, whether it ran with gradients."""
    decoder_and_head(policy.model)  # its one-off check, a forward pass, done beforehand
    passes: list[bool] = []
    hook = policy.model.register_forward_pre_hook(lambda *_: passes.append(torch.is_grad_enabled()))
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)
    try:
        stats = update_policy(
            policy, optimizer, groups, AlgoConfig(num_minibatches=2), TrainConfig(),
            group_size=4, max_tokens=10, seed=0, state=UpdateState(micro_batch_tokens=4096),
            fresh=fresh,
        )  # fmt: skip
    finally:
        hook.remove()
    return stats, passes


def test_fresh_episodes_skip_the_old_logprob_pass_and_update_the_same():
    policy = lora_policy()
    assert samples_policy_exactly(policy)
    groups = sampled_groups(policy)
    other = twin(policy)
    fresh, fresh_passes = update(policy, groups, fresh=True)
    scored, scored_passes = update(other, groups, fresh=False)

    assert not all(scored_passes) and all(fresh_passes)  # no pass without gradients
    assert len(fresh_passes) < len(scored_passes)
    assert fresh["updated"] == scored["updated"] == 2
    for key in ("loss", "grad_norm"):
        assert fresh[key] == pytest.approx(scored[key], rel=1e-4, abs=1e-7), key
    # the gap is measured in both: by the old-logprob pass, or by the loss passes
    # before the first optimizer step
    assert 0 <= fresh["logprob_gap"] < 1e-4 and 0 <= scored["logprob_gap"] < 1e-4
    for mine, theirs in zip(policy.trainable_parameters(), other.trainable_parameters()):
        assert torch.allclose(mine, theirs, atol=1e-6, rtol=1e-5)


def test_the_gap_still_shows_an_engine_that_disagrees():
    """The engine's logprobs taken as old ones must not hide an engine that is wrong:
    the loss passes before any optimizer step measure the gap against the trainer."""
    policy = lora_policy()
    groups = sampled_groups(policy)
    for group in groups:
        for episode in group.episodes:
            episode.logprobs = [lp - 0.5 * m for lp, m in zip(episode.logprobs, episode.loss_mask)]
    stats, _ = update(policy, groups, fresh=True)
    assert stats["logprob_gap"] == pytest.approx(0.5, abs=1e-3)


def test_no_engine_logprobs_as_old_ones_unless_the_sampler_is_the_policy():
    policy = lora_policy()
    groups = sampled_groups(policy)
    low = Policy(policy.model, policy.tokenizer, policy.renderer,
                 HFEngine(policy.model, policy.tokenizer, policy.renderer.eos_ids,
                          sampler_dtype="bfloat16"), policy.device)  # fmt: skip
    elsewhere = twin(policy)
    elsewhere.engine = policy.engine  # samples from another module
    assert not samples_policy_exactly(low) and not samples_policy_exactly(elsewhere)
    _, passes = update(low, groups, fresh=True)
    assert not all(passes)  # the trainer's own old-logprob pass ran

    dropping = lora_policy(dropout=0.1)
    assert has_dropout(dropping.model) and not samples_policy_exactly(dropping)
    assert not has_dropout(policy.model)
