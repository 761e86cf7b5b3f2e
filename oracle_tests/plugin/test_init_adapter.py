"""``dsv4-oracle init-adapter [PATH]``:

- the file it writes holds every op of the protocol and the attributes ``name``, ``device``,
  ``precision`` and ``backward_convention``, loads as an adapter providing every op, and passes
  ``dsv4-oracle check`` as written (its placeholders call the torch backend) at op level and as
  a packed layer;
- it never overwrites: an existing PATH (the file unchanged), a PATH not ending in ``.py`` and a
  missing directory each give one line on stderr and exit status 2, and leave no file behind.
"""
from __future__ import annotations

import ast
import os

import pytest

from dsv4_oracle.adapters import ALL_OPS, load_adapter
from dsv4_oracle.cli import main
from dsv4_oracle.init_adapter import DEFAULT_PATH


def _init(capsys, *args):
    rc = main(["init-adapter", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_template_loads_and_passes_the_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = _init(capsys, "first_dsv4_adapter.py")
    assert (rc, err) == (0, "")
    assert out == ("wrote first_dsv4_adapter.py; check it with: dsv4-oracle check --impl "
                   "first_dsv4_adapter.py:Adapter\n")
    text = (tmp_path / "first_dsv4_adapter.py").read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef))
    assert cls.name == "Adapter"
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]
    assert methods == ["precision", *ALL_OPS]
    attrs = {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets}
    assert attrs == {"name", "device", "backward_convention"}
    assert text.count("# REPLACE WITH YOUR KERNEL") == len(ALL_OPS)
    adapter = load_adapter("first_dsv4_adapter:Adapter")
    assert adapter.ops == ALL_OPS and adapter.device == "cpu"
    rc = main(["check", "--no-progress", "--impl", "first_dsv4_adapter:Adapter",
               "--case", "capacity-rows", "--replays", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "layer: given in 1 case" in out and out.rstrip().splitlines()[-1].startswith("PASS")


@pytest.mark.parametrize("path,needle", [
    ("existing.py", "existing.py exists; not overwriting it"),
    ("adapter.txt", "'adapter.txt' does not end in .py"),
    (os.path.join("no_such_dir", "a.py"), "directory no_such_dir does not exist"),
    (os.path.join("existing.py", "a.py"), "existing.py is not a directory"),
    ("my-kernel.py", "'my-kernel.py' is not a Python module name, which the checker imports the "
                     "file as (use, e.g., my_kernel.py)"),
    (".py", "'.py' is not a Python module name"),
    ("class.py", "'class.py' is not a Python module name"),
])
def test_refusals_are_one_line_and_status_2(tmp_path, monkeypatch, capsys, path, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing.py").write_text("# mine\n")
    rc, out, err = _init(capsys, path)
    assert (rc, out) == (2, "")
    assert err.startswith(f"dsv4-oracle init-adapter: error: {needle}")
    assert err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["existing.py"]
    assert (tmp_path / "existing.py").read_text() == "# mine\n"


def test_default_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _init(capsys)
    assert rc == 0 and os.listdir(tmp_path) == [DEFAULT_PATH] == ["dsv4_adapter.py"]
    rc, _, err = _init(capsys)
    assert rc == 2 and "dsv4_adapter.py exists" in err


def test_a_leftover_temporary_file_is_neither_a_conflict_nor_removed(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.chdir(tmp_path)
    leftover = tmp_path / f".mine.py.{os.getpid()}.tmp"
    leftover.write_text("someone's\n")
    rc, out, err = _init(capsys, "mine.py")
    assert rc == 0, err
    assert leftover.read_text() == "someone's\n"
    assert sorted(os.listdir(tmp_path)) == [leftover.name, "mine.py"]
