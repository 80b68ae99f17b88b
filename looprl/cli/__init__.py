"""`looprl` command line: run, eval, envs, config.

The commands are grouped by area, each group a module: `runs.py` (run, eval, doctor,
export, report, compare), `tools.py` (serve, play, plan) and `envs.py` (the `envs` and
`config` groups); `common.py` holds the typer apps they register on. Importing them here
registers the commands, in the order `looprl --help` lists them.
"""

from __future__ import annotations

from looprl.cli import envs, runs, tools  # noqa: F401  (registers the commands)
from looprl.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app()
