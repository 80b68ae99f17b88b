"""The loop, in order: baseline eval → training steps → retest → report.

One training step:
  1. sample `tasks_per_step` train tasks; play `group_size` episodes of each with the
     current policy (the engine samples from the very module being trained);
  2. rewards → group-relative advantages (A = (r − mean) / std per task group);
  3. recompute old logprobs with the trainer's own forward pass (the token-parity check
     `rollout/logprob_gap` compares them with the engine's);
  4. split the batch into `num_minibatches` optimizer updates of the chosen loss.

How this differs from the GSPO paper (arXiv 2507.18071): nothing in the objective. The
engine records the *unconstrained* policy logprobs of tokens sampled under a forced-call
grammar (see engine/hf.py), and groups whose rewards are all equal produce no gradient
(A = 0); they stay in the loss normaliser unless `algo.dynamic_sampling` drops them.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.algo import batch_advantages, dynamic_sampling_keep
from looprl.config import Config, to_yaml
from looprl.engine import SamplingParams
from looprl.envs import make_env
from looprl.errors import ConfigError, LoopRLError
from looprl.loop.checkpoint import (
    list_checkpoints,
    load_training_state,
    load_weights,
    save_checkpoint,
)
from looprl.loop.evaluate import eval_result, summarize
from looprl.loop.log import MetricsLogger, write_samples
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import Policy, load_policy
from looprl.loop.rollout import run_episodes
from looprl.loop.update import UpdateState, update_policy
from looprl.report.write import write_report
from looprl.types import ENV_ERROR

# ============================================================================ the loop


def run_training(cfg: Config, out: Path, force: bool = False, resume: bool = False) -> dict:
    # ---- everything that can be wrong is checked before anything is written
    check_run_dir(out, force=force, resume=resume)
    probe = make_env(cfg.env.name, cfg.env.args)
    if cfg.sft.enabled and not callable(getattr(probe, "demonstrations", None)):
        raise ConfigError(
            f"sft.enabled needs demonstrations, and environment {cfg.env.name!r} has no "
            "demonstrations(task) method (agent environments never do); set sft.enabled=false"
        )
    seed_everything(cfg.seed)
    started = time.time()
    policy = load_policy(cfg)
    run_dir = prepare_run_dir(out, force=force, resume=resume)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    play = player(cfg, policy, probe)

    # ---- baseline: fixed held-out tasks and sampling seed, reused by the final eval
    eval_tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    baseline = load_json(run_dir / "eval" / "baseline.json")
    if baseline is None:
        baseline = evaluate(policy, play, eval_tasks, cfg, run_dir, "baseline")

    # ---- optional SFT warm start on the env's demonstrations, then its own eval
    after_sft = load_json(run_dir / "eval" / "after_sft.json") if cfg.sft.enabled else None
    if cfg.sft.enabled and after_sft is None:
        warm_start(policy, probe, cfg, run_dir)
        after_sft = evaluate(policy, play, eval_tasks, cfg, run_dir, "after_sft")

    # ---- optimizer, schedule, resume
    optimizer = make_optimizer(
        policy.trainable_parameters(), cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg))
    loop = LoopState(update=UpdateState(micro_batch_tokens=cfg.train.micro_batch_tokens))
    start = resume_state(run_dir, policy, optimizer, scheduler, loop) if resume else 0
    logger = MetricsLogger(
        run_dir, cfg.logging.tensorboard, cfg.model_dump() if cfg.logging.wandb else None
    )

    def checkpoint(step: int) -> None:
        save_checkpoint(
            run_dir, step, policy.model, optimizer, scheduler,
            {"model": cfg.model.name, **loop.to_meta()}, cfg.train.keep_checkpoints,
        )  # fmt: skip

    # ---- training steps
    from rich.progress import Progress

    with Progress(transient=False) as progress, StopOnSignal() as stop:
        bar = progress.add_task("training", total=cfg.train.steps, completed=start)
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.time()
            tasks = probe.tasks(
                "train", n=cfg.rollout.tasks_per_step, seed=cfg.seed * 1_000_003 + step
            )
            params = SamplingParams(
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
                max_new_tokens=cfg.rollout.max_new_tokens,
                seed=cfg.seed * 1_000_003 + step,
            )
            episodes = play(
                [t for t in tasks for _ in range(cfg.rollout.group_size)], params=params
            )
            rollout_s = time.time() - t0

            # feedback: environment bugs are counted against the budget, never trained on
            errors = [e for e in episodes if e.outcome == ENV_ERROR]
            loop.env_errors += len(errors)
            if errors:
                write_samples(run_dir / "samples" / "env_errors.jsonl", errors, step)
            if loop.env_errors > cfg.env.error_budget:
                logger.close()
                raise LoopRLError(
                    f"{loop.env_errors} episodes ended in env_error (budget "
                    f"env.error_budget={cfg.env.error_budget}); tracebacks are in "
                    f"{run_dir / 'samples' / 'env_errors.jsonl'}; the last checkpoint is kept"
                )

            # advantages within each task group (env_error episodes take no part)
            groups = [
                [e for e in episodes[i : i + cfg.rollout.group_size] if e.trainable]
                for i in range(0, len(episodes), cfg.rollout.group_size)
            ]
            groups = [g for g in groups if g]
            rewards = [[e.reward for e in g] for g in groups]
            adv_B, zero_std_G = batch_advantages(rewards, scale=cfg.algo.scale_advantages)
            keep_G = dynamic_sampling_keep(rewards) if cfg.algo.dynamic_sampling else None
            flat = [(i, e) for i, g in enumerate(groups) for e in g]
            batch = [
                (episode, float(adv_B[k]))
                for k, (i, episode) in enumerate(flat)
                if keep_G is None or keep_G[i]
            ]

            # policy update
            t1 = time.time()
            stats = update_policy(policy, optimizer, batch, cfg, step, probe.max_turns, loop.update)
            train_s = time.time() - t1
            if stats["skipped"]:
                loop.bad_steps += 1
            elif stats["updated"]:
                loop.bad_steps = 0  # a step with only A = 0 groups proves nothing either way
            with warnings.catch_warnings():
                # the schedule follows training steps, also those where every advantage
                # was 0 and the optimizer had nothing to do (torch warns about that order)
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                scheduler.step()

            summary = summarize(episodes)
            metrics = {
                "step": step,
                "rollout/rewards_mean": summary["reward_mean"],
                "rollout/rewards_std": float(np.std([e.reward for e, _ in batch] or [0.0])),
                "response_len": summary["response_len"],
                "rollout/valid_tool_call_rate": summary["valid_tool_call_rate"],
                "rollout/env_errors": len(errors),
                "rollout/token_mismatch": sum("token_mismatch" in e.info for e in episodes),
                "rollout/logprob_gap": stats["logprob_gap"],
                "train/loss": stats["loss"],
                "train/clip_frac": stats["clip_frac"],
                "train/grad_norm": stats["grad_norm"],
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/zero_std_groups": int(zero_std_G.sum()),
                "train/skipped_steps": stats["skipped"],
                "train/ratio_max": stats["ratio_max"],
                "train/micro_batch_tokens": loop.update.micro_batch_tokens,
                "perf/step_s": time.time() - t0,
                "perf/rollout_tokens_per_s": sum(e.response_len for e in episodes) / rollout_s,
                "perf/train_tokens_per_s": stats["tokens"] / max(train_s, 1e-9),
                "perf/peak_rss_gb": peak_rss_gb(),
            }
            for outcome, frac in summary["outcomes"].items():
                metrics[f"outcomes/{outcome}"] = frac
            logger.log(metrics)
            if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                write_samples(
                    run_dir / "samples" / "train.jsonl",
                    episodes[: cfg.logging.samples_per_log],
                    step,
                )
            last = step == cfg.train.steps
            if last or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                checkpoint(step)
            progress.update(
                bar,
                advance=1,
                description=f"step {step} reward {metrics['rollout/rewards_mean']:+.3f} "
                f"{metrics['perf/step_s']:.1f}s/step",
            )
            if loop.bad_steps >= cfg.train.max_bad_steps or stop.requested:
                checkpoint(step)
                logger.close()
                write_report(run_dir, cfg, baseline, None, time.time() - started, peak_rss_gb())
                if stop.requested:
                    raise Interrupted(
                        f"{stop.requested} after step {step}: checkpoint saved; continue with\n"
                        f"  looprl run --out {run_dir} --resume"
                    )
                raise LoopRLError(
                    f"{loop.bad_steps} optimizer steps in a row had NaN/inf loss or gradients "
                    "and were skipped (train.max_bad_steps); lower train.lr or check the "
                    "model's dtype. The weights are the last good ones, checkpointed."
                )
    logger.close()

    # ---- retest on exactly the same tasks and seeds, then report
    final = evaluate(policy, play, eval_tasks, cfg, run_dir, "final")
    write_report(run_dir, cfg, baseline, final, time.time() - started, peak_rss_gb())
    return {"baseline": baseline, "final": final, "run_dir": str(run_dir)}


@dataclass
class LoopState:
    """Counters that outlive a step, saved with each checkpoint."""

    update: UpdateState
    env_errors: int = 0
    bad_steps: int = 0

    def to_meta(self) -> dict[str, int]:
        return {
            "env_errors": self.env_errors,
            "bad_steps": self.bad_steps,
            "micro_batch_tokens": self.update.micro_batch_tokens,
        }

    def load_meta(self, meta: dict[str, Any]) -> None:
        self.env_errors = int(meta.get("env_errors", 0))
        self.bad_steps = int(meta.get("bad_steps", 0))
        self.update.micro_batch_tokens = int(
            meta.get("micro_batch_tokens", self.update.micro_batch_tokens)
        )


class Interrupted(LoopRLError):
    """SIGINT/SIGTERM: the run stopped cleanly after a step and can be resumed."""

    exit_code = 130


class StopOnSignal:
    """First Ctrl-C / SIGTERM: finish the current step, checkpoint, stop. A second one
    abandons the step at once (KeyboardInterrupt); the last checkpoint stays."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing this step, then saving (again to abandon it)")

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ============================================================================ plumbing


