"""Evaluation on fixed held-out tasks: the same tasks, seeds and sampling before and
after training, so the before/after comparison is paired. Also what training and
`looprl eval` share: `HeldOut`, a run's held-out evals, and `player`, which plays
episodes with a policy (built-in envs through loop/rollout.py, agent envs through
looprl/agents/runner.py)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from looprl.config import Config
from looprl.engine import SamplingParams, Thinking
from looprl.envs import env_factory, make_env, solved_outcomes
from looprl.errors import ConfigError, EnvError
from looprl.loop import dist as ranks
from looprl.loop import log, preflight
from looprl.loop.checkpoint import load_weights
from looprl.loop.dist import main_only
from looprl.loop.policy import Policy, load_model
from looprl.loop.progress import DONE, Progress
from looprl.loop.rollout import run_episodes
from looprl.report.stats import reward_with_ci
from looprl.types import ENV_ERROR, TRUNCATED, Episode, Task


def mean_ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and a normal-approximation 95% interval (mean ± 1.96·sd/√n)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = 1.96 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def valid_call_rate(episodes: list[Episode]) -> float:
    """Fraction of assistant turns that produced a valid tool call."""
    turns = [m for e in episodes for m in e.messages if m.role == "assistant"]
    if not turns:
        return 0.0
    return sum(1 for m in turns if m.tool_calls and not m.parse_failure) / len(turns)


def sampled_entropy(episodes: list[Episode]) -> float:
    """Mean −log π(y_t) over the generated tokens, from the logprobs recorded while sampling
    (the unconstrained policy's, at the sampling temperature): a Monte Carlo estimate of
    the per-token entropy E_y~π[−log π(y)], exact in expectation where the token was sampled
    from π itself, at no extra cost. Tokens a grammar forced or narrowed add their
    surprisal instead, so on forced calls it reads as "how unlikely the policy found its
    own reply"; it falls as the policy sharpens either way. 0 without generated tokens."""
    values = [-lp for e in episodes for lp, m in zip(e.logprobs, e.loss_mask) if m]
    return sum(values) / len(values) if values else 0.0


def summarize(episodes: list[Episode]) -> dict[str, Any]:
    """Reward, validity, length, entropy and outcome statistics of a batch of episodes.
    `env_error` episodes are counted in `outcomes` but left out of the reward mean."""
    scored = [e for e in episodes if e.outcome != ENV_ERROR]
    mean, lo, hi = mean_ci95([e.reward for e in scored])
    counts = Counter(e.outcome for e in episodes)
    n = max(len(episodes), 1)
    return {
        "n": len(episodes),
        "reward_mean": mean,
        "reward_ci95": [lo, hi],
        "valid_tool_call_rate": valid_call_rate(scored),
        "response_len": sum(e.response_len for e in scored) / max(len(scored), 1),
        "entropy": sampled_entropy(scored),
        "outcomes": {k: v / n for k, v in sorted(counts.items())},
        "env_errors": counts.get(ENV_ERROR, 0),
        "scores": score_means(scored),
        "judge": judge_cost(episodes),
    }


def by_member(episodes: list[Episode]) -> dict[str, list[Episode]]:
    """A mix's episodes by member: the label its task ids start with (`LABEL/...`)."""
    out: dict[str, list[Episode]] = {}
    for e in episodes:
        out.setdefault(e.task.id.split("/", 1)[0], []).append(e)
    return dict(sorted(out.items()))


def judge_cost(episodes: list[Episode]) -> dict[str, float]:
    """Judge requests made and seconds spent scoring (the `judge` scorer's info)."""
    verdicts = []
    for e in episodes:
        found = e.info.get("judge")
        verdicts += found if isinstance(found, list) else [found] if found else []
    if not verdicts:
        return {}
    return {"calls": sum(int(v.get("calls", 0)) for v in verdicts),
            "seconds": sum(float(v.get("seconds", 0.0)) for v in verdicts)}  # fmt: skip


def score_means(episodes: list[Episode]) -> dict[str, float]:
    """Each named score's mean, where the env reports scores (`info["scores"]`: the
    dataset env's scorers), over the episodes that have it."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        for name, value in (e.info.get("scores") or {}).items():
            if isinstance(value, int | float):
                values.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}


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
    """Play the eval tasks with the eval sampling settings; write eval/NAME.json. With
    `greedy`, at T = 0 and one episode per distinct task (another episode of the same
    task would be the same one, and would only narrow the interval)."""
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
    title = EVAL_TITLES.get(name, name)
    dist = ranks.current()  # each rank plays its share; every rank then has them all
    mine = dist.share(range(len(repeated)))
    with (progress or Progress(quiet=True)).phase(title, len(mine), "episode") as phase:
        episodes = dist.gather(
            play([repeated[i] for i in mine], params=params, on_progress=phase.update,
                 first_index=mine[0] if mine else 0)
        )  # fmt: skip
        solved = solved_outcomes(make_env(cfg.env.name, cfg.env.args))
        result = eval_result(
            episodes, cfg.env.name, cfg.model.name, cfg.eval.seed, temperature, solved
        )
        cut = result["episode_outcomes"].count(TRUNCATED)
        # a text task's replies never try a call: its call rate says nothing
        tried = any(m.tool_calls or m.parse_failure for e in episodes for m in e.messages
                    if m.role == "assistant")  # fmt: skip
        calls = f" · valid calls {result['valid_tool_call_rate']:.0%}" if tried else ""
        phase.done(
            f"reward {reward_with_ci(result)}{calls} · {result['n']} episodes"
            + (f" · {cut} truncated at the token limit" if cut else "")
        )
    if run_dir is not None:
        main_only(write_eval)(run_dir, name, result, episodes)
    check_some_scored(episodes, title, run_dir, name)
    return result


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
        cls, cfg: Config, policy: Policy, play: Player, probe: Any, run_dir: Path,
        progress: Progress,
    ) -> HeldOut:  # fmt: skip
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
            self.policy, self.play, tasks, self.cfg, self.run_dir,
            name + (GREEDY_SUFFIX if greedy else ""), self.progress, greedy=greedy,
        )  # fmt: skip

    def kept_or_run(self, name: str, greedy: bool = False) -> dict:
        """The eval kept in the run folder, or played now."""
        kept = self.read(self.run_dir, name + (GREEDY_SUFFIX if greedy else ""))
        return kept if kept is not None else self.run(name, greedy)


def check_some_scored(episodes: list[Episode], title: str, run_dir: Path | None, name: str) -> None:
    """An eval whose every episode ended in `env_error` measured nothing: a failure, never
    a reward of 0 (its tracebacks are in samples/NAME.jsonl when there is a run folder)."""
    if not episodes or any(e.outcome != ENV_ERROR for e in episodes):
        return
    where = f"; every traceback is in {run_dir / 'samples' / f'{name}.jsonl'}" if run_dir else ""
    last = (episodes[0].error or "").strip().splitlines()[-1:] or ["(no traceback)"]
    raise EnvError(
        f"the {title} measured nothing: all {len(episodes)} episodes ended in env_error "
        f"(the environment raised){where}. The first: {last[0]}"
    )


def distinct_tasks(tasks: list) -> list:
    """Each task once, in order of first appearance."""
    return list({task.id: task for task in tasks}.values())


def greedy_eval_tasks(env: Any, cfg: Config, eval_tasks: list) -> list:
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


class Player(Protocol):
    """Plays one episode per task (repeat a task for a group), in order, with one policy:
    `first_index` is the first episode's random stream (its index in the whole batch when
    this process plays a share of it, loop/dist.py); `on_progress(n)` hears how many have
    ended."""

    def __call__(
        self,
        tasks: list[Task],
        *,
        params: SamplingParams,
        first_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Episode]: ...


def player(cfg: Config, policy: Policy, probe: Any) -> Player:
    """`play(tasks, params=..., first_index=0) -> episodes` with this policy, in fresh env
    instances (agent environments, which have `run_agent`, are played by
    looprl.agents); `first_index` is the first episode's index in the whole batch
    when this process plays a share of it (loop/dist.py)."""
    from looprl.agents import is_agent_env, run_agents

    common = {
        "make_env": env_factory(cfg.env.name, cfg.env.args),
        "engine": policy.engine,
        "renderer": policy.renderer,
        "max_turns": probe.max_turns,
        "max_episode_tokens": cfg.rollout.max_episode_tokens,
    }
    if is_agent_env(probe):
        return partial(run_agents, **common)
    opened = cfg.rollout.think == "tagged" and policy.renderer.opens_thinking
    thinking = Thinking(cfg.rollout.think, cfg.rollout.think_max_tokens, opened)
    play = partial(run_episodes, **common, thinking=thinking)
    score_groups = getattr(probe, "score_groups", None)
    if not callable(score_groups):
        return play

    def play_and_score_groups(tasks: list[Task], **kwargs: Any) -> list[Episode]:
        """A group judge's scores come once the groups are played (the dataset env)."""
        episodes = play(tasks, **kwargs)
        score_groups(episodes)
        return episodes

    return play_and_score_groups


def run_eval(
    cfg: Config,
    checkpoint: Path | None = None,
    out: Path | None = None,
    progress: Progress | None = None,
) -> dict:
    """`looprl eval`: evaluate a model, or a run's checkpoint, on the held-out tasks."""
    progress = progress or Progress()
    if checkpoint is not None and not (checkpoint / "trainable.safetensors").exists():
        raise ConfigError(f"{checkpoint} is not a looprl checkpoint folder")
    probe = make_env(cfg.env.name, cfg.env.args)
    preflight.check_env(cfg, probe)
    policy = load_model(cfg, progress)
    preflight.check_reply_room(cfg, probe, policy.renderer)
    if checkpoint is not None:
        load_weights(policy.model, checkpoint)
        progress.note(f"{DONE} weights from {checkpoint}")
    play = player(cfg, policy, probe)
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    result = evaluate(policy, play, tasks, cfg, None, "eval", progress)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result
