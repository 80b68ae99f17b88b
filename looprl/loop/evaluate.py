"""Evaluation on fixed held-out tasks: the same tasks, seeds and sampling before and
after training, so the before/after comparison is paired. `HeldOut`, a run's held-out
evals, and `run_eval`, `looprl eval`. Episodes are played by loop/play.py's `player` and
summarised by loop/summary.py, as the training step does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looprl.config import Config
from looprl.engine import SamplingParams
from looprl.envs import Environment, make_env, solved_outcomes
from looprl.errors import ConfigError, EnvError
from looprl.loop import dist as ranks
from looprl.loop import log, preflight
from looprl.loop.checkpoint import has_weights, load_weights
from looprl.loop.dist import main_only
from looprl.loop.play import Player, distinct_tasks, player
from looprl.loop.policy import Policy, load_model
from looprl.loop.progress import DONE, Progress
from looprl.loop.summary import summarize
from looprl.report.stats import reward_with_ci
from looprl.types import ENV_ERROR, TRUNCATED, Episode, Task


def eval_result(
    episodes: list[Episode],
    env: str,
    model: str,
    task_seed: int,
    temperature: float | None = None,
    solved: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The EvalResult JSON object of the run-folder contract, with per-episode `rewards`,
    `task_ids` and `episode_outcomes` (for paired comparisons), the eval `temperature` and
    the env's `solved_outcomes` (labels that count as solved; [] when it declares none)."""
    stats = summarize(episodes)
    return {
        "env": env,
        "model": model,
        "n": stats["n"],
        "reward_mean": stats["reward_mean"],
        "reward_ci95": stats["reward_ci95"],
        "valid_tool_call_rate": stats["valid_tool_call_rate"],
        "response_len": stats["response_len"],
        "outcomes": stats["outcomes"],
        "task_seed": task_seed,
        "rewards": [e.reward for e in episodes],
        "task_ids": [e.task.id for e in episodes],
        "episode_outcomes": [e.outcome for e in episodes],
        "temperature": temperature,
        "solved_outcomes": list(solved),
        **({"scores": stats["scores"]} if stats["scores"] else {}),
        **({"judge": stats["judge"]} if stats["judge"] else {}),
    }


EVAL_TITLES = {
    "baseline": "baseline eval",
    "after_sft": "eval after SFT",
    "final": "final eval",
    "baseline_greedy": "greedy baseline eval",
    "final_greedy": "greedy final eval",
    "after_sft_greedy": "greedy eval after SFT",
    "teacher": "teacher eval (algo.teacher)",
}
GREEDY_SUFFIX = "_greedy"  # eval/NAME_greedy.json: the same tasks at T = 0, one episode each


def evaluate(
    policy: Policy,
    play: Player,
    tasks: list,
    cfg: Config,
    run_dir: Path | None,
    name: str,
    progress: Progress | None = None,
    greedy: bool = False,
) -> dict:
    """Play the eval tasks with the eval sampling settings; write eval/NAME.json and
    samples/NAME.jsonl when there is a run folder. With `greedy`, at T = 0 and one
    episode per distinct task (another episode of the same task would be the same one,
    and would only narrow the interval)."""
    result, episodes = play_eval(policy, play, tasks, cfg, name, progress, greedy)
    transcripts = None
    if run_dir is not None:
        main_only(write_eval)(run_dir, name, result, episodes)
        transcripts = run_dir / "samples" / f"{name}.jsonl"
    check_some_scored(episodes, EVAL_TITLES.get(name, name), transcripts)
    return result


def play_eval(
    policy: Policy,
    play: Player,
    tasks: list,
    cfg: Config,
    name: str,
    progress: Progress | None = None,
    greedy: bool = False,
) -> tuple[dict, list[Episode]]:
    """`evaluate`'s episodes and their EvalResult, written nowhere."""
    temperature = 0.0 if greedy else cfg.eval.temperature
    params = SamplingParams(
        temperature=temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.eval.seed,
    )
    if greedy:
        repeated = distinct_tasks(tasks)
    else:
        repeated = [t for t in tasks for _ in range(cfg.eval.samples_per_task)]
    dist = ranks.current()  # each rank plays its share; every rank then has them all
    mine = dist.share(range(len(repeated)))
    title = EVAL_TITLES.get(name, name)
    shown = progress or Progress(quiet=True)
    with shown.phase(title, len(mine), "episode", concurrent=True) as phase:
        episodes = dist.gather(
            play(
                [repeated[i] for i in mine],
                params=params,
                on_progress=phase.update,
                first_index=mine[0] if mine else 0,
            )
        )
        solved = solved_outcomes(make_env(cfg.env.name, cfg.env.args))
        result = eval_result(
            episodes, cfg.env.name, cfg.model.name, cfg.eval.seed, temperature, solved
        )
        cut = result["episode_outcomes"].count(TRUNCATED)
        # a text task's replies never try a call: its call rate says nothing
        tried = any(
            m.tool_calls or m.parse_failure
            for e in episodes
            for m in e.messages
            if m.role == "assistant"
        )
        calls = f" · valid calls {result['valid_tool_call_rate']:.0%}" if tried else ""
        phase.done(
            f"reward {reward_with_ci(result)}{calls} · {result['n']} episodes"
            + (f" · {cut} truncated at the token limit" if cut else "")
        )
    return result, episodes


