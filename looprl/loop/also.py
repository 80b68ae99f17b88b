"""`eval.also`: other environments evaluated before and after training, so the report can
say whether training changed anything besides the env it trained on ("did anything else
change?").

Each entry plays `tasks` held-out tasks of its own env, drawn with `eval.seed` as the main
eval draws its own, each `eval.samples_per_task` times with the eval sampling settings
(temperature, top-p/k, seed): the same episodes before and after, so the two are paired.
Its results are RUN/eval/also/KEY/{baseline,final}.json (the EvalResult of
loop/evaluate.py) and its transcripts RUN/samples/also/KEY/{baseline,final}.jsonl. A
resumed run reads a baseline already there back instead of playing it again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looprl.config import AlsoEval, Config, EnvConfig
from looprl.envs import make_env
from looprl.errors import ConfigError
from looprl.loop import log
from looprl.loop.dist import main_only
from looprl.loop.evaluate import check_some_scored, play_eval
from looprl.loop.play import Player, player
from looprl.loop.policy import Policy
from looprl.loop.preflight import check_reply_room
from looprl.loop.progress import DONE, Progress
from looprl.types import Task


def also_config(cfg: Config, entry: AlsoEval) -> Config:
    """The run's config with the entry's env and its number of tasks: what the entry's
    eval reads (its sampling settings and seed are the main eval's)."""
    env = EnvConfig(name=entry.name, args=entry.args)
    evals = cfg.eval.model_copy(update={"tasks": entry.tasks, "also": [], "references": []})
    return cfg.model_copy(update={"env": env, "eval": evals})


def also_dir(run_dir: Path, key: str) -> Path:
    return run_dir / "eval" / "also" / key


def check_also(cfg: Config) -> None:
    """Each eval.also env made and one of its held-out tasks reset without the model,
    before anything is written: a ConfigError naming the entry otherwise (an unknown
    name gets the registry's suggestion)."""
    for i, entry in enumerate(cfg.eval.also):
        where = f"eval.also[{i}] ({entry.key})"
        try:
            probe = make_env(entry.name, entry.args)
            tasks = probe.tasks("eval", n=1, seed=cfg.eval.seed)
        except Exception as err:
            raise ConfigError(f"{where}: {err}") from None
        if not tasks:
            raise ConfigError(f"{where}: environment {entry.name!r} has no eval tasks")


def check_also_room(cfg: Config, renderer: Any) -> None:
    """Each eval.also env's demonstrated replies fit `rollout.max_new_tokens`, which its
    episodes share with the run's (loop/preflight.py `check_reply_room`): a ConfigError
    naming the entry, once the tokenizer is there and still before anything is written."""
    for i, entry in enumerate(cfg.eval.also):
        try:
            check_reply_room(also_config(cfg, entry), make_env(entry.name, entry.args), renderer)
        except ConfigError as err:
            raise ConfigError(f"eval.also[{i}] ({entry.key}): {err}") from None


@dataclass
class AlsoEntry:
    """One eval.also entry, ready to play: its config, player and fixed tasks."""

    entry: AlsoEval
    cfg: Config
    play: Player
    tasks: list[Task]


@dataclass
class AlsoEvals:
    """A run's eval.also evals (module doc): `run("baseline")` before training,
    `run("final")` after it."""

    policy: Policy
    run_dir: Path
    progress: Progress
    entries: list[AlsoEntry]

    @classmethod
    def of(cls, cfg: Config, policy: Policy, run_dir: Path, progress: Progress) -> AlsoEvals:
        entries = []
        for entry in cfg.eval.also:
            own = also_config(cfg, entry)
            probe = make_env(entry.name, entry.args)
            tasks = probe.tasks("eval", n=entry.tasks, seed=cfg.eval.seed)
            entries.append(AlsoEntry(entry, own, player(own, policy, probe), tasks))
        return cls(policy, run_dir, progress, entries)

    def run(self, name: str) -> dict[str, dict]:
        """Each entry's eval NAME (baseline or final), by key: played and written, or, for
        a baseline, read back from the run folder when a resumed run has it already."""
        results = {}
        for one in self.entries:
            key = one.entry.key
            path = also_dir(self.run_dir, key) / f"{name}.json"
            if name == "baseline" and path.is_file():
                results[key] = json.loads(path.read_text())
                self.progress.note(f"{DONE} eval.also {key} baseline: kept from {path}")
                continue
            title = f"eval.also {key}: {name}"
            result, episodes = play_eval(
                self.policy, one.play, one.tasks, one.cfg, title, self.progress
            )
            main_only(write_also)(self.run_dir, key, name, result, episodes)
            transcripts = self.run_dir / "samples" / "also" / key / f"{name}.jsonl"
            check_some_scored(episodes, title, transcripts)
            results[key] = result
        return results


def write_also(run_dir: Path, key: str, name: str, result: dict, episodes: list) -> None:
    """eval/also/KEY/NAME.json and samples/also/KEY/NAME.jsonl (rewritten, not appended
    to: a resumed run's final eval replaces an interrupted one's)."""
    folder = also_dir(run_dir, key)
    folder.mkdir(parents=True, exist_ok=True)
    samples = run_dir / "samples" / "also" / key / f"{name}.jsonl"
    samples.unlink(missing_ok=True)
    log.write_samples(samples, episodes)
    (folder / f"{name}.json").write_text(json.dumps(result, indent=2))
