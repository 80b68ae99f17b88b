"""`looprl run`, `eval`, `doctor`, `export`, `report` and `compare`: a run, from the checks
before it to its evaluation, its exported model, its report and its comparison with
other runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from looprl.cli.common import (
    ConfigArg,
    SetOpt,
    app,
    console,
    err_console,
    fail,
    guarded,
    load_run_config,
)

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
    from looprl.loop.dist import current as current_rank
    from looprl.loop.train import run_training
    from looprl.report.headline import headline

    config, out = _run_paths(config, out, resume)
    replayed = [f"train.replay={replay}"] if replay is not None else []
    cfg = load_run_config(config, [*(set_ or []), *replayed])
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
    out: Annotated[
        Path | None,
        typer.Option(
            help="Write the EvalResult JSON here, and its episodes to OUT.episodes.jsonl."
        ),
    ] = None,
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
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole EvalResult JSON, not the summary.")
    ] = False,
) -> None:
    """Evaluate a model (or a run's checkpoint, or an API endpoint) on the env's held-out
    tasks."""
    cfg = load_run_config(config, set_)
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
    if as_json:
        console.print_json(json.dumps(result))
        return
    for line in _eval_summary(result, out):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _eval_summary(result: dict, out: Path | None) -> list[str]:
    """What `looprl eval` prints: who played what, the mean reward with its interval, how
    the episodes ended, and where the files went."""
    from collections import Counter

    from looprl.loop.evaluate import episodes_path
    from looprl.report.stats import reward_with_ci

    who = result["model"] + (f" at {result['endpoint']}" if result.get("endpoint") else "")
    counts = Counter(result.get("episode_outcomes") or [])
    lines = [
        f"{result['env']}, {who}: {result['n']} episodes",
        f"reward, mean [95% CI]: {reward_with_ci(result)}",
        "outcomes: " + " · ".join(f"{label} {n}" for label, n in counts.most_common()),
    ]
    if out is None:
        return [*lines, "nothing written: --out FILE.json keeps the EvalResult and each episode"]
    return [*lines, f"wrote {out} (EvalResult) and {episodes_path(out)} (episodes)"]


@app.command()
@guarded
def doctor(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder.")] = Path("runs/latest"),
) -> None:
    """Check what a first run needs: Python, torch, devices, model, disk; say how to fix."""
    from looprl.apps.doctor import doctor_table, run_checks

    cfg = load_run_config(config, set_)
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
    path = compare_runs(
        runs,
        out,
        say=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
    )
    console.print(f"wrote {path}, {path.with_suffix('.html')} and {path.parent / 'plots'}/")
