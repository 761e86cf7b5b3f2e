"""The dsv4-oracle test suite.

``reference/test_*.py`` prove the float64 oracle (``reference/``) against itself: closed forms,
an independent dense-mask formulation, finite differences, bitwise CP/chunking invariance and
argument validation. The helpers below are the few things those files share.
"""
from __future__ import annotations

import torch

from dsv4_oracle.compare import compare_numeric, content_hash

__all__ = ["content_hash", "content_hashes", "error_ratio"]


def content_hashes(*tensors) -> list[str | None]:
    """Hashes of several arguments (None for anything that is not a tensor)."""
    return [content_hash(t) if isinstance(t, torch.Tensor) else None for t in tensors]


def error_ratio(actual, expected, bound) -> float:
    """The verdict of the error model (contract section 12): ``max |actual - expected| / bound``,
    as :func:`dsv4_oracle.compare.compare_numeric` computes it (the one comparison engine).

    ``expected`` is the oracle's value and ``bound`` the error model's elementwise bound for it.
    Where the bound is 0 or the expected value is not finite (sink-only rows, ``lse = +inf``,
    invisible ``-inf`` scores), the contract is exact: any difference there (including a NaN)
    makes the ratio ``inf``. A check passes iff the ratio is ``<= 1``.
    """
    if actual.shape != expected.shape or bound.shape != expected.shape:
        raise ValueError(f"shapes differ: actual {tuple(actual.shape)}, expected "
                         f"{tuple(expected.shape)}, bound {tuple(bound.shape)}")
    return compare_numeric("error_ratio", actual, expected, bound).ratio
