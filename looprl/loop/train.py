"""The loop, in order: baseline eval → training steps → retest → report.

One training step:
  1. sample `tasks_per_step` train tasks; play `group_size` episodes of each with the
     current policy (the engine samples from the very module being trained);
  2. rewards → group-relative advantages (A = (r − mean) / std per task group); with
     `algo.dynamic_sampling` and `algo.max_oversample` the step plays more tasks until
     `tasks_per_step` groups with a reward spread are kept, and `curriculum.enabled`
     picks the tasks by their recent groups (both in loop/groups.py);
  3. recompute old logprobs with the trainer's own forward pass (the token-parity check
     `rollout/logprob_gap` compares them with the engine's);
  4. split the batch into `num_minibatches` optimizer updates of the chosen loss.

How this differs from the GSPO paper (arXiv 2507.18071): nothing in the objective. The
engine records the *unconstrained* policy logprobs of tokens sampled under a forced-call
grammar (see engine/hf.py), and groups whose rewards are all equal produce no gradient
(A = 0); they stay in the loss normaliser unless `algo.dynamic_sampling` drops them.
The held-out eval runs twice before and after: at the eval temperature, and greedily
(`eval.greedy`, T = 0, one episode per task).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.config import Config, to_yaml
from looprl.envs import Environment, capabilities, gives_turn_rewards, make_env
from looprl.envs.data.judge import cache_verdicts_in
from looprl.errors import ConfigError, LoopRLError
from looprl.loop import dist as ranks
from looprl.loop import log, preflight, sft
from looprl.loop.also import AlsoEvals, check_also, check_also_room
from looprl.loop.batches import UpdateState
from looprl.loop.checkpoint import writes_shards
from looprl.loop.curve import EvalCurve
from looprl.loop.decisions import grammar_cache
from looprl.loop.dist import Dist, main_only
from looprl.loop.evaluate import HeldOut
from looprl.loop.levers import Levers
from looprl.loop.log import MetricsLogger
from looprl.loop.optim import make_optimizer
from looprl.loop.overlap import check_overlap
from looprl.loop.play import player
from looprl.loop.policy import Policy, load_model
from looprl.loop.progress import DONE, Progress
from looprl.loop.reference import keep_reference
from looprl.loop.replay import check_replay
from looprl.loop.run_state import (
    LoopState,
    StopOnSignal,
    check_run_dir,
    peak_rss_gb,
    prepare_run_dir,
    resume_state,
    seed_everything,
)
from looprl.loop.shard import start_replicas
from looprl.loop.snapshot import start_snapshots
from looprl.loop.sources import group_source
from looprl.loop.step import Trainer, save_checkpoint, say_health, write_report
from looprl.loop.teacher import check_teacher, evaluate_teacher, load_teacher
from looprl.loop.trackers import check_trackers
from looprl.report import write as report_files
from looprl.report.also import also_warnings
from looprl.report.comparisons import load_references
from looprl.report.health import run_warnings
from looprl.seeds import sft_tasks_seed

# ============================================================================ the loop


def run_training(
    cfg: Config,
    out: Path,
    force: bool = False,
    resume: bool = False,
    progress: Progress | None = None,
) -> dict:
    """Returns the EvalResults (`baseline`, `after_sft` or None, `final`, and `greedy`: the
    greedy (baseline, final) pair or None), `run_dir` and
    `report` (report.md's path); `progress` shows each phase (default: on stderr).

    Under torchrun, every rank calls this: see loop/dist.py. A rank that fails says so
    with its rank before it exits; torchrun then stops the others."""
    dist = ranks.start()
    try:
        result = train(cfg, out, dist, force, resume, progress or Progress(quiet=not dist.is_main))
    except BaseException as err:
        ranks.report_failure(err)
        raise
    finally:
        cache_verdicts_in(None)  # a later run or eval in this process keeps its own
    ranks.stop()
    return result


def train(
    cfg: Config, out: Path, dist: Dist, force: bool, resume: bool, progress: Progress
) -> dict:
    """The loop itself (see run_training)."""
    # ---- everything that can be wrong is checked before anything is written
    probe, sft_env = check_run(cfg, out, dist, force, resume)
    seed_everything(cfg.seed)
    started = time.time()
    progress.note(
        f"looprl run: {cfg.env.name} · {cfg.model.name} · {cfg.algo.name} · "
        f"{cfg.train.steps} steps → {out}{' (resumed)' if resume else ''}"
    )
    policy = load_model(cfg, progress)
    policy.teacher = load_teacher(cfg, progress)  # algo.teacher (on-policy distillation)
    preflight.check_reply_room(cfg, probe, policy.renderer)  # still nothing written
    check_also_room(cfg, policy.renderer)  # eval.also's envs too
    start_replicas(policy.model, cfg.train, policy.device, dist)  # equal, then sharded
    # tictactoe-game's `snapshot` opponent: frozen copies of the model (loop/snapshot.py)
    snapshot = start_snapshots(policy, capabilities(probe).snapshot_opponent)
    run_dir = open_run_dir(cfg, out, dist, force, resume)
    play = player(cfg, policy, probe)
    held_out = HeldOut.of(cfg, policy, play, probe, run_dir, progress)
    greedy = cfg.eval.greedy_runs  # each eval also at T = 0 (eval.greedy)

    # ---- baseline: fixed held-out tasks and sampling seed, reused by every later eval
    also = AlsoEvals.of(cfg, policy, run_dir, progress)  # eval.also: other envs, same seeds
    baseline, baseline_greedy = baseline_evals(held_out, also, greedy)

    # ---- optional SFT warm start on the env's demonstrations, then its own eval
    after_sft = held_out.read(run_dir, "after_sft") if cfg.sft.enabled else None
    if cfg.sft.enabled and after_sft is None:
        warm_start(policy, sft_env, cfg, run_dir, dist, progress)
        dist.broadcast_parameters(policy.trainable_parameters())
        if snapshot is not None:
            snapshot.refresh(policy.model)
        if greedy:  # first: a resume redoes the SFT until after_sft.json exists
            held_out.run("after_sft", greedy=True)
        after_sft = held_out.run("after_sft")

    # ---- the training steps (loop/step.py), from the newest checkpoint when resumed
    trainer, start = start_trainer(cfg, policy, probe, play, dist, run_dir, snapshot, resume)
    trainer.baseline, trainer.started = baseline, started  # for the report of an early stop
    curve = EvalCurve.of(held_out, start)  # eval.every: the held-out reward over the steps
    if curve is not None and start == 0:
        curve.point(0, (after_sft or baseline) if curve.full else None)
    run_steps(trainer, start, curve, progress)

    # ---- retest on exactly the same tasks and seeds, then report
    final = held_out.run("final")
    final_greedy = held_out.run("final", greedy=True) if greedy else None
    also.run("final")
    if curve is not None:
        curve.point(cfg.train.steps, final if curve.full else None)
        best = curve.best()
        progress.note(
            f"{DONE} held-out curve: best at step {best['step']} "
            f"({best['reward_mean']:+.3f}), weights in {curve.best_dir}"
        )
    with progress.phase("write report") as phase:
        write_report(run_dir, cfg, baseline, final, time.time() - started, peak_rss_gb())
        report = run_dir / "report.md"
        phase.done(f"{report.name}, {report.with_suffix('.html').name}, plots/")
    trainer.logger.close(report_dir=run_dir)
    evals = {"baseline eval": baseline, "final eval": final}
    warned = run_warnings(report_files.read_metrics(run_dir), evals) + also_warnings(run_dir)
    if hasattr(policy.engine, "close"):  # a vLLM server looprl started stops here
        policy.engine.close()
    return {
        "baseline": baseline,
        "after_sft": after_sft,
        "final": final,
        "greedy": (baseline_greedy, final_greedy) if final_greedy is not None else None,
        "run_dir": str(run_dir),
        "report": str(report),
        "warnings": warned,
        "references": [r for _, r in load_references(cfg.eval.references) if r],
    }


def baseline_evals(held_out: HeldOut, also: AlsoEvals, greedy: bool) -> tuple[dict, dict | None]:
    """The evals before any training: the held-out one (and its greedy twin), then
    eval.also's, then the teacher's when the run distills; each one a resumed run has
    already is read back, not played again."""
    baseline = held_out.read(held_out.run_dir, "baseline")
    if baseline is None:
        baseline = held_out.run("baseline")
    else:
        kept = held_out.run_dir / "eval" / "baseline.json"
        held_out.progress.note(f"{DONE} baseline eval: kept from {kept}")
    baseline_greedy = held_out.kept_or_run("baseline", greedy=True) if greedy else None
    also.run("baseline")
    evaluate_teacher(held_out)  # a distilling run: the teacher's own reward, once
    return baseline, baseline_greedy


def run_steps(trainer: Trainer, start: int, curve: EvalCurve | None, progress: Progress) -> None:
    """Steps start + 1 .. train.steps (`Trainer.step`), each followed by its health checks,
    the held-out curve's point when due, and a stop when asked (Ctrl-C, SIGTERM, too many
    NaN steps)."""
    cfg = trainer.cfg
    with (
        progress.phase("training", total=cfg.train.steps, unit="step", start=start) as phase,
        StopOnSignal() as stop,
    ):
        step_seconds: list[float] = []  # this process's steps, for the mean it shows
        for step in range(start + 1, cfg.train.steps + 1):
            metrics = trainer.step(step)
            say_health(trainer, step, progress)  # train.health: warn, or stop here
            if curve is not None and curve.due(step):
                curve.point(step)
            step_seconds.append(metrics["perf/step_s"])
            phase.update(
                advance=1,
                detail=f"step {step} · reward {metrics['rollout/rewards_mean']:+.3f} · "
                f"{metrics['perf/step_s']:.1f} s (mean {np.mean(step_seconds):.1f} s/step)",
            )
            trainer.stop_if_asked(step, stop)  # Ctrl-C / SIGTERM, or too many NaN steps


# ============================================================================ run setup


def check_run(cfg: Config, out: Path, dist: Dist, force: bool, resume: bool) -> tuple[Any, Any]:
    """Everything about the run that can be wrong without the model: the run folder, the
    trackers, the split over processes, the env and what the levers need of it, one task of
    each split played without the model. Returns the env instance the loop asks for tasks
    (`probe`) and the SFT's (None without the SFT)."""
    check_run_dir(out, force=force, resume=resume)
    check_trackers(cfg.logging.trackers)
    ranks.check_split(cfg, dist)
    probe = make_env(cfg.env.name, cfg.env.args)
    # the SFT draws its demonstration tasks from env.args with sft.env_args over them
    sft_env = sft_environment(cfg) if cfg.sft.enabled else None
    guided = probe if cfg.algo.expert_samples else None  # its groups take the expert's
    for field, env, off in (
        ("sft.enabled", sft_env, "sft.enabled=false"),
        ("algo.expert_samples", guided, "algo.expert_samples=0"),
    ):
        if env is not None and not capabilities(env).demonstrations:
            raise ConfigError(
                f"{field} needs demonstrations, and environment {cfg.env.name!r} has no "
                f"demonstrations(task) method (agent environments never do); set {off}"
            )
    if cfg.algo.turn_reward_weight > 0 and not gives_turn_rewards(probe):
        raise ConfigError(
            f"algo.turn_reward_weight > 0 needs per-turn rewards, and environment "
            f"{cfg.env.name!r} with these env.args grades only whole episodes (tictactoe-game "
            "does with env.args.move_rewards=true); set algo.turn_reward_weight=0"
        )
    preflight.check_env(cfg, probe)  # one task of each split played without the model
    check_replay(cfg)  # train.replay: its saved rollouts fit this run
    check_overlap(cfg, probe, dist.world)  # rollout.max_staleness ≥ 1
    if cfg.train.shard == "fsdp" and capabilities(probe).snapshot_opponent:
        raise ConfigError(
            "train.shard=fsdp cannot be combined with the snapshot opponent: it plays a whole "
            "copy of the policy; choose another opponent or set train.shard=none"
        )
    check_teacher(cfg)  # algo.teacher: the student's tokenizer
    check_also(cfg)  # eval.also: each env made, one held-out task drawn
    return probe, sft_env


