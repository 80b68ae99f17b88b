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
import contextlib
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

import psutil

ROOT = Path(__file__).resolve().parents[1]


def arguments(doc: str | None) -> argparse.ArgumentParser:
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


def tree_rss_bytes(root: psutil.Process) -> int:
    """The resident sets of a process and all its descendants now, summed (a vLLM engine's
    sampler is a server process with workers of its own)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


@dataclass
class Run:
    """A finished `looprl run` child: its folder, exit status, wall-clock, peak resident
    set (from the kernel when it ended: the whole run, load and report included), the
    per-step records of its metrics.jsonl, the largest resident set of its whole process
    tree seen at one moment, the same for each phase its progress lines named (`load
    model`, `baseline eval`, `training`, ...; `other` between them), and the last lines
    of its stderr. The tree figures are sampled every `sample_s`; `phase_seconds` is the
    wall-clock each phase took (a phase entered twice, like `other`, summed)."""

    out: Path
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    metrics: list[dict[str, Any]]
    tree_peak_bytes: int = 0
    phase_peak_gb: dict[str, float] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    stderr_tail: str = ""


def looprl_run(
    out: Path | str,
    config: Path | str | None = None,
    overrides: Iterable[str] = (),
    echo: bool = True,
    sample_s: float = 0.003,
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
    seconds: dict[str, float] = {}
    since = start
    child = subprocess.Popen(
        command,
        stdout=None if echo else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
    )

    def sample() -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(child.pid)
            while not state["done"]:
                rss, phase = tree_rss_bytes(root), state["phase"]
                state["peak"][phase] = max(rss, state["peak"].get(phase, 0))
                time.sleep(sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tail: list[str] = []
    assert child.stderr is not None
    for line in child.stderr:
        if echo:
            sys.stderr.write(line)
        tail = (tail + [line])[-40:]
        phase = phase_of(line, state["phase"])
        if phase != state["phase"]:
            now = time.perf_counter()
            seconds[state["phase"]] = seconds.get(state["phase"], 0.0) + now - since
            since = now
        state["phase"] = phase
    seconds[state["phase"]] = seconds.get(state["phase"], 0.0) + time.perf_counter() - since
    state["done"] = True  # stderr closed: the run has ended, or is ending
    sampler.join()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own peak, not every child's
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    return Run(
        out=out,
        returncode=child.returncode,
        wall_s=wall,
        peak_rss_bytes=usage.ru_maxrss * 1024,  # KiB on Linux
        metrics=read_jsonl(out / "metrics.jsonl"),
        tree_peak_bytes=max(state["peak"].values(), default=0),
        phase_peak_gb={k: round(v / 1e9, 2) for k, v in state["peak"].items() if v > 0},
        phase_seconds={k: round(v, 1) for k, v in seconds.items()},
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
