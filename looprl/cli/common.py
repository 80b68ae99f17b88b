"""What every `looprl` command shares: the typer apps the commands register on, the
consoles, the option types, and `guarded`."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from looprl.errors import LoopRLError

if TYPE_CHECKING:
    from looprl.config import Config

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


def load_run_config(config: Path | None, overrides: list[str] | None) -> Config:
    """`load_config`, with the data files env.args (and sft.env_args) name found and written
    as absolute paths: a relative one is looked up in the config file's folder, then in the
    current folder (envs `with_found_files`). A run folder's saved config then loads from
    anywhere, and `looprl config show` prints the files a run would read."""
    from looprl.config import load_config
    from looprl.envs import with_found_files

    cfg = load_config(config, overrides)
    base = None if config is None else Path(config).resolve().parent
    args = with_found_files(cfg.env.name, cfg.env.args, base)
    env = cfg.env.model_copy(
        update={"args": args, "mix": args["members"] if cfg.env.mix else cfg.env.mix}
    )
    sft = cfg.sft.model_copy(
        update={"env_args": with_found_files(cfg.env.name, cfg.sft.env_args, base)}
    )
    return cfg.model_copy(update={"env": env, "sft": sft, "eval": also_found(cfg, base)})


def also_found(cfg: Config, base: Path | None) -> Any:
    """eval.also's entries with their data files found (as env.args's), each name checked
    now: an unknown one is a ConfigError with the registry's suggestion."""
    from looprl.envs import env_class, with_found_files
    from looprl.errors import ConfigError, EnvError

    entries = []
    for i, entry in enumerate(cfg.eval.also):
        try:
            env_class(entry.name)
        except EnvError as err:
            raise ConfigError(f"eval.also[{i}].name: {err}") from None
        args = with_found_files(entry.name, entry.args, base)
        entries.append(entry.model_copy(update={"args": args}))
    return cfg.eval.model_copy(update={"also": entries})


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
