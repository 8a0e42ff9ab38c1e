"""Progress, with one meaning of ``progress`` across analyses and commands.

Every analysis entry point takes ``progress: bool | None`` and every command ``--progress/--no-progress``;
the steps below an entry point read it from the current execution (``analyses.core.execution``):

- None or True: shown (None, an entry point's default, means the current execution's, which is None
  outside every ``executing``). On a terminal (stderr is a tty) or in a notebook, as a tqdm
  bar; elsewhere (stderr redirected to a file or a pipe: nohup, a cluster job, CI), where a bar
  would be one unreadable line of carriage returns, as plain lines on stderr (``LineProgress``).
- False: nothing.

In a notebook ``progress=None`` keeps tqdm's own rule (``disable=None``: the notebook's widget).

A plain line reads ``report: calibration 2/7 steps (01:12 elapsed)``: the bar's name, done/total
in its unit, the time since the bar began (and, for bars counting items, the time left at the rate so
far: ``total effects 42/300 items (02:39 elapsed, ~16:18 left)``). A bar writes one every ``INTERP_PROGRESS_SECONDS``
seconds (default 30) while it advances, and one when it ends; a bar opened inside another (a sweep
inside a report step) writes that last line only if it lasted the interval, so a report writes
about a line per step and one per 30 s of a long sweep, not one per sweep. Bars whose unit is ``step``
(the report's, the calibration's, the comparison's) write a line at every step.
"""

from __future__ import annotations

import os
import sys
import time
import weakref
from typing import Callable, Iterable, Iterator

from tqdm import autonotebook, std
from tqdm.auto import tqdm

from analyses.core.execution import current
from interp.errors import UserError

INTERVAL_ENV = "INTERP_PROGRESS_SECONDS"
DEFAULT_INTERVAL_S = 30.0
FROM_EXECUTION = object()  # progress_bar's default: the current execution's progress


def progress_bar(iterable: Iterable | None = None, *, progress: bool | None | object = FROM_EXECUTION, **options):
    """A progress bar over ``iterable`` (or a manual one, with ``total=``), shown per ``progress``
    (module docstring; left out: the current execution's, ``analyses.core.execution``): a ``tqdm``, or
    a ``LineProgress`` off a terminal. Both iterate, ``update(n)``, ``set_description_str``,
    ``refresh``, ``close`` and work as context managers."""
    if progress is FROM_EXECUTION:
        progress = current().progress
    if progress is False or _in_notebook() or _stderr_is_terminal():
        return tqdm(iterable, disable=None if progress is None else not progress, **options)
    return LineProgress(iterable, interval=line_interval(), **options)


def _in_notebook() -> bool:
    """tqdm.auto chose its notebook widget (an IPython kernel), not the terminal bar."""
    return autonotebook.tqdm is not std.tqdm


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def line_interval() -> float:
    """Seconds between a bar's plain lines: ``$INTERP_PROGRESS_SECONDS``, default 30."""
    text = os.environ.get(INTERVAL_ENV)
    if text is None:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:
        raise UserError(f"{INTERVAL_ENV}={text!r} must be a number of seconds >= 0 (default {DEFAULT_INTERVAL_S:g})")
    return seconds


# the LineProgress bars open now: a bar opened while another is open is nested (weak, so a bar an
# exception abandoned before its close leaves no trace once it is collected)
_OPEN: weakref.WeakSet = weakref.WeakSet()


class LineProgress:
    """A progress bar written as plain lines on ``sys.stderr`` (the module docstring says when).

    ``desc``, ``total``, ``unit``, ``initial`` mean what they mean to tqdm (``leave`` is accepted
    and changes nothing: a line once written stays); ``interval``: the seconds between lines
    within the bar; ``clock``: seconds, monotonic (``time.monotonic``; tests pass a fake)."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str | None = None, total: float | None = None,
                 unit: str = "it", initial: float = 0, leave: bool = True, interval: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.desc, self.total, self.unit = iterable, desc or "", total, unit
        self.n, self.interval, self.clock = initial, interval, clock
        self.start = self.last_line = clock()
        self.depth, self.lines, self.closed = len(_OPEN), 0, False
        _OPEN.add(self)

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """``n`` more done: a line if the interval has passed since the last, or at each step of a
        bar counting steps; not at the last (``close`` writes that one)."""
        self.n += n
        if self.total is not None and self.n >= self.total:
            return
        if (self.unit == "step" and n) or self.clock() - self.last_line >= self.interval:
            self.refresh()

    def set_description_str(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc
        if refresh and self.unit == "step":
            self.refresh()

    def refresh(self) -> None:
        """Write the bar's line now."""
        self._write(self.line())

    def close(self) -> None:
        """End the bar: its final line, if it is the outermost, wrote lines before or lasted the interval."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        if not self.depth or self.lines or self.clock() - self.start >= self.interval:
            self._write(self.line() + ", done")

    def line(self) -> str:
        """e.g. ``path patching 120/400 items (00:30 elapsed, ~01:10 left)``, indented two spaces per
        bar it is in. The time left is the rate so far carried to the total; it is written for bars
        with a total that have begun and are not done, except those counting steps (a report's
        steps are of very unequal length)."""
        units = "items" if self.unit == "it" else f"{self.unit}s"
        done = f"{self.n:g}" if self.total is None else f"{self.n:g}/{self.total:g}"
        seconds = self.clock() - self.start
        times = f"{std.tqdm.format_interval(seconds)} elapsed"
        if self.total is not None and 0 < self.n < self.total and self.unit != "step":
            times += f", ~{std.tqdm.format_interval(seconds * (self.total - self.n) / self.n)} left"
        return "  " * self.depth + f"{self.desc} {done} {units} ({times})".lstrip()

    def _write(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.lines += 1
        self.last_line = self.clock()
