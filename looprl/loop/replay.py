"""Replay: a run's training steps on another run's saved rollouts, without sampling.

With `logging.save_rollouts: true` a run writes each step's groups (every episode: its
tokens, loss mask, sampling logprobs, rewards, outcome, turns) to
`RUN/rollouts/step_NNNNNN.pkl.gz`. A run with `train.replay: RUN` (`looprl run --replay
RUN`) takes its steps' groups from there instead of playing them, and scores them again
under its own config (advantages, dynamic sampling, decision views): an A/B of losses,
learning rates or levers on the same data, which sampling noise otherwise blurs. The
held-out evals are played as in any run. Replaying with nothing changed gives the run
that saved the rollouts.

The files are Python pickles (gzip-compressed): replay only run folders you trust, as you
would only load a checkpoint you trust.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import replace
from pathlib import Path

import yaml

from looprl.config import Config
from looprl.errors import ConfigError
from looprl.loop.groups import Group

# what the saved episodes' token ids depend on: a replay must read them with the same
MUST_MATCH = ("model.name", "model.chat_template", "model.tool_format", "model.tool_prompt")


def rollout_path(run_dir: Path, step: int) -> Path:
    return run_dir / "rollouts" / f"step_{step:06d}.pkl.gz"


def save_rollouts(run_dir: Path, step: int, groups: list[Group]) -> None:
    """Step `step`'s groups, without their decision views (a replay builds its own)."""
    path = rollout_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as f:
        pickle.dump([replace(g, views=None) for g in groups], f, protocol=5)
    tmp.replace(path)


def load_rollouts(source: Path, step: int) -> list[Group]:
    with gzip.open(rollout_path(source, step), "rb") as f:
        return pickle.load(f)  # noqa: S301 -- a run folder the user named (module doc)


def check_replay(cfg: Config) -> None:
    """`train.replay`'s run folder holds rollouts for every step this run takes, saved
    with the same model and chat format; a clear error before anything loads otherwise."""
    if cfg.train.replay is None:
        return
    source = Path(cfg.train.replay)
    if not (source / "config.yaml").is_file():
        raise ConfigError(f"train.replay={source}: not a run folder (no config.yaml)")
    missing = [s for s in range(1, cfg.train.steps + 1) if not rollout_path(source, s).exists()]
    if missing:
        saved = len(list((source / "rollouts").glob("step_*.pkl.gz")))
        raise ConfigError(
            f"train.replay={source}: no saved rollouts for step {missing[0]} ({saved} steps "
            f"saved in {source / 'rollouts'}; a run saves them with "
            f"logging.save_rollouts=true); set train.steps={saved} or fewer"
        )
    theirs = yaml.safe_load((source / "config.yaml").read_text()) or {}
    ours = cfg.model_dump(mode="json")
    for key in MUST_MATCH:
        a, b = _get(ours, key), _get(theirs, key)
        if a != b:
            raise ConfigError(
                f"train.replay={source}: its rollouts were tokenized with {key}={b!r}, this "
                f"run has {key}={a!r}; set {key} to match (token ids differ between them)"
            )


def _get(tree: dict, dotted: str) -> object:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree
