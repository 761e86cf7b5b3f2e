"""Argument validation shared by the gpu_impl backends (contract: bad input is rejected first).

Every backend function validates with these helpers *before* it launches any computation, so a
bad argument raises a ``TypeError`` or ``ValueError`` that names it while the device is still
untouched. Checks on types, dtypes, shapes and devices read only tensor metadata (no kernel is
launched). The few checks that depend on tensor *values* (NaN scores or sinks, compressed ids
outside a row's visibility) run one small reduction and a host synchronisation; they also come
before any of the op's real work. Nothing here ever writes to a tensor it is given.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "FLOAT_DTYPES", "INDEX_DTYPES", "as_bool", "as_int", "as_real", "check_dim", "choice",
    "float_tensor", "index_tensor", "same_device",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(x, name: str, ndim: int | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def float_tensor(x, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """A float tensor (bf16, fp16, fp32 or fp64), returned as is."""
    x = _tensor(x, name, ndim)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a bfloat16/float16/float32/float64 tensor, got dtype {x.dtype}")
    return x


def index_tensor(x, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """An int32 or int64 tensor, returned as is."""
    x = _tensor(x, name, ndim)
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {x.dtype}")
    return x


def same_device(**named) -> torch.device:
    """The common device of the named tensors (``None`` entries are skipped)."""
    device, first = None, None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; "
                             "all tensors of one call must be on the same device")
    return device if device is not None else torch.device("cpu")


def check_dim(x: torch.Tensor, name: str, axis: int, size: int, what: str) -> None:
    if x.shape[axis] != size:
        raise ValueError(f"{name} has size {x.shape[axis]} in dimension {axis}, expected {size} "
                         f"({what}); shape {tuple(x.shape)}")


def as_int(x, name: str, *, minimum: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def as_real(x, name: str, *, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def choice(x, name: str, allowed: tuple) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a str, got {type(x).__name__}")
    if x not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {x!r}")
    return x


def as_bool(x, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x
