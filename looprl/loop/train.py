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
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.config import Config, to_yaml
from looprl.envs import gives_turn_rewards, make_env
from looprl.envs.judge import cache_verdicts_in
from looprl.errors import ConfigError, EngineError, LoopRLError
from looprl.loop import checkpoint as checkpoints
from looprl.loop import dist as ranks
from looprl.loop import log, preflight, sft
from looprl.loop.decisions import decision_batch, decision_surprisal, grammar_cache
from looprl.loop.dist import Dist, main_only
from looprl.loop.evaluate import (
    by_member,
    evaluate,
    greedy_eval_tasks,
    judge_cost,
    kept_tasks,
    load_model,
    player,
    summarize,
)
from looprl.loop.groups import greedy_member, play_step
from looprl.loop.guidance import expert_advantage, mean_advantage, safe_expert_episode
from looprl.loop.log import MetricsLogger
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import Policy
from looprl.loop.progress import DONE, Progress
from looprl.loop.run_state import (
    Interrupted,
    LoopState,
    StopOnSignal,
    check_run_dir,
    load_json,
    peak_rss_gb,
    prepare_run_dir,
    resume_state,
    seed_everything,
)
from looprl.loop.snapshot import start_snapshots
from looprl.loop.trackers import check_trackers
from looprl.loop.update import UpdateState, update_policy
from looprl.report import write as report_files
from looprl.report.comparisons import load_references
from looprl.report.health import run_warnings
from looprl.types import ENV_ERROR, PARSE_FAILURES, TRUNCATED

