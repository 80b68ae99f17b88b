"""Peak memory of the default run: `looprl run` with every default (no config file).

    .venv/bin/python bench/memory.py [--out runs/bench-memory] [--set key=value ...]

Runs `looprl run --out OUT --force [--set ...]` in a child process and reads the child's
peak resident set size from the kernel (`getrusage(RUSAGE_CHILDREN)`), so the figure
covers the whole run (model load, baseline eval, every rollout and update, final eval,
report), not only the steps the run logs itself. Also prints the largest
`perf/peak_rss_gb` the run logged and its wall-clock. With `--phases` the child runs
through `bench/memory_phases.py`, which samples its resident set and prints the peak of
each phase (load, eval, rollout, the update's forward passes and its backward). Ends with

    RESULT peak_rss_gb=X wall_s=Y

in GB of 10^9 bytes (the run's own `perf/peak_rss_gb` metric counts GiB).

Not a test: the default run takes about ten minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/bench-memory")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--phases", action="store_true", help="peak RSS of each phase")
    args = parser.parse_args()
    phases = Path(args.out + "-phases.json")
    runner = [str(Path(__file__).with_name("memory_phases.py")), str(phases)]
    launcher = runner if args.phases else ["-m", "looprl.cli"]
    command = [sys.executable, *launcher, "run", "--out", args.out, "--force"]
    for override in args.overrides:
        command += ["--set", override]
    start = time.perf_counter()
    done = subprocess.run(command, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"looprl run failed with exit code {done.returncode}")
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9  # KiB on Linux
    logged = [
        json.loads(line).get("perf/peak_rss_gb", 0.0)
        for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()
    ]
    print(f"command: {' '.join(command[1:])}")
    print(f"peak RSS (whole run, kernel): {peak_gb:.2f} GB")
    print(f"largest perf/peak_rss_gb logged by a step: {max(logged, default=0.0):.2f} GB")
    print(f"wall-clock: {wall / 60:.1f} min")
    if args.phases:
        peaks = json.loads(phases.read_text())
        print("peak RSS by phase (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in peaks.items()))
    print(f"RESULT peak_rss_gb={peak_gb:.2f} wall_s={wall:.0f}")


if __name__ == "__main__":
    main()