def evaluate(
    policy: Policy, play: Any, tasks: list, cfg: Config, run_dir: Path | None, name: str
) -> dict:
    """Play the eval tasks with the eval sampling settings; write eval/NAME.json."""
    params = SamplingParams(
        temperature=cfg.eval.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.eval.seed,
    )
    episodes = play([t for t in tasks for _ in range(cfg.eval.samples_per_task)], params=params)
    result = eval_result(episodes, cfg.env.name, cfg.model.name, cfg.eval.seed)
    if run_dir is not None:
        (run_dir / "eval").mkdir(parents=True, exist_ok=True)
        (run_dir / "eval" / f"{name}.json").write_text(json.dumps(result, indent=2))
        write_samples(run_dir / "samples" / f"{name}.jsonl", episodes)
    return result


def player(cfg: Config, policy: Policy, probe: Any) -> Any:
    """`play(tasks, params=...) -> episodes` with this policy, in fresh env instances
    (agent environments, which have `run_agent`, are played by looprl.openai.agents)."""
    from looprl.openai.agents import is_agent_env, run_agents

    return partial(
        run_agents if is_agent_env(probe) else run_episodes,
        make_env=lambda: make_env(cfg.env.name, cfg.env.args),
        engine=policy.engine,
        renderer=policy.renderer,
        max_turns=probe.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
    )


