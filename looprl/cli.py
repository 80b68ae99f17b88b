"""`looprl` command line: run, eval, envs, config."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from looprl.errors import ConfigError, EnvError, LoopRLError

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

app = typer.Typer(
    help="Agentic RL post-training on one machine: baseline → post-train → retest.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
envs_app = typer.Typer(help="List, show and check environments.", invoke_without_command=True)
config_app = typer.Typer(help="Show the resolved config and describe every field.")
app.add_typer(envs_app, name="envs")
app.add_typer(config_app, name="config")

console = Console()
err_console = Console(stderr=True, soft_wrap=True)

ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config file (optional).")]
EnvConfigOpt = Annotated[
    Path | None, typer.Option("--config", help="A run config: its env.name and env.args.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a config field: section.field=value (repeatable)."),
]


def fail(message: str, code: int = 2) -> None:
    err_console.print("[bold red]error:[/] ", end="")
    err_console.print(message, markup=False, highlight=False)
    raise typer.Exit(code)


def guarded(fn: Any) -> Any:
    """Turn looprl's own errors into a clear message and exit code 2 (no traceback)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LoopRLError as err:
            fail(str(err), code=getattr(err, "exit_code", 2))

    return wrapper


# ---------------------------------------------------------------- run / eval


@app.command()
@guarded
def run(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Run folder (default: runs/latest).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing run folder.")] = False,
    resume: Annotated[
        bool, typer.Option(help="Continue the run in --out (or the run folder given as CONFIG).")
    ] = False,
    replay: Annotated[
        Path | None,
        typer.Option(help="Train on this run's saved rollouts instead of sampling (train.replay)."),
    ] = None,
) -> None:
    """Baseline eval → GSPO post-training → retest on the same tasks → report."""
    from looprl.config import load_config
    from looprl.loop.dist import current as current_rank
    from looprl.loop.train import run_training
    from looprl.report.headline import headline

    config, out = _run_paths(config, out, resume)
    replayed = [f"train.replay={replay}"] if replay is not None else []
    cfg = load_config(config, [*(set_ or []), *replayed])
    result = run_training(cfg, out, force=force, resume=resume)
    if not current_rank().is_main:
        return  # rank 0 of a torchrun job prints the headline
    console.print()
    for text in result.get("warnings") or []:
        err_console.print(f"[bold yellow]warning:[/] {text}", highlight=False)
    for line in headline(
        result["baseline"],
        result["final"],
        Path(result["report"]),
        result["after_sft"],
        greedy=result.get("greedy"),
        references=result.get("references"),
    ):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _run_paths(config: Path | None, out: Path | None, resume: bool) -> tuple[Path | None, Path]:
    """The config file and run folder `looprl run` means. A run folder where the config
    file goes (`looprl run --resume runs/demo`) means that run: with --resume it is
    continued, otherwise refused with the two commands the user may have meant."""
    if config is not None and config.is_dir():
        if not (config / "config.yaml").is_file():
            fail(f"{config} is a folder, not a config file (and not a run folder: no config.yaml)")
        if resume and (out is None or out.resolve() == config.resolve()):
            return config / "config.yaml", config
        other = f" and --out names another folder ({out})" if resume else ""
        fail(
            f"{config} is a run folder, not a config file{other}. To continue that run:\n"
            f"  looprl run --out {config} --resume\n"
            f"To start a new run from its config:\n"
            f"  looprl run {config / 'config.yaml'} --out {out if resume else 'NEW'}"
        )
    out = Path("runs/latest") if out is None else out
    if resume and config is None and (out / "config.yaml").exists():
        config = out / "config.yaml"  # continue with the run's own config
    return config, out


@app.command("eval")
@guarded
def eval_cmd(
    config: ConfigArg = None,
    set_: SetOpt = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder of a run to evaluate.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the EvalResult JSON here.")] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(help="An OpenAI-compatible base URL to evaluate instead of a local model."),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="The endpoint's model name (with --endpoint).")
    ] = None,
    api_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the endpoint's API key.")
    ] = "OPENAI_API_KEY",
    concurrency: Annotated[
        int, typer.Option(help="Requests in flight at once (with --endpoint).", min=1)
    ] = 4,
) -> None:
    """Evaluate a model (or a run's checkpoint, or an API endpoint) on the env's held-out
    tasks."""
    from looprl.config import load_config

    cfg = load_config(config, set_)
    if endpoint is not None or model is not None:
        from looprl.loop.remote import run_remote_eval

        if endpoint is None or model is None or out is None or checkpoint is not None:
            fail(
                "an endpoint eval takes --endpoint URL, --model NAME and --out FILE.json "
                "(its episodes go beside it), and no --checkpoint"
            )
        result = run_remote_eval(cfg, endpoint, model, out, api_key_env, concurrency)
    else:
        from looprl.loop.evaluate import run_eval

        result = run_eval(cfg, checkpoint=checkpoint, out=out)
    console.print_json(json.dumps(result))


@app.command()
@guarded
def doctor(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder.")] = Path("runs/latest"),
) -> None:
    """Check what a first run needs: Python, torch, devices, model, disk; say how to fix."""
    from looprl.apps.doctor import doctor_table, run_checks
    from looprl.config import load_config

    cfg = load_config(config, set_)
    with console.status("checking"):
        checks = run_checks(cfg, out)
    console.print(doctor_table(checks))
    problems = [check.name for check in checks if check.blocks_run]
    if problems:
        fail(f"a run would not start: fix the problems above ({', '.join(problems)})", code=1)
    console.print("no problems: a run with this config would start", highlight=False)


