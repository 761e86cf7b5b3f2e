"""The plugin as an engineer's own suite meets it: a test file outside this repository.

A temporary directory (outside the package) holds a tiny adapter wrapping the portable torch
backend's attention forward and backward, a copy with the sink gradient's sign flipped, and the
five-line test of ``docs/PYTEST_PLUGIN.md``; pytest runs there in a subprocess with the package
importable but not installed (``-p dsv4_oracle.pytest_plugin``):

- the five-line test passes on the right adapter, and the wrong adapter fails with the case's
  table of checks in the message, failed check first;
- installed (a ``pytest11`` entry point on the path, as ``pip install`` writes it), the plugin
  is loaded by the entry point alone, and is registered once when this repository's conftest
  and ``-p dsv4_oracle.pytest_plugin`` ask for it too (an entry point named other than the
  module makes pytest fail with "Plugin already registered under a different name").
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ADAPTER = '''
from dsv4_oracle.gpu_impl import api


class Adapter:
    """My attention kernels (here: the portable torch backend)."""

    name = "my attention"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        return api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                            backend="torch")

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        dq, dkv, dsink, _ = api.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                          v_dim=v_dim, lengths=lengths,
                                                          backend="torch")
        return dq, dkv, SIGN * dsink


SIGN = 1
'''

FIVE_LINES = '''
from dsv4_oracle.pytest_plugin import assert_conforms, cases
import pytest
@pytest.mark.parametrize("case", cases("quick", ["capacity-rows", "lengths-above-width"]))
def test_my_kernel_conforms(case):
    assert_conforms("mypkg.dsa:Adapter", case)


def test_a_wrong_kernel_fails():
    assert_conforms("mypkg.wrong:Adapter", "lengths-above-width")
'''


def _env(extra_path=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, ROOT])
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _pytest(cwd, *args, extra_path=()):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=_env(extra_path), capture_output=True, text=True,
                          timeout=600)


def test_five_line_test_passes_and_a_wrong_kernel_fails_with_the_table(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "dsa.py").write_text(ADAPTER)
    (pkg / "wrong.py").write_text(ADAPTER.replace("SIGN = 1", "SIGN = -1"))
    (tmp_path / "test_mine.py").write_text(FIVE_LINES)
    r = _pytest(tmp_path, "-p", "dsv4_oracle.pytest_plugin", "-q", "-rA", "test_mine.py")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert re.search(r"PASSED test_mine.py::test_my_kernel_conforms\[capacity-rows\]", out), out
    assert re.search(r"PASSED test_mine.py::test_my_kernel_conforms\[lengths-above-width\]",
                     out), out
    assert "FAILED test_mine.py::test_a_wrong_kernel_fails" in out, out
    assert "1 failed, 2 passed" in out, out
    # the message: a header naming the case, then the table, failed checks first
    assert "ConformanceError: dsv4-oracle: mypkg.wrong:Adapter on cpu: case lengths-above-width:" \
        in out, out
    lines = [ln[1:].strip() for ln in out.splitlines() if ln.startswith("E ")]
    header = next(i for i, ln in enumerate(lines) if re.match(r"case\s+level\s+quantity", ln))
    first = lines[header + 2].split()
    assert first[:4] == ["FAIL", "lengths-above-width", "op", "dsink"], lines[header:header + 3]
    assert float(first[5]) > 1, first
    assert "flipped sign" in lines[header + 2]
    assert sum(ln.startswith("FAIL") for ln in lines) == 1
    assert any(ln.startswith("ok") and " dq " in ln for ln in lines)


def _installed(tmp_path):
    """A ``pytest11`` entry point for the plugin, as ``pip install`` of this project writes it."""
    site = tmp_path / "site"
    info = site / "dsv4_oracle-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-oracle\nVersion: 0.1.0\n")
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        eps = tomllib.load(f)["project"]["entry-points"]["pytest11"]
    (info / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return str(site)


def _markers(out):
    return [ln.split(":")[0] for ln in out.splitlines()
            if re.match(r"@pytest\.mark\.(gpu|sm90|sm100|cudnn|multigpu|slow|production):", ln)]


MARKERS = ["@pytest.mark." + m for m in
           ("gpu", "sm90", "sm100", "cudnn", "multigpu", "slow", "production")]


def test_installed_entry_point_registers_the_plugin_once(tmp_path):
    site = _installed(tmp_path)
    outside = tmp_path / "suite"
    outside.mkdir()
    # the entry point alone (an engineer's suite with dsv4-oracle installed)
    r = _pytest(outside, "--markers", "--replays", "5", extra_path=[site])
    assert r.returncode == 0, r.stdout + r.stderr       # --replays is an option there
    assert _markers(r.stdout) == MARKERS
    # the entry point and -p, and the entry point and this repository's conftest
    for cwd, args in ((outside, ("-p", "dsv4_oracle.pytest_plugin")), (ROOT, ())):
        r = _pytest(cwd, "--markers", *args, extra_path=[site])
        assert r.returncode == 0, r.stdout + r.stderr
        assert _markers(r.stdout) == MARKERS, (cwd, args)
