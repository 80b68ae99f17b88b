"""tictactoe-game's `snapshot` opponent: a frozen copy of the policy that picks its
square from the logits of the nine squares' tokens, refreshed at every checkpoint for
train games and kept as loaded for eval games."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from looprl.config import config_from_dict
from looprl.envs.builtin.tictactoe import SnapshotPlayers, TicTacToeGame
from looprl.loop.policy import load_policy
from looprl.loop.preflight import check_env
from looprl.loop.snapshot import SnapshotPlayer, stand_in_snapshots
from looprl.loop.train import run_training


@pytest.fixture(scope="module")
def policy():
    return load_policy(config_from_dict({"model": {"name": "tiny-random"}}))


def _square_probs(player, messages, tools, legal):
    """The snapshot's probabilities of the legal squares, by a forward pass of its own."""
    prefix, heads = player._call_tokens(tools)
    ids = player.renderer.prompt_ids(messages, tools) + prefix
    with torch.no_grad():
        logits = player.model(torch.tensor([ids])).logits[0, -1].float()
    return torch.softmax(logits[[heads[k - 1] for k in legal]], dim=-1).tolist()


def test_the_snapshot_samples_a_legal_square_from_its_logits(policy):
    player = SnapshotPlayer(policy.model, policy.renderer, policy.device)
    prefix, heads = player._call_tokens(TicTacToeGame()._observation("x").tools)
    assert [policy.tokenizer.decode([h]) for h in heads] == [str(k) for k in range(1, 10)]
    assert "choose_square" in policy.tokenizer.decode(prefix)
    obs = TicTacToeGame()._observation("You play O.\n\nX . .\n. . .\n. . .\n\nYour move?")
    legal = [2, 5, 9]
    probs = _square_probs(player, obs.messages, obs.tools, legal)
    rng = random.Random(0)
    draws = Counter(player(obs.messages, obs.tools, legal, rng) for _ in range(400))
    assert set(draws) <= set(legal)
    for square, p in zip(legal, probs):  # within 4 standard errors of 400 draws
        assert abs(draws[square] / 400 - p) < 4 * (p * (1 - p) / 400) ** 0.5 + 1e-3
    # the game's stream decides: the same seed, the same squares
    again = [player(obs.messages, obs.tools, legal, random.Random(7)) for _ in range(5)]
    assert len(set(again)) == 1


def test_refresh_takes_the_policys_trainable_weights(policy):
    player = SnapshotPlayer(policy.model, policy.renderer, policy.device)
    obs = TicTacToeGame()._observation("You play X.\n\n. . .\n. . .\n. . .\n\nYour move?")
    legal = list(range(1, 10))
    before = _square_probs(player, obs.messages, obs.tools, legal)
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trained]
    try:
        with torch.no_grad():
            for p in trained:
                p.add_(torch.randn_like(p) * 0.5)
        assert _square_probs(player, obs.messages, obs.tools, legal) == before  # frozen
        player.refresh(policy.model)
        assert _square_probs(player, obs.messages, obs.tools, legal) != pytest.approx(before)
        mine = dict(player.model.named_parameters())
        for name, p in policy.model.named_parameters():
            assert torch.equal(mine[name], p.detach())
            assert not mine[name].requires_grad
    finally:
        with torch.no_grad():
            for p, s in zip(trained, saved):
                p.copy_(s)


def test_a_run_against_its_own_snapshot(tmp_path):
    """Train games (and the SFT's demonstration games) meet the last checkpoint's policy,
    eval games the model as loaded."""
    cfg = {
        "model": {"name": "tiny-random"},
        "env": {"name": "tictactoe-game", "args": {"opponent": "mix:random=0.5,snapshot=0.5"}},
        "sft": {"enabled": True, "steps": 2, "batch_size": 4, "lr": 1e-2},
        "rollout": {"tasks_per_step": 2, "group_size": 2, "max_new_tokens": 32},
        "train": {"steps": 2, "checkpoint_every": 1, "lr": 1e-2},
        "eval": {"tasks": 2, "samples_per_task": 1, "greedy": False},
        "logging": {"trackers": []},
    }
    run = tmp_path / "run"
    try:
        run_training(config_from_dict(cfg), run)
        train, held_out = SnapshotPlayers.players["train"], SnapshotPlayers.players["eval"]
        last = load_file(str(run / "checkpoints" / "step_000002" / "trainable.safetensors"))
        mine = dict(train.model.named_parameters())
        assert last and all(torch.equal(mine[name], value) for name, value in last.items())
        # LoRA's B starts at 0: the eval snapshot is still the model as loaded
        frozen = dict(held_out.model.named_parameters())
        lora_b = [name for name in last if "lora_B" in name]
        assert lora_b and all(not frozen[name].any() for name in lora_b)
        assert any(mine[name].any() for name in lora_b)
        assert (run / "report.md").exists()
        # the next run without a snapshot share leaves none behind
        plain = {**cfg, "env": {"name": "tictactoe-game", "args": {"opponent": "random"}}}
        plain["sft"] = {"enabled": False}
        run_training(config_from_dict({**plain, "train": {"steps": 1}}), tmp_path / "b")
        assert not SnapshotPlayers.players
    finally:
        SnapshotPlayers.players.clear()


def test_preflight_plays_a_snapshot_game_the_opponent_opens_with_a_stand_in():
    """`opponent: snapshot` alone: the first train task's opponent moves first, before any
    model is loaded; the preflight's stand-in plays it, and the run's players stay unset."""
    cfg = config_from_dict(
        {"model": {"name": "tiny-random"}, "seed": 3,
         "env": {"name": "tictactoe-game", "args": {"opponent": "snapshot"}}}
    )  # fmt: skip
    SnapshotPlayers.set("train", None)
    SnapshotPlayers.set("eval", None)
    probe = TicTacToeGame(opponent="snapshot")
    check_env(cfg, probe)  # raised "no train snapshot is set" before the stand-in
    assert SnapshotPlayers.players == {}
    keep = object()
    SnapshotPlayers.set("eval", keep)
    with stand_in_snapshots():
        assert SnapshotPlayers.get("eval") is keep
        assert SnapshotPlayers.get("train")(None, None, [4, 7], random.Random(0)) in (4, 7)
    assert SnapshotPlayers.players == {"eval": keep}
    SnapshotPlayers.set("eval", None)
