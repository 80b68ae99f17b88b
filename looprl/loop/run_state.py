"""What outlives one step of a run: the run folder (checked before anything is loaded
or written), the counters saved with each checkpoint, resuming from the newest
checkpoint, and stopping cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.errors import ConfigError, LoopRLError
from looprl.loop.batches import UpdateState
from looprl.loop.checkpoint import list_checkpoints, load_training_state, load_weights
from looprl.loop.dist import main_only
from looprl.loop.policy import Policy


@dataclass
class LoopState:
    """Counters that outlive a step, saved with each checkpoint."""

    update: UpdateState
    env_errors: int = 0
    bad_steps: int = 0
    # the curriculum's recent groups per task id (loop/groups.py); empty when it is off
    curriculum: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        return {
            "env_errors": self.env_errors,
            "bad_steps": self.bad_steps,
            "micro_batch_tokens": self.update.micro_batch_tokens,
            "curriculum": self.curriculum,
        }

    def load_meta(self, meta: dict[str, Any]) -> None:
        self.env_errors = int(meta.get("env_errors", 0))
        self.bad_steps = int(meta.get("bad_steps", 0))
        self.update.micro_batch_tokens = int(
            meta.get("micro_batch_tokens", self.update.micro_batch_tokens)
        )
        self.curriculum = {
            str(task): [[float(x) for x in group] for group in groups]
            for task, groups in (meta.get("curriculum") or {}).items()
        }


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


def resume_state(
    run_dir: Path, policy: Policy, optimizer: Any, scheduler: Any, loop: LoopState
) -> int:
    """Load the newest checkpoint; drop metrics logged after it. Returns its step.

    A checkpoint holds whole trainable weights and optimizer state, or each rank's
    shards of them (train.shard_checkpoint=sharded), resharded as they are read: a run
    resumes at any number of processes."""
    found = list_checkpoints(run_dir)
    if not found:
        return 0
    meta = load_weights(policy.model, found[-1])
    if meta.get("stage") == "sft":  # only the warm-started weights: RL starts afresh
        return 0
    load_training_state(found[-1], policy.model, optimizer, scheduler)
    loop.load_meta(meta)
    step = int(meta["step"])
    main_only(trim_steps)(run_dir / "metrics.jsonl", step)
    return step


def trim_steps(path: Path, step: int) -> None:
    """Drop the rows of a JSON-lines file logged after `step` (a resumed run logs them
    again): the step metrics, the eval curve."""
    if path.exists():
        kept = [
            line
            for line in path.read_text().splitlines()
            if line and json.loads(line)["step"] <= step
        ]
        path.write_text("".join(line + "\n" for line in kept))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
