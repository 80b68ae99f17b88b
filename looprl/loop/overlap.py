"""Overlapped rollouts (`rollout.max_staleness: K` ≥ 1): the next steps' groups are played
while the trainer updates, by a policy at most K steps older than the one they train.

A rollout thread plays step t's groups (loop/groups.py `play_step`, every lever included)
on a replica of the policy: a copy of the model with its own engine, whose weights are
those after step t − 1 − K (after the run's first step when t − 1 − K is earlier). The
trainer publishes its weights after each step; the thread waits for the version it needs,
copies it into the replica, and plays. So every episode of step t was sampled, every token
of it, by version t − 1 − K (`Episode.policy_version`; the replica's weights change only
between steps), its staleness is exactly K in the steady state, and no episode is ever
played only to be thrown away: admission is paced by the versions, not filtered after.
The step then trains on them as on any groups: the trainer's old logprobs are the current
policy's, the engine's are the replica's, and `algo.tis_cap` (required) weights each token
by min(exp(old − sampled), cap). `rollout/staleness_mean`, `_max` and
`rollout/mismatch_kl` (loop/update.py) measure the gap.

Each step's rollouts are fixed by its seeds and that version, so a run is reproducible
run to run. A resumed run starts the thread from the checkpoint's weights: its next K
steps sample from them (fresher than the uninterrupted run's), which is documented rather
than hidden. The thread's failure (an engine that died, an environment's `tasks` that
raised) reaches the trainer at the step that needs its groups, as an EngineError: the run
stops there with the last step checkpointed and resumable.

What it buys: with the vLLM engine the server samples while the trainer steps (two
processes, two devices on a GPU machine). With `hf` on a CPU both share the same cores;
the overlap is correct there, and what it saves is the idle time of each side (measured
by bench/speed/async.py).
"""

from __future__ import annotations

import copy
import threading

import torch

from looprl.config import Config
from looprl.envs import Environment, capabilities
from looprl.errors import ConfigError, EngineError
from looprl.loop.dist import Dist
from looprl.loop.groups import StepGroups, play_step
from looprl.loop.levers import Levers
from looprl.loop.play import player
from looprl.loop.policy import Policy, make_engine, policy_rescorer

History = dict[str, list[list[float]]]


def check_overlap(cfg: Config, probe: Environment, world: int) -> None:
    """What overlapped rollouts need beyond the config (config/run.py checks the rest):
    one process, and no snapshot opponent; checked before anything loads."""
    k = cfg.rollout.max_staleness
    if not k:
        return
    if world > 1:
        raise ConfigError(
            "rollout.max_staleness > 0 runs in one process; under torchrun set "
            "rollout.max_staleness=0"
        )
    if capabilities(probe).snapshot_opponent:
        raise ConfigError(
            "the snapshot opponent plays the policy of the last checkpoint, which overlapped "
            "rollouts would read while it changes; set rollout.max_staleness=0 or another "
            "opponent"
        )


class Overlap:
    """The rollout thread and the versions it and the trainer exchange: the group source
    (loop/sources.py) of a run with `rollout.max_staleness` ≥ 1. Its groups are not fresh:
    a replica sampled them, from weights up to K steps old."""

    fresh = False

    def __init__(
        self,
        cfg: Config,
        policy: Policy,
        probe: Environment,
        start: int,
        history: History,
        levers: Levers,
    ) -> None:
        self.cfg, self.probe, self.levers = cfg, probe, levers
        self.policy = policy
        self.replica = replica_of(cfg, policy)
        self.play = player(cfg, self.replica, probe)
        self.start = start
        self.version = start  # the replica holds the weights after step `version`
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.trained = start  # the trainer's last finished step
        self.results: dict[int, tuple[StepGroups, History] | BaseException] = {}
        self.stopping = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(
            target=self._produce,
            args=(start + 1, cfg.train.steps, history),
            name="looprl-rollouts",
            daemon=True,
        )
        self.thread.start()

    def needed(self, step: int) -> int:
        """The version step `step` samples from: t − 1 − K, or the start's when earlier."""
        return max(step - 1 - self.cfg.rollout.max_staleness, self.start)

    def _produce(self, first: int, last: int, history: History) -> None:
        try:
            self._produce_steps(first, last, history)
        finally:  # a vLLM replica's adapter folder (its server is the policy's)
            close = getattr(self.replica.engine, "close", None)
            if close is not None:
                close()

    def _produce_steps(self, first: int, last: int, history: History) -> None:
        for step in range(first, last + 1):
            want = self.needed(step)
            with self.cond:
                self.cond.wait_for(
                    lambda want=want: (
                        self.stopping or want in self.published or want == self.version
                    )
                )
                if self.stopping:
                    return
                state = self.published.pop(want, None)
                for old in [v for v in self.published if v < want]:
                    del self.published[old]
            if state is not None:
                self._load(state)
                self.version = want
            try:
                played, history = play_step(
                    self.cfg, self.probe, self.play, Dist(), step, history, self.levers
                )
                for episode in played.episodes:
                    if not episode.expert:
                        episode.policy_version = self.version
                result: tuple[StepGroups, History] | BaseException = (played, history)
            except BaseException as err:  # the trainer raises it at this step
                result = err
            with self.cond:
                self.results[step] = result
                self.cond.notify_all()
            if isinstance(result, BaseException):
                return

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.replica.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        self.replica.engine.load_weights()

    def groups(self, step: int, history: History) -> tuple[StepGroups, History]:
        """Step `step`'s groups and the curriculum history after them, once played (the
        thread carries the history from step to step: `history` is not read)."""
        with self.cond:
            self.cond.wait_for(lambda: step in self.results)
            result = self.results.pop(step)
        if isinstance(result, BaseException):
            raise EngineError(
                f"the rollout thread failed playing step {step}: {type(result).__name__}: {result}"
            ) from result
        return result

    def publish(self, step: int) -> None:
        """The trainer finished step `step`: its weights, for the step that samples from
        them (step + 1 + K)."""
        if step + 1 + self.cfg.rollout.max_staleness > self.cfg.train.steps:
            return  # no later step samples from them
        state = {
            name: p.detach().clone()
            for name, p in self.policy.model.named_parameters()
            if p.requires_grad
        }
        with self.cond:
            self.trained = step
            self.published[step] = state
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the thread after the step it is playing (a run that stops early)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()


def replica_of(cfg: Config, policy: Policy) -> Policy:
    """A copy of the policy with an engine of its own, for the rollout thread: an `hf`
    engine on the copy, or the same vLLM server under an adapter of its own."""
    model = copy.deepcopy(policy.model).eval()
    model.requires_grad_(False)
    if cfg.rollout.engine == "vllm":
        replica = Policy(model, policy.tokenizer, policy.renderer, None, policy.device)
        rescore = None
        if cfg.rollout.vllm_rescore == "policy":
            rescore = policy_rescorer(replica, cfg.train.micro_batch_tokens)
        replica.engine = policy.engine.replica(model, rescore)
        return replica
    engine = make_engine(cfg, model, policy.tokenizer, policy.renderer)
    return Policy(model, policy.tokenizer, policy.renderer, engine, policy.device)