def open_run_dir(cfg: Config, out: Path, dist: Dist, force: bool, resume: bool) -> Path:
    """The run folder, prepared by rank 0 once every rank has checked it, with the config
    and the judge's verdict cache in it."""
    dist.barrier()  # every rank has checked the folder before rank 0 changes it
    main_only(prepare_run_dir)(out, force=force, resume=resume)
    main_only(write_config)(out, cfg)
    cache_verdicts_in(out)  # a judge's verdicts are kept there (a resume re-asks nothing)
    dist.barrier()  # and every rank reads the folder only once rank 0 has prepared it
    return out


def start_trainer(
    cfg: Config,
    policy: Policy,
    probe: Environment,
    play: Any,
    dist: Dist,
    run_dir: Path,
    snapshot: Any,
    resume: bool,
) -> tuple[Trainer, int]:
    """The optimizer, its schedule, the loop state (the newest checkpoint's when resumed),
    the metrics logger and the levers: what every training step shares; and the step to
    continue after (0, or the resumed checkpoint's)."""
    optimizer = make_optimizer(
        policy.trainable_parameters(), cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg))
    state = LoopState(update=UpdateState(micro_batch_tokens=cfg.train.micro_batch_tokens))
    start = resume_state(run_dir, policy, optimizer, scheduler, state) if resume else 0
    keep_reference(cfg, policy, run_dir, dist, start)  # algo.kl_reference=start
    if snapshot is not None and resume:
        snapshot.refresh(policy.model)  # the resumed checkpoint's weights
    logger = MetricsLogger(
        run_dir,
        cfg.logging.trackers,
        cfg.model_dump(mode="json"),
        cfg.logging.project,
        enabled=dist.is_main,
    )
    levers = Levers.of(cfg, policy)
    rows = report_files.read_metrics(run_dir) if resume else []
    # the run's one group source: played now, by a rollout thread, or replayed
    source = group_source(cfg, policy, probe, play, dist, levers, start, state.curriculum)
    trainer = Trainer(
        cfg,
        policy,
        probe,
        play,
        dist,
        run_dir,
        optimizer,
        scheduler,
        state,
        logger,
        snapshot,
        levers,
        source,
        baseline={},
        started=time.time(),
        rows=rows,
    )
    return trainer, start


