"""``python -m fixtures``: a command that cannot run prints one line on stderr and exits 2,
never a traceback (unknown case, category, subcommand or option; --data that is not a
directory; regen inside an xdist worker)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.__main__ import main as fixtures_cli

REPO = Path(__file__).resolve().parent.parent


def _one_line_error(capsys, argv):
    rc = fixtures_cli(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, line", [
    (["show", "no-such-case"], "python -m fixtures show: error: no catalog case has id "
                               "'no-such-case' (`python -m fixtures list` lists them)"),
    (["list", "--category", "no-such-category"], "python -m fixtures list: error: unknown "
                                                 "category 'no-such-category'; categories: "),
    (["frobnicate"], "python -m fixtures: error: argument command: invalid choice: 'frobnicate'"),
    (["verify", "--bogus"], "python -m fixtures: error: unrecognized arguments: --bogus"),
    ([], "python -m fixtures: error: the following arguments are required: command"),
    (["show"], "python -m fixtures show: error: the following arguments are required: case_id"),
    (["regen", "no-such-case"], "python -m fixtures regen: error: case_ids ['no-such-case'] "
                                "are not in STORED_CASES"),
])
def test_usage_errors_are_one_line(capsys, argv, line):
    assert _one_line_error(capsys, argv).startswith(line)


@pytest.mark.parametrize("command", ["regen", "verify"])
def test_data_that_is_not_a_directory_is_one_line(capsys, tmp_path, command):
    f = tmp_path / "a-file"
    f.write_text("x")
    err = _one_line_error(capsys, [command, "--data", str(f), "capacity-rows"])
    assert err == f"python -m fixtures {command}: error: --data {str(f)!r} is not a directory"
    assert f.read_text() == "x"


def test_verify_of_a_missing_directory_is_one_line(capsys, tmp_path):
    err = _one_line_error(capsys, ["verify", "--data", str(tmp_path / "nowhere")])
    assert err.endswith("is not a directory")


def test_regen_inside_an_xdist_worker_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    err = _one_line_error(capsys, ["regen", "--data", str(tmp_path), "capacity-rows"])
    assert err.startswith("python -m fixtures regen: error: regen refuses to run "
                          "inside a pytest-xdist worker (gw3)")
    assert not any(tmp_path.iterdir())


def test_the_module_entry_point_prints_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    r = subprocess.run([sys.executable, "-m", "fixtures", "show", "no-such-case"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("python -m fixtures show: error: no catalog case has id 'no-such-case' "
                        "(`python -m fixtures list` lists them)\n")
