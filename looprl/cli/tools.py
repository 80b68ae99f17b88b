"""`looprl serve`, `serve-tinker`, `play` and `plan`: a model (or a run's) served over an
OpenAI-compatible API or Tinker's training API, or played against, and a run's memory
predicted before it starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from looprl.cli.common import (
    ConfigArg,
    SetOpt,
    app,
    console,
    fail,
    guarded,
    load_run_config,
)


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
    from looprl.apps.loading import load_chat_model
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


@app.command("serve-tinker")
@guarded
def serve_tinker(
    models: Annotated[
        list[str] | None,
        typer.Argument(help="Models listed as served (aliases or folders); any is loadable."),
    ] = None,
    host: Annotated[
        str, typer.Option(help="Address to bind; 0.0.0.0 opens it to your network.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    store: Annotated[
        Path, typer.Option(help="Folder of the saved states, sampler weights and tokenizers.")
    ] = Path("tinker-store"),
    dtype: Annotated[str, typer.Option(help="Weight dtype: float32 or bfloat16.")] = "float32",
) -> None:
    """Serve Tinker's training API: the tinker SDK and cookbook recipes train through looprl."""
    from looprl.tinker.app import run_tinker_server

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype}: use float32 or bfloat16")
    served = models or ["smollm2-135m"]
    console.print(f"Tinker API on http://{host}:{port} serving {', '.join(served)}")
    console.print(f"TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY=tml-local", highlight=False)
    run_tinker_server(store, served, host=host, port=port, dtype=dtype)


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
    from looprl.apps.loading import load_chat_model
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
    world_size: Annotated[
        int, typer.Option(min=1, help="Processes under torchrun: the plan is one rank's.")
    ] = 1,
    shard: Annotated[
        str | None, typer.Option(help="none or fsdp: train.shard for this plan.")
    ] = None,
) -> None:
    """Predict a run's peak memory from configs alone (no weights) and say if it fits."""
    from looprl.plan.show import make_plan, tables

    sets = [*(set_ or []), *([f"train.shard={shard}"] if shard is not None else [])]
    result = make_plan(load_run_config(config, sets), device, world_size)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    for renderable in tables(result):
        console.print(renderable)
