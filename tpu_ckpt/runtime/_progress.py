"""A one-line progress bar for long operations, drawn only on a terminal.

Long operations (verify, diff --values, export, the benchmark) are run by people at a
terminal, who want to see that something is happening, and by batch jobs whose output goes
to log files, where a bar redrawn with carriage returns is only noise. So the bar is drawn
only when its stream is a TTY; otherwise every method but :meth:`Progress.log` does nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from typing import TextIO

_WIDTH = 40


class Progress:
    """A bar on ``stream`` (stderr by default) counting ``total`` units of ``unit``.

    ``unit="bytes"`` shows sizes (:func:`size`); any other unit is shown as a count (``3/8 reps``).
    Use it as a context manager so the line is finished when the work is. Redraws are
    throttled to ``interval`` seconds: callers may report progress as often as they like.
    """

    def __init__(
        self, label: str, total: int = 0, *, unit: str = "bytes", stream: TextIO | None = None, interval: float = 0.1
    ):
        self.label = label
        self.total = total
        self.done = 0
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream)
        self._interval = interval
        self._started = time.monotonic()
        self._drawn_at: float | None = None

    def __enter__(self) -> Progress:
        if self.total:  # known up front: show the bar before the first (maybe slow) unit of work
            self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, done: int, total: int) -> None:
        """The ``progress(done, total)`` callback form taken by the library's long operations."""
        self.done, self.total = done, total
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def log(self, line: str) -> None:
        """Writes a line above the bar (and just the line when there is no bar)."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write("\r\x1b[K")
        self.stream.write(line + "\n")
        if self.enabled and self._drawn_at is not None:
            self._draw(force=True)
        self.stream.flush()

    def close(self) -> None:
        """Draws the final state and ends the line, so later output starts on a fresh one."""
        if self.enabled and self._drawn_at is not None:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
            self._drawn_at = None

    def _draw(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = self.total and self.done >= self.total
        if not (force or finished) and self._drawn_at is not None and now - self._drawn_at < self._interval:
            return
        self._drawn_at = now
        self.stream.write(f"\r{self._line(now)}\x1b[K")
        self.stream.flush()

    def _line(self, now: float) -> str:
        share = min(self.done / self.total, 1.0) if self.total else 0.0
        filled = int(_WIDTH * share)
        if self.unit == "bytes":
            amount = f"{size(self.done)}/{size(self.total)}"
        else:
            amount = f"{self.done}/{self.total} {self.unit}"
        elapsed = now - self._started
        return f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {share:4.0%} {amount} {elapsed:.0f}s"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def size(nbytes: float) -> str:
    """In the largest unit (powers of 1000) that keeps the number at 1 or more, so that a
    small export reads ``72 B`` rather than ``0.0 MB``; a value that would round up to
    ``1000.0`` moves to the next unit."""
    if nbytes < 1000:
        return f"{int(nbytes)} B"
    value = float(nbytes)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if round(value, 1) < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def table(rows: list[list[str]], right: Collection[int] = ()) -> str:
    """Aligned columns, two spaces apart: greppable and cut-able, unlike a boxed table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"