@app.command()
@guarded
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the exported model.")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder (default: the newest).")
    ] = None,
) -> None:
    """Export a run's trained model as a plain transformers folder (LoRA merged)."""
    from looprl.loop.checkpoint import export_model

    if not (run_dir / "config.yaml").exists():
        fail(f"{run_dir} is not a run folder (no config.yaml)")
    try:
        path = export_model(run_dir, out, checkpoint)
    except ValueError as err:
        fail(str(err))
    console.print(f"exported to {path}")


@app.command()
@guarded
def report(run_dir: Annotated[Path, typer.Argument(help="A run folder.")]) -> None:
    """Regenerate a run's report.md, report.html and plots/ from its run folder."""
    from looprl.report.write import regenerate_report

    path = regenerate_report(run_dir)
    console.print(f"wrote {path}, {path.with_suffix('.html')} and {path.parent / 'plots'}/")


@app.command()
@guarded
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run folders, each paired with the first.")],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for compare.md, compare.html, plots/.")
    ] = Path("compare"),
) -> None:
    """Compare runs on the same held-out episodes: paired differences, config, curves."""
    from looprl.report.compare import compare_runs

    if len(runs) < 2:
        fail("compare takes at least two run folders: looprl compare RUN_A RUN_B [...]")
    for run_dir in runs:
        if not (run_dir / "config.yaml").is_file():
            fail(f"{run_dir} is not a run folder (no config.yaml)")
    path = compare_runs(runs, out)
    console.print(f"wrote {path}, {path.with_suffix('.html')} and {path.parent / 'plots'}/")


@app.command()
@guarded
def serve(
    model: Annotated[str, typer.Argument(help="A model (alias, hub id, path) or a run folder.")],
    host: Annotated[
        str, typer.Option(help="Address to bind; 0.0.0.0 opens it to your network.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="LOOPRL_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder of the run (default: the newest).")
    ] = None,
    variant: Annotated[
        str | None,
        typer.Option(help="What model id NAME gets for a run: trained (default) or baseline."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    max_tokens_limit: Annotated[
        int | None,
        typer.Option(
            min=1, help="The most tokens a request may ask for (default: the context length)."
        ),
    ] = None,
) -> None:
    """Serve a model, or a run's trained and baseline model, over an OpenAI-compatible API."""
    from looprl.apps.inference import load_chat_model
    from looprl.apps.serve import model_ids, run_server

    if variant not in (None, "trained", "baseline", "base"):
        fail(f"--variant {variant}: use trained or baseline (a plain model has only base)")
    chat_model = load_chat_model(model, checkpoint=checkpoint, device=device)
    ids = ", ".join(model_ids(chat_model, variant))
    where = f" (checkpoint {chat_model.checkpoint})" if chat_model.checkpoint else ""
    console.print(f"serving {chat_model.name}{where} as: {ids}", highlight=False)
    console.print(f"OpenAI base URL: http://{host}:{port}/v1", highlight=False)
    run_server(
        chat_model,
        host=host,
        port=port,
        api_key=api_key,
        default_variant=variant,
        max_tokens_limit=max_tokens_limit,
    )


@app.command()
@guarded
def play(
    model: Annotated[str, typer.Argument(help="A model (alias, hub id, path) or a run folder.")],
    human: Annotated[str, typer.Option(help="Your mark: X (you move first) or O.")] = "X",
    variant: Annotated[
        str | None, typer.Option(help="trained or baseline, for a run (default: trained).")
    ] = None,
    checkpoint: Annotated[
        Path | None, typer.Option(help="A checkpoint folder of the run (default: the newest).")
    ] = None,
    temperature: Annotated[float, typer.Option(help="Model temperature; 0 = greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (with temperature > 0).")] = None,
    web: Annotated[bool, typer.Option("--web", help="Play in a local web page.")] = False,
    port: Annotated[int, typer.Option(help="Port of the --web page on 127.0.0.1.")] = 8765,
) -> None:
    """Play tic-tac-toe against a model, or a run's trained model, in the terminal or --web."""
    from looprl.apps.inference import load_chat_model
    from looprl.apps.play import (
        PlayError,
        PlaySession,
        check_human,
        check_temperature,
        check_variant,
        play_in_terminal,
    )
    from looprl.apps.play_web import serve

    mark, _ = check_human(human), check_temperature(temperature)
    if variant is not None and variant not in ("trained", "baseline", "base"):
        raise PlayError(f"--variant {variant}: expected trained or baseline")
    chat_model = load_chat_model(model, checkpoint=checkpoint)
    chosen = check_variant(chat_model, variant)
    if web:
        serve(
            chat_model,
            port=port,
            human=mark,
            variant=chosen,
            temperature=temperature,
            seed=seed,
            console=console,
        )
    else:
        play_in_terminal(
            lambda: PlaySession(chat_model, mark, chosen, temperature=temperature, seed=seed),
            console,
        )


@app.command()
@guarded
def plan(
    config: ConfigArg = None,
    set_: SetOpt = None,
    device: Annotated[
        str, typer.Option(help="dgx-spark, h200, h100-80g, a100-80g, rtx-4090, cpu-24g, ...")
    ] = "cpu-24g",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Predict a run's peak memory from configs alone (no weights) and say if it fits."""
    from looprl.config import load_config
    from looprl.plan.show import make_plan, tables

    result = make_plan(load_config(config, set_), device)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    for renderable in tables(result):
        console.print(renderable)


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
    from looprl.config import load_config

    env = load_config(config, None).env
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
    from looprl.config import load_config, to_yaml

    sys.stdout.write(to_yaml(load_config(config, set_)))


@config_app.command("fields")
def config_fields() -> None:
    """Every config field with its default and a one-line description."""
    from looprl.config import describe_fields

    table = Table("key", "default", "description")
    for key, default, description in describe_fields():
        table.add_row(key, default, description)
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
