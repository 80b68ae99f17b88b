"""A whole `looprl run` with each rollout engine, one after the other on the same config:
wall-clock, steps per minute, peak memory and the held-out result.

    .venv/bin/python bench/engine_run.py [--engines hf vllm] [--out runs/bench-engines]
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

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil


def tree_rss(root: psutil.Process) -> int:
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def run(engine: str, out: Path, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "looprl.cli", "run", "--out", str(out), "--force",
               "--set", f"rollout.engine={engine}"]  # fmt: skip
    for item in overrides:
        command += ["--set", item]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root, peak = psutil.Process(child.pid), [0]

    def sample() -> None:
        while child.poll() is None:
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], tree_rss(root))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = child.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if child.returncode != 0:
        sys.exit(f"looprl run with rollout.engine={engine} failed:\n{err[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"wall_s": wall, "tree_peak_gb": peak[0] / 1e9, "steps": len(rows),
              "step_s": sum(r["perf/step_s"] for r in rows),
              "looprl_peak_gb": max(r["perf/peak_rss_gb"] for r in rows) * 2**30 / 1e9}  # fmt: skip
    for name in ("baseline", "final", "baseline_greedy", "final_greedy"):
        path = out / "eval" / f"{name}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            result[name] = (data["reward_mean"], *data["reward_ci95"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--out", default="runs/bench-engines")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
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
    line = []
    for engine, r in results.items():
        line += [f"{engine}_wall_s={r['wall_s']:.0f}",
                 f"{engine}_steps_per_min={r['steps'] / (r['step_s'] / 60):.2f}",
                 f"{engine}_tree_peak_gb={r['tree_peak_gb']:.2f}",
                 f"{engine}_lift={r['final'][0] - r['baseline'][0]:+.3f}"]  # fmt: skip
    if "hf" in results and "vllm" in results:
        line.append(f"vllm_vs_hf_wall={results['vllm']['wall_s'] / results['hf']['wall_s']:.2f}")
    print("RESULT " + " ".join(line))


if __name__ == "__main__":
    main()
