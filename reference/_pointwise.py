"""Position-independent pointwise functions (contract section 10: per-row bits).

``torch.logaddexp`` and ``torch.sigmoid`` on the CPU take a vectorized path for the body of a
tensor and a scalar path for its tail, and the two differ in the last bit: the same value gets
different bits depending on where it sits in the tensor (e.g. row 9 of a 16-row chunk versus
the same row evaluated alone), which breaks the oracle's chunking and CP invariance. These
versions are built from ``exp``, ``log1p``, ``abs``, ``maximum`` and correctly rounded
arithmetic, whose bits do not depend on the position (checked by ``oracle_tests``).
"""
from __future__ import annotations

import torch


def logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``log(exp(a) + exp(b))`` as ``max + log1p(exp(-|a - b|))``; exact for infinities."""
    m = torch.maximum(a, b)
    d = torch.where(torch.isinf(m), torch.zeros_like(m), -(a - b).abs())
    return m + torch.log1p(torch.exp(d))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` (0 at -inf, 1 at +inf)."""
    return 1.0 / (1.0 + torch.exp(-x))