@dataclass
class HeldOut:
    """A run's held-out evals: the same tasks and sampling seeds before training, after the
    SFT and after training, so that every comparison is paired; with `eval.greedy`, each
    also greedily (T = 0, one episode per task) on `greedy_tasks`. An eval already in the
    run folder (a resumed run) is read back, not played again."""

    cfg: Config
    policy: Policy
    play: Player
    run_dir: Path
    progress: Progress
    tasks: list[Task]
    greedy_tasks: list[Task]

    @classmethod
    def of(
        cls,
        cfg: Config,
        policy: Policy,
        play: Player,
        probe: Environment,
        run_dir: Path,
        progress: Progress,
    ) -> HeldOut:
        tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
        greedy_tasks = greedy_eval_tasks(probe, cfg, tasks)
        kept = cls.read(run_dir, "baseline" + GREEDY_SUFFIX)
        if kept is not None:  # resumed: the tasks it played, whatever the settings
            greedy_tasks = kept_tasks(kept, greedy_tasks, tasks)
        return cls(cfg, policy, play, run_dir, progress, tasks, greedy_tasks)

    @staticmethod
    def read(run_dir: Path, name: str) -> dict | None:
        """eval/NAME.json of the run folder, if it is there."""
        path = run_dir / "eval" / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def run(self, name: str, greedy: bool = False) -> dict:
        """Play eval NAME (NAME_greedy with `greedy`) and write it to the run folder."""
        tasks = self.greedy_tasks if greedy else self.tasks
        return evaluate(
            self.policy,
            self.play,
            tasks,
            self.cfg,
            self.run_dir,
            name + (GREEDY_SUFFIX if greedy else ""),
            self.progress,
            greedy=greedy,
        )

    def kept_or_run(self, name: str, greedy: bool = False) -> dict:
        """The eval kept in the run folder, or played now."""
        kept = self.read(self.run_dir, name + (GREEDY_SUFFIX if greedy else ""))
        return kept if kept is not None else self.run(name, greedy)


def check_some_scored(episodes: list[Episode], title: str, transcripts: Path | None) -> None:
    """An eval whose every episode ended in `env_error` measured nothing: a failure, never
    a reward of 0 (its tracebacks are in `transcripts`, when they were written)."""
    if not episodes or any(e.outcome != ENV_ERROR for e in episodes):
        return
    where = f"; every traceback is in {transcripts}" if transcripts else ""
    last = (episodes[0].error or "").strip().splitlines()[-1:] or ["(no traceback)"]
    raise EnvError(
        f"the {title} measured nothing: all {len(episodes)} episodes ended in env_error "
        f"(the environment raised){where}. The first: {last[0]}"
    )


def greedy_eval_tasks(env: Environment, cfg: Config, eval_tasks: list) -> list:
    """The greedy eval's distinct tasks: `eval.greedy_count` of them, the sampled eval's
    own tasks first, then more held-out tasks drawn with `eval.seed`; at most the env's
    whole held-out set."""
    n = cfg.eval.greedy_count
    own = distinct_tasks(eval_tasks)
    if n <= len(own):
        return own[:n]
    return distinct_tasks(own + env.tasks("eval", n=n, seed=cfg.eval.seed))[:n]


def kept_tasks(kept: dict, tasks: list, candidates: list) -> list:
    """The tasks an eval kept in the run folder played, in its order, found among `tasks`
    and `candidates` (a run resumed under other eval settings retests the same tasks);
    `tasks` when one of its ids is not there."""
    pool = {t.id: t for t in [*tasks, *candidates]}
    ids = list(dict.fromkeys(kept.get("task_ids") or []))
    if not ids or any(i not in pool for i in ids):
        return tasks
    return [pool[i] for i in ids]


def write_eval(run_dir: Path, name: str, result: dict, episodes: list) -> None:
    (run_dir / "eval").mkdir(parents=True, exist_ok=True)
    (run_dir / "eval" / f"{name}.json").write_text(json.dumps(result, indent=2))
    log.write_samples(run_dir / "samples" / f"{name}.jsonl", episodes)


def run_eval(
    cfg: Config,
    checkpoint: Path | None = None,
    out: Path | None = None,
    progress: Progress | None = None,
) -> dict:
    """`looprl eval`: evaluate a model, or a run's checkpoint, on the held-out tasks; with
    `out`, write the EvalResult there and its episodes to `episodes_path(out)`."""
    progress = progress or Progress()
    if checkpoint is not None and not has_weights(checkpoint):
        raise ConfigError(f"{checkpoint} is not a looprl checkpoint folder")
    if out is not None and out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file, e.g. --out {out / 'eval.json'}")
    probe = make_env(cfg.env.name, cfg.env.args)
    preflight.check_env(cfg, probe)
    policy = load_model(cfg, progress)
    preflight.check_reply_room(cfg, probe, policy.renderer)
    if checkpoint is not None:
        load_weights(policy.model, checkpoint)
        progress.note(f"{DONE} weights from {checkpoint}")
    play = player(cfg, policy, probe)
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    result, episodes = play_eval(policy, play, tasks, cfg, "eval", progress)
    transcripts = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        transcripts = episodes_path(out)
        write_episodes(transcripts, episodes)
    check_some_scored(episodes, "eval", transcripts)
    return result


def episodes_path(out: Path) -> Path:
    """Where `looprl eval --out F.json` keeps its transcripts: F.episodes.jsonl."""
    return out.with_suffix(".episodes.jsonl")


def write_episodes(path: Path, episodes: list[Episode]) -> None:
    """`looprl eval`'s transcripts, one line per episode in play order: its `index` and
    loop/log.py's `episode_record` (as `--endpoint` writes them, one at a time)."""
    with path.open("w") as f:
        for i, episode in enumerate(episodes):
            f.write(json.dumps({"index": i, **log.episode_record(episode)}) + "\n")
