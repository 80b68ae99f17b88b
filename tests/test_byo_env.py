"""The README's bring-your-own-env example: it passes the env test kit and trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from looprl.envs import env_class
from looprl.envs.check import check_env

ROOT = Path(__file__).parent.parent
EXAMPLE = "examples.sum_env:SumEnv"


def test_example_is_short_and_in_the_docs():
    source = (ROOT / "examples" / "sum_env.py").read_text()
    assert len(source.splitlines()) <= 50
    assert source in (ROOT / "docs" / "byo-env.md").read_text()  # the page shows it whole


def test_example_passes_the_env_test_kit():
    report = check_env(EXAMPLE)
    assert report.ok, [(c.name, c.detail) for c in report.checks if not c.ok]
    assert report.agents["expert"].rewards == [1.0] * 64


def test_example_runs_from_its_folder(tmp_path):
    # `package.module:Class` imports from the working directory, like `python -m`.
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "looprl.cli", "run", "--out", str(out),
           "--set", f"env.name={EXAMPLE}", "--set", "model.name=tiny-random",
           "--set", "train.steps=1", "--set", "rollout.tasks_per_step=2",
           "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=40",
           "--set", "eval.tasks=2", "--set", "eval.samples_per_task=1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads((out / "eval" / "final.json").read_text())
    assert final["env"] == EXAMPLE and final["n"] == 2
    assert env_class(EXAMPLE).name == "sum"
