"""Several processes (torchrun, gloo on the CPU) train the same run as one process.

The same config and seed on 1 process, on 2 processes of one node, and on 2 "nodes" of
one process each (two torchrun launches on localhost) give the same metrics per step and
the same trainable weights; a checkpoint resumes at the other world size; a rank that
fails stops the whole job quickly, with its error in the output.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from looprl.config import load_config
from looprl.errors import ConfigError
from looprl.loop.checkpoint import checkpoint_weights
from looprl.loop.dist import Dist, share_bounds
from looprl.loop.progress import Progress
from looprl.loop.train import train

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SMALL = [
    "model.name=tiny-random",
    "env.name=dist_env:ChecksumEnv",  # rewards differ within a group: every step trains
    "rollout.tasks_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=16",
    "eval.tasks=3",  # does not split evenly over 2 ranks, and need not
    "eval.samples_per_task=1",
    "train.steps=2",
    "train.checkpoint_every=1",
    "logging.trackers=[]",
]
COMPARED = [
    "rollout/rewards_mean",
    "rollout/rewards_std",
    "response_len",
    "train/zero_std_groups",
    "train/loss",
    "train/clip_frac",
    "train/grad_norm",
    "train/lr",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    return env


def run_args(out: Path, *sets: str, resume: bool = False) -> list[str]:
    args = ["-m", "looprl", "run", "--out", str(out), "--force"]
    if resume:
        args = ["-m", "looprl", "run", "--out", str(out), "--resume"]
    for item in [*SMALL, *sets]:
        args += ["--set", item]
    return args


def launch(cmd: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=environment(**env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]
    return output


def one_process(out: Path, *sets: str, resume: bool = False) -> str:
    return finish(launch([sys.executable, *run_args(out, *sets, resume=resume)]))


def one_node(out: Path, *sets: str, resume: bool = False) -> str:
    cmd = [*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *run_args(out, *sets, resume=resume)]  # fmt: skip
    return finish(launch(cmd))


def two_nodes(out: Path) -> None:
    port = str(free_port())
    procs = [
        launch([*TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
                "--master_addr", "127.0.0.1", "--master_port", port, *run_args(out)])
        for node in (0, 1)
    ]  # fmt: skip
    for proc in procs:
        finish(proc)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights, whole (from its shards when it is sharded)."""
    return checkpoint_weights(run / "checkpoints" / f"step_{step:06d}")


def assert_same_step(a: Path, b: Path, step: int) -> None:
    """Step `step` of runs a and b, sampled from equal weights: equal metrics, and weights
    that agree to within a small part of what one optimizer step moves them."""
    xa = {m["step"]: m for m in metrics(a)}[step]
    xb = {m["step"]: m for m in metrics(b)}[step]
    for key in COMPARED:
        assert xa[key] == pytest.approx(xb[key], rel=1e-3, abs=1e-5), (key, step)
    wa, wb = weights(a, step), weights(b, step)
    # one step's movement in run a: into this step, or for the first out of it
    before, after = (weights(a, step - 1), wa) if step > 1 else (wa, weights(a, step + 1))
    for name in wa:
        moved = (after[name] - before[name]).norm()
        assert (wa[name] - wb[name]).norm() <= 0.05 * moved, name
    assert sum((after[n] - before[n]).norm() for n in wa) > 0  # the step did train


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs of the same config on other world sizes. The first step and the baseline
    eval are compared exactly; after the first update the weights differ by rounding
    (the gradients are summed in another order, and Adam turns a gradient at rounding
    level into a step of up to lr), and a tiny random model's near-uniform next-token
    distribution turns that into other samples, so later steps are compared where they
    start from equal weights (test_checkpoints_resume_at_another_world_size)."""
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    assert_same_step(a, b, 1)
    for m in ma[1:] + mb[1:]:
        assert m["train/loss"] is not None  # every step trained (see dist_env)
    ea, eb = (json.loads((run / "eval" / "baseline.json").read_text()) for run in (a, b))
    assert (ea["n"], ea["reward_mean"]) == (eb["n"], eb["reward_mean"])
    fa, fb = (json.loads((run / "eval" / "final.json").read_text()) for run in (a, b))
    assert fa["n"] == fb["n"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same run on 1 process, on 2 processes of one node, and on 2 nodes."""
    root = tmp_path_factory.mktemp("dist")
    out = {name: root / name for name in ("one", "two", "nodes")}
    one_process(out["one"])
    one_node(out["two"])
    two_nodes(out["nodes"])
    return out


def test_two_processes_train_like_one(runs):
    assert_same_run(runs["one"], runs["two"])
    # the eval tasks split 2 + 1 and come back whole, in order, to rank 0
    samples = (runs["two"] / "samples" / "final.jsonl").read_text().splitlines()
    assert [json.loads(s)["task_id"] for s in samples] == [
        json.loads(s)["task_id"]
        for s in (runs["one"] / "samples" / "final.jsonl").read_text().splitlines()
    ]


def test_two_nodes_train_like_one(runs):
    assert_same_run(runs["one"], runs["nodes"])


def test_expert_guidance_on_two_processes_trains_like_one(tmp_path):
    """Each rank adds the expert episodes of its own groups before the gather."""
    sets = ["algo.expert_samples=1", "rollout.group_size=3"]
    one_process(tmp_path / "one", *sets)
    one_node(tmp_path / "two", *sets)
    assert_same_step(tmp_path / "one", tmp_path / "two", 1)
    for run in ("one", "two"):
        assert metrics(tmp_path / run)[0]["train/expert_advantage"] != 0


def test_checkpoints_resume_at_another_world_size(runs, tmp_path):
    """A 2-process checkpoint resumed for one more step on 1 process and on 2 processes:
    the same step from the same weights."""
    import shutil

    on_one, on_two = tmp_path / "on_one", tmp_path / "on_two"
    shutil.copytree(runs["two"], on_one)
    shutil.copytree(runs["two"], on_two)
    one_process(on_one, "train.steps=3", resume=True)
    one_node(on_two, "train.steps=3", resume=True)
    assert [m["step"] for m in metrics(on_one)] == [1, 2, 3]
    assert [m["step"] for m in metrics(on_two)] == [1, 2, 3]
    assert_same_step(on_one, on_two, 3)


def test_a_failing_rank_stops_the_job(tmp_path):
    """Rank 1 raises at its first training step while rank 0 plays on into a collective:
    the job ends non-zero soon after, with rank 1's error in its output."""
    cmd = [*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *run_args(tmp_path / "run")]  # fmt: skip
    proc = launch(cmd, LOOPRL_TEST_FAIL_RANK="1")  # the default collective timeout: 300 s
    output, _ = proc.communicate(timeout=240)
    ended = time.time()
    assert proc.returncode != 0
    match = re.search(r"rank 1 fails on purpose at ([0-9.]+)", output)
    assert match, output[-4000:]
    assert "[rank 1] failed: RuntimeError" in output
    assert ended - float(match.group(1)) < 60  # not a hang until a timeout


def test_tasks_per_step_must_split_over_the_ranks(tmp_path):
    cfg = load_config(None, [*SMALL, "rollout.tasks_per_step=3"])
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="multiple of 2"):
        train(cfg, out, Dist(rank=0, world=2), False, False, Progress(quiet=True))
    assert not out.exists()  # refused before anything was written


def test_shares_are_contiguous_and_cover_everything():
    for n in range(7):
        for world in (1, 2, 3):
            bounds = [share_bounds(n, rank, world) for rank in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [end - start for start, end in bounds]
            assert max(sizes) - min(sizes) <= 1
