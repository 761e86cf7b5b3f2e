"""The normalised Walsh-Hadamard rotation of the indexer's compressed keys (contract section 14).

``hadamard(x) = x @ H_d`` with ``H_d[i, j] = (-1) ** popcount(i & j) / sqrt(d)``: the Sylvester
(natural) order, symmetric and orthogonal (``H_d @ H_d = I``), so it is its own inverse and its
own transpose. Computed by the butterfly ``(a, b) -> (a + b, a - b)`` over ``log2 d`` stages,
then scaled by ``d ** -0.5``, in float64.
"""
from __future__ import annotations

import torch

from ._checks import as_float64

__all__ = ["hadamard", "hadamard_matrix", "is_power_of_two"]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard(x) -> torch.Tensor:
    """Section 14: the normalised Walsh-Hadamard transform over the last dimension of ``x``
    (float64 copy); the last dimension must be a power of two."""
    x = as_float64(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {d}")
    lead = x.shape[:-1]
    y = x.reshape(-1, d).clone()
    n = y.shape[0]
    h = 1
    while h < d:
        v = y.view(n, d // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2).reshape(n, d)
        h *= 2
    return (y * d ** -0.5).reshape(*lead, d)


def hadamard_matrix(d: int) -> torch.Tensor:
    """``H_d`` of section 14 as a dense float64 matrix, from its definition (for tests and the
    dense cross-check)."""
    if not is_power_of_two(d):
        raise ValueError(f"d must be a power of two, got {d}")
    i = torch.arange(d)
    bits = torch.bitwise_and(i.unsqueeze(1), i.unsqueeze(0))
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(torch.float64) * d ** -0.5
