"""The objectives' evidence table: RL arms from one SFT warm start, paired on the same episodes.

    .venv/bin/python bench/learning/objectives.py demo --seeds 0,1
    .venv/bin/python bench/learning/objectives.py bookings --seeds 0 --arms gspo,icepop
    .venv/bin/python bench/learning/objectives.py demo --seeds 0,1 --table-only

For each seed, the task's SFT warm start is made once (`looprl run` with `train.steps=0`
and a 2-episode eval, its checkpoint exported as a plain folder, LoRA merged) unless
`--start SEED=DIR` names a folder already exported (`looprl export RUN --checkpoint
RUN/checkpoints/rl_start`). Then each arm runs the task's RL steps from that folder
(`sft.enabled=false`, a fresh LoRA), under `rollout.max_staleness=1` (overlapped rollouts,
one step stale), with the anchor the task's run has after an SFT stage
(`algo.kl_coef=0.1`, k2, to the warm start: with the SFT merged in, `base` is the warm
start). The arms differ only in the objective and the importance-sampling correction:

    gspo     algo.name=gspo   algo.is_correction=token_truncate  (the default objective)
    cispo    algo.name=cispo  algo.is_correction=token_truncate
    grpo     algo.name=grpo   algo.is_correction=token_truncate
    icepop   algo.name=gspo   algo.is_correction=icepop

Every arm's baseline eval is its start (the same weights and eval seeds), so within a seed
each arm's "RL stage" (final − baseline) and each arm against `gspo` (final − final) are
paired on the same held-out episodes. Runs go to runs/objectives/TASK-sSEED-ARM/; an arm
whose report.md (written last) is there is not run again. Ends with the tables (markdown)
and one `RESULT` line per arm.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

from looprl.report import load_eval, paired_stats, read_metrics

ROOT = Path(__file__).resolve().parents[2]
LOOPRL = [sys.executable, "-m", "looprl"]
CONFIGS = {"demo": "examples/demo.yaml", "bookings": "bench/learning/bookings.yaml"}
ANCHOR = ["algo.kl_coef=0.1", "algo.kl_estimator=k2", "rollout.max_staleness=1"]
ARMS = {
    "gspo": ["algo.name=gspo", "algo.is_correction=token_truncate"],
    "cispo": ["algo.name=cispo", "algo.is_correction=token_truncate"],
    "grpo": ["algo.name=grpo", "algo.is_correction=token_truncate"],
    "icepop": ["algo.name=gspo", "algo.is_correction=icepop"],
}


def sets(pairs: list[str]) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def run(cmd: list[str], log: Path) -> None:
    print("$", " ".join(cmd), flush=True)
    with log.open("w") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        sys.exit(f"exit {code}: {' '.join(cmd)} (log: {log})")


def warm_start(task: str, seed: int, out: Path, extra: list[str]) -> Path:
    """The task's SFT warm start for this seed, exported as a plain folder."""
    folder = out / f"{task}-s{seed}-sft-model"
    if (folder / "config.json").is_file():
        return folder
    sft_run = out / f"{task}-s{seed}-sft"
    # its evals are not used (each arm's baseline is this start): the fewest the run takes
    quick = ["eval.tasks=2", "eval.samples_per_task=1", "eval.greedy=false"]
    pairs = [f"seed={seed}", "train.steps=0", *quick, *extra]
    cmd = [*LOOPRL, "run", CONFIGS[task], "--out", str(sft_run), "--force", *sets(pairs)]
    run(cmd, out / f"{task}-s{seed}-sft.log")
    ckpts = sorted((sft_run / "checkpoints").glob("step_*"))
    if not ckpts:
        sys.exit(f"{sft_run} wrote no checkpoint to export")
    run(
        [*LOOPRL, "export", str(sft_run), "--checkpoint", str(ckpts[-1]), "--out", str(folder)],
        out / f"{task}-s{seed}-export.log",
    )
    return folder


def arm_run(task: str, seed: int, arm: str, start: Path, out: Path, extra: list[str]) -> Path:
    folder = out / f"{task}-s{seed}-{arm}"
    if (folder / "report.md").is_file():
        return folder
    pairs = [f"seed={seed}", f"model.name={start}", "sft.enabled=false", *ANCHOR, *ARMS[arm]]
    run(
        [*LOOPRL, "run", CONFIGS[task], "--out", str(folder), "--force", *sets(pairs + extra)],
        out / f"{task}-s{seed}-{arm}.log",
    )
    return folder


STEP_MEANS = (
    "train/zero_std_groups",
    "train/clip_frac",
    "rollout/mismatch_kl",
    "train/is_truncated_frac",
    "train/is_masked_frac",
    "train/kl",
)


def step_means(folder: Path) -> dict[str, float]:
    """Each STEP_MEANS metric's mean over the run's steps (nan where never logged)."""
    rows = read_metrics(folder)
    out = {}
    for key in STEP_MEANS:
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


