"""Overlapped rollouts (rollout.max_staleness): steps/min for K = 0, 1, 2 side by side.

Each K is a `looprl run` in a child process, one after the other in one invocation.

    .venv/bin/python bench/speed/async.py [--engine vllm|hf] [--steps 6] [--ks 0,1,2]
        [--model smollm2-135m] [--set key=value ...]

The same config for every K (the default task, LoRA, `algo.tis_cap` 2 so K ≥ 1 may
run, a small held-out eval, no greedy eval): what differs is only how the rollouts of
the next steps overlap the update (docs/training.md#overlapped-rollouts). The figure is
the training phase's wall clock (the sum of `perf/step_s`) and its steps per minute, per
K and against K = 0; the mean logged staleness and `rollout/mismatch_kl` beside them.
With `--engine vllm` (the default; `make setup-vllm`) the server samples while the
trainer steps: two processes. With `hf` on a CPU both sides share the same cores.
Ends with

    RESULT engine=E steps=N k0_steps_per_min=X k1_steps_per_min=Y k1_vs_k0=Y/X ...

Not a test: a few minutes a K on a 2-core CPU. `bench/checks/gpu_check.sh` runs it on a
GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import arguments, looprl_run, print_result


def main() -> None:
    args = arguments(__doc__)
    args.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    args.add_argument("--steps", type=int, default=6)
    args.add_argument("--ks", default="0,1,2", help="the staleness bounds, comma-separated")
    args.add_argument("--model", default="smollm2-135m")
    args.add_argument("--out", default="runs/bench-async")
    args.add_argument("--set", action="append", default=[], dest="overrides")
    args = args.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    common = [
        f"model.name={args.model}", f"rollout.engine={args.engine}", "algo.tis_cap=2.0",
        f"train.steps={args.steps}", "train.checkpoint_every=0", "eval.tasks=8",
        "eval.samples_per_task=1", "eval.greedy=false", "logging.trackers=[]",
        *args.overrides,
    ]  # fmt: skip
    rows = {}
    for k in ks:
        run = looprl_run(
            Path(args.out) / f"k{k}", overrides=[*common, f"rollout.max_staleness={k}"]
        )
        if run.returncode != 0:
            sys.exit(f"K={k}: looprl run failed ({run.returncode}):\n{run.stderr_tail}")
        seconds = sum(r["perf/step_s"] for r in run.metrics)
        rows[k] = {
            "train_s": seconds,
            "steps_per_min": 60 * len(run.metrics) / seconds,
            "staleness": sum(r["rollout/staleness_mean"] for r in run.metrics) / len(run.metrics),
            "mismatch_kl": sum(r["rollout/mismatch_kl"] for r in run.metrics) / len(run.metrics),
            "wall_s": run.wall_s,
        }
    print(f"\n{'K':>3} {'training s':>11} {'steps/min':>10} {'vs K=0':>7} {'staleness':>10} "
          f"{'mismatch KL':>12} {'run wall s':>11}")  # fmt: skip
    base = rows[ks[0]]["steps_per_min"]
    for k, row in rows.items():
        print(f"{k:>3} {row['train_s']:>11.1f} {row['steps_per_min']:>10.2f} "
              f"{row['steps_per_min'] / base:>6.2f}× {row['staleness']:>10.2f} "
              f"{row['mismatch_kl']:>12.2e} {row['wall_s']:>11.1f}")  # fmt: skip
    result = {"engine": args.engine, "steps": args.steps}
    for k, row in rows.items():
        result[f"k{k}_steps_per_min"] = f"{row['steps_per_min']:.3f}"
        if k != ks[0]:
            result[f"k{k}_vs_k{ks[0]}"] = f"{row['steps_per_min'] / base:.3f}"
    print_result(result)


if __name__ == "__main__":
    main()
