"""Canonical, chunking-independent reductions (contract sections 6, 8 and 10).

Every sum the oracle reports over rows (dkv, dsink, dk_idx, the loss) is a *sequential left fold
in global (row, slot) order*. ``torch.Tensor.index_add_`` on the CPU accumulates its source in
index order, one source slice after another, so folding chunk after chunk gives the same bits
as folding everything at once: the result does not depend on chunk sizes or on how rows are
split across CP ranks, as long as contributions arrive in global row order.
(``oracle_tests/test_reference_reduce.py`` proves the fold against a Python left fold.)

Every per-row product is :func:`row_bmm`: one GEMM per row on canonically placed operands, so a
row's bits do not depend on which other rows are evaluated with it (``torch.bmm`` on the CPU
does not promise that: MKL's batched GEMM picks kernels by batch size, batch position and
operand address; ``oracle_tests/test_reference_cp.py`` has the shapes that showed it).
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


def _canonical_operand(m: torch.Tensor) -> torch.Tensor:
    """A 2-D GEMM operand at a 64-byte aligned address. A BLAS-native stride pattern (row- or
    column-major with a leading dimension) at another address is copied into a fresh buffer
    with the same strides, so the GEMM path (and hence the bits) depends only on the shapes
    and the stride pattern, which are the same for every row. Other patterns are copied by
    ``torch.mm`` itself into fresh (aligned) buffers."""
    s0, s1 = m.stride()
    native = (s1 == 1 and s0 >= max(1, m.shape[1])) or (s0 == 1 and s1 >= max(1, m.shape[0]))
    if native and m.numel() and m.data_ptr() % 64:
        fresh = torch.empty_strided(tuple(m.shape), m.stride(), dtype=m.dtype)
        fresh.copy_(m)
        return fresh
    return m


def row_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with row-independent bits: batch element ``i`` is one ``torch.mm`` of
    canonically placed ``a[i]`` and ``b[i]``, whatever the batch size and position.
    Differentiable (used by the gradchecks)."""
    n = a.shape[0]
    if n == 0:
        return torch.zeros((0, a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    return torch.stack([torch.mm(_canonical_operand(a[i]), _canonical_operand(b[i]))
                        for i in range(n)])
