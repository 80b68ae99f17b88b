"""Long runs survive: exact resume after SIGKILL, atomic checkpoints, Ctrl-C, NaN and
out-of-memory handling. Tiny model, CPU, deterministic settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import looprl.loop.update as update
from looprl.config import Config, config_from_dict
from looprl.errors import LoopRLError
from looprl.loop.checkpoint import list_checkpoints, load_weights, save_checkpoint
from looprl.loop.train import run_training

TOY = [
    "--set", "model.name=tiny-random",
    "--set", "model.tool_format=llama3",
    "--set", "env.name=toy_envs:PickSeven",
    "--set", "rollout.tasks_per_step=2",
    "--set", "rollout.group_size=4",
    "--set", "rollout.max_new_tokens=32",
    "--set", "eval.tasks=2",
    "--set", "train.lr=1e-3",
    "--set", "train.checkpoint_every=1",
    "--set", "logging.tensorboard=false",
]  # fmt: skip
TESTS = Path(__file__).parent


def start(*args: str | Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "looprl.cli", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def comparable(row: dict) -> dict:
    """Everything but timings and memory, which legitimately differ between runs."""
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    """Tolerance: exact equality (same ops, same order, single process on CPU)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    ref = start("run", *TOY, "--set", "train.steps=4", "--out", straight)
    assert ref.wait(timeout=600) == 0, ref.communicate()[1][-3000:]

    proc = start("run", *TOY, "--set", "train.steps=4", "--out", killed)
    wait_for(
        lambda: (
            len(list_checkpoints(killed)) and list_checkpoints(killed)[-1].name >= "step_000002"
        ),
        proc,
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = start("run", *TOY, "--set", "train.steps=4", "--out", killed, "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]

    a, b = metrics(straight), metrics(killed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    final_a = json.loads((straight / "eval/final.json").read_text())
    final_b = json.loads((killed / "eval/final.json").read_text())
    assert final_a["rewards"] == final_b["rewards"]


def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(tmp_path):
    run = tmp_path / "run"
    proc = start("run", *TOY, "--set", "train.steps=50", "--set", "train.checkpoint_every=0",
                 "--out", run)  # fmt: skip
    wait_for(lambda: (run / "metrics.jsonl").exists() and metrics(run), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "--resume" in err
    step = metrics(run)[-1]["step"]
    assert step < 50
    assert list_checkpoints(run)[-1].name == f"step_{step:06d}"
    assert "Stopped after step" in (run / "report.md").read_text()
    # resuming needs no config: the run's own config.yaml is used (+ overrides)
    resumed = start("run", "--out", run, "--resume", "--set", f"train.steps={step + 1}")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [r["step"] for r in metrics(run)] == list(range(1, step + 2))


def test_killed_checkpoint_writer_leaves_the_previous_checkpoint(tmp_path):
    """A writer SIGKILLed in the middle of a checkpoint write."""
    script = f"""
import os, signal, sys, torch
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
import looprl.loop.checkpoint as ck
model = torch.nn.Linear(3, 3)
opt = torch.optim.AdamW(model.parameters())
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
run = Path({str(tmp_path)!r})
ck.save_checkpoint(run, 1, model, opt, sched, {{}}, keep=3, sharded=False)
with torch.no_grad():
    model.weight.add_(1.0)
real_save = torch.save
def dying_save(*a, **k):
    real_save(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
ck.torch.save = dying_save
ck.save_checkpoint(run, 2, model, opt, sched, {{}}, keep=3, sharded=False)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    assert list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written folder
    model = torch.nn.Linear(3, 3)
    assert load_weights(model, list_checkpoints(tmp_path)[-1])["step"] == 1
    # the next save cleans the leftover up
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(tmp_path, 3, model, opt, sched, {}, keep=3, sharded=False)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def _toy(steps: int = 3, **train) -> dict:
    return {
        "model": {"name": "tiny-random", "tool_format": "llama3"},
        "env": {"name": "toy_envs:PickSeven"},
        "rollout": {"tasks_per_step": 2, "group_size": 4, "max_new_tokens": 32},
        "train": {"steps": steps, "checkpoint_every": 1, **train},
        "eval": {"tasks": 2},
        "logging": {"tensorboard": False},
    }


def test_nan_loss_skips_updates_then_stops(tmp_path, monkeypatch):
    real = update.LOSSES["gspo"]

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setitem(update.LOSSES, "gspo", nan_loss)
    run = tmp_path / "run"
    with pytest.raises(LoopRLError, match="NaN/inf"):
        run_training(config_from_dict(_toy(steps=10, max_bad_steps=2)), run)
    rows = metrics(run)
    assert sum(r["train/skipped_steps"] > 0 for r in rows) == 2  # train.max_bad_steps
    assert rows[-1]["train/skipped_steps"] > 0 and len(rows) < 10
    # weights and optimizer state untouched: the LoRA B matrices are still all zero
    from safetensors.torch import load_file

    state = load_file(str(list_checkpoints(run)[-1] / "trainable.safetensors"))
    lora_b = [t for name, t in state.items() if "lora_B" in name]
    assert lora_b and all(bool((t == 0).all()) for t in lora_b)
    opt = torch.load(list_checkpoints(run)[-1] / "state.pt", weights_only=False)["optimizer"]
    assert opt["state"] == {}


def test_out_of_memory_halves_the_micro_batch_and_retries(tmp_path, monkeypatch):
    real = update.sequence_logprobs

    def small_memory(model, sequences, *args, **kwargs):
        if len(sequences) > 2:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return real(model, sequences, *args, **kwargs)

    monkeypatch.setattr(update, "sequence_logprobs", small_memory)
    run = tmp_path / "run"
    run_training(config_from_dict(_toy(steps=2)), run)
    rows = metrics(run)
    assert rows[-1]["train/micro_batch_tokens"] < Config().train.micro_batch_tokens
    assert all(r["train/skipped_steps"] == 0 for r in rows)


def test_out_of_memory_gives_up_with_advice(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of memory")

    monkeypatch.setattr(update, "sequence_logprobs", no_memory)
    with pytest.raises(LoopRLError, match="gradient_checkpointing"):
        run_training(config_from_dict(_toy(steps=1)), tmp_path / "run")
