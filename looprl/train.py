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
import random
import resource
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.algo import LOSSES, batch_advantages, dynamic_sampling_keep
from looprl.checkpoint import (
    list_checkpoints,
    load_training_state,
    load_weights,
    save_checkpoint,
)
from looprl.config import Config, to_yaml
from looprl.engine import SamplingParams
from looprl.envs import make_env
from looprl.errors import ConfigError, LoopRLError
from looprl.evaluate import eval_result, summarize
from looprl.log import MetricsLogger, write_samples
from looprl.policy import Policy, load_policy, prompt_length, sequence_logprobs
from looprl.report import write_report
from looprl.rollout import run_episodes
from looprl.types import Episode

# ============================================================================ the loop


def run_training(cfg: Config, out: Path, force: bool = False, resume: bool = False) -> dict:
    run_dir = prepare_run_dir(out, force=force, resume=resume)
    probe = make_env(cfg.env.name, cfg.env.args)  # validates env name and args early
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    seed_everything(cfg.seed)
    started = time.time()
    policy = load_policy(cfg)
    play = partial(
        run_episodes,
        make_env=lambda: make_env(cfg.env.name, cfg.env.args),
        engine=policy.engine,
        renderer=policy.renderer,
        max_turns=probe.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
    )

    # ---- baseline: fixed held-out tasks and sampling seed, reused by the final eval
    eval_tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    baseline = load_json(run_dir / "eval" / "baseline.json")
    if baseline is None:
        baseline = evaluate(policy, play, eval_tasks, cfg, run_dir, "baseline")

    # ---- optimizer, schedule, resume
    optimizer = torch.optim.AdamW(
        policy.trainable_parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg))
    start = resume_state(run_dir, policy, optimizer, scheduler) if resume else 0
    logger = MetricsLogger(
        run_dir, cfg.logging.tensorboard, cfg.model_dump() if cfg.logging.wandb else None
    )
    env_errors = 0
    bad_steps = 0

    # ---- training steps
    from rich.progress import Progress

    with Progress(transient=False) as progress:
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

            # feedback → advantages
            groups = [
                episodes[i : i + cfg.rollout.group_size]
                for i in range(0, len(episodes), cfg.rollout.group_size)
            ]
            errors = sum(1 for e in episodes if not e.trainable and e.outcome == "env_error")
            env_errors += errors
            if env_errors > cfg.env.error_budget:
                save_now(run_dir, step - 1, policy, optimizer, scheduler, cfg)
                raise LoopRLError(
                    f"{env_errors} episodes ended in env_error (budget env.error_budget="
                    f"{cfg.env.error_budget}); tracebacks are in "
                    f"{run_dir / 'samples' / 'env_errors.jsonl'}"
                )
            if errors:
                write_samples(
                    run_dir / "samples" / "env_errors.jsonl", [e for e in episodes if e.error], step
                )
            # env_error episodes take no part in the group statistics or the loss
            groups = [[e for e in g if e.trainable] for g in groups]
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
            stats = update_policy(policy, optimizer, batch, cfg, step, max_turns=probe.max_turns)
            train_s = time.time() - t1
            bad_steps = bad_steps + 1 if stats["skipped"] else 0
            scheduler.step()

            summary = summarize(episodes)
            generated = sum(e.response_len for e in episodes)
            metrics = {
                "step": step,
                "rollout/rewards_mean": summary["reward_mean"],
                "rollout/rewards_std": float(
                    np.std([e.reward for e in episodes if e.trainable] or [0.0])
                ),
                "response_len": summary["response_len"],
                "rollout/valid_tool_call_rate": summary["valid_tool_call_rate"],
                "rollout/env_errors": errors,
                "rollout/logprob_gap": stats["logprob_gap"],
                "train/loss": stats["loss"],
                "train/clip_frac": stats["clip_frac"],
                "train/grad_norm": stats["grad_norm"],
                "train/lr": optimizer.param_groups[0]["lr"],
                "train/zero_std_groups": int(zero_std_G.sum()),
                "train/skipped_steps": int(stats["skipped"]),
                "train/ratio_max": stats["ratio_max"],
                "perf/step_s": time.time() - t0,
                "perf/rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
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
            if cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0:
                save_now(run_dir, step, policy, optimizer, scheduler, cfg)
            progress.update(
                bar,
                advance=1,
                description=f"step {step} reward {metrics['rollout/rewards_mean']:+.3f} "
                f"{metrics['perf/step_s']:.1f}s/step",
            )
            if bad_steps >= cfg.train.max_bad_steps:
                save_now(run_dir, step, policy, optimizer, scheduler, cfg)
                raise LoopRLError(
                    f"{bad_steps} steps in a row had NaN/inf loss or gradients; lower train.lr "
                    f"or check the model's dtype (the last good weights are checkpointed)"
                )
    logger.close()
    if cfg.train.steps and not (run_dir / "checkpoints" / f"step_{cfg.train.steps:06d}").exists():
        save_now(run_dir, cfg.train.steps, policy, optimizer, scheduler, cfg)

    # ---- retest on exactly the same tasks and seeds, then report
    final = evaluate(policy, play, eval_tasks, cfg, run_dir, "final")
    write_report(
        run_dir, cfg, baseline, final, wall_s=time.time() - started, peak_rss=peak_rss_gb()
    )
    return {"baseline": baseline, "final": final, "run_dir": str(run_dir)}


# ============================================================================ the update


def update_policy(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    batch: list[tuple[Episode, float]],
    cfg: Config,
    step: int,
    max_turns: int,
) -> dict[str, Any]:
    """`num_minibatches` optimizer updates on one rollout batch (episode, advantage)."""
    out = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "ratio_max": 1.0,
           "logprob_gap": 0.0, "skipped": False, "tokens": 0}  # fmt: skip
    if not batch:
        return out
    model, temperature = policy.model, cfg.rollout.temperature or 1.0
    pad = policy.tokenizer.pad_token_id or 0

    def logprobs(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logprobs(
            model, [e.token_ids for e in episodes], [e.loss_mask for e in episodes],
            pad, policy.device, temperature,
        )  # fmt: skip

    # old logprobs from the trainer's own forward pass, before any update (no grad);
    # stored per episode as the values at its masked tokens, in order.
    old: dict[int, torch.Tensor] = {}
    ref: dict[int, torch.Tensor] = {}
    gaps = []
    model.eval()
    with torch.no_grad():
        for chunk in micro_batches([e for e, _ in batch], cfg.train.micro_batch_tokens):
            logp_BK, mask_BK = logprobs(chunk)
            for row, episode in enumerate(chunk):
                values = logp_BK[row][mask_BK[row]].float().cpu()
                old[id(episode)] = values
                engine = torch.tensor(
                    [lp for lp, m in zip(episode.logprobs, episode.loss_mask) if m]
                )
                gaps.append((values - engine).abs().mean().item())
            if cfg.algo.kl_coef > 0:
                with model.disable_adapter():
                    logp_BK, mask_BK = logprobs(chunk)
                for row, episode in enumerate(chunk):
                    ref[id(episode)] = logp_BK[row][mask_BK[row]].float().cpu()
    out["logprob_gap"] = float(np.mean(gaps))
    model.train()

    loss_fn = LOSSES[cfg.algo.name]
    extra = (
        {"max_tokens": cfg.rollout.max_new_tokens * max_turns} if cfg.algo.name == "dr_grpo" else {}
    )
    # minibatches are made of whole groups (shuffled), so a group's episodes share one
    # prompt pass (see sequence_logprobs)
    by_task: dict[str, list[tuple[Episode, float]]] = {}
    for item in batch:
        by_task.setdefault(item[0].task.id, []).append(item)
    groups = list(by_task.values())
    order = torch.randperm(
        len(groups), generator=torch.Generator().manual_seed(cfg.seed * 7 + step)
    )
    splits = [
        m for m in torch.tensor_split(order, min(cfg.algo.num_minibatches, len(groups))) if len(m)
    ]
    losses, clips, norms, ratio_max = [], [], [], 1.0
    for indices in splits:
        mb = [item for i in indices.tolist() for item in groups[i]]
        if cfg.algo.name == "grpo":
            normalizer = float(sum(e.response_len for e, _ in mb))
        else:
            normalizer = float(len(mb))
        # A = 0 sequences add nothing to the policy-gradient loss: skip their forward
        # pass (unless the KL term needs them); they still count in the normaliser.
        active = [(e, a) for e, a in mb if a != 0.0 or cfg.algo.kl_coef > 0]
        optimizer.zero_grad(set_to_none=True)
        total, clip_units, clip_sum = 0.0, 0.0, 0.0
        adv = {id(e): a for e, a in active}
        for chunk in micro_batches([e for e, _ in active], cfg.train.micro_batch_tokens):
            logp_BK, mask_BK = logprobs(chunk)
            old_BK = torch.zeros_like(logp_BK)
            old_BK[mask_BK] = torch.cat([old[id(e)] for e in chunk]).to(old_BK)
            ref_BK = None
            if ref:
                ref_BK = torch.zeros_like(logp_BK)
                ref_BK[mask_BK] = torch.cat([ref[id(e)] for e in chunk]).to(ref_BK)
            adv_B = torch.tensor([adv[id(e)] for e in chunk], device=logp_BK.device)
            loss, st = loss_fn(
                logp_BK, old_BK, adv_B, mask_BK.float(),
                eps_low=cfg.algo.eps_low, eps_high=cfg.algo.eps_high,
                ref_logp_BT=ref_BK, kl_coef=cfg.algo.kl_coef, normalizer=normalizer, **extra,
            )  # fmt: skip
            loss.backward()
            total += float(loss.detach())
            clip_units += st["count"]
            clip_sum += st["clip_frac"] * st["count"]
            ratio_max = max(ratio_max, st["ratio_max"])
            out["tokens"] += sum(len(e.token_ids) for e in chunk)
        norm = torch.nn.utils.clip_grad_norm_(
            policy.trainable_parameters(), cfg.train.max_grad_norm
        )
        if not (np.isfinite(total) and torch.isfinite(norm)):
            optimizer.zero_grad(set_to_none=True)  # skip: weights and optimizer untouched
            out["skipped"] = True
            continue
        optimizer.step()
        losses.append(total)
        clips.append(clip_sum / max(clip_units, 1))
        norms.append(float(norm))
    optimizer.zero_grad(set_to_none=True)
    out.update(
        loss=float(np.mean(losses)) if losses else float("nan"),
        clip_frac=float(np.mean(clips)) if clips else 0.0,
        grad_norm=float(np.mean(norms)) if norms else float("nan"),
        ratio_max=ratio_max,
    )
    return out


def micro_batches(episodes: list[Episode], token_budget: int) -> list[list[Episode]]:
    """Greedy split, in order, so that the tokens one forward pass processes stay within
    the budget: each distinct prompt once plus (rows × longest suffix)."""
    chunks: list[list[Episode]] = []
    current: list[Episode] = []

    def cost(chunk: list[Episode]) -> int:
        prompts = {tuple(e.token_ids[: prompt_length(e.loss_mask)]) for e in chunk}
        suffix = max(len(e.token_ids) - prompt_length(e.loss_mask) for e in chunk)
        return sum(len(p) for p in prompts) + len(chunk) * suffix

    for episode in episodes:
        if current and cost(current + [episode]) > token_budget:
            chunks.append(current)
            current = []
        current.append(episode)
    if current:
        chunks.append(current)
    return chunks


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


def run_eval(cfg: Config, checkpoint: Path | None = None, out: Path | None = None) -> dict:
    """`looprl eval`: evaluate a model, or a run's checkpoint, on the held-out tasks."""
    policy = load_policy(cfg)
    if checkpoint is not None:
        if not (checkpoint / "trainable.safetensors").exists():
            raise ConfigError(f"{checkpoint} is not a looprl checkpoint folder")
        load_weights(policy.model, checkpoint)
    probe = make_env(cfg.env.name, cfg.env.args)
    play = partial(
        run_episodes,
        make_env=lambda: make_env(cfg.env.name, cfg.env.args),
        engine=policy.engine,
        renderer=policy.renderer,
        max_turns=probe.max_turns,
        max_episode_tokens=cfg.rollout.max_episode_tokens,
    )
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    result = evaluate(policy, play, tasks, cfg, None, "eval")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result


def prepare_run_dir(out: Path, force: bool, resume: bool) -> Path:
    if resume:
        if not (out / "config.yaml").exists():
            raise ConfigError(f"--resume: {out} is not a run folder (no config.yaml)")
        return out
    if out.exists() and any(out.iterdir()):
        if not force:
            hint = " (it holds an unfinished run)" if list_checkpoints(out) else ""
            raise ConfigError(
                f"run folder {out} is not empty{hint}; pass --resume to continue it or "
                f"--force to overwrite it"
            )
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create run folder {out}: {err.strerror}") from None
    return out


def resume_state(run_dir: Path, policy: Policy, optimizer: Any, scheduler: Any) -> int:
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        return 0
    meta = load_weights(policy.model, checkpoints[-1])
    load_training_state(checkpoints[-1], optimizer, scheduler)
    step = int(meta["step"])
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():  # drop steps logged after the checkpoint
        kept = [
            ln for ln in metrics.read_text().splitlines() if ln and json.loads(ln)["step"] <= step
        ]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    return step


def save_now(
    run_dir: Path, step: int, policy: Policy, optimizer: Any, scheduler: Any, cfg: Config
) -> None:
    if step > 0:
        save_checkpoint(
            run_dir,
            step,
            policy.model,
            optimizer,
            scheduler,
            {"model": cfg.model.name},
            cfg.train.keep_checkpoints,
        )


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
