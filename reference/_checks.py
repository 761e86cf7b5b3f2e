"""Argument validation shared by every oracle function.

Every public function converts its inputs with these helpers *before* computing anything, so a
bad argument raises a ``TypeError`` or ``ValueError`` that names it, and no input is ever
modified (the helpers never write into the tensors they are given).

The compute device. The oracle computes on the CPU: that is its definition. For large inputs
(the production tier) the same float64 code may run on a CUDA device, and only when a caller
asks for it explicitly, with ``fixtures.run_oracle(..., compute_device="cuda")``, the
``compute_device`` keyword of ``fixtures.oracle_bounds`` or ``dsv4-oracle check
--oracle-device cuda``; those open :func:`compute_on` around their oracle calls. Inside that
scope (and only there: it is a context variable, restored on exit, never set at import) the
helpers below place the converted inputs on that device and tensors the oracle creates go
there too (``torch.device`` as a context manager). Results agree with the CPU's within float64
rounding, not bitwise (``oracle_tests/conformance/test_production.py``, the ``gpu`` lane). Outside any
scope, and inside ``compute_on("cpu")``, the code path and the bits are the CPU oracle's.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import numbers

import torch

from .constants import BOUND_CHUNK_BYTES

F64 = torch.float64
CPU = torch.device("cpu")
_COMPUTE_DEVICE: contextvars.ContextVar[torch.device] = contextvars.ContextVar(
    "reference_compute_device", default=CPU)


def compute_device() -> torch.device:
    """The device the oracle computes on: the CPU, unless inside :func:`compute_on`."""
    return _COMPUTE_DEVICE.get()


def as_device(device, name: str = "compute_device") -> torch.device:
    """``device`` (a ``str`` or ``torch.device``; ``None`` = the CPU) checked: ``cpu`` or an
    available ``cuda`` device, else ``ValueError`` naming ``name``."""
    if device is None:
        return CPU
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{name}: {device!r} is not a device ({exc})") from None
    if dev.type == "cpu":
        return CPU
    if dev.type != "cuda":
        raise ValueError(f"{name} must be 'cpu' or a CUDA device, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{name}={device!r}: CUDA is not available on this machine")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"{name}={device!r}: this machine has {torch.cuda.device_count()} "
                         "CUDA devices")
    return torch.device("cuda", index)


@contextlib.contextmanager
def compute_on(device):
    """Run the oracle code of the ``with`` block on ``device`` (see the module docstring).
    The CPU, given explicitly, is the default path (the same bits)."""
    dev = as_device(device)
    token = _COMPUTE_DEVICE.set(dev)
    try:
        if dev.type == "cpu":
            yield dev
        else:
            with torch.device(dev):
                yield dev
    finally:
        _COMPUTE_DEVICE.reset(token)


def to_cpu(result):
    """``result`` (a tensor, or a (named) tuple / list of them and plain values) with every
    tensor moved to the CPU: what the oracle returns at the end of a :func:`compute_on` block."""
    if isinstance(result, torch.Tensor):
        return result.to(CPU)
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        return type(result)(*(to_cpu(r) for r in result))
    if isinstance(result, (tuple, list)):
        return type(result)(to_cpu(r) for r in result)
    if isinstance(result, dict):
        return {k: to_cpu(v) for k, v in result.items()}
    return result


def _no_meta(x: torch.Tensor, name: str) -> None:
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (it holds no data); the oracle needs values")


def as_float64(x, name: str, *, ndim: int | None = None, allow_nan: bool = True) -> torch.Tensor:
    """A float tensor of any dtype/device as a float64 tensor on the compute device (a CPU
    tensor unless inside :func:`compute_on`; a view or copy, never mutated)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _no_meta(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    out = x.to(device=_COMPUTE_DEVICE.get(), dtype=F64)
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
    tensor on the compute device (the CPU unless inside :func:`compute_on`; never mutated). ``uint64`` is rejected with ``TypeError``: its values above
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
    return x.to(device=_COMPUTE_DEVICE.get(), dtype=torch.int64)


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


def allocated(make, name: str, what: str):
    """``make()``, an allocation whose size comes from the argument ``name``: an allocator
    failure (a size this machine cannot hold, or one past the element count a tensor can
    have) is a ``ValueError`` naming ``name`` and ``what`` was to be allocated."""
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{name}: {what} cannot be allocated here ({first})") from None


def chunk_rows(rows_per_chunk: int | None, per_row_bytes: int,
               budget_bytes: int = BOUND_CHUNK_BYTES) -> int:
    """Rows per chunk: given explicitly, or as many as fit a fixed memory budget (by default
    ``BOUND_CHUNK_BYTES``, 256 MiB)."""
    if rows_per_chunk is not None:
        return as_int(rows_per_chunk, "chunk_rows", minimum=1)
    return max(1, budget_bytes // max(1, per_row_bytes))
