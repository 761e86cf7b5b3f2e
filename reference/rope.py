"""Rotary position embedding of the compressed keys (contract section 13).

Interleaved pairs: channel pair ``(x[o + 2i], x[o + 2i + 1])`` of the last ``dim`` channels
(``o = d - dim``) is rotated as a complex number by the angle ``p * f_i``, where ``p`` is a
document-relative position and ``f_i`` the YaRN-blended frequency of pair ``i``. The rotation is
given either by a :class:`RopeSpec` (the frequencies are computed here, in float64) or by a
table of ``(cos, sin)`` per position and pair, used exactly as given.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ._checks import as_float64, as_index
from .constants import ROPE_BETA_FAST, ROPE_BETA_SLOW, ROPE_DIM

__all__ = ["RopeSpec", "rope_spec", "rope_frequencies", "rope_cos_sin", "rope_rotate"]

F64 = torch.float64


class RopeSpec(NamedTuple):
    """Section 13: the rotary embedding's parameters. ``dim``: rotated channels (the last
    ``dim`` of a row; even); ``base``: ``f_i = base ** (-2 i / dim)``; ``factor``,
    ``original_seq_len``, ``beta_fast``, ``beta_slow``: the YaRN frequency blend, applied when
    ``original_seq_len > 0`` (``mscale`` is 1: a pure rotation)."""

    dim: int = ROPE_DIM
    base: float = 10000.0
    factor: float = 1.0
    original_seq_len: int = 0
    beta_fast: float = ROPE_BETA_FAST
    beta_slow: float = ROPE_BETA_SLOW


def _real(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise TypeError(f"{name} must be a finite real number, got {x!r}")
    return float(x)


def rope_spec(spec, name: str = "rope") -> RopeSpec:
    """``spec`` checked as a :class:`RopeSpec` (``TypeError`` / ``ValueError`` naming the
    field): ``dim`` even and >= 2, ``base > 1``, ``factor > 0``, ``original_seq_len >= 0``,
    ``beta_fast > beta_slow > 0``."""
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"{name} must be a reference.RopeSpec or a (cos, sin) table tensor, "
                        f"got {type(spec).__name__}")
    dim = spec.dim
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{name}.dim must be an int, got {type(dim).__name__}")
    if dim < 2 or dim % 2:
        raise ValueError(f"{name}.dim must be even and >= 2, got {dim}")
    base, factor = _real(spec.base, f"{name}.base"), _real(spec.factor, f"{name}.factor")
    fast, slow = _real(spec.beta_fast, f"{name}.beta_fast"), _real(spec.beta_slow, f"{name}.beta_slow")
    orig = spec.original_seq_len
    if isinstance(orig, bool) or not isinstance(orig, numbers.Integral):
        raise TypeError(f"{name}.original_seq_len must be an int, got {type(orig).__name__}")
    if not base > 1:
        raise ValueError(f"{name}.base must be > 1, got {base}")
    if not factor > 0:
        raise ValueError(f"{name}.factor must be > 0, got {factor}")
    if orig < 0:
        raise ValueError(f"{name}.original_seq_len must be >= 0, got {orig}")
    if not fast > slow > 0:
        raise ValueError(f"{name}: beta_fast > beta_slow > 0 is required, got {fast}, {slow}")
    return RopeSpec(int(dim), base, factor, int(orig), fast, slow)


def rope_frequencies(spec) -> torch.Tensor:
    """Section 13: the frequencies ``f_i`` of the ``dim / 2`` pairs, float64.

    ``f_i = base ** (-2 i / dim)``; with ``original_seq_len > 0`` they are blended
    ``f_i / factor * (1 - smooth_i) + f_i * smooth_i`` with ``smooth_i = 1 - clamp((i - low) /
    (high - low), 0, 1)``, ``low = max(floor(c(beta_fast)), 0)``, ``high = min(ceil(c(beta_slow)),
    dim - 1)`` (``high += 0.001`` when equal to ``low``) and ``c(b) = dim * ln(original_seq_len /
    (2 pi b)) / (2 ln base)``.
    """
    s = rope_spec(spec)
    i = torch.arange(s.dim // 2, dtype=F64)
    f = torch.pow(torch.tensor(s.base, dtype=F64), -2.0 * i / s.dim)
    if s.original_seq_len > 0:
        def corr(b):
            return s.dim * math.log(s.original_seq_len / (b * 2 * math.pi)) / (2 * math.log(s.base))
        low = max(math.floor(corr(s.beta_fast)), 0)
        high = min(math.ceil(corr(s.beta_slow)), s.dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - torch.clamp((i - low) / (high - low), 0, 1)
        f = f / s.factor * (1 - smooth) + f * smooth
    return f


def rope_cos_sin(rope, positions: torch.Tensor):
    """``(cos, sin, dim)`` of section 13 at int64 ``positions [n]``: float64 ``[n, dim/2]`` each,
    from a :class:`RopeSpec` (angles ``p * f_i`` in float64) or gathered from a table
    ``[P, dim/2, 2]`` of ``(cos, sin)`` (every position must be below ``P``)."""
    if isinstance(rope, torch.Tensor):
        table = as_float64(rope, "rope", ndim=3, allow_nan=False)
        if table.shape[2] != 2 or table.shape[1] < 1:
            raise ValueError(f"rope table must have shape [P, dim/2, 2] (cos, sin), got "
                             f"{tuple(table.shape)}")
        if positions.numel() and int(positions.max()) >= table.shape[0]:
            raise ValueError(f"rope table has {table.shape[0]} positions; position "
                             f"{int(positions.max())} is needed")
        rows = table.index_select(0, positions)
        return rows[:, :, 0], rows[:, :, 1], 2 * table.shape[1]
    s = rope_spec(rope)
    theta = positions.to(F64).unsqueeze(1) * rope_frequencies(s).unsqueeze(0)
    return torch.cos(theta), torch.sin(theta), s.dim


def rope_rotate(x, positions, rope, *, inverse: bool = False) -> torch.Tensor:
    """Section 13: ``x [n, d]`` (float64 copy) with the last ``dim`` channels rotated in
    interleaved pairs by ``positions [n] * f`` (``inverse``: by minus that angle, the transpose,
    used by the backward). Channels before them are unchanged."""
    x = as_float64(x, "x", ndim=2)
    positions = as_index(positions, "positions", ndim=1)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries, x has {x.shape[0]} rows")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError("positions must be >= 0")
    cos, sin, dim = rope_cos_sin(rope, positions)
    d = x.shape[1]
    if dim > d:
        raise ValueError(f"rope rotates {dim} channels, the rows have only {d}")
    if inverse:
        sin = -sin
    out = x.clone()
    tail = x[:, d - dim:].reshape(x.shape[0], dim // 2, 2)
    a, b = tail[:, :, 0], tail[:, :, 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=2)
    out[:, d - dim:] = rot.reshape(x.shape[0], dim)
    return out