def cell(before: dict | None, after: dict | None) -> tuple[str, str]:
    """'+0.012 [-0.010, +0.035]' and its compact 'mean,lo,hi' for the RESULT line."""
    if before is None or after is None:
        return "-", "nan,nan,nan"
    paired = paired_stats(before, after)
    if isinstance(paired, str):
        return f"not paired: {paired}", "nan,nan,nan"
    return (
        f"{paired.mean:+.3f} [{paired.lo:+.3f}, {paired.hi:+.3f}]",
        f"{paired.mean:.4f},{paired.lo:.4f},{paired.hi:.4f}",
    )


EVALS = ("baseline", "final", "baseline_greedy", "final_greedy")


def seed_evals(task: str, seed: int, arms: list[str], out: Path) -> dict[str, dict]:
    """arm → eval name → EvalResult (None where the file is missing)."""
    return {
        arm: {
            name: load_eval(out / f"{task}-s{seed}-{arm}" / "eval" / f"{name}.json")
            for name in EVALS
        }
        for arm in arms
    }


def pooled(per_seed: dict[int, dict[str, dict]], arm: str, name: str) -> dict | None:
    """One eval's episodes of every seed as one EvalResult; a task is (seed, task id)."""
    parts = [(seed, ev[arm][name]) for seed, ev in per_seed.items()]
    if any(result is None or "rewards" not in result for _, result in parts):
        return None
    rewards = [r for _, result in parts for r in result["rewards"]]
    ids = [f"s{seed}:{t}" for seed, result in parts for t in result["task_ids"]]
    finite = [r for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
    return {"rewards": rewards, "task_ids": ids, "reward_mean": sum(finite) / len(finite)}


def table(task: str, seeds: list[int], arms: list[str], out: Path) -> None:
    print(f"\n### {task}: RL arms from the SFT warm start, paired on the same episodes\n")
    print(
        "| seed | arm | final, sampled | RL stage, sampled | RL stage, greedy "
        "| − gspo, sampled | − gspo, greedy |"
    )
    print("|---|---|---|---|---|---|---|")
    per_seed = {seed: seed_evals(task, seed, arms, out) for seed in seeds}
    blocks: list[tuple[str, dict[str, dict]]] = [(str(s), ev) for s, ev in per_seed.items()]
    if len(seeds) > 1:
        blocks.append(("all", {a: {n: pooled(per_seed, a, n) for n in EVALS} for a in arms}))
    lines = []
    for label, ev in blocks:
        ref = ev.get("gspo")
        for arm in arms:
            e = ev[arm]
            if e["final"] is None:
                print(f"| {label} | {arm} | not run | | | | |")
                continue
            stage, stage_c = cell(e["baseline"], e["final"])
            greedy, greedy_c = cell(e["baseline_greedy"], e["final_greedy"])
            vs, vs_c = ("(reference)", "nan,nan,nan")
            vs_g, vs_g_c = vs, vs_c
            if arm != "gspo" and ref is not None:
                vs, vs_c = cell(ref["final"], e["final"])
                vs_g, vs_g_c = cell(ref["final_greedy"], e["final_greedy"])
            print(
                f"| {label} | {arm} | {e['final']['reward_mean']:+.3f} | {stage} | {greedy} "
                f"| {vs} | {vs_g} |"
            )
            lines.append(
                f"RESULT task={task} seed={label} arm={arm} "
                f"start={e['baseline']['reward_mean']:.4f} final={e['final']['reward_mean']:.4f} "
                f"stage={stage_c} stage_greedy={greedy_c} vs_gspo={vs_c} vs_gspo_greedy={vs_g_c}"
            )
    print("\nPer-step means (" + ", ".join(STEP_MEANS) + "):\n")
    print("| seed | arm | " + " | ".join(k.split("/")[1] for k in STEP_MEANS) + " |")
    print("|---|---|" + "---|" * len(STEP_MEANS))
    for seed in seeds:
        for arm in arms:
            folder = out / f"{task}-s{seed}-{arm}"
            if (folder / "metrics.jsonl").is_file():
                means = step_means(folder)
                print(
                    f"| {seed} | {arm} | "
                    + " | ".join(f"{means[k]:.3f}" for k in STEP_MEANS)
                    + " |"
                )
    print()
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=sorted(CONFIGS))
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument(
        "--start", action="append", default=[], metavar="SEED=DIR", help="an exported warm start"
    )
    parser.add_argument("--out", default="runs/objectives", help="folder of the runs")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run"
    )
    parser.add_argument("--table-only", action="store_true", help="print the table of runs made")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    if any("=" not in item for item in args.start):
        parser.error(f"--start takes SEED=DIR, got {args.start}")
    starts = {
        seed: Path(folder).resolve() for seed, folder in (i.split("=", 1) for i in args.start)
    }
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for seed in seeds:
            given = starts.get(str(seed))
            start = given or warm_start(args.task, seed, out, args.set)
            for arm in arms:
                arm_run(args.task, seed, arm, start, out, args.set)
    table(args.task, seeds, arms, out)


if __name__ == "__main__":
    main()
