"""Canonical, chunking-independent reductions (contract sections 6, 8 and 10).

Every sum the oracle reports over rows (dkv, dsink, dk_idx, the loss) is a *sequential left fold
in global (row, slot) order*. ``torch.Tensor.index_add_`` on the CPU accumulates its source in
index order, one source slice after another, so folding chunk after chunk gives the same bits
as folding everything at once: the result does not depend on chunk sizes or on how rows are
split across CP ranks, as long as contributions arrive in global row order.
(``oracle_tests/reference/test_reduce.py`` proves the fold against a Python left fold.)

Every per-row product is :func:`row_bmm`: a batched GEMM whose items are all 64-byte aligned, so
a row's bits do not depend on which other rows are evaluated with it (plain ``torch.bmm`` on
the CPU does not promise that: MKL's batched GEMM picks kernels by item address, which varies
with the batch position when an item's size is not a multiple of 8 elements;
``oracle_tests/reference/test_cp.py`` has the shapes that showed it).
"""
from __future__ import annotations

import torch


def fold_rows_into(acc: torch.Tensor, index: torch.Tensor, contributions: torch.Tensor) -> None:
    """acc[index[i]] += contributions[i] for i = 0, 1, ... in that order (sequential per row)."""
    if index.numel():
        acc.index_add_(0, index, contributions)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dimension 0 as a left fold ``((x0 + x1) + x2) + ...``; shape ``x.shape[1:]``."""
    acc = torch.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype)
    fold_rows_into(acc, torch.zeros(x.shape[0], dtype=torch.int64), x)
    return acc[0]



_ALIGN = 8  # float64 elements per 64 bytes


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _aligned_batch(x: torch.Tensor, cols: int) -> torch.Tensor:
    """``x [n, r, c]`` as a batch of row- or column-major items, each at a 64-byte aligned
    address, with ``cols >= c`` columns (zero-padded). Copies only when ``x`` is not already so."""
    n, r, c = x.shape
    items = (x.stride(2) == 1 and x.stride(1) == c) or (x.stride(1) == 1 and x.stride(2) == r)
    if (cols == c and items and x.data_ptr() % 64 == 0
            and (n == 1 or x.stride(0) % _ALIGN == 0)):
        return x
    stride = _round_up(max(r * cols, 1), _ALIGN)
    buf = (torch.empty if cols == c else torch.zeros)((n, stride), dtype=x.dtype)
    out = buf[:, : r * cols].view(n, r, cols)
    out[:, :, :c] = x
    return out


def row_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.bmm(a, b)`` whose batch element ``i`` has the same bits whatever the batch size,
    its position in the batch and the operands' addresses.

    MKL's batched GEMM (the path ``torch.bmm`` takes for float64 on the CPU) picks kernels by
    the alignment of every item's A, B and C pointers. Here every item of A and B starts on a
    64-byte boundary and B's columns are zero-padded to a multiple of 8, so every item of the
    (contiguous) result starts on one too; the shapes, strides and alignment then being the same
    for every row, so are the bits. Differentiable (used by the gradchecks).
    """
    n, _, inner = a.shape
    cols = b.shape[2]
    if n == 0:
        return torch.zeros((0, a.shape[1], cols), dtype=torch.result_type(a, b))
    padded = _round_up(max(cols, 1), _ALIGN)
    if out is None:
        out = torch.bmm(_aligned_batch(a, inner), _aligned_batch(b, padded))
    else:  # a buffer laid out exactly like the result bmm would allocate (row_bmm_buffer)
        if tuple(out.shape) != (n, a.shape[1], padded) or not out.is_contiguous() \
                or out.data_ptr() % 64:
            raise ValueError("row_bmm: out must be a row_bmm_buffer(...)[:n]")
        torch.bmm(_aligned_batch(a, inner), _aligned_batch(b, padded), out=out)
    return out if padded == cols else out[:, :, :cols]


def row_bmm_buffer(n: int, rows: int, cols: int) -> torch.Tensor:
    """A reusable result buffer for ``row_bmm(a, b, out=buf[:m])`` (``m <= n`` items of
    ``[rows, cols]``): contiguous, 64-byte aligned, columns padded to a multiple of 8, i.e. the
    layout ``row_bmm`` itself allocates, so the bits are the same. Reusing it across chunks saves
    the page faults of a fresh multi-MiB allocation per product."""
    return torch.empty((n, rows, _round_up(max(cols, 1), _ALIGN)), dtype=torch.float64)


def fold_slot_rows_into(acc: torch.Tensor, keys: torch.Tensor, contributions: torch.Tensor) -> None:
    """``acc[keys[i, j]] += contributions[i, j]`` for rows ``i = 0, 1, ...`` in order and slots
    ``j`` in order within a row: the left fold of :func:`fold_rows_into` over the (row, slot)
    sequence, with the same bits. The last row of ``acc`` is a discard row: slots whose key is
    ``acc.shape[0] - 1`` (invalid slots) are folded there and must be ignored by the caller.

    A row whose other keys are distinct (the normal case) is one gather, one add and one
    scatter-copy (each destination gets one addition per row, rows in order); a row with a
    repeated key falls back to ``index_add_`` (sequential in slot order). This is much faster
    than one ``index_add_`` per chunk of wide rows on the CPU."""
    n, width = keys.shape
    if n == 0 or width == 0:
        return
    discard = acc.shape[0] - 1
    ordered = torch.sort(keys, dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != discard)).any(dim=1)
    work = torch.empty((width,) + tuple(acc.shape[1:]), dtype=acc.dtype)
    for i, rep in enumerate(repeated.tolist()):
        row = keys[i]
        if rep:
            keep = row != discard
            acc.index_add_(0, row[keep], contributions[i][keep])
        else:
            torch.index_select(acc, 0, row, out=work)
            work.add_(contributions[i])
            acc.index_copy_(0, row, work)


def row_extents(valid: torch.Tensor, multiple: int) -> torch.Tensor:
    """Per row of ``valid [T, K]``, the slots it is evaluated over: its last valid slot + 1,
    rounded up to a multiple of ``multiple`` (at least one multiple). Slots past a row's last
    valid slot are invalid and add exact zeros, so a row's bits depend on its own slots only
    (never on the caller's width or on other rows), and a row with few valid slots costs only
    its own extent. Callers pad the slot axis to a multiple of ``multiple`` first."""
    T, K = valid.shape
    if K == 0:
        return torch.full((T,), multiple, dtype=torch.int64)
    last = torch.where(valid, torch.arange(1, K + 1), torch.zeros((), dtype=torch.int64))
    last = last.amax(dim=1)
    return torch.clamp(-(-last // multiple) * multiple, min=multiple)


def row_runs(widths: torch.Tensor, step: int):
    """``(r0, r1, w)``: runs of consecutive rows of equal extent ``w``, at most ``step`` rows
    each, in row order (folds over the runs stay in global row order)."""
    T = widths.numel()
    if T == 0:
        return
    bounds = [0] + (torch.nonzero(widths[1:] != widths[:-1]).flatten() + 1).tolist() + [T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        w = int(widths[a])
        for r0 in range(a, b, step):
            yield r0, min(r0 + step, b), w


def carve(buf: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous ``shape`` view of the front of the flat work buffer ``buf``: 64-byte aligned
    and laid out like a fresh tensor of that shape (e.g. a ``row_bmm`` result)."""
    n = 1
    for d in shape:
        n *= d
    return buf[:n].view(*shape)
