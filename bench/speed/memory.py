"""Peak memory of a looprl run: the default run (no config file), or a config's.

    .venv/bin/python bench/speed/memory.py [CONFIG] [--out runs/bench-memory] [--phases]
        [--set key=value ...]

Runs `looprl run [CONFIG] --out OUT --force [--set ...]` in a child process and reads the child's
peak resident set size from the kernel when it ends (`wait4`), so the figure covers the
whole run (model load, baseline eval, every rollout and update, final eval, report), not
only the steps the run logs itself. Also prints the largest `perf/peak_rss_gb` the run
logged and its wall-clock. With `--phases` it prints the seconds and the peak of each
phase the run's progress lines name (`load model`, `baseline eval`, `SFT warm start`,
`training`, `final eval`, `write report`, ...; `other` between them, summed), the peak
sampled from outside the child every 3 ms. Ends with

    RESULT peak_rss_gb=X wall_s=Y

in GB of 10^9 bytes (the run's own `perf/peak_rss_gb` metric counts GiB).

Not a test: the default run takes about ten minutes on a 2-core CPU, `make demo`'s
(examples/demo.yaml) 10-15 minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, looprl_run, print_result


def main() -> None:
    args = arguments(__doc__)
    args.add_argument("config", nargs="?", default=None, help="a run config (default: none)")
    args.add_argument("--out", default="runs/bench-memory")
    args.add_argument("--set", action="append", default=[], dest="overrides")
    args.add_argument("--phases", action="store_true", help="peak RSS of each phase")
    args = args.parse_args()
    run = looprl_run(args.out, args.config, overrides=args.overrides)
    if run.returncode != 0:
        sys.exit(f"looprl run failed with exit code {run.returncode}")
    peak_gb = run.peak_rss_bytes / 1e9
    logged = [record.get("perf/peak_rss_gb", 0.0) for record in run.metrics]
    overrides = "".join(f" --set {o}" for o in args.overrides)
    config = f" {args.config}" if args.config else ""
    print(f"command: looprl run{config} --out {args.out} --force{overrides}")
    print(f"peak RSS (whole run, kernel): {peak_gb:.2f} GB")
    print(f"largest perf/peak_rss_gb logged by a step: {max(logged, default=0.0):.2f} GB")
    print(f"wall-clock: {run.wall_s / 60:.1f} min")
    if args.phases:
        print(f"{'phase':<28} {'seconds':>8} {'peak RSS (GB)':>14}")
        for name, seconds in run.phase_seconds.items():
            peak = run.phase_peak_gb.get(name)
            print(f"{name:<28} {seconds:>8.1f} {'-' if peak is None else f'{peak:.2f}':>14}")
    print_result({"peak_rss_gb": f"{peak_gb:.2f}", "wall_s": f"{run.wall_s:.0f}"})


if __name__ == "__main__":
    main()
