"""The test tiers (tests/conftest.py): `make test-fast` leaves out what took long in the
last recorded run, and with LOOPRL_NO_SKIPS=1 (CI) a skipped test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest in a child, with these variables and none of CI's own (`.ci/run` exports
    LOOPRL_NO_SKIPS for the suite this test runs in)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOOPRL_NO_SKIPS", "LOOPRL_ALLOWED_SKIPS") and not k.startswith("PYTEST_XDIST")
    }  # fmt: skip  (a child is no worker)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**base, **env}, timeout=300)  # fmt: skip


def test_the_fast_tier_leaves_out_the_slow_tests():
    known = json.loads((ROOT / "tests" / "durations.json").read_text())
    slow = [k for k, (setup, call) in known.items() if setup + call >= 5.0]
    assert slow  # the recorded run had training runs
    listed = _pytest("-o", "addopts=", "-m", "not slow", "--collect-only", "-q",
                     "tests/test_run_smoke.py",
                     "tests/test_algo.py").stdout  # fmt: skip
    assert "tests/test_algo.py::" in listed
    assert "tests/test_run_smoke.py::" not in listed  # every one of them runs the loop


def test_with_no_skips_a_skip_fails_unless_allowed(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\ndef test_a():\n    pytest.skip('vLLM is not installed')\n")
    args = ("-p", "tests.conftest", "-q", str(probe))
    assert _pytest(*args).returncode == 0  # a skip, on a machine without it
    failed = _pytest(*args, LOOPRL_NO_SKIPS="1")
    assert failed.returncode == 1
    assert "skipped where LOOPRL_NO_SKIPS=1" in failed.stdout + failed.stderr
    allowed = _pytest(*args, LOOPRL_NO_SKIPS="1", LOOPRL_ALLOWED_SKIPS="not installed")
    assert allowed.returncode == 0
    on_a_worker = _pytest(*args, "-n", "1", LOOPRL_NO_SKIPS="1")  # as `make test` runs
    assert on_a_worker.returncode == 1
    assert "skipped where LOOPRL_NO_SKIPS=1" in on_a_worker.stdout + on_a_worker.stderr


def test_parallel_workers_get_the_longest_files_first():
    known = json.loads((ROOT / "tests" / "durations.json").read_text())
    seconds = {name: sum(sum(v) for k, v in known.items() if k.startswith(f"tests/{name}::"))
               for name in ("test_algo.py", "test_run_smoke.py")}  # fmt: skip
    assert seconds["test_run_smoke.py"] > seconds["test_algo.py"]
    args = ("-o", "addopts=", "--collect-only", "-q", "tests/test_algo.py",
            "tests/test_run_smoke.py")  # fmt: skip
    serial = [line for line in _pytest(*args).stdout.splitlines() if "::" in line]
    assert serial[0].startswith("tests/test_algo.py::")  # as given
    worker = [line for line in _pytest(*args, PYTEST_XDIST_WORKER="gw0").stdout.splitlines()
              if "::" in line]  # fmt: skip
    assert worker[0].startswith("tests/test_run_smoke.py::")
    assert sorted(worker) == sorted(serial)
