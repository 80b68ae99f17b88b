"""Run one learning benchmark and print its before/after line.

    .venv/bin/python bench/learning/run.py move_forced     # or move_free_sft, game_random
    .venv/bin/python bench/learning/run.py move_forced --set train.steps=10

Writes runs/bench-NAME/ (the usual run folder, report included) and ends with
`RESULT name=... before=... after=... ...` (rewards on the same held-out episodes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    name, extra = sys.argv[1], sys.argv[2:]
    config = HERE / f"{name}.yaml"
    out = Path("runs") / f"bench-{name}"
    started = time.time()
    cmd = [sys.executable, "-m", "looprl.cli", "run", str(config), "--out", str(out), "--force"]
    subprocess.run([*cmd, *extra], check=True)
    minutes = (time.time() - started) / 60
    evals = {p.stem: json.loads(p.read_text()) for p in (out / "eval").glob("*.json")}
    print(f"\n{'stage':<10} {'reward [95% CI]':<28} {'valid calls':>11}  outcomes")
    for stage in ("baseline", "after_sft", "final"):
        if stage in evals:
            r = evals[stage]
            ci = f"{r['reward_mean']:+.3f} [{r['reward_ci95'][0]:+.3f}, {r['reward_ci95'][1]:+.3f}]"
            outcomes = " ".join(f"{k}={v:.0%}" for k, v in r["outcomes"].items())
            print(f"{stage:<10} {ci:<28} {r['valid_tool_call_rate']:>11.1%}  {outcomes}")
    before, after = evals["baseline"], evals["final"]
    fields = {
        "name": name,
        "minutes": f"{minutes:.1f}",
        "before": f"{before['reward_mean']:.3f}",
        "after": f"{after['reward_mean']:.3f}",
        "after_lo": f"{after['reward_ci95'][0]:.3f}",
        "valid_before": f"{before['valid_tool_call_rate']:.3f}",
        "valid_after": f"{after['valid_tool_call_rate']:.3f}",
    }
    if "after_sft" in evals:
        fields["after_sft"] = f"{evals['after_sft']['reward_mean']:.3f}"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
