"""What a run shows while it works: one line per phase, a live bar within a phase.

The loop reports through one `Progress` object and never prints itself, so what a run
shows is decided here, in one place. On a terminal a phase is a live line (spinner, bar,
count, elapsed time) that gives way to one summary line when the phase ends. Anywhere
else (a log file, a pipe, a test) a bar redrawn hundreds of times would only be noise:
each phase writes one line when it starts and one when it ends. `quiet=True` writes
nothing. Everything goes to stderr, so that stdout carries only a command's result (the
headline of `looprl run`, the JSON of `looprl eval`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as LiveBars

START, DONE = "▶", "✓"


class Phase:
    """One phase in progress: a count towards a total (optional) and a closing summary."""

    def __init__(self, title: str, total: int | None, unit: str, bars: LiveBars | None) -> None:
        self.title, self.total, self.unit = title, total, unit
        self.completed = 0
        self.detail = ""
        self.summary = ""
        self._bars = bars
        self._task = None if bars is None else bars.add_task(title, total=total, count="")
        self.update(0)

    def update(self, completed: int | None = None, advance: int = 0, detail: str = "") -> None:
        """Set (or advance) the count; `detail` replaces the text after the title."""
        self.completed = (self.completed if completed is None else completed) + advance
        self.detail = detail or self.detail
        if self._bars is None or self._task is None:
            return
        title = f"{self.title} · {self.detail}" if self.detail else self.title
        self._bars.update(
            self._task, completed=self.completed, description=escape(title), count=self.count()
        )

    def count(self) -> str:
        if self.total is None:
            return ""
        return f"{self.completed}/{self.total} {plural(self.total, self.unit)}"

    def done(self, summary: str) -> None:
        """What the closing line says after the title (by default: the count and the
        last detail)."""
        self.summary = summary

    def closing(self) -> str:
        return self.summary or " · ".join(x for x in (self.count(), self.detail) if x)


class Progress:
    """Phase lines and live bars on stderr; see the module doc for what goes where."""

    def __init__(self, quiet: bool = False, console: Console | None = None) -> None:
        self.quiet = quiet
        self.console = console or Console(stderr=True, highlight=False)

    @property
    def live(self) -> bool:
        """Bars are drawn only on a terminal."""
        return not self.quiet and self.console.is_terminal

    def note(self, text: str) -> None:
        """A line of its own, outside any phase."""
        if not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)

    @contextmanager
    def phase(self, title: str, total: int | None = None, unit: str = "") -> Iterator[Phase]:
        """`with progress.phase("baseline eval", total=256, unit="episode") as phase:`
        then `phase.update(...)` as work gets done and `phase.done(summary)` at the end.
        A phase left by an exception writes no closing line (the error says enough)."""
        started = time.monotonic()
        if not self.live:
            size = f" ({total} {plural(total, unit)})" if total is not None else ""
            self.note(f"{START} {title}{size}")
            phase = Phase(title, total, unit, None)
            yield phase
        else:
            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if total is not None:
                columns += [BarColumn(), TextColumn("{task.fields[count]}")]
            bars = LiveBars(*columns, TimeElapsedColumn(), console=self.console, transient=True)
            with bars:
                phase = Phase(title, total, unit, bars)
                yield phase
        summary = f": {phase.closing()}" if phase.closing() else ""
        self.note(f"{DONE} {title}{summary} ({duration(time.monotonic() - started)})")


def plural(n: int, unit: str) -> str:
    return unit if n == 1 or not unit else f"{unit}s"


def duration(seconds: float) -> str:
    """12.3 s, 4.1 min, 1.2 h: as precise as a reader needs."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
