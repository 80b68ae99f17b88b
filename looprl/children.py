"""Child processes looprl starts and looks after, in one place: each dies with looprl (even
when looprl is killed), writes its output to a log whose tail the error messages quote, and
the live ones are kept by key and stopped when looprl exits. Used by the vLLM server
(engine/vllm_server.py), the verifiers worker (envs/adapters/verifiers_env.py) and the MCP
servers (envs/adapters/mcp_client.py). Standard library only."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

T = TypeVar("T")


def stop_with_parent() -> None:
    """In the child before it starts (Linux): SIGTERM it when looprl dies, even by SIGKILL,
    so that no orphaned child keeps its memory."""
    with contextlib.suppress(OSError):  # not Linux: no such call
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(command: list[str], log: Path, *, merge_stdout: bool, **popen: Any) -> subprocess.Popen:
    """`command` started to die with looprl, its stderr (and its stdout too when
    `merge_stdout`) written to `log`; `popen` are further `subprocess.Popen` arguments."""
    with open(log, "wb") as sink:
        if merge_stdout:
            popen.update(stdout=sink, stderr=subprocess.STDOUT)
        else:
            popen.update(stderr=sink)
        return subprocess.Popen(command, preexec_fn=stop_with_parent, **popen)


def stop(process: subprocess.Popen | None, grace_s: float | None = None) -> None:
    """Stop `process` if it still runs: SIGTERM and up to `grace_s` seconds to exit, then
    SIGKILL (at once when `grace_s` is None)."""
    if process is None or process.poll() is not None:
        return
    if grace_s is not None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
    process.kill()
    process.wait()


def log_lines(log: Path, lines: int, prefer: Callable[[str], bool] | None = None) -> list[str]:
    """The last `lines` lines of the log (of those `prefer` picks, when it picks any)."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    chosen = [line for line in text if prefer(line)] if prefer else []
    return (chosen or text)[-lines:]


def file_tail(file: IO[Any], chars: int) -> str:
    """The last `chars` characters of an open log file, without moving its position."""
    fd = file.fileno()
    size = os.fstat(fd).st_size
    return os.pread(fd, chars, max(0, size - chars)).decode("utf-8", "replace").strip()


class Children(Generic[T]):
    """Live children by key (one per configuration), started again when one has died, and
    all closed when looprl exits."""

    def __init__(self, close: Callable[[T], None], close_at_exit: bool = True) -> None:
        self._close = close
        self._live: dict[Hashable, T] = {}
        self.lock = threading.Lock()
        if close_at_exit:  # else its owner closes them, as MCP does to let them settle
            atexit.register(self.close_all)

    def get(self, key: Hashable, start: Callable[[], T], alive: Callable[[T], bool]) -> T:
        """The live child of `key`, started with `start()` when there is none."""
        with self.lock:
            child = self._live.get(key)
            if child is None or not alive(child):
                child = self._live[key] = start()
            return child

    def close_all(self) -> list[T]:
        """Close every child and forget them; returns those closed."""
        with self.lock:
            children = list(self._live.values())
            self._live.clear()
        for child in children:
            self._close(child)
        return children
