"""What `train.shard: fsdp` costs and saves: the same short run on one process (whole
model) and on two sharded processes (torchrun, FSDP2), side by side, with `looprl plan`'s
prediction of each one's per-process peak.

    .venv/bin/python bench/speed/shard.py [--model smollm2-135m] [--lora] [--steps 2] \
        [--set KEY=VALUE ...]

Each run is `looprl run` in a child process (torchrun for the sharded one) whose peak
resident set the kernel reports when it ends (`wait4`: the largest of its processes, so
one rank's peak under torchrun). The step time is the median `perf/step_s` of the steps.
Both runs get the machine's cores (one process with all of them as threads; one thread
per rank). `--set` adds a setting to both runs and their plans (after the defaults
below), e.g. fewer, shorter episodes a step, where the weights, gradients and AdamW
state, which sharding splits, weigh most beside the update's activations. Ends with

    RESULT step_s_one=A step_s_sharded=B peak_gb_one=C peak_gb_sharded=D \
        plan_gb_one=E plan_gb_sharded=F plan_error_pct_one=G plan_error_pct_sharded=H

Not a test: it loads the real model; a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import ROOT, arguments, read_jsonl, result_line

WORLD = 2


def settings(model: str, lora: bool, steps: int, extra: list[str]) -> list[str]:
    return [
        f"model.name={model}",
        f"model.lora.enabled={str(lora).lower()}",
        "rollout.tasks_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=32",
        "eval.tasks=4",
        "eval.samples_per_task=1",
        "eval.greedy_tasks=4",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        "logging.trackers=[]",
        *extra,
    ]


def run(out: Path, sets: list[str], processes: int) -> dict:
    """One `looprl run`: its median step seconds and its largest process's peak (GB)."""
    command = [sys.executable, "-m", "looprl.cli", "run", "--out", str(out), "--force"]
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            "29517",
            "-m",
            "looprl.cli",
            "run",
            "--out",
            str(out),
            "--force",
        ]
    for item in sets:
        command += ["--set", item]
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # the largest of the child and its ranks
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"looprl run failed ({' '.join(command)})")
    steps = [m["perf/step_s"] for m in read_jsonl(out / "metrics.jsonl")]
    return {"step_s": statistics.median(steps), "peak_gb": usage.ru_maxrss * 1024 / 1e9}


def planned(sets: list[str], processes: int) -> float:
    """`looprl plan --json`'s peak (GB) for one process of the run."""
    command = [
        sys.executable,
        "-m",
        "looprl.cli",
        "plan",
        "--json",
        "--device",
        "cpu-24g",
        "--world-size",
        str(processes),
    ]
    for item in sets:
        command += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    text = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(text.stdout)["peak_bytes"] / 1e9


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lora", action="store_true", help="LoRA (default: full fine-tuning)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE for both runs (repeatable)"
    )
    args = parser.parse_args()
    base = settings(args.model, args.lora, args.steps, args.set)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, processes, shard in (("one", 1, "none"), ("sharded", WORLD, "fsdp")):
            sets = [*base, f"train.shard={shard}"]
            measured = run(Path(tmp) / name, sets, processes)
            plan = planned(sets, processes)
            error = 100 * (plan - measured["peak_gb"]) / measured["peak_gb"]
            rows[name] = {**measured, "plan_gb": plan, "error_pct": error}
    print(
        f"{args.model}, {'LoRA' if args.lora else 'full fine-tuning'}, {args.steps} steps"
        + "".join(f", {item}" for item in args.set)
    )
    print(f"{'run':<22}{'step s':>9}{'peak GB':>10}{'plan GB':>10}{'plan error':>12}")
    for name, row in rows.items():
        label = "1 process" if name == "one" else f"{WORLD} processes, fsdp"
        print(
            f"{label:<22}{row['step_s']:>9.2f}{row['peak_gb']:>10.2f}{row['plan_gb']:>10.2f}"
            f"{row['error_pct']:>+11.1f}%"
        )
    fields = {}
    for name, row in rows.items():
        fields.update(
            {
                f"step_s_{name}": round(row["step_s"], 2),
                f"peak_gb_{name}": round(row["peak_gb"], 2),
                f"plan_gb_{name}": round(row["plan_gb"], 2),
                f"plan_error_pct_{name}": round(row["error_pct"], 1),
            }
        )
    print(result_line(fields))


if __name__ == "__main__":
    main()
