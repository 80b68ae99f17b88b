"""Run one learning benchmark and print its before/after line.

    .venv/bin/python bench/learning/run.py move_forced     # or move_free_sft, game_random,
                                                           # gemma_move_sft (make setup-gemma)
    .venv/bin/python bench/learning/run.py move_forced --set train.steps=10
    .venv/bin/python bench/learning/run.py --extra-only move_forced   # re-tests only
    .venv/bin/python bench/learning/run.py --result-only move_greedy [RUN_DIR]  # RESULT again

Writes runs/bench-NAME/ (the usual run folder, report included) and ends with
`RESULT name=... before=... after=... ...` (rewards on the same held-out episodes).
The run's own greedy evals (eval.greedy) add `greedy_before`/`greedy_after` and their
outcome shares (with `_ci`: a 95% Wilson interval) to that line, `expert` (the env's
demonstrations played on the same held-out tasks: what imitation alone could reach) and,
for multi-turn envs, `distinct_before`/`distinct_after` (how many different transcripts
the greedy held-out episodes contain: the games a seeded opponent makes the policy
play). Then it re-evaluates the base model and the final checkpoint under the extra
settings listed in EXTRA_EVALS (e.g. another opponent), writing
runs/bench-NAME/eval/extra-*.json, and prints one `EXTRA ...` line per setting.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from looprl.config import load_config
from looprl.envs import make_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.harness import looprl_run, result_line

HERE = Path(__file__).parent
GREEDY = ["eval.temperature=0", "eval.samples_per_task=1"]
# Extra re-tests of the same base model and final checkpoint: name -> --set overrides.
EXTRA_EVALS: dict[str, dict[str, list[str]]] = {
    "move_forced": {"greedy": GREEDY},
    "move_free_sft": {"greedy": GREEDY},
    "gemma_move_sft": {"greedy": GREEDY},
    "game_random": {
        "vs_random_greedy": GREEDY,
        "vs_minimax_sampled": ["env.args.opponent=minimax"],
    },
}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a share k/n (sound at 0% and 100%, unlike p ± 2 SE)."""
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def distinct_transcripts(samples: Path) -> int:
    """How many different conversations (system prompt aside) an eval's samples hold."""
    rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return len({json.dumps(r["messages"][1:], sort_keys=True) for r in rows})


def expert_reference(env: Any, tasks: list) -> dict | None:
    """The env's demonstrations played on `tasks` (`looprl envs check`'s expert agent):
    mean reward and outcome shares; None when the env has no demonstrations."""
    from looprl.envs.check import AgentStats, play

    stats = AgentStats()
    for task in tasks:
        if play(env, task, "expert", random.Random(0), stats) is None:
            return None
    shares = {k: v / stats.episodes for k, v in sorted(stats.outcomes.items())}
    return {"mean": sum(stats.rewards) / stats.episodes, "outcomes": shares}


def extra_evals(name: str, out: Path) -> None:
    """Evaluate the base model and the final checkpoint under each extra setting."""
    final = sorted((out / "checkpoints").glob("step_*"))[-1]
    for label, sets in EXTRA_EVALS.get(name, {}).items():
        line = [f"EXTRA name={name} eval={label}"]
        for stage, ckpt in (("before", None), ("after", final)):
            path = out / "eval" / f"extra-{label}-{stage}.json"
            cmd = [sys.executable, "-m", "looprl.cli", "eval", str(out / "config.yaml")]
            cmd += ["--out", str(path)]
            cmd += [arg for s in sets for arg in ("--set", s)]
            cmd += ["--checkpoint", str(ckpt)] if ckpt else []
            subprocess.run(cmd, check=True, capture_output=True)
            r = json.loads(path.read_text())
            outcomes = ",".join(f"{k}:{v:.2f}" for k, v in r["outcomes"].items())
            lo, hi = r["reward_ci95"]
            line.append(f"{stage}={r['reward_mean']:.3f} {stage}_ci={lo:.3f}..{hi:.3f} "
                        f"{stage}_outcomes={outcomes}")  # fmt: skip
        print(" ".join(line), flush=True)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if sys.argv[1] == "--extra-only":  # re-test a finished benchmark run
        extra_evals(sys.argv[2], Path("runs") / f"bench-{sys.argv[2]}")
        return
    if sys.argv[1] == "--result-only":  # the RESULT line of a finished run folder, again
        print_result(
            sys.argv[2], Path(sys.argv[3] if len(sys.argv) > 3 else f"runs/bench-{sys.argv[2]}")
        )
        return
    name, extra = sys.argv[1], sys.argv[2:]
    if len(extra) % 2 or any(flag != "--set" for flag in extra[::2]):
        sys.exit(f"after the benchmark's name, only `--set KEY=VALUE` pairs: {' '.join(extra)}")
    out = Path("runs") / f"bench-{name}"
    run = looprl_run(out, HERE / f"{name}.yaml", overrides=extra[1::2])
    if run.returncode != 0:
        sys.exit(f"looprl run failed with exit code {run.returncode}")
    print_result(name, out, run.wall_s / 60)
    extra_evals(name, out)


