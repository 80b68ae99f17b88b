"""Two source trees of looprl, the same short runs, every metric compared key by key.

A refactor that claims "behaviour unchanged" shows it here: each lever of the loop gets a
short run (tiny-random unless said) through the real CLI, once with each tree's `looprl`
on PYTHONPATH, and the runs' `metrics.jsonl` rows and `eval/*.json` results are compared
key by key. Timings, memory and the run's own paths differ between any two runs and are
left out (IGNORED). Runs go one at a time: two torch processes on a small CPU slow each
other, and this is a check of values, not a benchmark.

    python bench/checks/same_metrics.py --before /path/to/old/tree --after . --out runs/same
    python bench/checks/same_metrics.py --before OLD --after NEW --only overlap,replay

`--before-out DIR` reuses the old tree's runs from an earlier call (they take the longest
when the same old tree is compared against several new ones). Ends with a RESULT line:
`identical` when every run matched on every key, else the runs and keys that differ.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import result_line  # noqa: E402

TINY = ["model.name=tiny-random", "eval.tasks=4", "eval.samples_per_task=2", "seed=3"]
# Several levers in one run (the old spelling algo.entropy_coef: every tree reads it).
LEVERS = [
    "algo.dynamic_sampling=true", "algo.max_oversample=2", "curriculum.enabled=true",
    "algo.greedy_samples=1", "algo.entropy_coef=0.2", "algo.loss_on=free", "algo.kl_coef=0.05",
    "algo.tis_cap=2", "algo.num_minibatches=2",
]  # fmt: skip
STEPS = ["train.steps=2", "rollout.tasks_per_step=4", "rollout.group_size=4"]

# name -> (the `--set` overrides, the run it replays or None). One lever or a related few
# per run, so a difference names the lever that moved.
RUNS: dict[str, tuple[list[str], str | None]] = {
    "levers": (
        [
            *TINY,
            *STEPS,
            *LEVERS,
            "logging.save_rollouts=true",
        ],
        None,
    ),
    "grpo-extraction": (
        [
            *TINY,
            *STEPS,
            "env.name=extraction",
            "algo.name=grpo",
            "rollout.max_new_tokens=112",
            "algo.dynamic_sampling=true",
        ],
        None,
    ),
    "workflow": ([*TINY, *STEPS, "env.name=workflow", "rollout.max_new_tokens=48"], None),
    "expert-sft": (
        [
            *TINY,
            *STEPS,
            "algo.expert_samples=1",
            "algo.expert_baseline=samples",
            "sft.enabled=true",
            "sft.steps=2",
            "sft.batch_size=4",
        ],
        None,
    ),
    "game-turns-snapshot": (
        [
            *TINY,
            *STEPS,
            "env.name=tictactoe-game",
            "env.args.opponent=mix:random=0.5,snapshot=0.5",
            "env.args.move_rewards=true",
            "algo.name=gspo_turn",
            "algo.turn_reward_weight=0.5",
            "train.checkpoint_every=1",
        ],
        None,
    ),
    "mix": (
        [
            *TINY,
            *STEPS,
            "rollout.max_new_tokens=112",
            'env.mix=[{"name": "tictactoe-move"}, {"name": "extraction"}]',
        ],
        None,
    ),
    "data-file": (  # a config file first: the run's CONFIG argument
        [
            "examples/bookings/run.yaml",
            *TINY,
            *STEPS,
            "sft.steps=2",
            "sft.batch_size=4",
            "eval.greedy_tasks=4",
        ],
        None,
    ),
    "overlap": ([*TINY, *STEPS, "rollout.max_staleness=1", "algo.tis_cap=2"], None),
    "replay": (
        [
            *TINY,
            *STEPS,
            *LEVERS,
        ],
        "levers",
    ),
    # the demo's shape on the real model, shortened (SmolLM2-135M; a few minutes)
    "demo-short": (
        [
            "env.args.board_view=grid+threats",
            "sft.enabled=true",
            "sft.steps=3",
            "sft.batch_size=16",
            "sft.lr=5.0e-4",
            "sft.loss_on=free",
            "train.steps=2",
            "eval.tasks=16",
            "eval.greedy_tasks=16",
            "model.gradient_checkpointing=true",
        ],
        None,
    ),
}

# Keys whose values differ between any two runs of the same code: wall-clock, memory, paths.
IGNORED = ("_s", "time", "seconds", "rss", "memory", "peak", "per_s", "/s", "tokens_per",
           "elapsed", "started", "finished", "path", "run_dir", "eta")  # fmt: skip


def ignored(key: str) -> bool:
    return any(part in key.lower() for part in IGNORED)


def run_one(tree: Path, name: str, out: Path, log: Path) -> float:
    sets, replays = RUNS[name]
    sets = list(sets)
    if replays is not None:
        sets.append(f"train.replay={out.parent / replays}")
    config = [sets.pop(0)] if sets and sets[0].endswith(".yaml") else []
    cmd = [sys.executable, "-m", "looprl", "run", *config, "--out", str(out), "--force"]
    for item in sets:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.time()
    with log.open("w") as sink:
        done = subprocess.run(cmd, cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{name} failed in {tree} (exit {done.returncode}):\n" + "\n".join(tail))
    return time.time() - t0


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        flat: dict[str, object] = {}
        for key, inner in value.items():
            flat.update(flatten(inner, f"{prefix}{key}."))
        return flat
    if isinstance(value, list):
        flat = {}
        for i, inner in enumerate(value):
            flat.update(flatten(inner, f"{prefix}{i}."))
        return flat
    return {prefix.rstrip("."): value}


def run_values(run: Path) -> dict[str, object]:
    """Every compared value of a run: its metrics rows and eval results, flattened."""
    values: dict[str, object] = {}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        values.update(flatten(row, f"metrics.step{row.get('step')}."))
    for path in sorted((run / "eval").glob("*.json")):
        values.update(flatten(json.loads(path.read_text()), f"eval.{path.stem}."))
    return {key: value for key, value in values.items() if not ignored(key)}


def relative(a: object, b: object) -> float:
    """How far two values are apart: 0 when equal, inf when they differ other than as
    two finite numbers (a label, a count, a missing value)."""
    if a == b or (
        isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    ):
        return 0.0
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if not numbers or isinstance(a, int) and isinstance(b, int):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def differences(before: dict[str, object], after: dict[str, object], rtol: float) -> list[str]:
    found = [f"{key}: only before" for key in before if key not in after]
    found += [f"{key}: only after" for key in after if key not in before]
    found += [
        f"{key}: {before[key]!r} -> {after[key]!r} "
        f"(relative {relative(before[key], after[key]):.1e})"
        for key in before
        if key in after and relative(before[key], after[key]) > rtol
    ]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="The old source tree.")
    parser.add_argument("--after", type=Path, default=Path("."), help="The new source tree.")
    parser.add_argument("--out", type=Path, default=Path("runs/same-metrics"))
    parser.add_argument("--before-out", type=Path, help="The old tree's runs, made earlier.")
    parser.add_argument("--only", help="Comma-separated run names (default: all).")
    parser.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        help="Floats this close (relative) count as equal; 0 = bit for bit. The update on "
        "a CPU is not bit-reproducible run to run (threads), so compare the same tree with "
        "itself first to know the floor.",
    )
    parser.add_argument(
        "--before-only", action="store_true", help="Make the old tree's runs and stop."
    )
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; expected some of {list(RUNS)}")
    for name in names:  # a replayed run needs the run it replays
        replays = RUNS[name][1]
        if replays is not None and replays not in names:
            names.insert(names.index(name), replays)
    before_out = args.before_out or args.out / "before"
    failed: dict[str, list[str]] = {}
    print(f"{'run':22} {'before s':>9} {'after s':>9} {'keys':>6}  differences")
    for name in names:
        took = []
        sides = [(args.before, before_out), (args.after, args.out / "after")]
        for tree, out in sides[: 1 if args.before_only else 2]:
            run = out / name
            if out == args.before_out and (run / "metrics.jsonl").exists():
                took.append(float("nan"))
                continue
            out.mkdir(parents=True, exist_ok=True)
            took.append(run_one(tree.resolve(), name, run.resolve(), out / f"{name}.log"))
        if args.before_only:
            print(f"{name:22} {took[0]:9.1f}")
            continue
        old, new = run_values(before_out / name), run_values(args.out / "after" / name)
        found = differences(old, new, args.rtol)
        if found:
            failed[name] = found
        print(f"{name:22} {took[0]:9.1f} {took[1]:9.1f} {len(old):6d}  {len(found)}")
        for line in found[:10]:
            print(f"    {line}")
    summary = "identical" if not failed else "differ:" + ",".join(failed)
    print(result_line({"runs": len(names), "differing": len(failed), "verdict": summary}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
