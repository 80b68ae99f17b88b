"""The trainer's scoring pass with and without sequence packing, side by side.

    .venv/bin/python bench/speed/packing.py [--env tictactoe-game] [--tasks 8] [--group 8] \
        [--repeats 3]

Plays one rollout batch of the env with the default `looprl run` policy (SmolLM2-135M
float32 with its LoRA adapters, the run's sampling settings and engine), splits it into
the run's minibatches (whole groups) and micro-batches (`train.micro_batch_tokens`), and
times what the GSPO update does to each micro-batch: the forward pass that scores the
episodes' tokens (`policy.sequence_logprobs`) and its backward pass.

- **packed**: the episodes' suffixes (everything after the prompt) run as one row of
  their real tokens; only attention sees them padded;
- **padded**: the same call with `pack=False`: suffixes right-padded to the longest.

Prints the padding share of the suffix positions, seconds per update pass over the batch
(median of the repeats, the two interleaved), the positions the model's body ran (prompt
passes included), the largest logprob difference between the two, and ends with

    RESULT pack_speedup=X packed_s=Y padded_s=Z pad_share=W
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from looprl.config import load_config
from looprl.engine import SamplingParams
from looprl.envs import make_env
from looprl.forward.score import micro_batches, prompt_length, sequence_logprobs
from looprl.loop.batches import minibatches, scoring_keys
from looprl.loop.play import player
from looprl.loop.policy import load_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, median, result_line


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--env", default="tictactoe-game")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config(overrides=[f"env.name={args.env}"])
    policy = load_policy(cfg)
    probe = make_env(cfg.env.name, cfg.env.args)
    tasks = [t for t in probe.tasks("train", n=args.tasks, seed=5) for _ in range(args.group)]
    params = SamplingParams(
        temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens, seed=3
    )
    start = time.perf_counter()
    episodes = player(cfg, policy, probe)(tasks, params=params)
    rollout_s = time.perf_counter() - start
    by_task: dict[str, list] = {}  # whole groups go to one minibatch, as in the update
    for episode in episodes:
        by_task.setdefault(episode.task.id, []).append(episode)
    chunks = [
        [minibatch[i] for i in indices]
        for minibatch in minibatches(list(by_task.values()), cfg.algo.num_minibatches, seed=0)
        for indices in micro_batches(*scoring_keys(minibatch), cfg.train.micro_batch_tokens)
    ]
    real = padded = 0
    for chunk in chunks:
        suffixes = [len(e.token_ids) - prompt_length(e.loss_mask) for e in chunk]
        real += sum(suffixes)
        padded += len(suffixes) * max(suffixes)
    model = policy.model
    model.train()
    cpu = policy.device
    ran = [0]  # positions the model's body ran (prompt passes included)
    policy.model.get_base_model().model.register_forward_hook(
        lambda m, a, kw, out: ran.__setitem__(0, ran[0] + kw["input_ids"].numel()),
        with_kwargs=True,
    )

    def update_pass(pack: bool) -> tuple[float, list[torch.Tensor]]:
        scores = []
        ran[0] = 0
        begin = time.perf_counter()
        for chunk in chunks:
            logp, mask = sequence_logprobs(
                model, [e.token_ids for e in chunk], [e.loss_mask for e in chunk],
                policy.engine.pad_id, cpu, cfg.rollout.temperature, pack=pack,
            )  # fmt: skip
            (logp * mask).sum().backward()
            scores.append(logp[mask].detach())
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - begin, scores

    update_pass(True)  # warm-up
    times: dict[str, list[float]] = {"packed": [], "padded": []}
    positions: dict[str, int] = {}
    gap = 0.0
    for _ in range(args.repeats):
        seconds, ours = update_pass(True)
        times["packed"].append(seconds)
        positions["packed"] = ran[0]
        seconds, theirs = update_pass(False)
        times["padded"].append(seconds)
        positions["padded"] = ran[0]
        gap = max(gap, max((a - b).abs().max().item() for a, b in zip(ours, theirs)))
    turns = sum(len(e.turns) for e in episodes)
    print(
        f"{args.env}: {len(episodes)} episodes, {turns} model turns (rollout {rollout_s:.0f} s); "
        f"{len(chunks)} micro-batches; {torch.get_num_threads()} threads"
    )
    share = 1 - real / padded
    print(f"suffix positions: {real} real of {padded} padded ({share:.1%} padding)")
    print(f"{'':>7} {'seconds':>8} {'positions run':>14}")
    for name, values in times.items():
        print(f"{name:>7} {median(values):>8.2f} {positions[name]:>14}")
    print(f"largest |logprob difference|: {gap:.2e}")
    a, b = median(times["packed"]), median(times["padded"])
    print(result_line({"pack_speedup": f"{b / a:.2f}", "packed_s": f"{a:.2f}",
                       "padded_s": f"{b:.2f}", "pad_share": f"{share:.3f}"}))  # fmt: skip


if __name__ == "__main__":
    main()
