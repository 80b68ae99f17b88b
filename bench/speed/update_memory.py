"""The update phase's memory alone: live tensors against the resident set.

    .venv/bin/python bench/speed/update_memory.py [--profile] [--trim] [--response N] \
        [KEY=VALUE ...]

Loads the policy of the config (`KEY=VALUE` overrides, as `--set`), builds one step's
episodes of the workload's shape without sampling (each task's real prompt and N random
generated tokens, advantages ±1 so every episode learns), and runs `update_policy` on
them: the old-logprob pass, then `algo.num_minibatches` optimizer steps over
micro-batches of `train.micro_batch_tokens`. A thread reads /proc/self/statm every 2 ms
and keeps the peak resident set of the model's forward passes (marked by forward hooks on
the model, not by patching looprl), the rest of the update (backward passes and optimizer
steps) and the whole update. With `--profile` the update runs under torch's profiler with
`profile_memory`, and the peak of the live tensor bytes it reports ("Total Allocated")
is printed beside the resident peak: the difference is memory the allocator holds that
no tensor uses. `--trim` returns freed heap pages (`malloc_trim`) before every forward
pass (a forward pre-hook), to see how much of that difference the freed blocks of
earlier micro-batches are.
Setting glibc's `MALLOC_MMAP_THRESHOLD_` or `MALLOC_ARENA_MAX` in the environment shows
the share of its dynamic mmap threshold and of its per-thread arenas. Ends with

    RESULT update_rss_gb=X update_live_gb=Y after_gb=Z

(`update_live_gb` only with `--profile`; GB of 10^9 bytes; `after_gb` is the resident
set after the update and its trim: what every phase holds), and `update_s` and
`update_cpu_s`: the update's wall-clock and the process's CPU seconds in it (on a shared
machine, compare CPU seconds with `torch` at one thread, `OMP_NUM_THREADS=1`). `--fresh`
runs it as a training step does on episodes its `hf` engine just sampled: their
logprobs stand in for the old-logprob pass (loop/update.py); the built episodes' logprobs
are not the policy's, so only its time and memory mean anything then.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from looprl.config import load_config
from looprl.envs import make_env
from looprl.loop.groups import Group
from looprl.loop.optim import make_optimizer
from looprl.loop.policy import load_policy
from looprl.loop.update import UpdateState, update_policy
from looprl.model.memory import release_free_memory
from looprl.types import Episode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, result_line

PAGE = os.sysconf("SC_PAGE_SIZE")
state: dict[str, Any] = {"phase": "load", "peak": {}}


def rss_gb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / 1e9


def sample() -> None:
    while True:
        rss, phase = rss_gb(), state["phase"]
        state["peak"][phase] = max(rss, state["peak"].get(phase, 0.0))
        time.sleep(0.002)


def label_forward_passes(model: Any, trim: bool) -> None:
    """Forward hooks on the model: the phase is "forward" while it runs, and back to
    "update" after; with `trim`, freed heap pages are returned before each pass."""

    def before(*_: Any) -> None:
        if trim:
            release_free_memory()
        state["phase"] = "forward"

    def after(*_: Any) -> None:
        state["phase"] = "update"

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def episodes(cfg: Any, policy: Any, response: int) -> list[Group]:
    """One group a task, every member learning (advantages ±1)."""
    env = make_env(cfg.env.name, cfg.env.args)
    rng = random.Random(0)
    groups = []
    for task in env.tasks("train", n=cfg.rollout.tasks_per_step, seed=0):
        obs = env.reset(task)
        ids = policy.renderer.prompt_ids(obs.messages, obs.tools)
        group = Group(task, [])
        for g in range(cfg.rollout.group_size):
            generated = [rng.randrange(100, len(policy.tokenizer) - 1) for _ in range(response)]
            episode = Episode(task=task, messages=[], token_ids=ids + generated,
                              loss_mask=[0] * len(ids) + [1] * response,
                              logprobs=[0.0] * len(ids) + [-1.0] * response)  # fmt: skip
            group.episodes.append(episode)
            group.advantages.append(1.0 if g % 2 else -1.0)
        groups.append(group)
    return groups


def live_peak_gb(trace: Path) -> float:
    events = json.loads(trace.read_text())["traceEvents"]
    return (
        max(e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]")
        / 1e9
    )


def main() -> None:
    args = arguments(__doc__)
    args.add_argument("overrides", nargs="*", help="config KEY=VALUE, as --set")
    args.add_argument("--profile", action="store_true", help="live tensor bytes too")
    args.add_argument("--trim", action="store_true", help="malloc_trim before each forward")
    args.add_argument("--response", type=int, default=32, help="generated tokens per episode")
    args.add_argument("--fresh", action="store_true", help="the engine's logprobs as old ones")
    args = args.parse_args()
    cfg = load_config(None, args.overrides)
    threading.Thread(target=sample, daemon=True).start()
    policy = load_policy(cfg)
    batch = episodes(cfg, policy, args.response)
    optimizer = make_optimizer(policy.trainable_parameters(), cfg.train.optimizer, 1e-6, 0.0)
    label_forward_passes(policy.model, args.trim)
    release_free_memory()
    before = rss_gb()

    def run() -> None:
        update_policy(
            policy, optimizer, batch, cfg.algo, cfg.train, group_size=cfg.rollout.group_size,
            max_tokens=args.response, seed=0,
            state=UpdateState(cfg.train.micro_batch_tokens), fresh=args.fresh,
        )  # fmt: skip

    state["phase"] = "update"
    live = None
    wall, cpu = time.perf_counter(), time.process_time()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        trace = Path(tempfile.mkdtemp(prefix="update-memory-")) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        prof.export_chrome_trace(str(trace))
        live = live_peak_gb(trace)
    else:
        run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    state["phase"] = "after"
    time.sleep(0.05)
    after = rss_gb()
    peaks = state["peak"]
    top = max(peaks.get(k, 0.0) for k in ("update", "forward"))
    count = sum(len(g.episodes) for g in batch)
    print(f"{count} episodes; resident before the update {before:.3f} GB, after {after:.3f}")
    print(
        "peak resident set by phase (GB): " + json.dumps({k: round(v, 3) for k, v in peaks.items()})
    )
    live_field = {"update_live_gb": f"{live:.3f}"} if live is not None else {}
    print(result_line({"update_rss_gb": f"{top:.3f}", **live_field, "after_gb": f"{after:.3f}",
                       "update_s": f"{wall:.2f}", "update_cpu_s": f"{cpu:.2f}"}))  # fmt: skip


if __name__ == "__main__":
    main()