def run_eval(cfg: Config, checkpoint: Path | None = None, out: Path | None = None) -> dict:
    """`looprl eval`: evaluate a model, or a run's checkpoint, on the held-out tasks."""
    policy = load_policy(cfg)
    if checkpoint is not None:
        if not (checkpoint / "trainable.safetensors").exists():
            raise ConfigError(f"{checkpoint} is not a looprl checkpoint folder")
        load_weights(policy.model, checkpoint)
    probe = make_env(cfg.env.name, cfg.env.args)
    play = player(cfg, policy, probe)
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    result = evaluate(policy, play, tasks, cfg, None, "eval")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result


def check_run_dir(out: Path, force: bool, resume: bool) -> None:
    """Refuse a run folder we must not touch, before anything is loaded or written."""
    if resume:
        if not (out / "config.yaml").exists():
            raise ConfigError(f"--resume: {out} is not a run folder (no config.yaml)")
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        hint = " (it holds an unfinished run)" if list_checkpoints(out) else ""
        raise ConfigError(
            f"run folder {out} is not empty{hint}; pass --resume to continue it or "
            f"--force to overwrite it"
        )
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot create the run folder {out}: {parent} is not a writable folder")


def prepare_run_dir(out: Path, force: bool, resume: bool) -> Path:
    check_run_dir(out, force=force, resume=resume)
    try:
        if not resume and out.exists() and force:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the run folder {out}: {err.strerror}") from None
    return out


def warm_start(policy: Policy, probe: Any, cfg: Config, run_dir: Path) -> None:
    """SFT steps on demonstrations of train tasks; checkpointed as step 0 (weights only)."""
    from looprl.loop.sft import demo_episode, sft_step

    # weight decay 0.01: torch AdamW's default, which the warm start has always used
    optimizer = make_optimizer(policy.trainable_parameters(), cfg.train.optimizer, cfg.sft.lr, 0.01)
    with (run_dir / "sft_metrics.jsonl").open("w") as log:
        for step in range(1, cfg.sft.steps + 1):
            tasks = probe.tasks("train", n=cfg.sft.batch_size, seed=cfg.seed * 999_983 + step)
            episodes = [
                demo_episode(make_env(cfg.env.name, cfg.env.args), t, policy.renderer)
                for t in tasks
            ]
            log.write(
                json.dumps({"step": step, **sft_step(policy, optimizer, episodes, cfg)}) + "\n"
            )
            log.flush()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    save_checkpoint(run_dir, 0, policy.model, optimizer, scheduler, {"stage": "sft"}, 1_000_000)


def resume_state(
    run_dir: Path, policy: Policy, optimizer: Any, scheduler: Any, loop: LoopState
) -> int:
    """Load the newest checkpoint; drop metrics logged after it. Returns its step."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return 0
    meta = load_weights(policy.model, checkpoints[-1])
    if meta.get("stage") == "sft":  # only the warm-started weights: RL starts afresh
        return 0
    load_training_state(checkpoints[-1], optimizer, scheduler)
    loop.load_meta(meta)
    step = int(meta["step"])
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        kept = [
            line
            for line in metrics.read_text().splitlines()
            if line and json.loads(line)["step"] <= step
        ]
        metrics.write_text("".join(line + "\n" for line in kept))
    return step


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warmup, then constant / cosine / linear decay to 10% of the peak."""
    warm = cfg.train.warmup_steps
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.train.lr_schedule == "constant" or cfg.train.steps <= warm:
        return 1.0
    progress = min(1.0, (step - warm) / max(1, cfg.train.steps - warm))
    if cfg.train.lr_schedule == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def load_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
