"""What every benchmark shares: its arguments, medians of repeated timings, the `RESULT`
line it ends with, and a looprl run in a child process with its peak memory.

A benchmark reaches looprl only through public entry points: the `looprl` CLI in a child
process (reading the run folder it writes) or package-level names (`looprl.engine`,
`looprl.envs`, `looprl.config`, `looprl.chat`, `looprl.model.load`, ...). It never
patches a looprl module, so a refactor inside the loop cannot change what it measures
without the run's own records changing too. `tests/test_bench.py` keeps that true.

A script under bench/speed or bench/checks imports this module after putting the
repository root on `sys.path` (two lines at its top), so it runs as
`.venv/bin/python bench/speed/rollout.py` from anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose description is the first line of the script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").strip().split("\n", 1)[0])


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall-clock seconds of one call, and what it returned."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def result_line(fields: dict[str, Any]) -> str:
    """`RESULT key=value key=value ...`: the one line a benchmark ends with, which the
    docs quote and `make bench` logs are searched for."""
    return "RESULT " + " ".join(f"{key}={value}" for key, value in fields.items())


def print_result(fields: dict[str, Any]) -> None:
    print(result_line(fields), flush=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (a run's metrics.jsonl, its samples); [] if none."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rss_gb(pid: int) -> float:
    """The resident set of process `pid` now, in GB (0.0 once it has ended)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE / 1e9
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


@dataclass
class Run:
    """A finished `looprl run` child: its folder, exit status, wall-clock, peak resident
    set (from the kernel when it ended: the whole run, load and report included), the
    per-step records of its metrics.jsonl, the peak resident set of each phase its
    progress lines named (`load model`, `baseline eval`, `training`, ...; `other` between
    them; sampled every 3 ms), and the last lines of its stderr."""

    out: Path
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    metrics: list[dict[str, Any]]
    phase_peak_gb: dict[str, float] = field(default_factory=dict)
    stderr_tail: str = ""


def looprl_run(
    out: Path | str,
    config: Path | str | None = None,
    overrides: Iterable[str] = (),
    echo: bool = True,
) -> Run:
    """`looprl run [CONFIG] --out OUT --force --set ...` in a child process, from the
    repository root (so an env named `bench.speed.step_env:Class` imports). With `echo`
    its output shows as it comes; without, its stdout is dropped and its stderr kept for
    the error message."""
    out = Path(out).resolve()
    command = [sys.executable, "-m", "looprl.cli", "run"]
    command += ([str(Path(config).resolve())] if config else []) + ["--out", str(out), "--force"]
    for override in overrides:
        command += ["--set", override]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    state: dict[str, Any] = {"phase": "other", "peak": {}, "done": False}
    start = time.perf_counter()
    child = subprocess.Popen(
        command,
        stdout=None if echo else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )

    def sample() -> None:
        while not state["done"]:
            rss, phase = rss_gb(child.pid), state["phase"]
            state["peak"][phase] = max(rss, state["peak"].get(phase, 0.0))
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tail: list[str] = []
    assert child.stderr is not None
    for line in child.stderr:
        if echo:
            sys.stderr.write(line)
        tail = (tail + [line])[-40:]
        state["phase"] = phase_of(line, state["phase"])
    _, status, usage = os.wait4(child.pid, 0)  # the child's own peak, not every child's
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    state["done"] = True
    sampler.join()
    return Run(
        out=out,
        returncode=child.returncode,
        wall_s=wall,
        peak_rss_bytes=usage.ru_maxrss * 1024,  # KiB on Linux
        metrics=read_jsonl(out / "metrics.jsonl"),
        phase_peak_gb={k: round(v, 2) for k, v in state["peak"].items() if v > 0},
        stderr_tail="".join(tail),
    )


def phase_of(line: str, current: str) -> str:
    """The phase a progress line leaves the run in: `▶ title ...` opens `title`, `✓ ...`
    closes it (back to `other`); any other line changes nothing."""
    text = line.strip()
    if text.startswith("▶ "):
        title = text[2:].split(" · ")[0]
        return title.split(" (")[0].strip()
    if text.startswith("✓ "):
        return "other"
    return current


def repo_root_on_path() -> None:
    """Lets a child interpreter (or a user env named `bench.speed.step_env:Class`) import
    from the repository root wherever the script was started."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
