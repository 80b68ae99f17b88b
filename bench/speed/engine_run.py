"""A whole `looprl run` with each rollout engine, one after the other on the same config:
wall-clock, steps per minute, peak memory and the held-out result.

    .venv/bin/python bench/speed/engine_run.py [--engines hf vllm] [--out runs/bench-engines]
                                               [--set KEY=VALUE ...]

With no `--set`, each engine trains the default task (`looprl run`'s defaults). Memory is
sampled every 0.5 s over the whole process tree, since the `vllm` engine's sampler is a
server process with its own workers: `tree_peak_gb` is the largest sum of resident sets
seen at one moment; `looprl_peak_gb` is the run's own process (`perf/peak_rss_gb` as
the run logs it). Wall-clock includes everything `looprl run` does (model load, the
vLLM server's start, both evaluations, the report). Ends with

    RESULT hf_wall_s=… vllm_wall_s=… vllm_vs_hf_wall=… hf_tree_peak_gb=… vllm_tree_peak_gb=…
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, looprl_run, result_line


def run(engine: str, out: Path, overrides: list[str]) -> dict:
    done = looprl_run(out, overrides=[f"rollout.engine={engine}", *overrides], echo=False,
                      sample_s=0.5)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"looprl run with rollout.engine={engine} failed:\n{done.stderr_tail[-3000:]}")
    rows = done.metrics
    result = {"wall_s": done.wall_s, "tree_peak_gb": done.tree_peak_bytes / 1e9,
              "steps": len(rows), "step_s": sum(r["perf/step_s"] for r in rows),
              "looprl_peak_gb": max(r["perf/peak_rss_gb"] for r in rows) * 2**30 / 1e9}  # fmt: skip
    for name in ("baseline", "final", "baseline_greedy", "final_greedy"):
        path = out / "eval" / f"{name}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            result[name] = (data["reward_mean"], *data["reward_ci95"])
    return result


def main() -> None:
    args = arguments(__doc__)
    args.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    args.add_argument("--out", default="runs/bench-engines")
    args.add_argument("--set", action="append", default=[], dest="overrides")
    args = args.parse_args()
    results = {}
    for engine in args.engines:
        results[engine] = run(engine, Path(args.out) / engine, args.overrides)
        print(f"{engine}: {json.dumps(results[engine])}", flush=True)

    def fmt(value: tuple | None) -> str:
        return f"{value[0]:+.3f} [{value[1]:+.3f}, {value[2]:+.3f}]" if value else "-"

    print(f"\n{'engine':<7} {'wall':>8} {'steps/min':>9} {'tree peak':>10} {'looprl peak':>11}  "
          "held-out sampled before -> after; greedy before -> after")  # fmt: skip
    for engine, r in results.items():
        rate = r["steps"] / (r["step_s"] / 60)
        print(f"{engine:<7} {r['wall_s']:>7.0f}s {rate:>9.2f} {r['tree_peak_gb']:>8.2f}GB "
              f"{r['looprl_peak_gb']:>9.2f}GB  {fmt(r.get('baseline'))} -> {fmt(r.get('final'))}; "
              f"{fmt(r.get('baseline_greedy'))} -> {fmt(r.get('final_greedy'))}")  # fmt: skip
    fields = {}
    for engine, r in results.items():
        fields[f"{engine}_wall_s"] = f"{r['wall_s']:.0f}"
        fields[f"{engine}_steps_per_min"] = f"{r['steps'] / (r['step_s'] / 60):.2f}"
        fields[f"{engine}_tree_peak_gb"] = f"{r['tree_peak_gb']:.2f}"
        fields[f"{engine}_lift"] = f"{r['final'][0] - r['baseline'][0]:+.3f}"
    if "hf" in results and "vllm" in results:
        fields["vllm_vs_hf_wall"] = f"{results['vllm']['wall_s'] / results['hf']['wall_s']:.2f}"
    print(result_line(fields))


if __name__ == "__main__":
    main()
