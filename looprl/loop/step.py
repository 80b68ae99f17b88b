"""One training step and what it works on: play the step's groups (loop/groups.py), count
the environment's errors, update the policy (loop/update.py), measure the step.

`Trainer` holds what outlives a step (the policy, its optimizer and schedule, the loop
state, the metrics logger, the group source of loop/sources.py, the levers of
loop/levers.py); loop/train.py calls `Trainer.step` once a step.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.config import Config
from looprl.envs import Environment
from looprl.errors import EndpointError, EngineError, LoopRLError
from looprl.loop import checkpoint as checkpoints
from looprl.loop import log
from looprl.loop.decisions import decision_metrics
from looprl.loop.dist import Dist, main_only
from looprl.loop.groups import StepGroups, greedy_member
from looprl.loop.guidance import expert_advantage, mean_advantage
from looprl.loop.levers import Levers
from looprl.loop.log import MetricsLogger
from looprl.loop.play import Player
from looprl.loop.policy import Policy
from looprl.loop.progress import Progress
from looprl.loop.replay import save_rollouts
from looprl.loop.run_state import Interrupted, LoopState, StopOnSignal, peak_rss_gb
from looprl.loop.snapshot import SnapshotPlayer
from looprl.loop.sources import GroupSource
from looprl.loop.summary import by_member, judge_cost, summarize
from looprl.loop.update import update_policy
from looprl.report import write as report_files
from looprl.report.health import step_health
from looprl.seeds import minibatch_seed
from looprl.types import ENV_ERROR, PARSE_FAILURES, TRUNCATED, Episode

# Under torchrun every rank runs the loop and computes the same metrics from all ranks'
# episodes (loop/dist.py); rank 0 alone writes the run folder. These writers do nothing
# on the other ranks, so the loop reads the same for one process or many.
UNSCORABLE = (*PARSE_FAILURES, TRUNCATED)  # outcomes that say nothing of the task itself
save_checkpoint = checkpoints.save_checkpoint  # every rank: its shards, or gathered for rank 0
write_samples = main_only(log.write_samples)
write_report = main_only(report_files.write_report)


@dataclass
class Trainer:
    """What a run's training steps share."""

    cfg: Config
    policy: Policy
    probe: Environment  # an env instance: tasks, max_turns
    play: Player
    dist: Dist
    run_dir: Path
    optimizer: torch.optim.Optimizer
    scheduler: Any
    state: LoopState
    logger: MetricsLogger
    snapshot: SnapshotPlayer | None
    levers: Levers
    source: GroupSource  # where each step's groups come from (loop/sources.py)
    baseline: dict  # the baseline eval: the report written when a run stops early
    started: float  # time.time() at the run's start
    rows: list[dict[str, Any]] = field(default_factory=list)  # the steps' metrics so far
    problems: dict[str, str] = field(default_factory=dict)  # the last step's failed checks

    def step(self, step: int) -> dict[str, Any]:
        """Play, learn, measure and log one step; checkpoint when due. Returns its metrics."""
        cfg, t0 = self.cfg, time.time()
        played = self.play_groups(step)
        rollout_s = time.time() - t0
        if cfg.logging.save_rollouts:
            main_only(save_rollouts)(self.run_dir, step, played.groups)
        errors = self.count_env_errors(played.episodes, step)
        t1 = time.time()
        try:
            stats = update_policy(
                self.policy,
                self.optimizer,
                self.dist.share(played.groups),
                cfg.algo,
                cfg.train,
                views=self.levers.loss_on_views,
                group_size=cfg.rollout.group_size,
                max_tokens=cfg.rollout.max_new_tokens * self.probe.max_turns,
                seed=minibatch_seed(cfg.seed, step),
                state=self.state.update,
                dist=self.dist,
                fresh=self.source.fresh,  # sampled just now, by these weights
            )
        except EndpointError as err:  # algo.teacher's server, asked before any weight moved
            raise self.stopped(step, err, "the teacher's server") from None
        train_s = time.time() - t1
        self.source.publish(step)  # for the step that samples from these weights
        if stats["skipped"]:
            self.state.bad_steps += 1
        elif stats["updated"]:
            self.state.bad_steps = 0  # a step with only A = 0 groups proves nothing either way
        with warnings.catch_warnings():
            # the schedule follows training steps, also those where every advantage was 0
            # and the optimizer had nothing to do (torch warns about that order)
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            self.scheduler.step()
        generated = sum(e.response_len for e in played.episodes if not e.expert)  # greedy too
        run = {
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/micro_batch_tokens": self.state.update.micro_batch_tokens,
            "perf/step_s": time.time() - t0,
            "perf/rollout_tokens_per_s": generated / rollout_s,
            "perf/train_tokens_per_s": stats["tokens"] / max(train_s, 1e-9),
            "perf/peak_rss_gb": peak_rss_gb(),
        }
        metrics = step_metrics(cfg, step, played, stats, errors, self.levers, run)
        self.rows.append(metrics)
        problems = step_health(
            self.rows,
            cfg.train.health_patience,
            cfg.rollout.tasks_per_step,
            cfg.rollout.max_new_tokens,
        )
        metrics.update({f"health/{check}": 1 for check in problems})
        self.logger.log(metrics)
        if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
            episodes = played.episodes[: cfg.logging.samples_per_log]
            write_samples(self.run_dir / "samples" / "train.jsonl", episodes, step)
        every = cfg.train.checkpoint_every
        if step == cfg.train.steps or (every and step % every == 0):
            self.checkpoint(step)
        self.problems = problems
        return metrics

    def play_groups(self, step: int) -> StepGroups:
        """The step's groups, from the run's group source (loop/sources.py). An engine
        that fails (a vLLM server that died) stops the run with the state after the
        previous step checkpointed."""
        try:
            played, self.state.curriculum = self.source.groups(step, self.state.curriculum)
        except EngineError as err:
            raise self.stopped(step, err, "the engine") from None
        return played

    def stopped(self, step: int, err: LoopRLError, what: str) -> LoopRLError:
        """A service the step needs (`what`) failed before any weight moved: the state
        after the previous step is checkpointed, and the error says how to continue."""
        self.checkpoint(step - 1)
        self.close()
        self.logger.close()
        return type(err)(
            f"{err}\nthe run stopped at step {step}; the state after step {step - 1} is "
            f"checkpointed. Once {what} is back, continue with\n"
            f"  looprl run --out {self.run_dir} --resume"
        )

    def count_env_errors(self, episodes: list[Episode], step: int) -> int:
        """Environment bugs are counted against `env.error_budget`, never trained on; past
        the budget the run stops with its report and the last checkpoint kept."""
        errors = [e for e in episodes if e.outcome == ENV_ERROR]
        self.state.env_errors += len(errors)
        if errors:
            write_samples(self.run_dir / "samples" / "env_errors.jsonl", errors, step)
        if self.state.env_errors > self.cfg.env.error_budget:
            self.stop_early()
            kept = (checkpoints.list_checkpoints(self.run_dir) or [None])[-1]
            raise LoopRLError(
                f"{self.state.env_errors} episodes ended in env_error (budget "
                f"env.error_budget={self.cfg.env.error_budget}); tracebacks are in "
                f"{self.run_dir / 'samples' / 'env_errors.jsonl'}; "
                + (
                    f"the last checkpoint ({kept.name}) is kept"
                    if kept
                    else "no step had been checkpointed yet"
                )
            )
        return len(errors)

    def checkpoint(self, step: int) -> None:
        save_checkpoint(
            self.run_dir,
            step,
            self.policy.model,
            self.optimizer,
            self.scheduler,
            {"model": self.cfg.model.name, **self.state.to_meta()},
            self.cfg.train.keep_checkpoints,
            sharded=checkpoints.writes_shards(self.cfg.train),
        )
        if self.snapshot is not None:  # train games meet the policy of the last checkpoint
            self.snapshot.refresh(self.policy.model)

    def stop_if_asked(self, step: int, stop: StopOnSignal) -> None:
        """After step `step`: a stop asked on any rank (Ctrl-C, SIGTERM), or
        `train.max_bad_steps` NaN/inf steps in a row, stop the run here, checkpointed."""
        stopping = self.dist.all_reduce([bool(stop.requested)], op="max")[0]  # all or none
        stop.requested = stop.requested or ("SIGTERM" if stopping else None)
        if self.state.bad_steps < self.cfg.train.max_bad_steps and not stop.requested:
            return
        self.checkpoint(step)
        self.stop_early()
        if stop.requested:
            raise Interrupted(
                f"{stop.requested} after step {step}: checkpoint saved; continue with\n"
                f"  looprl run --out {self.run_dir} --resume"
            )
        raise LoopRLError(
            f"{self.state.bad_steps} optimizer steps in a row had NaN/inf loss or gradients "
            "and were skipped (train.max_bad_steps); lower train.lr or check the model's "
            "dtype. The weights are the last good ones, checkpointed."
        )

    def close(self) -> None:
        """Close the group source (a rollout thread stops after the step it is playing)."""
        self.source.close()

    def stop_early(self) -> None:
        """The report of a run that stops before its last step (no final eval)."""
        self.close()
        write_report(
            self.run_dir, self.cfg, self.baseline, None, time.time() - self.started, peak_rss_gb()
        )
        self.logger.close(report_dir=self.run_dir)


