"""What a run shows while it works: one line per phase, and its count as it goes.

The loop reports through one `Progress` object and never prints itself, so what a run
shows is decided here, in one place. On a terminal a phase is a live line (spinner, bar,
count, elapsed time, time remaining) that gives way to one summary line when the phase
ends. Anywhere else (a log file, `nohup`, `tee`, CI, a test) a redrawn bar would only be
noise: a phase writes one line when it starts, one plain line as its count moves (each
training or SFT step, each batch of eval episodes that ends), and one when it ends.
Those count lines are flushed as they are written and carry no carriage return; a phase
whose units end faster than one every `PLAIN_EVERY_S` seconds writes its first and last
count line and at most one in between every `PLAIN_EVERY_S`, so fast steps never flood a
log. Both forms show the time remaining (`ETA`): the phase's mean time per unit so far
times the units left (for episodes played together, once a quarter of them have ended).
`quiet=True` writes nothing. Everything goes to stderr, so that stdout carries only a
command's result (the headline of `looprl run`, the summary of `looprl eval`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as LiveBars

START, DONE = "▶", "✓"
PLAIN_EVERY_S = 10.0  # off a terminal: at most one count line this often (first and last aside)


class Phase:
    """One phase in progress: a count towards a total (optional) and a closing summary.

    `start` units were done before the phase began (a resumed run's steps, a reference
    eval's kept episodes): they count towards the total, not towards the time per unit.
    `concurrent` units are played together (an eval's episodes): the first to end says
    little of the pace, so the ETA waits for a quarter of them. Off a terminal, `say`
    writes the count lines."""

    def __init__(
        self,
        title: str,
        total: int | None,
        unit: str,
        bars: LiveBars | None,
        start: int = 0,
        say: Callable[[str], None] | None = None,
        every: float = PLAIN_EVERY_S,
        concurrent: bool = False,
    ) -> None:
        self.title, self.total, self.unit = title, total, unit
        self.start = self.completed = self.said = start
        self.detail = ""
        self.summary = ""
        self.started = time.monotonic()
        self._said_at = float("-inf")
        self._say, self._every = say, every
        self._first_eta = max(1, math.ceil((total - start) / 4)) if concurrent and total else 1
        self._bars = bars
        self._task = None
        if bars is not None:
            self._task = bars.add_task(title, total=total, count="", eta="")
        self.update(start)

    def update(self, completed: int | None = None, advance: int = 0, detail: str = "") -> None:
        """Set (or advance) the count; `detail` replaces the text after the title."""
        self.completed = (self.completed if completed is None else completed) + advance
        self.detail = detail or self.detail
        if self._bars is not None and self._task is not None:
            title = f"{self.title} · {self.detail}" if self.detail else self.title
            self._bars.update(
                self._task,
                completed=self.completed,
                description=escape(title),
                count=self.count(),
                eta=self.eta(),
            )
        elif self._say is not None and self.total is not None and self.completed > self.said:
            now = time.monotonic()
            first, last = self.said == self.start, self.completed >= self.total
            if first or last or now - self._said_at >= self._every:
                self._said_at, self.said = now, self.completed
                self._say(f"  {self.line()}")

    def line(self) -> str:
        """The count line: `training · 3/10 steps · step 3 · reward +0.250 · ETA 2.5 min`."""
        return " · ".join(x for x in (self.title, self.count(), self.detail, self.eta()) if x)

    def count(self) -> str:
        if self.total is None:
            return ""
        return f"{self.completed}/{self.total} {plural(self.total, self.unit)}"

    def eta(self) -> str:
        """`ETA 2.5 min`, or nothing before the first unit and after the last."""
        if self.total is None or self.completed - self.start < self._first_eta:
            return ""
        left = remaining(
            time.monotonic() - self.started,
            self.completed - self.start,
            self.total - self.completed,
        )
        return "" if left is None else f"ETA {duration(left)}"

    def done(self, summary: str) -> None:
        """What the closing line says after the title (by default: the count and the
        last detail)."""
        self.summary = summary

    def closing(self) -> str:
        return self.summary or " · ".join(x for x in (self.count(), self.detail) if x)


class Progress:
    """Phase lines and live bars on stderr; see the module doc for what goes where."""

    def __init__(
        self, quiet: bool = False, console: Console | None = None, every: float = PLAIN_EVERY_S
    ) -> None:
        self.quiet = quiet
        self.console = console or Console(stderr=True, highlight=False)
        self.every = every  # off a terminal: seconds between count lines (first and last aside)

    @property
    def live(self) -> bool:
        """Bars are drawn only on a terminal."""
        return not self.quiet and self.console.is_terminal

    def note(self, text: str) -> None:
        """A line of its own, outside any phase."""
        if not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)
            self.console.file.flush()  # a log read while the run works has it at once

    @contextmanager
    def phase(
        self,
        title: str,
        total: int | None = None,
        unit: str = "",
        start: int = 0,
        concurrent: bool = False,
    ) -> Iterator[Phase]:
        """`with progress.phase("baseline eval", total=256, unit="episode") as phase:`
        then `phase.update(...)` as work gets done and `phase.done(summary)` at the end;
        `start` and `concurrent`: see `Phase`. A phase left by an exception writes no
        closing line (the error says enough)."""
        if not self.live:
            size = f" ({total} {plural(total, unit)})" if total is not None else ""
            self.note(f"{START} {title}{size}")
            phase = Phase(title, total, unit, None, start, self.note, self.every, concurrent)
            yield phase
        else:
            columns = [SpinnerColumn(), TextColumn("{task.description}")]
            if total is not None:
                columns += [BarColumn(), TextColumn("{task.fields[count]}")]
            columns += [TimeElapsedColumn(), TextColumn("{task.fields[eta]}")]
            bars = LiveBars(*columns, console=self.console, transient=True)
            with bars:
                phase = Phase(title, total, unit, bars, start, concurrent=concurrent)
                yield phase
        summary = f": {phase.closing()}" if phase.closing() else ""
        self.note(f"{DONE} {title}{summary} ({duration(time.monotonic() - phase.started)})")


def remaining(elapsed: float, done: int, left: int) -> float | None:
    """Seconds left at the mean pace so far: elapsed / done × left; None before the first
    unit (no pace yet) and once nothing is left."""
    if done <= 0 or left <= 0:
        return None
    return elapsed / done * left


def plural(n: int, unit: str) -> str:
    return unit if n == 1 or not unit else f"{unit}s"


def duration(seconds: float) -> str:
    """12.3 s, 4.1 min, 1.2 h: as precise as a reader needs."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
