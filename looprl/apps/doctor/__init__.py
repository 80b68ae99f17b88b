"""`looprl doctor`: what a first run needs, checked before it starts.

The machine first (Python, torch, devices, the embedded model's package and cache, the
run folder), then what the config chooses (the environment, the model, its chat template
and call syntax, a forced call's grammar, one real token from the engine), then the
optional extras. A run would start when no check is a problem; notes never stop it.
"""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from looprl.agents import is_agent_env
from looprl.apps.doctor.check import Check
from looprl.apps.doctor.machine import (
    check_cache,
    check_chromium,
    check_cpu,
    check_cuda,
    check_embedded_package,
    check_gemma_packages,
    check_openai,
    check_python,
    check_run_folder,
    check_torch,
    check_trl,
    visible_gpus,
)
from looprl.apps.doctor.model import check_environment, model_checks
from looprl.config import Config
from looprl.model.load import ALIASES

__all__ = ["Check", "doctor_table", "run_checks"]

STYLES = {"OK": "green", "problem": "bold red", "note": "yellow", "skipped": "dim"}


def run_checks(cfg: Config, out: Path) -> list[Check]:
    """Every check for a `looprl run` of `cfg` into `out`, in the table's order."""
    gpus = visible_gpus()
    cuda = check_cuda(cfg.model.device, cfg.model.dtype, gpus=gpus)
    on_cpu = cfg.model.device == "cpu" or not gpus  # where the run samples
    machine = [
        check_python(),
        check_torch(),
        cuda,
        check_cpu(sampler_dtype=cfg.rollout.sampler_dtype, on_cpu=on_cpu),
        check_embedded_package(needed=cfg.model.name in ALIASES),
        *([check_gemma_packages()] if cfg.model.name == "gemma3-270m" else []),
        check_cache(),
        check_run_folder(out),
    ]
    environment = check_environment(cfg.env.name, cfg.env.args)
    chosen = model_checks(cfg, environment, device_ready=not cuda.blocks_run)
    agent_env = environment.ok and is_agent_env(environment.value[0])
    extras = [check_openai(agent_env), check_trl(), check_chromium()]
    return [*machine, environment, *chosen, *extras]


def doctor_table(checks: list[Check]) -> Table:
    table = Table("check", "status", "detail", "how to fix", title="looprl doctor")
    for check in checks:
        style = STYLES[check.status]
        table.add_row(
            check.name, f"[{style}]{check.status}[/]", escape(check.detail), escape(check.fix)
        )
    return table
