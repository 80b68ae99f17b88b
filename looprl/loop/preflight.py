"""What is checked before a run (or `looprl eval`) loads the model or writes anything.

`check_env` plays the environment without the model: one task of each split is drawn and
reset, its tool schemas and `response_format` must compile into the grammar a forced reply
is sampled under, and its demonstrations (if it has any) must play to the end with every
reward inside `reward_range`. `check_reply_room`, once the tokenizer is there, measures
the demonstrations' replies in tokens: a `rollout.max_new_tokens` below the longest would
cut every such reply (the run would train on `truncated` episodes only), so it is refused
with the number needed. Each failure is one ConfigError (exit 2), raised before the run
folder is touched.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from looprl.config import Config
from looprl.engine.grammar import build_grammar
from looprl.engine.requests import check_tools, generation_request
from looprl.envs import Environment, capabilities, demonstrations, make_env
from looprl.envs.common import check_reward
from looprl.errors import ConfigError
from looprl.loop.snapshot import stand_in_snapshots
from looprl.types import Observation, Task

SPLITS = ("train", "eval")
ROOM_SAMPLE = 32  # demonstrations measured per split for check_reply_room


def check_env(cfg: Config, probe: Environment) -> None:
    """Raise ConfigError naming the env, the split, the task and what failed."""
    from looprl.agents import is_agent_env

    name = cfg.env.name
    check_references(cfg, probe)
    caps = capabilities(probe)
    if cfg.algo.expert_samples and caps.group_judge:
        raise ConfigError(
            "algo.expert_samples puts the demonstration in each group unjudged, "
            "and a judge with mode: group scores only what was sampled; set "
            "algo.expert_samples=0 or use mode: pointwise"
        )
    for split in SPLITS:
        task = _first_task(probe, name, split, cfg.seed)
        if is_agent_env(probe):
            continue  # an agent's calls are checked as it makes them
        where = f"environment {name!r}, {split} task {task.id!r}"
        env = make_env(name, cfg.env.args)
        # a snapshot opponent exists only once the model is loaded: a stand-in moves first
        # here, and its games' demonstrations wait for the run
        with stand_in_snapshots() if caps.snapshot_opponent else nullcontext():
            obs = _call(where, "reset", env.reset, task)
        _check_schemas(where, obs)
        if caps.demonstrations and not caps.snapshot_opponent:
            shown = _check_demonstrations(where, make_env(name, cfg.env.args), task)
            if split == "train" and cfg.sft.enabled and not shown:
                raise ConfigError(
                    f"sft.enabled needs demonstrations, and {where} has none (a data "
                    "file's rows need an answer); set sft.enabled=false"
                )


def _first_task(probe: Environment, name: str, split: str, seed: int) -> Task:
    tasks = _call(f"environment {name!r}", f"tasks({split!r}, n=1)", probe.tasks, split, 1, seed)
    if not tasks:
        raise ConfigError(f"environment {name!r} has no {split} tasks")
    return tasks[0]


def _call(where: str, what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"{where}: {what} raised {type(err).__name__}: {err}") from None


def _check_schemas(where: str, obs: Observation) -> None:
    """The tools and response format as a request would send them, compiled into the
    grammar (in the hermes syntax: the schema, not the syntax, is what fails)."""
    try:
        tools = check_tools(obs.tools, obs.tool_choice)
        request = generation_request(
            [], tools, obs.tool_choice, "hermes", response_format=obs.response_format
        )
        if request.constraint is not None:
            build_grammar(request.constraint)
    except Exception as err:
        detail = str(err).split("\n")[0]
        raise ConfigError(
            f"{where}: its tool schemas or response_format cannot be forced: {detail}"
        ) from None


def _check_demonstrations(where: str, env: Environment, task: Task) -> bool:
    """Play the task's demonstrations, if it has any; whether it had."""
    demos = _call(where, "demonstrations", demonstrations, env, task)
    if not demos:
        return False
    _call(where, "reset", env.reset, task)
    for i, demo in enumerate(demos):
        result = _call(where, f"step with demonstration {i + 1}", env.step, demo)
        _call(where, f"the reward of demonstration {i + 1}", check_reward, env, result.reward)
        if result.done:
            break
    return True


def check_reply_room(cfg: Config, probe: Environment, renderer: Any) -> None:
    """Refuse a `rollout.max_new_tokens` below the longest demonstrated reply (thinking
    aside: a demonstration has none), measured on up to ROOM_SAMPLE tasks of each split."""
    if not capabilities(probe).demonstrations:
        return
    longest, task_id = 0, None
    for split in SPLITS:
        try:
            tasks = probe.tasks(split, n=ROOM_SAMPLE, seed=cfg.seed)
        except Exception:
            continue  # check_env has reported a broken split already
        for task in tasks:
            try:
                demos = demonstrations(make_env(cfg.env.name, cfg.env.args), task) or []
            except Exception:
                continue  # a task without a demonstration (e.g. a row without an answer)
            for demo in demos:
                size = len(renderer.assistant_ids(demo))
                if size > longest:
                    longest, task_id = size, task.id
    limit = cfg.rollout.max_new_tokens
    if longest and cfg.rollout.think != "off":
        longest += cfg.rollout.think_max_tokens  # the thinking a reply may start with
    if longest > limit:
        needed = int(math.ceil(longest * 1.25 / 8) * 8)  # a margin for longer sampled values
        raise ConfigError(
            f"rollout.max_new_tokens={limit} is below the {longest} tokens of a demonstrated "
            f"reply (task {task_id}): every such reply would be cut and scored `truncated`. "
            f"Set rollout.max_new_tokens={needed} (or more)"
        )


def check_references(cfg: Config, probe: Environment) -> None:
    """Each of eval.references is an EvalResult of this env's held-out episodes, the very
    ones this run's sampled eval will play (same task ids in the same order)."""
    if not cfg.eval.references:
        return
    tasks = probe.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed)
    ids = [t.id for t in tasks for _ in range(cfg.eval.samples_per_task)]
    for path in cfg.eval.references:
        try:
            ref = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"eval.references: cannot read {path}: {err}") from None
        if not isinstance(ref, dict) or ref.get("env") != cfg.env.name:
            got = ref.get("env") if isinstance(ref, dict) else None
            raise ConfigError(
                f"eval.references: {path} is an eval of {got!r}, not of {cfg.env.name!r}"
            )
        if ref.get("task_ids") != ids:
            raise ConfigError(
                f"eval.references: {path} did not play this run's held-out episodes (eval.tasks"
                f"={cfg.eval.tasks}, eval.samples_per_task={cfg.eval.samples_per_task}, eval.seed"
                f"={cfg.eval.seed}, env.args); make it with the run's config: looprl eval "
                f"CONFIG --endpoint URL --model NAME --out {path}"
            )