KL_STATS = ("kl", "distill_kl")


def step_metrics(
    cfg: Config,
    step: int,
    played: StepGroups,
    stats: dict[str, Any],
    env_errors: int,
    levers: Levers,
    run: dict[str, float],
) -> dict[str, Any]:
    """The step's metrics (docs/training.md names each), with `run`'s (train/lr,
    train/micro_batch_tokens, perf/*) in their places. rollout/*: the policy's own samples
    (expert episodes were not sampled, greedy members not at the rollout temperature)."""
    episodes = played.episodes
    batch = played.learners()
    sampled = [e for e in episodes if not (e.expert or greedy_member(cfg, e))]
    summary = summarize(sampled)
    unscorable = sum(e.outcome in UNSCORABLE for e in sampled) / max(len(sampled), 1)
    decision: dict[str, float] = {}
    if levers.decide is not None:  # rollout/decision_entropy, rollout/decision_tokens
        views = [v for group in played.groups for v in (group.views or [])]
        decision = decision_metrics(episodes, views)
    rewards = [e.reward for e, _ in batch if not (e.expert or greedy_member(cfg, e))]
    versions = [e.policy_version for e in episodes if e.policy_version is not None]
    staleness = [step - 1 - v for v in versions] or [0]
    metrics = {
        "step": step,
        "rollout/rewards_mean": summary["reward_mean"],
        "rollout/rewards_std": float(np.std(rewards or [0.0])),
        "response_len": summary["response_len"],
        "rollout/valid_tool_call_rate": summary["valid_tool_call_rate"],
        "rollout/episodes": len(episodes),
        "rollout/env_errors": env_errors,
        "rollout/unscorable": unscorable,  # truncated or unparsable share
        "rollout/token_mismatch": sum("token_mismatch" in e.info for e in sampled),
        "rollout/retokenize_mismatch": sum("retokenize_mismatch" in e.info for e in sampled),
        "rollout/logprob_gap": stats["logprob_gap"],
        "rollout/mismatch_kl": stats["mismatch_kl"],
        "rollout/staleness_mean": float(np.mean(staleness)),
        "rollout/staleness_max": max(staleness),
        "rollout/entropy": summary["entropy"],
        **decision,
        "train/loss": stats["loss"],
        "train/clip_frac": stats["clip_frac"],
        "train/grad_norm": stats["grad_norm"],
        "train/lr": run["train/lr"],
        **played.metrics,  # train/zero_std_groups, kept_groups, ...; curriculum/*
        "train/skipped_steps": stats["skipped"],
        "train/updates": stats["updated"],  # optimizer updates made this step
        "train/tokens": stats["tokens"],  # tokens of the episodes the update trained on
        "train/ratio_max": stats["ratio_max"],
        **run,  # train/micro_batch_tokens, perf/*
    }
    # algo.kl_coef: train/kl; a teacher: train/distill_kl; algo.is_correction: train/is_*
    metrics.update({f"train/{k}": v for k, v in stats.items() if k in KL_STATS or k[:3] == "is_"})
    if levers.expert is not None:
        metrics["train/expert_advantage"] = expert_advantage(batch)
    if cfg.algo.greedy_samples:  # above 0: the argmax beat its groups' mean
        metrics["train/greedy_advantage"] = mean_advantage(
            [a for e, a in batch if greedy_member(cfg, e)]
        )
    graded = [r for e in sampled if e.trainable for r in e.turn_rewards]
    if graded:  # environments that grade each turn (StepResult.turn_reward)
        metrics["rollout/turn_rewards_mean"] = float(np.mean(graded))
    metrics.update(stats.get("router", {}))  # MoE models only
    for outcome, frac in summary["outcomes"].items():
        metrics[f"outcomes/{outcome}"] = frac
    for name, value in summary["scores"].items():  # the dataset env's scorers
        metrics[f"scores/{name}"] = value
    for name, value in judge_cost(episodes).items():  # judge/calls, judge/seconds
        metrics[f"judge/{name}"] = value
    if cfg.env.name == "mix":  # each member's own reward (task ids LABEL/...)
        for label, members in by_member(sampled).items():
            metrics[f"mix/{label}/rewards_mean"] = summarize(members)["reward_mean"]
    return metrics


def say_health(trainer: Trainer, step: int, progress: Progress) -> None:
    """The step's failed health checks (`report/health.py`): each warned about when it
    starts failing; with `train.health: stop`, the run stops here, checkpointed."""
    problems = trainer.problems
    if problems and trainer.cfg.train.health == "stop":
        trainer.checkpoint(step)
        trainer.stop_early()
        check, sentence = next(iter(problems.items()))
        raise LoopRLError(
            f"health check {check} failed at step {step}: {sentence}. The run stopped "
            f"(train.health=stop) with step {step} checkpointed; set train.health=warn to "
            "train on regardless"
        )
    before = {
        k[7:]
        for k, v in (trainer.rows[-2] if len(trainer.rows) > 1 else {}).items()
        if k.startswith("health/") and v
    }
    for check, sentence in problems.items():
        if check not in before:
            progress.note(f"warning: step {step}: {sentence}")
