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
    base = {k: v for k, v in os.environ.items()
            if k not in ("LOOPRL_NO_SKIPS", "LOOPRL_ALLOWED_SKIPS")}  # fmt: skip
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
