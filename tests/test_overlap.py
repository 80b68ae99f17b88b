"""rollout.max_staleness: overlapped rollouts played by a rollout thread on a replica of
the policy, each step's episodes sampled by the version K steps back, never staler."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import config_from_dict
from looprl.loop.train import run_training

TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=4", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]", "--set", "algo.tis_cap=2.0",
        "--set", "train.lr=0.02"]  # fmt: skip


def _run(out: Path, *args: str, code: int = 0):
    result = CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])
    assert result.exit_code == code, result.output
    return result


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def _steady(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def test_k0_is_the_synchronous_run(tmp_path):
    _run(tmp_path / "default", "--set", "train.steps=2")
    _run(tmp_path / "k0", "--set", "train.steps=2", "--set", "rollout.max_staleness=0")
    a, b = _rows(tmp_path / "default"), _rows(tmp_path / "k0")
    assert [_steady(r) for r in a] == [_steady(r) for r in b]
    assert all(r["rollout/staleness_max"] == 0 for r in a)
    final = [json.loads((tmp_path / n / "eval" / "final.json").read_text())
             for n in ("default", "k0")]  # fmt: skip
    assert final[0]["rewards"] == final[1]["rewards"]


@pytest.mark.parametrize("k", [1, 2])
def test_no_episode_is_staler_than_k_and_a_run_is_reproducible(tmp_path, k):
    for name in ("a", "b"):
        _run(tmp_path / name, "--set", "train.steps=5", "--set", f"rollout.max_staleness={k}")
    rows = _rows(tmp_path / "a")
    # step t samples from the weights after step t - 1 - K (the start's when earlier)
    assert [r["rollout/staleness_max"] for r in rows] == [min(k, s - 1) for s in range(1, 6)]
    assert [r["rollout/staleness_mean"] for r in rows] == [min(k, s - 1) for s in range(1, 6)]
    assert all(r["rollout/mismatch_kl"] >= 0 for r in rows)
    assert rows[-1]["rollout/mismatch_kl"] > 0  # sampled by older weights than it trains
    # paced by versions, not by timing: two runs give the same steps
    assert [_steady(r) for r in rows] == [_steady(r) for r in _rows(tmp_path / "b")]


def test_the_steps_rollouts_differ_from_the_synchronous_runs(tmp_path):
    # four groups a step, not two: the versions differ only where a step updated, which
    # takes a group of unequal rewards (with two groups of four, a seed may draw none)
    more = ["--set", "train.steps=3", "--set", "rollout.tasks_per_step=4"]
    _run(tmp_path / "sync", *more)
    _run(tmp_path / "k1", *more, "--set", "rollout.max_staleness=1")
    sync, k1 = _rows(tmp_path / "sync"), _rows(tmp_path / "k1")
    assert sync[0]["rollout/entropy"] == k1[0]["rollout/entropy"]  # both: the start's weights
    for step in (1, 2):  # versions 1 and 0, then 2 and 1
        assert sync[step]["rollout/entropy"] != k1[step]["rollout/entropy"]


def test_a_dying_rollout_thread_stops_the_run_resumable(tmp_path):
    out = tmp_path / "run"
    result = _run(out, "--set", "env.name=tests.toy_envs:TasksFailAtStep3",
                  "--set", "train.steps=4", "--set", "rollout.max_staleness=1",
                  "--set", "train.checkpoint_every=1", code=2)  # fmt: skip
    assert "the rollout thread failed playing step 3" in result.stderr
    assert "simulated task-source outage" in result.stderr
    assert "looprl run --out" in result.stderr and "--resume" in result.stderr
    assert [r["step"] for r in _rows(out)] == [1, 2]
    assert (out / "checkpoints" / "step_000002").is_dir()


def test_a_killed_overlapped_run_resumes(tmp_path):
    """SIGKILL with the rollout thread ahead of the trainer: the resumed run plays the
    steps after its checkpoint again, from the checkpoint's weights (the first one fresh,
    staleness 0, then K again), and finishes."""
    from looprl.loop.checkpoint import list_checkpoints
    from tests.test_reliability import TOY, metrics, start, wait_for

    run = tmp_path / "run"
    args = [*TOY, "--set", "rollout.max_staleness=1", "--set", "algo.tis_cap=2.0",
            "--set", "train.steps=5", "--set", "train.checkpoint_every=1"]  # fmt: skip
    proc = start("run", *args, "--out", run)
    wait_for(lambda: len(list_checkpoints(run)) and list_checkpoints(run)[-1].name >= "step_000002",
             proc)  # fmt: skip
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = int(list_checkpoints(run)[-1].name.removeprefix("step_"))
    resumed = start("run", *args, "--out", run, "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    after = [r["rollout/staleness_max"] for r in rows[kept:]]
    assert after == [0, 1, 1, 1][: len(after)]


def test_overlap_needs_truncated_importance_sampling(tmp_path):
    result = _run(tmp_path / "a", "--set", "rollout.max_staleness=1", "--set",
                  "algo.tis_cap=null", code=2)  # fmt: skip
    assert "set algo.tis_cap" in result.stderr
    assert not (tmp_path / "a").exists()


def test_a_run_learns_with_overlapped_rollouts(tmp_path):
    from tests.test_learning import _config, _hit_rate

    cfg = _config()
    cfg["rollout"]["max_staleness"] = 1
    cfg["algo"]["tis_cap"] = 2.0
    result = run_training(config_from_dict(cfg), tmp_path / "run")
    early, late = _hit_rate(tmp_path / "run", 4, 4)
    assert late > early + 0.2, (early, late)
    assert result["final"]["reward_mean"] > result["baseline"]["reward_mean"] + 0.2
