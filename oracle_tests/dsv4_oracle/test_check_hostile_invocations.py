"""Bad invocations of ``dsv4-oracle check`` are the user's errors, never the implementation's:
one line on stderr and exit status 2, before anything runs.

- the checker's own options out of range (``--timeout 1e12`` overflowed the timers and failed
  every op of a right implementation);
- report paths that cannot be written, or that collide (``--report D --junit D/report.json``
  overwrote the report with the XML), or that are empty (nothing was written and nothing said),
  found before the run (a failing run with an unwritable ``--report`` exited 2, not 1, after
  the run);
- ``--ops`` that names no op (``--ops ''`` checked every op, ``--ops ,`` blamed the adapter).
"""
from __future__ import annotations

import os
import time

import pytest

from dsv4_oracle.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = "oracle_tests.helpers.check_adapters:"
OP_CASE = "lengths-above-width"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# (arguments, text of the one-line error); {tmp} is a temporary directory holding a file
# "afile"; every row checks the sign-flipped adapter, which fails when it runs (exit 1)
BAD_INVOCATIONS = [
    (["--timeout", "1e12"], "--timeout must be a number of seconds in [0, 1e+06] (0: no limit), "
                            "got 1000000000000.0"),
    (["--timeout", "inf"], "--timeout must be a number of seconds in [0, 1e+06]"),
    (["--report", ""], "--report must name a directory, got ''"),
    (["--junit", ""], "--junit must name a file, got ''"),
    (["--report", "{tmp}/r", "--junit", "{tmp}/r/report.json"],
     "--junit '{tmp}/r/report.json' is one of the files --report '{tmp}/r' writes"),
    (["--report", "{tmp}/afile"], "--report '{tmp}/afile' exists and is not a directory"),
    (["--report", "{tmp}/afile/sub"], "--report '{tmp}/afile/sub': cannot write into "
                                      "'{tmp}/afile/sub': Not a directory"),
    (["--junit", "{tmp}/afile/j.xml"], "--junit '{tmp}/afile/j.xml': cannot write into"),
    (["--junit", "{tmp}"], "--junit '{tmp}' is a directory, not a file"),
    (["--ops", ""], "--ops: names no op; ops are compressor_forward, indexer_compressor_forward, indexer_scores"),
    (["--ops", ","], "--ops: names no op; ops are compressor_forward, indexer_compressor_forward, indexer_scores"),
]


@pytest.mark.parametrize("args, needle", BAD_INVOCATIONS, ids=[" ".join(a[0]) or "''"
                                                                for a in BAD_INVOCATIONS])
def test_a_bad_invocation_is_one_line_before_anything_runs(capsys, tmp_path, args, needle):
    (tmp_path / "afile").write_text("not a directory\n")
    args = [a.format(tmp=tmp_path) for a in args]
    t0 = time.monotonic()
    rc = main(["check", "--no-progress", "--impl", FIX + "SignFlipAdapter", "--case", OP_CASE,
               *args])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"dsv4-oracle check: error: {needle.format(tmp=tmp_path)}"), err
    assert time.monotonic() - t0 < 30
    assert sorted(os.listdir(tmp_path)) in (["afile"], ["afile", "r"])


def test_a_huge_timeout_within_range_runs_and_passes(capsys):
    rc = main(["check", "--no-progress", "--impl", "gpu_impl:torch", "--case", OP_CASE,
               "--replays", "0", "--ops", "sparse_attention_forward", "--timeout", "1e6"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
