"""Canonical, chunking-independent reductions (contract sections 6, 8 and 10).

Every sum the oracle reports over rows (dkv, dsink, dk_idx, the loss) is a *sequential left fold
in global (row, slot) order*. ``torch.Tensor.index_add_`` on the CPU accumulates its source in
index order, one source slice after another, so folding chunk after chunk gives the same bits
as folding everything at once: the result does not depend on chunk sizes or on how rows are
split across CP ranks, as long as contributions arrive in global row order.
(``oracle_tests/test_reduce.py`` proves the fold against a Python left fold.)
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
