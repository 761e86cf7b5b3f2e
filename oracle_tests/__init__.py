"""The dsv4-oracle test suite.

``test_reference_*.py`` prove the float64 oracle (``reference/``) against itself: closed forms,
an independent dense-mask formulation, finite differences, bitwise CP/chunking invariance and
argument validation. The helpers below are the few things those files share.
"""
from __future__ import annotations

import hashlib

import torch


def content_hash(x) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (any dtype, any device, any strides)."""
    t = x.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def content_hashes(*tensors) -> list[str | None]:
    """Hashes of several arguments (None for anything that is not a tensor)."""
    return [content_hash(t) if isinstance(t, torch.Tensor) else None for t in tensors]


def error_ratio(actual, expected, bound) -> float:
    """The verdict of the error model (contract section 12): ``max |actual - expected| / bound``.

    ``expected`` is the oracle's value and ``bound`` the error model's elementwise bound for it.
    Where the bound is 0 or the expected value is not finite (sink-only rows, ``lse = +inf``,
    invisible ``-inf`` scores), the contract is exact: any difference there (including a NaN)
    makes the ratio ``inf``. A check passes iff the ratio is ``<= 1``.
    """
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    b = bound.detach().to("cpu", torch.float64)
    if a.shape != e.shape or b.shape != e.shape:
        raise ValueError(f"shapes differ: actual {tuple(a.shape)}, expected {tuple(e.shape)}, "
                         f"bound {tuple(b.shape)}")
    exact = (b <= 0) | ~torch.isfinite(e)
    if not torch.equal(a[exact], e[exact]):
        return float("inf")
    if bool(torch.isnan(a).any()):
        return float("inf")
    if bool(exact.all()):
        return 0.0
    return float(((a - e).abs()[~exact] / b[~exact]).max())
