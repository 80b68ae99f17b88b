"""The health checks of each training step (report/health.py `step_health`): each check by
hand on metric rows, then runs that trip them, warned about or stopped on."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from looprl.cli import app
from looprl.report.health import HEALTH, run_warnings, step_health

GOOD = {"step": 1, "rollout/episodes": 8, "rollout/env_errors": 0, "rollout/unscorable": 0.0,
        "train/tokens": 100, "train/zero_std_groups": 1, "train/updates": 4,
        "train/skipped_steps": 0, "train/loss": 0.1, "train/grad_norm": 0.5}  # fmt: skip


def checks(*rows: dict, patience: int = 2) -> set[str]:
    full = [{**GOOD, "step": i + 1, **row} for i, row in enumerate(rows)]
    return set(step_health(full, patience, groups=2, token_limit=64))


def test_a_healthy_step_fails_no_check():
    assert checks({}, {"train/loss": 0.2}) == set()


def test_each_check_by_hand():
    assert checks({"rollout/env_errors": 8, "train/tokens": 0}) == {"env_errors"}
    unscorable = {"rollout/unscorable": 1.0, "train/tokens": 0, "outcomes/truncated": 1.0}
    assert checks(unscorable) == {"unscorable"}
    equal = {"train/tokens": 0, "train/zero_std_groups": 2, "train/updates": 0}
    assert checks(equal) == set()  # one step of equal groups is no problem yet
    assert checks(equal, equal) == {"equal_groups"}
    assert checks({}, equal) == set()
    assert checks({"train/tokens": 0, "train/updates": 0}) == {"no_tokens"}
    assert checks({"train/skipped_steps": 1}) == {"bad_loss"}
    assert checks({"train/loss": 0.3}, {"train/loss": 0.3}) == {"flat_loss"}
    assert checks({"train/loss": 0.3}, {"train/loss": 0.3, "train/updates": 0}) == set()
    assert checks({"train/grad_norm": 0.0}) == {"zero_grad"}
    assert checks({"train/grad_norm": 0.0, "train/updates": 0, "train/tokens": 0}) == {
        "no_tokens"
    }  # no update: a zero norm says nothing


def test_the_unscorable_check_names_the_token_limit_when_episodes_were_cut():
    row = {**GOOD, "rollout/unscorable": 1.0, "outcomes/truncated": 0.75, "outcomes/bad_json": 0.25}
    sentence = step_health([row], 2, 2, 64)["unscorable"]
    assert sentence.endswith(
        "(mostly truncated); rollout.max_new_tokens is 64: raise it (e.g. to 128)"
    )
    row = {**GOOD, "rollout/unscorable": 1.0, "outcomes/bad_json": 1.0}
    sentence = step_health([row], 2, 2, 64)["unscorable"]
    assert "mostly bad_json" in sentence and "max_new_tokens" not in sentence


def test_the_report_lists_each_check_with_its_steps():
    rows = [{**GOOD, "step": s, **({"health/zero_grad": 1} if s in (2, 3) else {})}
            for s in (1, 2, 3)]  # fmt: skip
    text = "\n".join(run_warnings(rows, {}))
    assert "health check zero_grad on 2 of 3 steps (steps 2, 3)" in text
    assert HEALTH["zero_grad"].split(":")[0] in text


TINY = ["--set", "model.name=tiny-random", "--set", "rollout.tasks_per_step=2",
        "--set", "rollout.group_size=2", "--set", "eval.tasks=2",
        "--set", "eval.samples_per_task=1", "--set", "eval.greedy=false",
        "--set", "logging.trackers=[]"]  # fmt: skip


def _run(tmp_path: Path, *args: str):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return result, out, rows


def test_equal_groups_warn_then_the_report_says_so(tmp_path):
    result, out, rows = _run(tmp_path, "--set", "env.name=tests.toy_envs:PickAnything",
                             "--set", "train.steps=3",
                             "--set", "train.health_patience=2")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [bool(r.get("health/equal_groups")) for r in rows] == [False, True, True]
    # warned once, when it started failing
    assert result.stderr.count("every group's rewards were equal for 2 steps") == 1
    assert (
        "health check equal_groups on 2 of 3 steps (steps 2, 3)" in (out / "report.md").read_text()
    )


def test_health_stop_stops_the_run_checkpointed(tmp_path):
    result, out, rows = _run(tmp_path, "--set", "env.name=tests.toy_envs:PickAnything",
                             "--set", "train.steps=4", "--set", "train.health_patience=2",
                             "--set", "train.health=stop")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "health check equal_groups failed at step 2" in result.stderr
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "checkpoints" / "step_000002").is_dir()
    assert (out / "report.md").exists()


def test_every_training_episode_an_env_error_is_a_health_warning(tmp_path):
    result, _, rows = _run(tmp_path, "--set", "env.name=tests.toy_envs:TrainStepFails",
                           "--set", "train.steps=1", "--set", "env.error_budget=100")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert rows[0]["rollout/env_errors"] == rows[0]["rollout/episodes"] == 4
    assert rows[0]["health/env_errors"] == 1
    assert "step 1: every episode ended in env_error" in result.stderr


def test_every_episode_unparsable_or_cut_is_a_health_warning(tmp_path):
    # a free choice of tool on the tiny random model: text that never makes a call
    result, _, rows = _run(tmp_path, "--set", "env.name=tests.toy_envs:PickSeven",
                           "--set", "env.args.tool_choice=auto",
                           "--set", "train.steps=1",
                           "--set", "rollout.max_new_tokens=32")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert rows[0]["rollout/unscorable"] == 1.0 and rows[0]["health/unscorable"] == 1
    assert "step 1: every episode was truncated or unparsable" in result.stderr