# Under torchrun every rank runs this loop and computes the same metrics from all ranks'
# episodes (loop/dist.py); rank 0 alone writes the run folder. These writers do nothing
# on the other ranks, so the loop reads the same for one process or many.
UNSCORABLE = (*PARSE_FAILURES, TRUNCATED)  # outcomes that say nothing of the task itself
save_checkpoint = main_only(checkpoints.save_checkpoint)
write_samples = main_only(log.write_samples)
write_report = main_only(report_files.write_report)

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
        if env is not None and not callable(getattr(env, "demonstrations", None)):
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
    seed_everything(cfg.seed)
    started = time.time()
    progress.note(
        f"looprl run: {cfg.env.name} · {cfg.model.name} · {cfg.algo.name} · "
        f"{cfg.train.steps} steps → {out}{' (resumed)' if resume else ''}"
    )
    policy = load_model(cfg, progress)
    preflight.check_reply_room(cfg, probe, policy.renderer)  # still nothing written
    dist.broadcast_parameters(policy.trainable_parameters())  # the replicas start equal
    # tictactoe-game's `snapshot` opponent: frozen copies of the model (loop/snapshot.py)
    snapshot = start_snapshots(policy, bool(getattr(probe, "plays_snapshot", False)))
    dist.barrier()  # every rank has checked the folder before rank 0 changes it
    run_dir = out
    main_only(prepare_run_dir)(out, force=force, resume=resume)
    main_only(write_config)(run_dir, cfg)
    cache_verdicts_in(run_dir)  # a judge's verdicts are kept there (a resume re-asks nothing)
    dist.barrier()  # and every rank reads the folder only once rank 0 has prepared it
    play = player(cfg, policy, probe)

    # ---- baseline: fixed held-out tasks and sampling seed, reused by the final eval
    eval_tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    baseline = load_json(run_dir / "eval" / "baseline.json")
    if baseline is None:
        baseline = evaluate(policy, play, eval_tasks, cfg, run_dir, "baseline", progress)
    else:
        progress.note(f"{DONE} baseline eval: kept from {run_dir / 'eval' / 'baseline.json'}")
    # the greedy policy (T = 0, one episode per distinct task; eval.greedy_tasks of them,
    # the sampled eval's first), beside it (unless the eval above already was greedy)
    greedy = cfg.eval.greedy_runs
    greedy_tasks = greedy_eval_tasks(probe, cfg, eval_tasks)
    baseline_greedy = load_json(run_dir / "eval" / "baseline_greedy.json")
    if baseline_greedy is not None:  # resumed: the tasks it played, whatever the settings
        greedy_tasks = kept_tasks(baseline_greedy, greedy_tasks, eval_tasks)
    if greedy and baseline_greedy is None:
        baseline_greedy = evaluate(
            policy, play, greedy_tasks, cfg, run_dir, "baseline_greedy", progress, greedy=True
        )

    # ---- optional SFT warm start on the env's demonstrations, then its own eval
    after_sft = load_json(run_dir / "eval" / "after_sft.json") if cfg.sft.enabled else None
    if cfg.sft.enabled and after_sft is None:
        warm_start(policy, sft_env, cfg, run_dir, progress)
        dist.broadcast_parameters(policy.trainable_parameters())
        if snapshot is not None:
            snapshot.refresh(policy.model)
        if greedy:  # first: a resume redoes the SFT until after_sft.json exists
            evaluate(policy, play, greedy_tasks, cfg, run_dir, "after_sft_greedy", progress,
                     greedy=True)  # fmt: skip
        after_sft = evaluate(policy, play, eval_tasks, cfg, run_dir, "after_sft", progress)

    # ---- optimizer, schedule, resume
    optimizer = make_optimizer(
        policy.trainable_parameters(), cfg.train.optimizer, cfg.train.lr, cfg.train.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg))
    loop = LoopState(update=UpdateState(micro_batch_tokens=cfg.train.micro_batch_tokens))
    start = resume_state(run_dir, policy, optimizer, scheduler, loop) if resume else 0
    if snapshot is not None and resume:
        snapshot.refresh(policy.model)  # the resumed checkpoint's weights
    logger = MetricsLogger(
        run_dir, cfg.logging.trackers, cfg.model_dump(mode="json"), cfg.logging.project,
        enabled=dist.is_main,
    )  # fmt: skip

    def checkpoint(step: int) -> None:
        save_checkpoint(
            run_dir, step, policy.model, optimizer, scheduler,
            {"model": cfg.model.name, **loop.to_meta()}, cfg.train.keep_checkpoints,
        )  # fmt: skip
        if snapshot is not None:  # train games meet the policy of the last checkpoint
            snapshot.refresh(policy.model)

    # algo.loss_on=free: the update sees each forced call's decision tokens only;
    # algo.entropy_coef: each advantage takes the spread of the decisions' surprisal
    decisions = cfg.algo.loss_on == "free" or cfg.algo.entropy_coef > 0
    grammars = grammar_cache(policy) if decisions else None
    views_of_step: dict[int, Any] = {}  # each episode's decision view, built once a step
    bonus = None
    if grammars is not None and cfg.algo.entropy_coef > 0:
        bonus = partial(
            decision_surprisal, grammars=grammars, tokenizer=policy.tokenizer,
            cache=views_of_step,
        )  # fmt: skip

    # algo.expert_samples: the task's expert episode as the last members of each group
    expert = None
    if cfg.algo.expert_samples:
        expert = partial(
            safe_expert_episode, lambda: make_env(cfg.env.name, cfg.env.args),
            renderer=policy.renderer, temperature=cfg.rollout.temperature,
        )  # fmt: skip

    # ---- training steps
    with (
        progress.phase("training", total=cfg.train.steps, unit="step") as phase,
        StopOnSignal() as stop,
    ):
        phase.update(start)
        step_seconds: list[float] = []  # this process's steps, for the mean it shows
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.time()
            views_of_step.clear()
            # play the step's groups (refilled and picked by the levers of loop/groups.py)
            try:
                played, loop.curriculum = play_step(
                    cfg, probe, play, dist, step, loop.curriculum, bonus, expert
                )
            except EngineError as err:  # e.g. the vLLM server died: keep what was learned
                checkpoint(step - 1)
                logger.close()
                raise EngineError(
                    f"{err}\nthe run stopped at step {step}; the state after step {step - 1} "
                    f"is checkpointed. Once the engine is back, continue with\n"
                    f"  looprl run --out {run_dir} --resume"
                ) from None
            episodes, advantages = played.episodes, played.advantages
            rollout_s = time.time() - t0

            # feedback: environment bugs are counted against the budget, never trained on
            errors = [e for e in episodes if e.outcome == ENV_ERROR]
            loop.env_errors += len(errors)
            if errors:
                write_samples(run_dir / "samples" / "env_errors.jsonl", errors, step)
            if loop.env_errors > cfg.env.error_budget:
                write_report(run_dir, cfg, baseline, None, time.time() - started, peak_rss_gb())
                logger.close(report_dir=run_dir)
                kept = (checkpoints.list_checkpoints(run_dir) or [None])[-1]
                raise LoopRLError(
                    f"{loop.env_errors} episodes ended in env_error (budget "
                    f"env.error_budget={cfg.env.error_budget}); tracebacks are in "
                    f"{run_dir / 'samples' / 'env_errors.jsonl'}; "
                    + (f"the last checkpoint ({kept.name}) is kept" if kept else
                       "no step had been checkpointed yet")
                )  # fmt: skip

            # advantages were computed within each task group (env_error episodes take no part)
            batch = [(e, a) for e, a in zip(episodes, advantages) if a is not None]
            mine_batch = [(e, a) for e, a in dist.share(list(zip(episodes, advantages)))
                          if a is not None]  # fmt: skip
            decision: dict[str, float] = {}
            if grammars is not None:
                views, decision = decision_batch(
                    episodes, mine_batch, grammars, policy.tokenizer, views_of_step
                )
                if cfg.algo.loss_on == "free":
                    mine_batch = views

            # policy update
            t1 = time.time()
            stats = update_policy(
                policy, optimizer, mine_batch, cfg.algo, cfg.train,
                group_size=cfg.rollout.group_size,
                max_tokens=cfg.rollout.max_new_tokens * probe.max_turns,
                seed=cfg.seed * 7 + step, state=loop.update, dist=dist,
            )  # fmt: skip
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

            # rollout/*: the policy's own samples (expert episodes were not sampled, greedy
            # members not at the rollout temperature)
            sampled = [e for e in episodes if not (e.expert or greedy_member(cfg, e))]
            summary = summarize(sampled)
            unscorable = sum(e.outcome in UNSCORABLE for e in sampled) / max(len(sampled), 1)
            if sampled and unscorable == 1.0:
                top = max(summary["outcomes"], key=summary["outcomes"].get)
                progress.note(
                    f"warning: step {step}: every episode was truncated or unparsable (mostly "
                    f"{top}): nothing to learn from"
                    + (f"; raise rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
                       if top == TRUNCATED else "")
                )  # fmt: skip
            generated = sum(e.response_len for e in episodes if not e.expert)  # greedy too
            metrics = {
                "step": step,
                "rollout/rewards_mean": summary["reward_mean"],
                "rollout/rewards_std": float(
                    np.std(
                        [e.reward for e, _ in batch if not (e.expert or greedy_member(cfg, e))]
                        or [0.0]
                    )
                ),
                "response_len": summary["response_len"],
                "rollout/valid_tool_call_rate": summary["valid_tool_call_rate"],
                "rollout/env_errors": len(errors),
                "rollout/unscorable": unscorable,  # truncated or unparsable share
                "rollout/token_mismatch": sum("token_mismatch" in e.info for e in sampled),
                "rollout/retokenize_mismatch": sum(
                    "retokenize_mismatch" in e.info for e in sampled
                ),
                "rollout/logprob_gap": stats["logprob_gap"],
                "rollout/entropy": summary["entropy"],
                **decision,  # rollout/decision_entropy, rollout/decision_tokens
                "train/loss": stats["loss"],
                "train/clip_frac": stats["clip_frac"],
                "train/grad_norm": stats["grad_norm"],
                "train/lr": optimizer.param_groups[0]["lr"],
                **played.metrics,  # train/zero_std_groups, kept_groups, ...; curriculum/*
                "train/skipped_steps": stats["skipped"],
                "train/updates": stats["updated"],  # optimizer updates made this step
                "train/ratio_max": stats["ratio_max"],
                "train/micro_batch_tokens": loop.update.micro_batch_tokens,
                "perf/step_s": time.time() - t0,
                "perf/rollout_tokens_per_s": generated / rollout_s,
                "perf/train_tokens_per_s": stats["tokens"] / max(train_s, 1e-9),
                "perf/peak_rss_gb": peak_rss_gb(),
            }
            if expert is not None:
                metrics["train/expert_advantage"] = expert_advantage(batch)
            if cfg.algo.greedy_samples:  # above 0: the argmax beat its groups' mean
                argmax = [a for e, a in batch if greedy_member(cfg, e)]
                metrics["train/greedy_advantage"] = mean_advantage(argmax)
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
            step_seconds.append(metrics["perf/step_s"])
            phase.update(
                advance=1,
                detail=f"step {step} · reward {metrics['rollout/rewards_mean']:+.3f} · "
                f"{metrics['perf/step_s']:.1f} s (mean {np.mean(step_seconds):.1f} s/step)",
            )
            stopping = dist.all_reduce([bool(stop.requested)], op="max")[0]  # all or none
            stop.requested = stop.requested or ("SIGTERM" if stopping else None)
            if loop.bad_steps >= cfg.train.max_bad_steps or stop.requested:
                checkpoint(step)
                write_report(run_dir, cfg, baseline, None, time.time() - started, peak_rss_gb())
                logger.close(report_dir=run_dir)
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

    # ---- retest on exactly the same tasks and seeds, then report
    final = evaluate(policy, play, eval_tasks, cfg, run_dir, "final", progress)
    final_greedy = None
    if greedy:
        final_greedy = evaluate(
            policy, play, greedy_tasks, cfg, run_dir, "final_greedy", progress, greedy=True
        )
    with progress.phase("write report") as phase:
        write_report(run_dir, cfg, baseline, final, time.time() - started, peak_rss_gb())
        report = run_dir / "report.md"
        phase.done(f"{report.name}, {report.with_suffix('.html').name}, plots/")
    logger.close(report_dir=run_dir)
    evals = {"baseline eval": baseline, "final eval": final}
    warned = run_warnings(report_files.read_metrics(run_dir), evals)
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


# ============================================================================ plumbing


def write_config(run_dir: Path, cfg: Config) -> None:
    (run_dir / "config.yaml").write_text(to_yaml(cfg))


def warm_start(
    policy: Policy, probe: Any, cfg: Config, run_dir: Path, progress: Progress | None = None
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
            tasks = probe.tasks("train", n=cfg.sft.batch_size, seed=cfg.seed * 999_983 + step)
            episodes = [
                sft.demo_episode(make_env(cfg.env.name, args), t, policy.renderer, grammars)
                for t in tasks
            ]
            stats = sft.sft_step(policy, optimizer, episodes, cfg)
            append_line(sft_log, {"step": step, **stats})
            phase.update(step, detail=f"loss {stats['sft/loss']:.3f}")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    save_checkpoint(run_dir, 0, policy.model, optimizer, scheduler, {"stage": "sft"}, 1_000_000)


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