def print_result(name: str, out: Path, minutes: float | None = None) -> None:
    """The stage table and the RESULT line of run folder `out`."""
    evals = {p.stem: json.loads(p.read_text()) for p in (out / "eval").glob("*.json")}
    print(f"\n{'stage':<10} {'reward [95% CI]':<28} {'valid calls':>11}  outcomes")
    stages = ("baseline", "after_sft", "final", "baseline_greedy", "after_sft_greedy")
    for stage in (*stages, "final_greedy"):
        if stage in evals:
            r = evals[stage]
            ci = f"{r['reward_mean']:+.3f} [{r['reward_ci95'][0]:+.3f}, {r['reward_ci95'][1]:+.3f}]"
            outcomes = " ".join(f"{k}={v:.0%}" for k, v in r["outcomes"].items())
            print(f"{stage:<10} {ci:<28} {r['valid_tool_call_rate']:>11.1%}  {outcomes}")
    before, after = evals["baseline"], evals["final"]
    fields = {
        "name": name,
        "minutes": "?" if minutes is None else f"{minutes:.1f}",
        "before": f"{before['reward_mean']:.3f}",
        "after": f"{after['reward_mean']:.3f}",
        "after_lo": f"{after['reward_ci95'][0]:.3f}",
        "valid_before": f"{before['valid_tool_call_rate']:.3f}",
        "valid_after": f"{after['valid_tool_call_rate']:.3f}",
    }
    if "after_sft" in evals:
        fields["after_sft"] = f"{evals['after_sft']['reward_mean']:.3f}"
    if "after_sft_greedy" in evals:
        fields["greedy_after_sft"] = f"{evals['after_sft_greedy']['reward_mean']:.3f}"
    greedy = {"before": evals.get("baseline_greedy"), "after": evals.get("final_greedy")}
    if None not in greedy.values():  # eval.greedy: T = 0 on the same tasks
        seen = {k for r in greedy.values() for k in r["outcomes"]}
        for side, r in greedy.items():
            fields[f"greedy_{side}"] = f"{r['reward_mean']:.3f}"
            for label in ("win", "draw", "illegal", "optimal", "success"):
                if label in seen:  # 0% after is a figure too, when it was there before
                    k = r["episode_outcomes"].count(label)
                    lo, hi = wilson(k, r["n"])
                    fields[f"greedy_{side}_{label}"] = f"{k / r['n']:.3f}"
                    fields[f"greedy_{side}_{label}_ci"] = f"{lo:.3f}..{hi:.3f}"
    cfg = load_config(out / "config.yaml")
    env = make_env(cfg.env.name, cfg.env.args)
    expert = expert_reference(env, env.tasks("eval", n=cfg.eval.tasks, seed=cfg.eval.seed))
    if expert is not None:
        fields["expert"] = f"{expert['mean']:.3f}"
        fields["expert_outcomes"] = ",".join(f"{k}:{v:.2f}" for k, v in expert["outcomes"].items())
    if env.max_turns > 1:  # multi-turn: how many different games the greedy episodes are
        for stage, side in (("baseline_greedy", "before"), ("final_greedy", "after")):
            samples = out / "samples" / f"{stage}.jsonl"
            if samples.exists():
                fields[f"distinct_{side}"] = str(distinct_transcripts(samples))
    print(result_line(fields), flush=True)


if __name__ == "__main__":
    main()