# ============================================================================ plumbing


def write_config(run_dir: Path, cfg: Config) -> None:
    (run_dir / "config.yaml").write_text(to_yaml(cfg))


def warm_start(
    policy: Policy,
    probe: Environment,
    cfg: Config,
    run_dir: Path,
    dist: Dist,
    progress: Progress | None = None,
) -> None:
    """SFT steps on demonstrations of `probe`'s train tasks (the env built with env.args and
    sft.env_args over them); checkpointed as step 0 (weights only)."""
    # weight decay 0.01: torch AdamW's default, which the warm start has always used
    optimizer = make_optimizer(policy.trainable_parameters(), cfg.train.optimizer, cfg.sft.lr, 0.01)
    sft_log = run_dir / "sft_metrics.jsonl"
    main_only(sft_log.write_text)("")
    append_line = main_only(log.append_json)
    # sft.loss_on=free: the loss leaves out the tokens a forced call's grammar fixes
    grammars = grammar_cache(policy) if cfg.sft.loss_on == "free" else None
    args = sft_env_args(cfg)
    with (progress or Progress(quiet=True)).phase("SFT warm start", cfg.sft.steps, "step") as phase:
        for step in range(1, cfg.sft.steps + 1):
            tasks = probe.tasks("train", n=cfg.sft.batch_size, seed=sft_tasks_seed(cfg.seed, step))
            episodes = [
                sft.demo_episode(make_env(cfg.env.name, args), t, policy.renderer, grammars)
                for t in tasks
            ]
            stats = sft.sft_step(policy, optimizer, episodes, cfg, dist)
            append_line(sft_log, {"step": step, **stats})
            phase.update(step, detail=f"loss {stats['sft/loss']:.3f}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    meta = {"stage": "sft"}
    sharded = writes_shards(cfg.train)
    save_checkpoint(
        run_dir, 0, policy.model, optimizer, scheduler, meta, 1_000_000, sharded=sharded
    )


def sft_env_args(cfg: Config) -> dict[str, Any]:
    """The env arguments of the SFT's demonstration tasks: env.args, sft.env_args over them."""
    return {**cfg.env.args, **cfg.sft.env_args}


def sft_environment(cfg: Config) -> Any:
    """The env the SFT draws its demonstration tasks from (`sft_env_args`)."""
    if not cfg.sft.env_args:
        return make_env(cfg.env.name, cfg.env.args)
    try:
        return make_env(cfg.env.name, sft_env_args(cfg))
    except LoopRLError as err:
        raise ConfigError(f"sft.env_args {cfg.sft.env_args} over env.args: {err}") from None


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
