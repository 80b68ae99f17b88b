"""Shared fixtures: the SmolLM2 tokenizer, the tiny random model and a renderer for them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from looprl.chat import ChatRenderer
from looprl.model.load import load_causal_lm, load_tokenizer

# pytest-xdist gives its workers COLUMNS=80 and LINES=24; a rich console made at import
# (looprl.cli's) would keep that width, whatever width a test's CliRunner sets later.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

# The tiny model is far too small for intra-op threads to pay off; with a busy machine
# they make every forward pass orders of magnitude slower.
torch.set_num_threads(1)

# Property tests check what is generated, not how fast: on a loaded 2-core machine a
# single example can take longer than hypothesis's default 200 ms deadline.
settings.register_profile("looprl", deadline=None)
settings.load_profile("looprl")


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="session")
def tiny_model():
    model = load_causal_lm("tiny-random", torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, model_name="tiny-random")


# ---------------------------------------------------------------------- test tiers
# `make test-fast` runs the tests that took under FAST_S in the last full run recorded in
# tests/durations.json (`make durations` records it; a test not in it counts as fast
# until the next recording): units and contracts, no training runs. A test whose module-
# or class-scoped fixture took FAST_S to set up (wherever that happened) is slow too: in
# the fast tier it would pay that setup itself. `make test` runs all.
DURATIONS = Path(__file__).parent / "durations.json"
FAST_S = 0.5


def _shared_fixtures(item) -> set[str]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {name for name, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope in ("module", "class")}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    slow_setups = {
        (item.module.__name__, name)
        for item in items
        if known.get(item.nodeid, [0.0, 0.0])[0] >= FAST_S
        for name in _shared_fixtures(item)
    }
    for item in items:
        setup, call = known.get(item.nodeid, [0.0, 0.0])
        shared = {(item.module.__name__, name) for name in _shared_fixtures(item)}
        if setup + call >= FAST_S or shared & slow_setups:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _longest_files_first(items, known)


def _longest_files_first(items, known) -> None:
    """Under pytest-xdist (`make test`: one test file per worker at a time, handed out in
    collection order) the files go longest first by their recorded durations, so that no
    long file starts last and leaves the other workers idle. Within a file the order stays."""
    seconds: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        seconds[path] = seconds.get(path, 0.0) + sum(known.get(item.nodeid, [0.0, 0.0]))
    rank = {path: i for i, path in enumerate(sorted(seconds, key=lambda p: (-seconds[p], p)))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # a stable sort


_recorded: dict[str, list[float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("LOOPRL_RECORD_DURATIONS"):
        times = _recorded.setdefault(item.nodeid, [0.0, 0.0])
        times[0 if report.when == "setup" else 1] += report.duration
    if report.skipped and _no_skips() and not hasattr(report, "wasxfail"):
        _fail_skip(report)


def pytest_collectreport(report):
    if report.skipped and _no_skips():  # a module skipped whole (importorskip at its top)
        _fail_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("LOOPRL_RECORD_DURATIONS") and _recorded:
        rows = [f"{json.dumps(k)}: [{v[0]:.3f}, {v[1]:.3f}]" for k, v in sorted(_recorded.items())]
        DURATIONS.write_text("{\n" + ",\n".join(rows) + "\n}\n")


# CI (`.ci/run`) installs every optional part the suite tests (vLLM, Gemma, Chromium,
# verifiers, the trackers): there a skip means a broken install and fails the test,
# unless its reason matches LOOPRL_ALLOWED_SKIPS (what the machine truly cannot have).
def _no_skips() -> bool:
    return os.environ.get("LOOPRL_NO_SKIPS") == "1"


def _fail_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    allowed = os.environ.get("LOOPRL_ALLOWED_SKIPS")
    if allowed and re.search(allowed, reason):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped where LOOPRL_NO_SKIPS=1 (CI installs every optional part): {reason}"
