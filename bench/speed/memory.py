"""Peak memory of the default run: `looprl run` with every default (no config file).

    .venv/bin/python bench/speed/memory.py [--out runs/bench-memory] [--set key=value ...]

Runs `looprl run --out OUT --force [--set ...]` in a child process and reads the child's
peak resident set size from the kernel when it ends (`wait4`), so the figure covers the
whole run (model load, baseline eval, every rollout and update, final eval, report), not
only the steps the run logs itself. Also prints the largest `perf/peak_rss_gb` the run
logged and its wall-clock. With `--phases` it prints the peak of each phase the run's
progress lines name (`load model`, `baseline eval`, `training`, `final eval`,
`write report`; `other` between them), sampled from outside the child every 3 ms. Ends
with

    RESULT peak_rss_gb=X wall_s=Y

in GB of 10^9 bytes (the run's own `perf/peak_rss_gb` metric counts GiB).

Not a test: the default run takes about ten minutes on a 2-core CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, looprl_run, print_result


def main() -> None:
    args = arguments(__doc__)
    args.add_argument("--out", default="runs/bench-memory")
    args.add_argument("--set", action="append", default=[], dest="overrides")
    args.add_argument("--phases", action="store_true", help="peak RSS of each phase")
    args = args.parse_args()
    run = looprl_run(args.out, overrides=args.overrides)
    if run.returncode != 0:
        sys.exit(f"looprl run failed with exit code {run.returncode}")
    peak_gb = run.peak_rss_bytes / 1e9
    logged = [record.get("perf/peak_rss_gb", 0.0) for record in run.metrics]
    overrides = "".join(f" --set {o}" for o in args.overrides)
    print(f"command: looprl run --out {args.out} --force{overrides}")
    print(f"peak RSS (whole run, kernel): {peak_gb:.2f} GB")
    print(f"largest perf/peak_rss_gb logged by a step: {max(logged, default=0.0):.2f} GB")
    print(f"wall-clock: {run.wall_s / 60:.1f} min")
    if args.phases:
        peaks = ", ".join(f"{k} {v:.2f}" for k, v in run.phase_peak_gb.items())
        print(f"peak RSS by phase (GB): {peaks}")
    print_result({"peak_rss_gb": f"{peak_gb:.2f}", "wall_s": f"{run.wall_s:.0f}"})


if __name__ == "__main__":
    main()
