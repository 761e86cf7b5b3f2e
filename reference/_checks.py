"""Argument validation shared by every oracle function.

Every public function converts its inputs with these helpers *before* computing anything, so a
bad argument raises a ``TypeError`` or ``ValueError`` that names it, and no input is ever
modified (the helpers never write into the tensors they are given).
"""
from __future__ import annotations

import math
import numbers

import torch

from .constants import BOUND_CHUNK_BYTES

F64 = torch.float64
CPU = torch.device("cpu")


def _no_meta(x: torch.Tensor, name: str) -> None:
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (it holds no data); the oracle needs values")


def as_float64(x, name: str, *, ndim: int | None = None, allow_nan: bool = True) -> torch.Tensor:
    """A float tensor of any dtype/device as a float64 CPU tensor (a view or copy, never mutated)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _no_meta(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    out = x.to(device=CPU, dtype=F64)
    if not out.is_contiguous() or out.data_ptr() % 64:
        # CPU kernels pick code paths by stride and alignment: a fresh contiguous buffer (like
        # the one any dtype conversion allocates) keeps the oracle's bits independent of the
        # caller's memory layout (e.g. float64 tensors loaded from a file at an odd offset).
        out = out.clone(memory_format=torch.contiguous_format)
    if not allow_nan and bool(torch.isnan(out).any()):
        raise ValueError(f"{name} contains NaN")
    return out


def as_index(x, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """An integer tensor of any signed integer dtype (or uint8/16/32) and any device as an int64
    CPU tensor (never mutated). ``uint64`` is rejected with ``TypeError``: its values above
    ``2**63 - 1`` have no int64 value (a conversion would wrap them to negative numbers, i.e.
    silently to "no selection", where contract section 6 makes every id outside ``[0, S)``
    invalid by its value)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    if x.dtype == torch.uint64:
        raise TypeError(f"{name} must be a signed integer tensor (int32 or int64), got dtype "
                        "torch.uint64 (values above 2**63 - 1 would wrap)")
    _no_meta(x, name)
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x.to(device=CPU, dtype=torch.int64)


def as_int(x, name: str, *, minimum: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def as_real(x, name: str, *, positive: bool = False, finite: bool = True) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if math.isnan(x) or (finite and math.isinf(x)):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def head_dim(x: torch.Tensor, name: str) -> int:
    """The size of the last (head) dimension of ``x``, which must be >= 1 (the default scale
    ``D**-0.5`` and every dot product need one)."""
    d = x.shape[-1]
    if d < 1:
        raise ValueError(f"{name} must have a head dimension >= 1, got shape {tuple(x.shape)}")
    return d


def check_dim(x: torch.Tensor, name: str, axis: int, size: int, what: str) -> None:
    if x.shape[axis] != size:
        raise ValueError(
            f"{name} has size {x.shape[axis]} in dimension {axis}, expected {size} ({what}); "
            f"shape {tuple(x.shape)}"
        )


def choice(x, name: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a str, got {type(x).__name__}")
    if x not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {x!r}")
    return x


def chunk_rows(rows_per_chunk: int | None, per_row_bytes: int,
               budget_bytes: int = BOUND_CHUNK_BYTES) -> int:
    """Rows per chunk: given explicitly, or as many as fit a fixed memory budget (by default
    ``BOUND_CHUNK_BYTES``, 256 MiB)."""
    if rows_per_chunk is not None:
        return as_int(rows_per_chunk, "chunk_rows", minimum=1)
    return max(1, budget_bytes // max(1, per_row_bytes))
