"""On-policy distillation from a teacher behind a server (`algo.teacher: URL/v1#MODEL`):
`looprl serve` in a subprocess on a tiny random teacher saved to a folder gives the same
distillation KL as the same teacher loaded locally; a server with another tokenizer, an
unreachable one and a student sampling at another temperature are refused before
anything is written; the teacher's held-out reward is the report's paired row."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from looprl.cli import app
from looprl.config import config_from_dict
from looprl.errors import ConfigError
from looprl.model.load import load_tokenizer
from looprl.model.tiny import build_tiny
from looprl.report.stats import paired_stats, reward_with_ci
from tests.run_flags import TINY_RUN, set_flags
from tests.serving_helpers import wait_until

TINY = set_flags(*TINY_RUN, "train.steps=1", "algo.name=opd")


def _save_teacher(
    out: Path, extra_tokens: list[str] | None = None, context: int | None = None
) -> Path:
    """A tiny random llama (not the student's weights) with the SmolLM2 tokenizer, or
    with `extra_tokens` added to it (another tokenizer); `context`: the most tokens the
    server reads (shorter than an episode: every scoring request is refused)."""
    tokenizer = load_tokenizer("tiny-random")
    if extra_tokens:
        tokenizer.add_tokens(extra_tokens)
    out.mkdir(parents=True)
    model = build_tiny("llama", tokenizer, seed=3)
    if context is not None:
        model.config.max_position_embeddings = context
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1):
            return True
    except OSError:
        return False


def _serve(folder: Path) -> Iterator[str]:
    """`looprl serve FOLDER` in a subprocess; its base URL (…/v1) while it runs."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "looprl",
        "serve",
        str(folder),
        "--port",
        str(port),
        "--device",
        "cpu",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        if not wait_until(lambda: _up(base) or server.poll() is not None, timeout=120):
            raise RuntimeError("looprl serve did not start in 120 s")
        assert server.poll() is None, server.stderr.read().decode()  # type: ignore[union-attr]
        yield f"{base}/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return _save_teacher(tmp_path_factory.mktemp("teacher") / "tiny-teacher")


@pytest.fixture(scope="module")
def url(teacher) -> Iterator[str]:
    yield from _serve(teacher)


def _run(out: Path, *args: str):
    return CliRunner().invoke(app, ["run", *TINY, *args, "--out", str(out)])


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def test_a_served_teacher_gives_the_local_teachers_distill_kl(teacher, url, tmp_path):
    local = _run(tmp_path / "local", "--set", f"algo.teacher={teacher}")
    assert local.exit_code == 0, local.output
    served = _run(tmp_path / "served", "--set", f"algo.teacher={url}#tiny-teacher")
    assert served.exit_code == 0, served.output
    a, b = _metrics(tmp_path / "local")[0], _metrics(tmp_path / "served")[0]
    assert a["rollout/rewards_mean"] == b["rollout/rewards_mean"]  # the same episodes
    assert abs(a["train/distill_kl"]) > 1e-3  # another model: something to distil
    assert b["train/distill_kl"] == pytest.approx(a["train/distill_kl"], abs=1e-5)
    # the teacher's held-out row: the run's episodes, paired against the trained model
    for name, out in (("local", tmp_path / "local"), ("served", tmp_path / "served")):
        kept = json.loads((out / "eval" / "teacher.json").read_text())
        final = json.loads((out / "eval" / "final.json").read_text())
        assert kept["n"] == 4 and kept["task_ids"] == final["task_ids"], name
        assert kept["model"] == (str(teacher) if name == "local" else "tiny-teacher")
        paired = paired_stats(kept, final)
        assert not isinstance(paired, str)
        report = (out / "report.md").read_text()
        assert "## Teacher (" in report and reward_with_ci(kept) in report
        said = f"Paired difference (trained − teacher, episode by episode): {paired.mean:+.3f}"
        assert said in report
    assert "teacher tiny-teacher: " in served.stdout


def test_a_server_with_another_tokenizer_is_refused_before_anything_is_written(tmp_path):
    other = _save_teacher(tmp_path / "other", extra_tokens=[" distillation", " teacher"])
    for served in _serve(other):
        result = _run(tmp_path / "run", "--set", f"algo.teacher={served}")
        assert result.exit_code == 2, result.output
        assert "tokenizes otherwise than the student" in result.output
        assert "scores the same texts as other token ids" in result.output
    assert not (tmp_path / "run").exists()


def test_a_failing_request_stops_the_run_checkpointed_with_the_resume_command(tmp_path):
    """The server answers the probe but refuses every episode (its context is shorter):
    the step stops before any weight moved, the state after step 0 checkpointed, with an
    error naming the URL and the command that continues the run."""
    short = _save_teacher(tmp_path / "short", context=64)
    out = tmp_path / "run"
    for served in _serve(short):
        result = _run(out, "--set", f"algo.teacher={served}")
    assert result.exit_code == 2, result.output
    assert f"algo.teacher: {served}/completions answered HTTP 400" in result.output
    assert f"looprl run --out {out} --resume" in result.output
    assert (out / "eval" / "baseline.json").is_file()
    assert (out / "checkpoints" / "step_000000").is_dir()
    assert not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text()


def test_an_unreachable_server_and_a_missing_model_are_clear_errors(url, tmp_path):
    result = _run(tmp_path / "run", "--set", "algo.teacher=http://127.0.0.1:9/v1")
    assert result.exit_code == 2 and "http://127.0.0.1:9/v1/models failed" in result.output
    result = _run(tmp_path / "run", "--set", f"algo.teacher={url}#nope")
    assert result.exit_code == 2 and "does not serve 'nope'" in result.output
    assert not (tmp_path / "run").exists()


def test_a_server_teacher_needs_the_student_sampling_at_temperature_1():
    served = {"algo": {"name": "opd", "teacher": "http://127.0.0.1:8000/v1"}}
    with pytest.raises(ConfigError, match="scores the student's tokens at temperature 1"):
        config_from_dict({**served, "rollout": {"temperature": 0.7}})
    assert config_from_dict(served).rollout.temperature == 1.0
    local = {"algo": {"name": "opd", "teacher": "tiny-random"}, "rollout": {"temperature": 0.7}}
    assert config_from_dict(local).rollout.temperature == 0.7  # a local one scores at T
