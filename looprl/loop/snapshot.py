"""The policy snapshots that `tictactoe-game`'s `snapshot` opponent plays as.

An opponent mix with a share of `snapshot` (`opponent: snapshot` or `mix:...,snapshot=S`)
has the policy play against a frozen copy of itself. Two copies of the model are kept
beside the policy (so the memory of two more models):

- train games meet the policy as of the last checkpoint (`train.checkpoint_every`), the
  copy taken after the SFT warm start and refreshed at every checkpoint save. A run
  resumed from a checkpoint therefore meets the same snapshot an uninterrupted run does.
- eval games (baseline, after SFT, final) all meet the model as it was loaded, so the
  before/after comparison is against one fixed opponent.

A snapshot's move is one forward pass over the prompt the environment writes from its
side and the forced call up to the square: the logits of the nine squares' tokens there,
restricted to the legal squares, sampled at T = 1 with the game's own random stream.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from looprl.chat import ChatRenderer
from looprl.errors import LoopRLError
from looprl.forward.score import decoder_and_head
from looprl.types import Message, ToolCall

SQUARE_TOOL = "choose_square"


class SnapshotPlayer:
    """`(messages, tools, legal_squares, rng) -> square` from a frozen copy of a model."""

    def __init__(self, model: Any, renderer: ChatRenderer, device: torch.device) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.renderer = renderer
        self.device = device
        self._calls: dict[str, tuple[list[int], list[int]]] = {}

    def refresh(self, model: Any) -> None:
        """Take the trainable weights of `model` (the policy) into the copy."""
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    mine[name].copy_(param.detach())

    def _call_tokens(self, tools: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """The tokens every square's call starts with, and the token after them that
        names square 1..9 (one each); cached per tool list."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._calls:
            calls = [
                self.renderer.assistant_ids(
                    Message("assistant", tool_calls=[ToolCall(SQUARE_TOOL, {"square": k})])
                )
                for k in range(1, 10)
            ]
            n = 0
            while all(len(c) > n for c in calls) and len({c[n] for c in calls}) == 1:
                n += 1
            heads = [c[n] if len(c) > n else -1 for c in calls]
            if -1 in heads or len(set(heads)) != 9:
                raise LoopRLError(
                    "the snapshot opponent needs each square's call to differ first in one "
                    "token that names the square; this chat format's calls do not"
                )
            self._calls[key] = (calls[0][:n], heads)
        return self._calls[key]

    @torch.no_grad()
    def __call__(
        self,
        messages: list[Message],
        tools: list[dict[str, Any]],
        legal: list[int],
        rng: random.Random,
    ) -> int:
        prefix, heads = self._call_tokens(tools)
        ids = torch.tensor([self.renderer.prompt_ids(messages, tools) + prefix], device=self.device)
        split = decoder_and_head(self.model)
        if split is not None:  # the head on the last position only
            decoder, head = split
            logits_V = head(decoder(input_ids=ids).last_hidden_state[:, -1]).float()[0]
        else:
            logits_V = self.model(input_ids=ids, use_cache=False).logits[0, -1].float()
        logp_L = torch.log_softmax(logits_V[[heads[k - 1] for k in legal]], dim=-1)
        # inverse CDF with the game's own stream: one draw per move, whatever the weights
        u, total = rng.random(), 0.0
        for square, p in zip(legal, logp_L.exp().tolist()):
            total += p
            if u < total:
                return square
        return legal[-1]  # u within rounding of 1


def start_snapshots(policy: Any, uses_snapshot: bool) -> SnapshotPlayer | None:
    """Set the `snapshot` opponent's eval and train players for this run (both the model
    as loaded), or clear them when the run's env has no snapshot share. Returns the train
    player, which the loop refreshes after the SFT warm start and at every checkpoint."""
    from looprl.envs.builtin.tictactoe import SnapshotPlayers

    if not uses_snapshot:
        SnapshotPlayers.set("eval", None)
        SnapshotPlayers.set("train", None)
        return None
    SnapshotPlayers.set("eval", SnapshotPlayer(policy.model, policy.renderer, policy.device))
    train = SnapshotPlayer(policy.model, policy.renderer, policy.device)
    SnapshotPlayers.set("train", train)
    return train


def _random_square(messages: Any, tools: Any, legal: list[int], rng: Any) -> int:
    return rng.choice(legal)


@contextmanager
def stand_in_snapshots() -> Iterator[None]:
    """Before the model loads, the run's preflight plays one task of each split without it:
    a `snapshot` opponent that moves first meets a stand-in there, which plays a random
    legal square; the players set before are back afterwards."""
    from looprl.envs.builtin.tictactoe import SnapshotPlayers

    kept = dict(SnapshotPlayers.players)
    for split in ("train", "eval"):
        SnapshotPlayers.set(split, kept.get(split, _random_square))
    try:
        yield
    finally:
        for split in ("train", "eval"):
            SnapshotPlayers.set(split, kept.get(split))
