"""The plugin's hooks, run in-process on a generated test file (``pytester``):

- every marker is registered (``--strict-markers`` accepts them);
- a hardware-marked test is skipped with ``[marker] reason`` when the machine lacks the
  hardware, runs when it has it, and is put in the xdist group ``"gpu"`` (unmarked tests are
  not); the reasons come from :func:`dsv4_oracle.pytest_plugin.hardware`, here a fake H200;
- ``--replays N`` reaches the ``replays`` fixture (default 3);
- under ``-n``, ``--dist`` defaults to ``loadgroup``.
"""
from __future__ import annotations

import pytest

from dsv4_oracle import pytest_plugin as plugin

pytest_plugins = ["pytester"]

H200 = {"gpu": None, "sm90": None, "sm100": "needs compute capability 10.x, this GPU is (9, 0)",
        "cudnn": "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)",
        "multigpu": "needs 2 or more CUDA GPUs, found 1"}

SUITE = '''
import pytest

def group(request):
    m = request.node.get_closest_marker("xdist_group")
    return m.args[0] if m else None

@pytest.mark.gpu
def test_gpu(request):
    assert group(request) == "gpu"

@pytest.mark.gpu
@pytest.mark.sm90
def test_sm90(request):
    assert group(request) == "gpu"

@pytest.mark.sm100
def test_sm100():
    pass

@pytest.mark.cudnn
def test_cudnn():
    pass

@pytest.mark.multigpu
@pytest.mark.gpu
def test_multigpu():
    pass

@pytest.mark.slow
@pytest.mark.production
def test_plain(request, replays):
    assert group(request) is None
    print("REPLAYS", replays)
'''


def test_hardware_markers_skip_with_the_reason_and_group_gpu_tests(pytester, monkeypatch):
    monkeypatch.setattr(plugin, "hardware", lambda: dict(H200))
    pytester.makepyfile(test_suite=SUITE)
    r = pytester.runpytest("-p", "dsv4_oracle.pytest_plugin", "--strict-markers", "-rs", "-s",
                           "-p", "no:cacheprovider")
    r.assert_outcomes(passed=3, skipped=3)
    out = r.stdout.str()
    for line in ("[sm100] needs compute capability 10.x, this GPU is (9, 0)",
                 "[cudnn] the cuDNN frontend is not installed",
                 "[multigpu] needs 2 or more CUDA GPUs, found 1"):
        assert line in out
    assert "REPLAYS 3" in out


def test_replays_option_reaches_the_fixture(pytester):
    pytester.makepyfile(test_r="def test_r(replays):\n    assert replays == 7\n")
    r = pytester.runpytest("-p", "dsv4_oracle.pytest_plugin", "--replays", "7",
                           "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)


def test_without_cuda_every_hardware_marker_has_a_reason(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = plugin.hardware()
    assert set(reasons) == set(plugin.HARDWARE_MARKERS)
    assert all(isinstance(r, str) and r for r in reasons.values())
    assert reasons["gpu"] == "no CUDA GPU (torch.cuda.is_available() is False)"


def test_one_sm90_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    reasons = plugin.hardware()
    assert reasons["gpu"] is None and reasons["sm90"] is None
    assert reasons["sm100"] == "needs compute capability 10.x, this GPU is (9, 0)"
    assert reasons["multigpu"] == "needs 2 or more CUDA GPUs, found 1"


def test_broken_cuda_does_not_crash_collection(monkeypatch):
    import torch

    def broken():
        raise RuntimeError("driver mismatch")
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    reasons = plugin.hardware()
    assert reasons["gpu"] == "torch cannot use CUDA (RuntimeError: driver mismatch)"


@pytest.mark.parametrize("numprocesses,dist,want", [(2, "no", "loadgroup"), (2, "load", "load"),
                                                    (None, "no", "no")])
def test_xdist_runs_default_to_loadgroup(numprocesses, dist, want):
    class Option:
        pass
    opt = Option()
    opt.numprocesses, opt.dist = numprocesses, dist

    class Config:
        option = opt
    plugin.pytest_cmdline_main(Config())
    assert opt.dist == want
