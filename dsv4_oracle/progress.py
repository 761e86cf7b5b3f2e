"""A live progress bar for ``dsv4-oracle check`` on stderr.

It draws only when the stream is a terminal (and not with ``--no-progress``), redraws one line
in place, and erases it when done, so that stdout (the summary table) and logs of CI runs stay
clean. No threads: it is redrawn at the start and end of every case. Where it does not draw,
``lines=True`` (``dsv4-oracle check -v`` writing to a file) writes one flushed line per finished
case instead, so a long run that is cut off still leaves what it finished in its log.
"""
from __future__ import annotations

import shutil
import sys
import time

__all__ = ["ProgressBar", "progress_enabled"]


def progress_enabled(stream=None, disabled: bool = False) -> bool:
    """True when a progress bar should be drawn on ``stream`` (default stderr)."""
    stream = sys.stderr if stream is None else stream
    if disabled:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _clock(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """``check X [#######------]  12/33  sink-mixed            0:21  ~0:35 left  1 failing``.

    The bar, the counts and the case id keep their width for the whole run (the id padded or
    cut to ``id_width``, the label cut to 32 characters), so the line does not jump as cases
    finish."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None, label: str = "check",
                 lines: bool = False, id_width: int = 24):
        self.total = max(int(total), 0)
        self.enabled = enabled
        self.lines = lines and not enabled
        self.stream = sys.stderr if stream is None else stream
        self.label = label
        self.done = 0
        self.failing = 0
        self.t0 = time.perf_counter()
        self._width = 0
        self.id_width = id_width
        self._bar_w = None                  # fixed at the first draw
    def __call__(self, event: str, case, outcome) -> None:
        """The :func:`dsv4_oracle.runner.run_check` callback."""
        if event == "done":
            self.done += 1
            self.failing += int(outcome is not None and not outcome.passed)
            if self.lines:
                verdict = ("ERROR" if outcome is None or outcome.error else
                           "PASS" if outcome.passed else "FAIL")
                took = f"  {outcome.elapsed_s:.1f} s" if outcome is not None else ""
                self.stream.write(f"{self.label}: {self.done}/{self.total}  {case.id}  "
                                  f"{verdict}{took}\n")
                self.stream.flush()
        self.draw(case.id if event == "start" else "")

    def line(self, current: str = "") -> str:
        cols = shutil.get_terminal_size((100, 20)).columns
        elapsed = time.perf_counter() - self.t0
        frac = self.done / self.total if self.total else 1.0
        left = (_clock(elapsed / self.done * (self.total - self.done)) if self.done else "-:--")
        fail = f"  {self.failing} failing" if self.failing else ""
        n = len(str(self.total))
        label = self.label[:32]
        if self._bar_w is None:             # fixed at the first draw: the line never jumps
            # room for the label, a bar of 10, the counts, clocks and a failing count
            room = cols - 1 - len(label) - 12 - (2 * n + 2) - 22 - 14
            self.id_width = max(8, min(self.id_width, room))
            self._bar_w = max(10, min(40, room - self.id_width + 10))
        cur = current[:self.id_width].ljust(self.id_width)
        tail = f" {self.done:>{n}}/{self.total}  {cur}  {_clock(elapsed):>5}  ~{left:>5} left"
        fill = int(round(frac * self._bar_w))
        line = f"{label} [{'#' * fill}{'-' * (self._bar_w - fill)}]{tail}{fail}"
        return line[:cols - 1]

    def draw(self, current: str = "") -> None:
        if not self.enabled:
            return
        text = self.line(current)
        pad = " " * max(0, self._width - len(text))
        self.stream.write("\r" + text + pad)
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
