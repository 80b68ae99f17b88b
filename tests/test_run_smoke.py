"""End-to-end runs of the real CLI on the tiny model: the run-folder contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

METRIC_KEYS = {
    "step",
    "rollout/rewards_mean",
    "rollout/rewards_std",
    "response_len",
    "rollout/valid_tool_call_rate",
    "train/loss",
    "train/clip_frac",
    "train/grad_norm",
    "train/lr",
    "train/zero_std_groups",
    "perf/step_s",
    "perf/rollout_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/peak_rss_gb",
}
EVAL_KEYS = {
    "env",
    "model",
    "n",
    "reward_mean",
    "reward_ci95",
    "valid_tool_call_rate",
    "response_len",
    "outcomes",
    "task_seed",
}
SMALL = [
    "--set", "model.name=tiny-random",
    "--set", "rollout.tasks_per_step=2",
    "--set", "rollout.group_size=4",
    "--set", "rollout.max_new_tokens=48",
    "--set", "eval.tasks=4",
    "--set", "train.checkpoint_every=1",
]  # fmt: skip


def looprl(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run = tmp_path_factory.mktemp("smoke") / "run"
    # the greedy eval on 6 held-out tasks of its own (eval.greedy_tasks), not the 4 above
    res = looprl("run", *SMALL, "--set", "train.steps=2", "--set", "eval.greedy_tasks=6",
                 "--out", run)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return run, res


@pytest.fixture(scope="module")
def run_dir(first_run) -> Path:
    return first_run[0]


def files(run: Path) -> dict[str, tuple[int, int]]:
    """Every file under `run` with its size and modification time."""
    return {
        str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run.rglob("*")
        if p.is_file()
    }


def test_run_folder_contract(run_dir):
    for path in ("config.yaml", "metrics.jsonl", "eval/baseline.json", "eval/final.json",
                 "samples/baseline.jsonl", "samples/final.jsonl", "report.md"):  # fmt: skip
        assert (run_dir / path).is_file(), path
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row.keys() >= METRIC_KEYS, METRIC_KEYS - row.keys()
        assert row["perf/peak_rss_gb"] > 0 and row["perf/step_s"] > 0
    baseline = json.loads((run_dir / "eval/baseline.json").read_text())
    final = json.loads((run_dir / "eval/final.json").read_text())
    assert baseline.keys() >= EVAL_KEYS and final.keys() >= EVAL_KEYS
    assert baseline["task_ids"] == final["task_ids"]  # retest on the same tasks
    assert baseline["n"] == 4 * 4  # eval.tasks × eval.samples_per_task
    assert (run_dir / "checkpoints" / "step_000002" / "trainable.safetensors").exists()
    assert "before" in (run_dir / "report.md").read_text()


def test_run_shows_each_phase_and_ends_with_the_headline(first_run):
    run, res = first_run
    starts = [line for line in res.stderr.splitlines() if line.startswith("▶ ")]
    assert starts == [
        "▶ load model",
        "▶ baseline eval (16 episodes)",
        "▶ greedy baseline eval (6 episodes)",
        "▶ training (2 steps)",
        "▶ final eval (16 episodes)",
        "▶ greedy final eval (6 episodes)",
        "▶ write report",
    ]
    for title in ("load model", "baseline eval", "training", "final eval", "write report"):
        assert f"✓ {title}: " in res.stderr, title
    # piped, not a terminal: a plain line per step, flushed as it goes, with the time left
    assert "\r" not in res.stderr
    counted = [line for line in res.stderr.splitlines() if line.startswith("  training · ")]
    assert len(counted) == 2, res.stderr
    assert re.fullmatch(
        r"  training · 1/2 steps · step 1 · reward [+-]\d\.\d{3} · \d+\.\d s "
        r"\(mean \d+\.\d s/step\) · ETA \d+\.\d (s|min)",
        counted[0],
    ), counted[0]
    assert counted[1].startswith("  training · 2/2 steps · step 2 · reward ")
    assert "ETA" not in counted[1]  # nothing left
    # episodes played together: the first to end says nothing of the pace, so no ETA yet
    assert "  baseline eval · 1/16 episodes" in res.stderr.splitlines()
    # the training line closes on the last step's seconds and the mean over the steps
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [s["perf/step_s"] for s in steps]
    assert f"{times[-1]:.1f} s (mean {sum(times) / len(times):.1f} s/step)" in res.stderr
    baseline = json.loads((run / "eval/baseline.json").read_text())
    final = json.loads((run / "eval/final.json").read_text())

    def reward(result: dict) -> str:
        lo, hi = result["reward_ci95"]
        return f"{result['reward_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    reward_line, paired_line, greedy_line, report_line = res.stdout.strip().splitlines()
    assert reward_line == (
        f"held-out reward, 16 episodes, mean [95% CI]: before {reward(baseline)} → "
        f"after {reward(final)}"
    )
    assert paired_line.startswith("paired difference, after − before: ")
    assert f"over {len(set(baseline['task_ids']))} tasks" in paired_line
    greedy = [
        json.loads((run / f"eval/{n}_greedy.json").read_text()) for n in ("baseline", "final")
    ]
    assert greedy[0]["n"] == greedy[1]["n"] == 6 and greedy[0]["temperature"] == 0.0
    assert greedy[0]["task_ids"] == greedy[1]["task_ids"] and len(set(greedy[0]["task_ids"])) == 6
    assert greedy_line.startswith(
        f"greedy (T = 0), 6 episodes: before {reward(greedy[0])} → after {reward(greedy[1])}"
    )
    md = (run / "report.md").read_text()
    assert "6 held-out tasks (task seed 1234), one greedy episode each" in md
    assert "| greedy eval | 6 tasks × 1, T = 0 |" in md
    assert report_line == f"report: {run / 'report.md'}, {run / 'report.html'}"
    # the paired figure is the report's own
    figure = paired_line.split(": ", 1)[1].split(" over ")[0]  # "+0.000 [95% CI …]"
    assert (
        f"Paired difference (after − before, episode by episode): {figure}"
        in (run / "report.md").read_text()
    )


def test_a_run_folder_given_as_the_config_resumes_only_with_resume(run_dir, tmp_path):
    import shutil

    run = tmp_path / "demo"
    shutil.copytree(run_dir, run)
    before = files(run)
    new = tmp_path / "other"
    for args in ([run], [run, "--force"], [run, "--resume", "--out", new]):
        res = looprl("run", *args)
        assert res.returncode == 2, (args, res.stderr[-3000:])
        assert f"{run} is a run folder, not a config file" in res.stderr
        assert f"looprl run --out {run} --resume" in res.stderr
        assert f"looprl run {run / 'config.yaml'} --out " in res.stderr
        assert "Traceback" not in res.stderr
        assert files(run) == before and not new.exists()  # nothing written

    # the newcomer's `looprl run --resume runs/demo`: continues that run in place
    res = looprl("run", "--resume", run)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(resumed)" in res.stderr and "✓ baseline eval: kept from" in res.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2]  # all steps were done already
    assert files(run)["eval/final.json"] != before["eval/final.json"]  # retested
    assert f"report: {run / 'report.md'}" in res.stdout


def test_tensorboard_has_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("rollout/rewards_mean")]
    assert steps == [1, 2]


def test_existing_run_folder_is_not_overwritten(run_dir):
    before = (run_dir / "metrics.jsonl").read_text()
    res = looprl("run", *SMALL, "--out", run_dir)
    assert res.returncode == 2
    assert "--resume" in res.stderr and "--force" in res.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_continues_from_the_last_checkpoint(run_dir, tmp_path):
    import shutil

    run = tmp_path / "resumed"
    shutil.copytree(run_dir, run)
    res = looprl("run", *SMALL, "--set", "train.steps=3", "--out", run, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_eval_a_checkpoint(run_dir, tmp_path):
    out = tmp_path / "eval.json"
    ckpt = run_dir / "checkpoints" / "step_000002"
    res = looprl("eval", *SMALL, "--checkpoint", ckpt, "--out", out, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.read_text())
    final = json.loads((run_dir / "eval/final.json").read_text())
    assert json.loads(res.stdout) == result  # progress goes to stderr: stdout stays JSON
    assert len(out.with_suffix(".episodes.jsonl").read_text().splitlines()) == 16
    assert "▶ eval (16 episodes)" in res.stderr and "✓ eval: reward " in res.stderr
    # same weights, same tasks, same greedy decoding: the same rewards
    assert result["rewards"] == final["rewards"]


def test_multi_turn_game_full_finetune_with_gradient_checkpointing(tmp_path):
    run = tmp_path / "game"
    res = looprl(
        "run", *SMALL,
        "--set", "env.name=tictactoe-game",
        "--set", "env.args={opponent: random}",
        "--set", "model.lora.enabled=false",
        "--set", "model.gradient_checkpointing=true",
        "--set", "algo.name=grpo",
        "--set", "train.steps=1",
        "--out", run,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    row = metrics(run)[0]
    assert row["rollout/logprob_gap"] < 1e-3  # engine and trainer agree over many turns
    assert row["response_len"] > 0
    sample = json.loads((run / "samples" / "final.jsonl").read_text().splitlines()[0])
    assert any(m["role"] == "tool" for m in sample["messages"])


def test_export_gives_a_plain_transformers_model(run_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    res = looprl("export", run_dir, "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
