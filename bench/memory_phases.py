"""`looprl` with its resident set sampled by phase: run as `python bench/memory_phases.py
OUT.json run --set ...` (bench/memory.py --phases does). A thread reads /proc/self/statm
every 3 ms and keeps the peak of each phase: `other` (loading the model, checkpoints,
the report: anything outside the phases below), `eval` (baseline and final eval),
`rollout` (training rollouts), `update.logprobs` (the update's forward passes: old
logprobs and the loss's forward) and `update.backward`. Writes {phase: peak GB} to
OUT.json when the run ends."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import looprl.loop.train as train
import looprl.loop.update as update
from looprl.cli import main

PAGE = os.sysconf("SC_PAGE_SIZE")
state: dict[str, Any] = {"phase": "other", "peak": {}}


def sample() -> None:
    with open("/proc/self/statm") as statm:
        while True:
            statm.seek(0)
            rss = int(statm.read().split()[1]) * PAGE / 1e9
            phase = state["phase"]
            state["peak"][phase] = max(rss, state["peak"].get(phase, 0.0))
            time.sleep(0.003)


def labelled(fn: Callable, phase: str, only_from: tuple[str, ...] | None = None) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        previous = state["phase"]
        if only_from is None or previous in only_from:
            state["phase"] = phase
        try:
            return fn(*args, **kwargs)
        finally:
            state["phase"] = previous

    return run


def player(*args: Any, **kwargs: Any) -> Callable:
    return labelled(real_player(*args, **kwargs), "rollout", only_from=("other",))


real_player = train.player
train.player = player
train.evaluate = labelled(train.evaluate, "eval")
update.sequence_logprobs = labelled(update.sequence_logprobs, "update.logprobs")
torch.Tensor.backward = labelled(torch.Tensor.backward, "update.backward")

if __name__ == "__main__":
    out = sys.argv[1]
    threading.Thread(target=sample, daemon=True).start()
    sys.argv = ["looprl", *sys.argv[2:]]
    try:
        main()
    finally:
        peaks = {k: round(v, 2) for k, v in state["peak"].items()}
        with open(out, "w") as f:
            json.dump(peaks, f)
