"""``dsv4-oracle check`` as a kernel engineer meets it in the first hour:

- ``--impl path/to/file.py:attr`` imports the modules beside the file (as ``python file.py``
  does) from any directory, and an adapter file named like a standard module (``json.py``)
  shadows nothing for the rest of the run;
"""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from dsv4_oracle.adapters import load_adapter
from dsv4_oracle.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OP_CASE = "lengths-above-width"       # a small op-level case

SIBLING = """\
from dsv4_oracle.gpu_impl import api


def forward(q, kv, ids, sink, v_dim, lengths):
    return api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                        backend="torch")
"""
ADAPTER = """\
import {sibling}


class Adapter:
    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        return {sibling}.forward(q, kv, ids, sink, v_dim, lengths)
"""


@pytest.fixture
def isolated_imports(monkeypatch):
    """``sys.path`` and ``sys.modules`` restored after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = dict(sys.modules)
    yield
    for name in set(sys.modules) - set(before):
        del sys.modules[name]
    sys.modules.update(before)


def check(capsys, *args):
    rc = main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def kernel_folder(tmp_path, adapter_file: str, sibling: str):
    kern = tmp_path / "kern"
    kern.mkdir()
    (kern / f"{sibling}.py").write_text(SIBLING)
    (kern / adapter_file).write_text(ADAPTER.format(sibling=sibling))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return kern, elsewhere


# ---------------------------------------------------------------------------------------------
# --impl path/to/file.py:attr
# ---------------------------------------------------------------------------------------------
def test_a_file_adapter_imports_the_modules_beside_it(capsys, tmp_path, monkeypatch,
                                                      isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "adapters.py", "fh_sibling_kernel")
    monkeypatch.chdir(elsewhere)
    rc, out, err = check(capsys, "--impl", "../kern/adapters.py:Adapter", "--case", OP_CASE,
                         "--replays", "0", "--report", str(tmp_path / "report"))
    assert rc == 0, out + err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["passed"] is True
    assert sys.path[-1] == str(kern)        # after every installed and standard module


def test_an_adapter_named_like_a_standard_module_shadows_nothing(capsys, tmp_path, monkeypatch,
                                                                 isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "json.py", "fh_sibling_kernel_json")
    monkeypatch.chdir(elsewhere)
    standard = sys.modules["json"]
    adapter = load_adapter(f"{kern / 'json.py'}:Adapter")
    assert adapter.ops == ("sparse_attention_forward",)
    assert sys.modules["json"] is standard and json.dumps({"a": 1}) == '{"a": 1}'
    module = sys.modules[type(adapter.target).__module__]
    assert module.__file__ == str(kern / "json.py")
    # end to end: the report (written with the standard json) after the adapter ran
    rc, out, err = check(capsys, "--impl", "../kern/json.py:Adapter", "--case", OP_CASE,
                         "--replays", "0", "--report", str(tmp_path / "report"))
    assert rc == 0, out + err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["passed"] is True


def test_a_file_adapter_reloaded_keeps_its_own_name(tmp_path, monkeypatch, isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "fh_my_adapter.py", "fh_sibling_kernel_2")
    monkeypatch.chdir(elsewhere)
    for _ in range(2):                # the pytest plugin loads a spec once per test
        a = load_adapter(f"{kern / 'fh_my_adapter.py'}:Adapter")
        assert type(a.target).__module__ == "fh_my_adapter"
    assert sys.path.count(str(kern)) == 1
