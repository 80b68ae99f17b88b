"""Where a run's groups come from, chosen once when the trainer starts (`group_source`):
played now by the policy's own engine (`SyncGroups`), played meanwhile by a rollout
thread on a replica up to `rollout.max_staleness` steps old (loop/overlap.py `Overlap`),
or read back from another run's saved rollouts (`ReplayedGroups`, `train.replay`). The
training step asks its source for each step's groups and tells it when new weights are
there; it never asks which source it has."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from looprl.config import Config
from looprl.envs import Environment
from looprl.loop.dist import Dist
from looprl.loop.groups import StepGroups, play_step, replay_step
from looprl.loop.levers import Levers
from looprl.loop.overlap import History, Overlap
from looprl.loop.play import Player
from looprl.loop.policy import Policy
from looprl.loop.replay import load_rollouts


class GroupSource(Protocol):
    """The groups of each step. `fresh`: they were sampled by the policy's engine from the
    current weights (loop/update.py may take the engine's logprobs as the old ones)."""

    fresh: bool

    def groups(self, step: int, history: History) -> tuple[StepGroups, History]:
        """Step `step`'s groups and the curriculum history after them."""
        ...

    def publish(self, step: int) -> None:
        """The trainer finished step `step`: its weights are the newest."""
        ...

    def close(self) -> None:
        """The run stops: no more steps will be asked for."""
        ...


class SyncGroups:
    """Each step's groups played when the step asks, by the policy being trained."""

    fresh = True

    def __init__(self, cfg: Config, probe: Environment, play: Player, dist: Dist, levers: Levers):
        self.cfg, self.probe, self.play, self.dist, self.levers = cfg, probe, play, dist, levers

    def groups(self, step: int, history: History) -> tuple[StepGroups, History]:
        return play_step(self.cfg, self.probe, self.play, self.dist, step, history, self.levers)

    def publish(self, step: int) -> None:
        pass  # the next step's groups are played with the weights as they are then

    def close(self) -> None:
        pass


class ReplayedGroups:
    """Each step's groups as another run saved them (loop/replay.py), scored again under
    this run's config; the curriculum history is left as it is."""

    fresh = False

    def __init__(self, cfg: Config, levers: Levers):
        assert cfg.train.replay is not None
        self.cfg, self.source, self.levers = cfg, Path(cfg.train.replay), levers

    def groups(self, step: int, history: History) -> tuple[StepGroups, History]:
        played = replay_step(self.cfg, load_rollouts(self.source, step), self.levers)
        return played, history

    def publish(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def group_source(
    cfg: Config,
    policy: Policy,
    probe: Environment,
    play: Player,
    dist: Dist,
    levers: Levers,
    start: int,
    history: History,
) -> GroupSource:
    """The run's source: `train.replay`'s saved groups; else, with `rollout.max_staleness`
    and steps left to play after `start`, the rollout thread (started here); else groups
    played by the trainer's own engine."""
    if cfg.train.replay is not None:
        return ReplayedGroups(cfg, levers)
    if cfg.rollout.max_staleness and start < cfg.train.steps:
        return Overlap(cfg, policy, probe, start, history, levers)
    return SyncGroups(cfg, probe, play, dist, levers)
