"""The live progress bar of ``dsv4-oracle check`` (``dsv4_oracle.progress``): drawn on a
terminal only, never with ``--no-progress`` or when stderr is a pipe or a file (CI logs stay
clean), one line redrawn in place and erased at the end."""
from __future__ import annotations

import io
from types import SimpleNamespace

from dsv4_oracle.progress import ProgressBar, progress_enabled


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_enabled_only_on_a_terminal():
    assert progress_enabled(FakeTTY()) is True
    assert progress_enabled(FakeTTY(), disabled=True) is False
    assert progress_enabled(io.StringIO()) is False


def test_bar_draws_in_place_counts_failures_and_erases_itself():
    tty = FakeTTY()
    bar = ProgressBar(4, enabled=True, stream=tty, label="check x")
    case = SimpleNamespace(id="sink-mixed")
    bar("start", case, None)
    assert tty.getvalue().startswith("\rcheck x [") and "0/4  sink-mixed" in tty.getvalue()
    bar("done", case, SimpleNamespace(passed=False))
    bar("done", case, SimpleNamespace(passed=True))
    line = bar.line()
    assert "2/4" in line and "1 failing" in line and "left" in line
    assert "#" * 5 in line and "-" * 5 in line                       # half full
    bar.close()
    assert tty.getvalue().endswith("\r") and "\n" not in tty.getvalue()


def test_disabled_bar_writes_nothing():
    s = io.StringIO()
    bar = ProgressBar(3, enabled=False, stream=s)
    bar("start", SimpleNamespace(id="a"), None)
    bar("done", SimpleNamespace(id="a"), SimpleNamespace(passed=True))
    bar.close()
    assert s.getvalue() == ""


def test_lines_without_a_bar_write_one_flushed_line_per_finished_case():
    s = io.StringIO()
    bar = ProgressBar(3, enabled=False, stream=s, label="check x", lines=True)
    bar("start", SimpleNamespace(id="a"), None)
    assert s.getvalue() == ""
    bar("done", SimpleNamespace(id="a"),
        SimpleNamespace(passed=True, error=None, elapsed_s=1.25))
    bar("done", SimpleNamespace(id="b"),
        SimpleNamespace(passed=False, error=None, elapsed_s=0.5))
    bar("done", SimpleNamespace(id="c"),
        SimpleNamespace(passed=False, error="cannot materialize", elapsed_s=0.0))
    bar.close()
    assert s.getvalue().splitlines() == ["check x: 1/3  a  PASS  1.2 s",
                                         "check x: 2/3  b  FAIL  0.5 s",
                                         "check x: 3/3  c  ERROR  0.0 s"]


def test_lines_are_off_when_the_bar_draws():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    s = Tty()
    bar = ProgressBar(1, enabled=True, stream=s, lines=True)
    bar("done", SimpleNamespace(id="a"), SimpleNamespace(passed=True, error=None, elapsed_s=1.0))
    bar.close()
    assert "PASS" not in s.getvalue()


def test_the_bar_keeps_its_width_as_cases_finish():
    tty = FakeTTY()
    bar = ProgressBar(12, enabled=True, stream=tty, label="check x")
    widths = set()
    for i, cid in enumerate(["a", "sink-mixed", "public-cp-worked-example", "b" * 50] * 3):
        bar("start", SimpleNamespace(id=cid), None)
        widths.add(len(bar.line(cid)))
        bar("done", SimpleNamespace(id=cid), SimpleNamespace(passed=True))
    assert len(widths) == 1, widths
