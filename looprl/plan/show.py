"""`looprl plan`'s output: a table of components by phase, the verdict for the device,
the largest batch settings that fit, what to change otherwise, and every named device."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from looprl.config import Config
from looprl.plan.devices import DEVICES, device
from looprl.plan.fit import full_plan
from looprl.plan.shape import model_shape
from looprl.plan.workload import probe_workload


def make_plan(cfg: Config, device_name: str, world: int = 1) -> dict[str, Any]:
    """Plan `cfg` for the named device, one rank of `world` processes, from configs, the
    env and the tokenizer alone."""
    target = device(device_name)
    shape = model_shape(cfg)
    work = probe_workload(cfg, shape.vocab)
    return full_plan(cfg, shape, work, target, world)


def gb(value: float) -> str:
    return f"{value / 1e9:,.2f}"


def tables(result: dict[str, Any]) -> list[Any]:
    """Rich renderables: the components table, then the verdicts."""
    model, work, dev = result["model"], result["workload"], result["device"]
    active = f", {model['active_params'] / 1e9:.2f}B active" if model["expert_params"] else ""
    size = f"{model['params'] / 1e9:.3f}B params{active}"
    title = f"{model['name']} ({size}) on {dev['name']}: {dev['about']}"
    if result["world_size"] > 1:
        how = "sharded (train.shard=fsdp)" if result["shard"] == "fsdp" else "whole on each"
        title += f"; one rank of {result['world_size']}, {how}"
    table = Table("phase", "component", "GB", "how", title=title, title_justify="left")
    notes = result["notes"]
    for key, value in result["persistent"].items():
        table.add_row("every phase", key, gb(value), notes.get(key, ""))
    for name, phase in result["phases"].items():
        for key, value in phase["components"].items():
            table.add_row(name, key, gb(value), notes.get(f"{name}/{key}", ""))
    base = sum(result["persistent"].values())
    for name, phase in result["phases"].items():
        mark = "  ← peak" if name == result["peak_phase"] else ""
        table.add_row("", f"[bold]{name} total[/]", gb(base + phase["total"]), mark)
    verdict = Table.grid(padding=(0, 2))
    fits = "[green]fits[/]" if result["fits"] else "[bold red]does not fit[/]"
    verdict.add_row(
        "verdict",
        f"{fits}: peak {gb(result['peak_bytes'])} GB ({result['peak_phase']}) of "
        f"{gb(dev['usable_bytes'])} GB usable ({gb(dev['memory_bytes'])} GB × 0.9), "
        f"weights in {result['dtype']}",
    )
    verdict.add_row(
        "sequences",
        f"prompts ≤ {work['prompt_tokens']} tokens ({work['head_tokens']} shared), "
        f"≤ {work['response_tokens']} generated, forced call span {work['forced_tokens']}; "
        f"tokenizer: {work['tokenizer']}",
    )
    for key, found in result["largest"].items():
        value = found["value"]
        text = "none fits" if value is None else str(value)
        if value is not None and value == found["search_max"]:
            text += " (all at once: nothing larger changes the plan)"
        verdict.add_row(f"largest {key}", text)
    for item in result["advice"]:
        ok = "fits" if item["fits"] else "still too big"
        verdict.add_row("try", f"--set {item['set']}: peak {gb(item['peak_bytes'])} GB ({ok})")
    others = ", ".join(
        f"{name} {'✓' if v['fits'] else '✗'} {gb(v['peak_bytes'])}"
        for name, v in result["devices"].items()
    )
    verdict.add_row("devices (GB)", others)
    return [table, verdict]


__all__ = ["DEVICES", "make_plan", "tables"]
