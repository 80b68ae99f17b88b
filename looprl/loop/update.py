"""One policy update on a rollout batch: old logprobs, then `num_minibatches` optimizer
steps of the chosen loss, each accumulated over micro-batches under a token budget.

Old logprobs (log pi_old of every generated token, before this update): when the
episodes were just sampled by the policy module itself (the `hf` engine in the model's
own dtype, weights untouched since, no dropout), the engine recorded exactly these, to
float32 rounding (`rollout/logprob_gap` ~1e-6 per token: a GSPO sequence ratio off 1 by
~1e-6, against a clip range of 3e-4), and the update takes them instead of a forward pass
over the batch. Otherwise (a bf16 sampler copy, vLLM, overlapped or replayed rollouts,
expert episodes, dropout) the trainer scores them itself. Either way the engine-vs-trainer
gap is measured with the trainer's logprobs before any weight moved: that pass's, or the
loss passes' before the first optimizer step.

Failures that must not kill a long run are contained here: a NaN/inf loss or gradient
skips that optimizer step (weights and optimizer state untouched), and running out of
memory halves the micro-batch token budget and retries the same minibatch.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from looprl.algo import (
    LOSSES,
    Advantage,
    Normalizer,
    masked_counts,
    moves,
    opd_loss,
    scoring_temperature,
)
from looprl.config import AlgoConfig, TrainConfig
from looprl.config.algo import DEFAULT_CLIP
from looprl.forward.routing import RouterLoad, router_metrics
from looprl.forward.score import micro_batches, sequence_logprobs
from looprl.loop.batches import Scored, UpdateState, minibatches, retry_on_oom, scoring_keys
from looprl.loop.dist import Dist
from looprl.loop.offpolicy import corrected, gap_stats, samples_policy_exactly, set_corrections
from looprl.loop.policy import Policy
from looprl.loop.reference import reference_weights
from looprl.loop.shard import clip_gradients, full_weights, is_sharded, synced_passes
from looprl.loop.teacher_server import ServerTeacher
from looprl.model.memory import release_free_memory

if TYPE_CHECKING:
    from looprl.loop.groups import Group


def update_policy(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    groups: list[Group],
    algo: AlgoConfig,
    train: TrainConfig,
    *,
    views: bool = False,
    group_size: int,
    max_tokens: int,
    seed: int,
    state: UpdateState,
    dist: Dist | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """`algo.num_minibatches` optimizer updates on one rollout batch: the members of
    `groups` that take part (`Group.learners`; with `views`, their decision views).

    `group_size` episodes of one task form a group; `max_tokens` is the generation budget
    of one episode (the constant length of Dr.GRPO's normaliser); `seed` shuffles this
    step's groups into minibatches. Each episode is scored at its own sampling temperature.
    `fresh`: the episodes were sampled by `policy.engine` since the policy's last update
    (not replayed, not by an overlapped rollout replica); where that engine samples from
    the policy module itself, its logprobs stand in for the old-logprob pass (module doc).

    Over several processes (`dist`), `groups` is this rank's share; the minibatches, the
    loss normaliser, the gradient and the returned stats are those of the whole batch over
    all ranks, so the update is the one-process update.

    In three parts: `old_logprobs` (and the engine-vs-trainer gap checks), then per
    minibatch `minibatch_gradient` (accumulated over micro-batches) and `optimizer_step`.
    """
    dist = dist or Dist()
    # the step's stats, as they stand when no episode takes part
    out = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "ratio_max": 1.0,
           "logprob_gap": 0.0, "mismatch_kl": 0.0, "skipped": 0, "updated": 0,
           "tokens": 0}  # fmt: skip
    batch = [Scored(e, a) for group in groups for e, a in group.learners(views)]
    if not dist.all_reduce([len(batch)])[0]:
        return out
    scorer = Scorer(policy, algo, state, optimizer, dist, train.shard_grad_sync == "every")
    load = RouterLoad(policy.model)  # MoE models: tokens per expert in the first full pass
    with full_weights(policy.model):  # no-grad passes, each rank its own count (shard.py)
        reuse, checks = old_logprobs(scorer, batch, group_size, fresh, load, dist)
    out.update(set_corrections(batch, algo, dist))
    taken: list[dict[str, float]] = []  # the minibatches whose optimizer step was taken
    with load if reuse else nullcontext():
        for minibatch in minibatches(task_units(batch), algo.num_minibatches, seed=seed, dist=dist):
            normalizer = minibatch_normalizer(minibatch, max_tokens, dist)
            gap = reuse and not taken  # no weight has moved yet: measure the gap here
            acc = retry_on_oom(
                lambda budget, mb=minibatch, n=normalizer, g=gap: minibatch_gradient(
                    scorer, mb, n, budget, g
                ),
                state,
                optimizer,
            )
            checks += acc.pop("checks")
            norm = optimizer_step(policy, optimizer, train, acc, out, dist)
            if norm is not None:
                taken.append(minibatch_stats(acc, norm))
    optimizer.zero_grad(set_to_none=True)
    if load.counts_LE is not None or (dist.world > 1 and load.routers):
        out["router"] = _gathered_router_metrics(load, dist)
    out.update(gap_stats(checks, dist))
    release_free_memory()
    out.update(step_means(taken, algo))
    return out


def minibatch_stats(acc: dict[str, Any], norm: torch.Tensor) -> dict[str, float]:
    """One taken minibatch's loss, clipped share, KL estimates and gradient norm."""
    units = max(acc["units"], 1)
    return {"loss": acc["loss"], "clip_frac": acc["clipped"] / units, "kl": acc["kl"] / units,
            "distill_kl": acc["distill_kl"] / units, "grad_norm": float(norm)}  # fmt: skip


def step_means(taken: list[dict[str, float]], algo: AlgoConfig) -> dict[str, float]:
    """The step's stats: the taken minibatches' means (NaN, or a 0 clipped share, when
    none was taken); the KL estimates only where a KL term or a teacher is on."""
    keys = ["loss", "clip_frac", "grad_norm"]
    keys += ["kl"] * (algo.kl_coef > 0) + ["distill_kl"] * algo.distills
    empty = {"clip_frac": 0.0}
    return {k: float(np.mean([t[k] for t in taken])) if taken else empty.get(k, float("nan"))
            for k in keys}  # fmt: skip


@dataclass
class Scorer:
    """What the update's forward passes share: the policy, the loss and its settings, and
    the micro-batch budget (which out-of-memory retries halve)."""

    policy: Policy
    algo: AlgoConfig
    state: UpdateState
    optimizer: torch.optim.Optimizer
    dist: Dist = field(default_factory=Dist)
    sync_every: bool = False  # train.shard_grad_sync=every (loop/shard.py)

    def logprobs(self, chunk: list[Scored], model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's logprobs and loss mask, [B, K], under the policy (or `model`,
        e.g. the teacher): one temperature per micro-batch (forward/score.py)."""
        policy = self.policy
        return sequence_logprobs(
            policy.model if model is None else model,
            [s.episode.token_ids for s in chunk],
            [s.episode.loss_mask for s in chunk],
            policy.tokenizer.pad_token_id or 0,
            policy.device,
            scoring_temperature(chunk[0].episode.temperature),
        )

    def masked_values(
        self, samples: list[Scored], budget: int, model: Any = None
    ) -> list[torch.Tensor]:
        """Each episode's logprobs at its generated tokens, in order (no grad)."""
        values: list[torch.Tensor] = []
        with torch.no_grad():
            keys = scoring_keys([s.episode for s in samples], is_sharded(self.policy.model))
            for indices in micro_batches(*keys, budget):
                chunk = [samples[i] for i in indices]
                logp_BK, mask_BK = self.logprobs(chunk, model)
                values += [logp_BK[row][mask_BK[row]].float().cpu() for row in range(len(chunk))]
        return values

    def all_values(self, samples: list[Scored], model: Any = None) -> list[torch.Tensor]:
        """`masked_values` under the out-of-memory retry; a teacher's server scores them
        itself (loop/teacher_server.py)."""
        if isinstance(model, ServerTeacher):
            return model.masked_values([s.episode for s in samples])
        return retry_on_oom(
            lambda budget: self.masked_values(samples, budget, model), self.state, self.optimizer
        )


Check = tuple[torch.Tensor, torch.Tensor]  # (trainer's, engine's) logprobs of one episode


def old_logprobs(
    scorer: Scorer, batch: list[Scored], group_size: int, fresh: bool, load: RouterLoad, dist: Dist
) -> tuple[bool, list[Check]]:
    """Set each learning episode's old (with `algo.kl_coef`, reference; with a teacher, the
    teacher's) logprobs.
    Returns whether the engine's logprobs stand in for the old ones (`reuse`: the gap is
    then measured by the first minibatch's loss pass) and the gap checks made here.

    Only the episodes that can move the loss need them: A = 0 episodes are skipped by the
    loss passes (unless the KL term needs them); with none left on any rank, one group per
    rank still measures the engine-vs-trainer gap."""
    algo, model = scorer.algo, scorer.policy.model
    learning = [s for s in batch if takes_part(s, algo)]
    anyone_learning = dist.all_reduce([len(learning)])[0] > 0
    scored = learning if anyone_learning else batch[:group_size]
    reuse = fresh and anyone_learning and samples_policy_exactly(scorer.policy)
    own_pass = [s for s in scored if s.episode.expert] if reuse else scored
    model.eval()
    with nullcontext() if reuse else load:
        old = scorer.all_values(own_pass)
    for sample, values in zip(own_pass, old, strict=True):
        sample.old = values
    # (trainer's, engine's) logprobs of sampled tokens before any weight moved
    checks = [] if reuse else [(s.old, s.sampled) for s in scored if not s.episode.expert]
    for sample in [s for s in scored if reuse and not s.episode.expert]:
        sample.old = sample.sampled  # the engine's, exact to rounding (module doc)
    if algo.kl_coef > 0:
        with reference_weights(scorer.policy):  # algo.kl_reference's
            ref = scorer.all_values(scored)
        for sample, values in zip(scored, ref, strict=True):
            sample.ref = values
    if algo.distills:  # the teacher's view of the student's own tokens
        teacher = scorer.all_values(scored, model=scorer.policy.teacher)
        for sample, values in zip(scored, teacher, strict=True):
            sample.teacher = values
    model.train()
    return reuse, checks


def minibatch_normalizer(minibatch: list[Scored], max_tokens: int, dist: Dist) -> Normalizer:
    """The whole minibatch's counts, over all ranks: each loss divides by its own
    (algo/losses.py)."""
    masked_sequences, masked_tokens = masked_counts([s.correction for s in minibatch])
    sequences, tokens = dist.all_reduce(
        [
            len(minibatch) - masked_sequences,
            sum(s.episode.response_len for s in minibatch) - masked_tokens,
        ]
    )
    return Normalizer(sequences=sequences, tokens=tokens, max_tokens=max_tokens)


def minibatch_gradient(
    scorer: Scorer, minibatch: list[Scored], normalizer: Normalizer, budget: int, gap: bool
) -> dict[str, Any]:
    """Accumulate the gradient of this rank's part of one minibatch's loss, a micro-batch
    at a time. `gap`: also return the trainer's logprobs as gap checks (no weight has
    moved yet and the engine's logprobs stood in for the old ones)."""
    algo, optimizer = scorer.algo, scorer.optimizer
    # A = 0 sequences add nothing to the policy-gradient loss: skip their forward
    # pass (unless the KL term needs them); they still count in the normaliser.
    active = [s for s in minibatch if takes_part(s, algo)]
    optimizer.zero_grad(set_to_none=True)
    acc = {"loss": 0.0, "units": 0.0, "clipped": 0.0, "kl": 0.0, "distill_kl": 0.0,
           "ratio_max": 1.0, "tokens": 0, "checks": []}  # fmt: skip
    model = scorer.policy.model
    keys = scoring_keys([s.episode for s in active], is_sharded(model))
    chunks = [[active[i] for i in indices] for indices in micro_batches(*keys, budget)]
    for chunk in synced_passes(model, chunks, scorer.dist, scorer.sync_every):  # shard.py
        logp_BK, mask_BK = scorer.logprobs(chunk)
        if gap:
            acc["checks"] += [
                (logp_BK[row][mask_BK[row]].detach().float().cpu(), s.sampled)
                for row, s in enumerate(chunk)
                if not s.episode.expert
            ]
        old_BK = torch.zeros_like(logp_BK)
        old_BK[mask_BK] = torch.cat([s.old for s in chunk]).to(old_BK)
        # algo.is_correction: weighted gradients, masked tokens out of the loss
        logp_BK, loss_mask_BK = corrected(logp_BK, mask_BK, [s.correction for s in chunk])
        ref_BK = _padded(chunk, "ref", mask_BK, logp_BK) if algo.kl_coef > 0 else None
        teacher_BK = _padded(chunk, "teacher", mask_BK, logp_BK) if algo.distills else None
        adv_B = advantage_tensor([s.advantage for s in chunk]).to(logp_BK.device)
        loss, st = policy_loss(
            algo, logp_BK, old_BK, adv_B, loss_mask_BK.float(), ref_BK, teacher_BK, normalizer
        )
        loss.backward()
        acc["loss"] += float(loss.detach())
        acc["units"] += st["count"]
        acc["clipped"] += st["clip_frac"] * st["count"]
        acc["ratio_max"] = max(acc["ratio_max"], st["ratio_max"])
        acc["kl"] += st.get("kl", 0.0) * st["count"]
        acc["distill_kl"] += st.get("distill_kl", 0.0) * st["count"]
        acc["tokens"] += sum(len(s.episode.token_ids) for s in chunk)
    return acc


def takes_part(sample: Scored, algo: AlgoConfig) -> bool:
    """Whether an episode enters the loss passes: its advantage moves the loss, or a KL
    term or the teacher gives every token a signal; and a correction left it a token."""
    if sample.correction is not None and not bool(sample.correction.keep_T.any()):
        return False
    return moves(sample.advantage) or algo.kl_coef > 0 or algo.distills


def policy_loss(
    algo: AlgoConfig,
    logp_BK: torch.Tensor,
    old_BK: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BK: torch.Tensor,
    ref_BK: torch.Tensor | None,
    teacher_BK: torch.Tensor | None,
    normalizer: Normalizer,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`algo.name`'s loss with its clip range and KL term; on-policy distillation's as the
    loss (`opd`) or added to it (`algo.distill_coef`, at opd's own clip range)."""
    if algo.name == "opd":
        low, high = algo.eps_low, algo.eps_high
        return opd_loss(logp_BK, old_BK, teacher_BK, mask_BK,
                        eps_low=low, eps_high=high, normalizer=normalizer)  # fmt: skip
    loss, stats = LOSSES[algo.name](
        logp_BK, old_BK, adv_B, mask_BK,
        eps_low=algo.eps_low, eps_high=algo.eps_high,
        ref_logp_BT=ref_BK, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        normalizer=normalizer,
    )  # fmt: skip
    if algo.distill_coef > 0:
        low, high = DEFAULT_CLIP["opd"]
        distill, distill_stats = opd_loss(
            logp_BK, old_BK, teacher_BK, mask_BK, eps_low=low, eps_high=high, normalizer=normalizer
        )
        loss = loss + algo.distill_coef * distill
        stats["distill_kl"] = distill_stats["distill_kl"]
    return loss, stats


def _padded(
    chunk: list[Scored], name: str, mask_BK: torch.Tensor, like_BK: torch.Tensor
) -> torch.Tensor:
    """Per-episode logprobs (`Scored.ref`, `.teacher`) laid out at the mask's positions."""
    out_BK = torch.zeros_like(like_BK).detach()
    out_BK[mask_BK] = torch.cat([getattr(s, name) for s in chunk]).to(out_BK)
    return out_BK


def optimizer_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    train: TrainConfig,
    acc: dict[str, Any],
    out: dict[str, Any],
    dist: Dist,
) -> torch.Tensor | None:
    """One minibatch's gradient summed over ranks, clipped and applied; `acc` becomes the
    whole minibatch's, `out` counts the step. Returns the gradient norm, or None when
    nothing was applied: no token to learn from, or a NaN/inf loss or gradient (the step
    is skipped, weights and optimizer state untouched)."""
    dist.sum_gradients(policy.trainable_parameters())  # sharded: FSDP2 reduced them
    keys = ("loss", "units", "clipped", "kl", "distill_kl", "tokens")
    acc.update(zip(keys, dist.all_reduce([acc[k] for k in keys])))
    acc["ratio_max"] = dist.all_reduce([acc["ratio_max"]], op="max")[0]
    if not acc["tokens"]:
        return None  # every advantage was 0: nothing to learn from this minibatch
    out["tokens"] += int(acc["tokens"])
    out["ratio_max"] = max(out["ratio_max"], acc["ratio_max"])
    norm = clip_gradients(policy.trainable_parameters(), train.max_grad_norm)
    if not (np.isfinite(acc["loss"]) and torch.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)  # skip: weights and optimizer untouched
        out["skipped"] += 1
        return None
    optimizer.step()
    out["updated"] += 1
    return norm


def advantage_tensor(advantages: list[Advantage]) -> torch.Tensor:
    """[B] float32 for one advantage per episode; [B, K] for per-turn ones (K = the most
    turns, shorter rows padded with 0: a turn past the graded ones moves nothing)."""
    if not any(isinstance(a, tuple) for a in advantages):
        return torch.tensor(advantages, dtype=torch.float32)
    rows = [a if isinstance(a, tuple) else (a,) for a in advantages]
    k = max(len(row) for row in rows)
    return torch.tensor([list(row) + [0.0] * (k - len(row)) for row in rows], dtype=torch.float32)


def _gathered_router_metrics(load: RouterLoad, dist: Dist) -> dict[str, float]:
    """`routing.router_metrics` of the expert counts summed over all ranks."""
    counts_LE = load.counts_LE
    if counts_LE is None:  # this rank had no tokens: zeros of the right shape
        experts = int(next(iter(load.routers.values())).weight.shape[0])
        counts_LE = torch.zeros(len(load.routers), experts, dtype=torch.float64)
    summed = dist.all_reduce(counts_LE.reshape(-1).tolist())
    return router_metrics(torch.tensor(summed, dtype=torch.float64).reshape(counts_LE.shape))


def task_units(batch: list[Scored]) -> list[list[Scored]]:
    """The batch's members by task, in order of first appearance: one group, or the groups
    of a task drawn twice in a step, which then share a minibatch and one prompt pass."""
    by_task: dict[str, list[Scored]] = {}
    for sample in batch:
        by_task.setdefault(sample.episode.task.id, []).append(sample)
    return list(by_task.values())
