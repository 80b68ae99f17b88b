"""`looprl envs` (list, `show`, `check`) and `looprl config` (`show`, `fields`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from looprl.cli.common import (
    ConfigArg,
    EnvConfigOpt,
    SetOpt,
    config_app,
    console,
    envs_app,
    fail,
    guarded,
    load_run_config,
)
from looprl.errors import ConfigError, EnvError

# ---------------------------------------------------------------- envs


@envs_app.callback()
@guarded
def envs_list(ctx: typer.Context) -> None:
    """List environments with a one-line description."""
    if ctx.invoked_subcommand is not None:
        return
    from looprl.envs import list_envs

    table = Table("environment", "description")
    for name, description in list_envs().items():
        table.add_row(name, description)
    console.print(table)


@envs_app.command("show")
@guarded
def envs_show(
    name: Annotated[
        str | None, typer.Argument(help="Environment name (default: the --config's).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Pick the task with this seed.")] = 0,
    split: Annotated[str, typer.Option(help="train or eval.")] = "train",
    model: Annotated[str, typer.Option(help="Whose tokenizer renders it.")] = "smollm2-135m",
    arg: Annotated[
        list[str] | None, typer.Option("--arg", help="Env argument key=value (repeatable).")
    ] = None,
    config: EnvConfigOpt = None,
) -> None:
    """Print one task exactly as the model sees it: rendered prompt and tool schemas."""
    from looprl.chat import ChatRenderer
    from looprl.envs import make_env
    from looprl.model.load import load_tokenizer

    name, args = _env_spec(name, arg, config)
    env = make_env(name, args)
    if not callable(getattr(env, "reset", None)):
        raise EnvError(f"{name} is an agent environment: its prompts are written by its agent")
    task = env.tasks(split, n=1, seed=seed)[0]
    obs = env.reset(task)
    renderer = ChatRenderer(load_tokenizer(model), model_name=model)
    ids = renderer.prompt_ids(obs.messages, obs.tools)
    console.rule(f"{name} · task {task.id} · tool_choice={obs.tool_choice}")
    console.print(
        "tools reach the prompt: "
        f"{'native template' if renderer.native_tools else 'fallback system block'}"
        f" · call syntax: {renderer.format} · prompt tokens: {len(ids)}",
        highlight=False,
    )
    console.rule("rendered prompt")
    console.print(renderer.tokenizer.decode(ids), markup=False, highlight=False)
    console.rule("tool schemas")
    console.print_json(json.dumps(obs.tools))
    _show_answer(env, task, renderer)


def _show_answer(env: Any, task: Any, renderer: Any) -> None:
    """The task's expected answer, its demonstration's length in tokens (what
    `rollout.max_new_tokens` must hold), and how a scored env's scorers compare replies."""
    from looprl.envs import demonstrations

    if "answer" in task.data:
        console.rule("expected answer")
        answer = json.dumps(task.data["answer"], ensure_ascii=False)
        console.print(answer, markup=False, highlight=False, soft_wrap=True)
    demos = demonstrations(env, task) or []
    if demos:
        sizes = [len(renderer.assistant_ids(demo)) for demo in demos]
        replies = f" in {len(sizes)} replies" if len(sizes) > 1 else ""
        console.print(
            f"demonstration: {' + '.join(map(str, sizes))} tokens{replies} "
            f"(rollout.max_new_tokens must hold {max(sizes)})",
            highlight=False,
            soft_wrap=True,
        )
    for scorer in getattr(env, "scorers", None) or []:
        how = getattr(scorer, "matching", None)
        detail = f": {how.describe()}" if how is not None else ""
        line = f"scorer {scorer.name} (weight {scorer.weight:g}){detail}"
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@envs_app.command("check")
@guarded
def envs_check(
    names: Annotated[
        list[str] | None, typer.Argument(help="Environment names (default: every one).")
    ] = None,
    tasks: Annotated[int, typer.Option(help="Episodes per agent.", min=1)] = 64,
    seed: Annotated[int, typer.Option(help="Seed of tasks and random agents.")] = 0,
    max_step_ms: Annotated[float, typer.Option(help="Slowest allowed mean step.")] = 1000.0,
    arg: Annotated[
        list[str] | None, typer.Option("--arg", help="Env argument key=value (repeatable).")
    ] = None,
    config: EnvConfigOpt = None,
) -> None:
    """Test an environment with random, expert and perturbed-expert agents (no model)."""
    from looprl.envs import env_class, list_envs
    from looprl.envs.check import check_env

    failed = []
    if config is not None and not names:
        names = [_env_spec(None, None, config)[0]]
    for name in names or list(list_envs()):
        if not names and "<" in name:  # an adapter: its target is the user's to name
            console.print(f"looprl envs check {name}: skipped (name the target: {name})")
            continue
        needs = getattr(env_class(name), "needs_args", None)
        if not names and needs and not arg:
            console.print(f"looprl envs check {name}: skipped (it needs --arg {needs})")
            continue
        name, args = _env_spec(name, arg, config)
        report = check_env(name, args, n=tasks, seed=seed, max_step_ms=max_step_ms)
        table = Table("check", "", "detail", title=f"looprl envs check {name}")
        for c in report.checks:
            table.add_row(c.name, "[green]ok[/]" if c.ok else "[bold red]FAIL[/]", c.detail)
        console.print(table)
        agents = Table("agent", "episodes", "reward mean", "min", "max", "outcomes")
        for agent, s in report.agents.items():
            if not s.episodes:
                continue
            outcomes = " ".join(f"{k}={v}" for k, v in sorted(s.outcomes.items()))
            mean = sum(s.rewards) / len(s.rewards)
            agents.add_row(
                agent,
                str(s.episodes),
                f"{mean:+.3f}",
                f"{min(s.rewards):+.2f}",
                f"{max(s.rewards):+.2f}",
                outcomes,
            )
        console.print(agents)
        if not report.ok:
            failed.append(name)
    if failed:
        fail(f"checks failed for: {', '.join(failed)}", code=1)


def _env_spec(name: str | None, items: list[str] | None, config: Path | None) -> tuple[str, dict]:
    """The env name and args: a run config's env section (when given, and when `name` is
    its env or none), with --arg values over them."""
    args = _env_args(items)
    if config is None:
        if name is None:
            fail("name an environment, or give a run config with --config")
        return name, args
    env = load_run_config(config, None).env
    if name is None or name == env.name:
        return env.name, {**env.args, **args}
    return name, args


def _env_args(items: list[str] | None) -> dict:
    from looprl.config import parse_yaml

    args = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--arg {item!r} is invalid: expected key=value")
        args[key] = parse_yaml(value)
    return args


# ---------------------------------------------------------------- config


@config_app.command("show")
@guarded
def config_show(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print the fully resolved config as YAML."""
    from looprl.config import to_yaml

    sys.stdout.write(to_yaml(load_run_config(config, set_)))


@config_app.command("fields")
def config_fields() -> None:
    """Every config field with its default and a one-line description."""
    from looprl.config import describe_fields

    table = Table("key", "default", "description")
    for key, default, description in describe_fields():
        table.add_row(key, default, description)
    console.print(table)
