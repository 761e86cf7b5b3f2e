"""Repository-wide pytest configuration.

Markers are declared in pyproject.toml; GPU lanes select them with ``-m`` (``pytest -m gpu``).
Hardware markers are enforced here, once, in :func:`pytest_collection_modifyitems`: a test
marked ``gpu``, ``sm90``, ``sm100``, ``cudnn`` or ``multigpu`` is skipped, with the reason,
when this machine lacks what the marker names:

- ``gpu``: a CUDA device that torch can use;
- ``sm90``: compute capability exactly 9.0 (H100/H200); ``sm100``: major 10 (B200/GB200);
- ``cudnn``: the cuDNN frontend (``import cudnn``) and a CUDA device;
- ``multigpu``: two or more CUDA devices.

GPU tests never oversubscribe the GPU under ``pytest -n auto``: every test carrying one of
those markers is put in the xdist group ``"gpu"``, and ``-n`` runs use ``--dist loadgroup``
(set below unless ``--dist`` is given), so one worker runs all of them, one at a time.
"""
import importlib.util

import pytest

HARDWARE_MARKERS = ("gpu", "sm90", "sm100", "cudnn", "multigpu")


def pytest_addoption(parser):
    parser.addoption("--replays", type=int, default=3,
                     help="bitwise replays per determinism check (default 3)")


@pytest.fixture
def replays(request):
    return request.config.getoption("--replays")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Under xdist (``-n``), default to ``--dist loadgroup`` so the ``gpu`` group is honoured."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"


def _hardware():
    """What this machine offers, as reasons keyed by marker (``None`` = available)."""
    try:
        import torch
        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
        cap = torch.cuda.get_device_capability(0) if cuda else None
    except Exception as exc:                      # a broken CUDA install must not crash collection
        cuda, count, cap = False, 0, None
        no_cuda = f"torch cannot use CUDA ({type(exc).__name__}: {exc})"
    else:
        no_cuda = "no CUDA GPU (torch.cuda.is_available() is False)"
    has_cudnn = importlib.util.find_spec("cudnn") is not None
    return {
        "gpu": None if cuda else no_cuda,
        "sm90": None if cap == (9, 0) else (no_cuda if not cuda else
                                            f"needs compute capability 9.0, this GPU is {cap}"),
        "sm100": None if cap is not None and cap[0] == 10 else (
            no_cuda if not cuda else f"needs compute capability 10.x, this GPU is {cap}"),
        "cudnn": None if (has_cudnn and cuda) else (
            "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)"
            if not has_cudnn else no_cuda),
        "multigpu": None if count >= 2 else f"needs 2 or more CUDA GPUs, found {count}",
    }


def pytest_collection_modifyitems(config, items):
    reasons = None
    for item in items:
        marks = [m for m in HARDWARE_MARKERS if item.get_closest_marker(m) is not None]
        if not marks:
            continue
        item.add_marker(pytest.mark.xdist_group("gpu"))
        if reasons is None:
            reasons = _hardware()
        for m in marks:
            if reasons[m] is not None:
                item.add_marker(pytest.mark.skip(reason=f"[{m}] {reasons[m]}"))
                break
