"""The canonical reductions (contract sections 6, 8 and 10): ``_reduce.ordered_sum`` and
``_reduce.fold_rows_into`` are bitwise equal to a Python left fold in index order.

The data mixes magnitudes from 1e-3 to 1e16 with both signs, so float64 addition is far from
associative on it; the negative control asserts that a different order gives different bits,
so these tests would catch a pairwise, blocked or parallel summation."""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle.reference._reduce import fold_rows_into, ordered_sum


def order_sensitive(shape, seed):
    g = torch.Generator().manual_seed(seed)
    mant = torch.randn(shape, generator=g, dtype=torch.float64)
    expo = torch.randint(-3, 17, shape, generator=g).to(torch.float64)
    return mant * torch.pow(10.0, expo)


def left_fold(rows: list, width: int) -> list[float]:
    acc = [0.0] * width
    for row in rows:
        for j in range(width):
            acc[j] = acc[j] + row[j]
    return acc


def right_fold(rows: list, width: int) -> list[float]:
    return left_fold(rows[::-1], width)


@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (40000,), (300, 3), (64, 2, 2)])
def test_ordered_sum_is_the_left_fold(shape):
    x = order_sensitive(shape, seed=sum(shape))
    flat = x.reshape(shape[0], -1)
    width = flat.shape[1]
    want = left_fold(flat.tolist(), width)
    got = ordered_sum(x)
    assert got.shape == x.shape[1:]
    assert got.reshape(-1).tolist() == want
    if shape[0] >= 1000:           # negative control: the order matters on this data
        assert right_fold(flat.tolist(), width) != want


def test_ordered_sum_of_nothing_is_zero():
    assert torch.equal(ordered_sum(torch.zeros((0, 3), dtype=torch.float64)),
                       torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("n,slots,width", [(1, 1, 1), (50, 4, 3), (5000, 7, 2), (20000, 3, 1)])
def test_fold_rows_into_is_the_left_fold_per_slot(n, slots, width):
    g = torch.Generator().manual_seed(n)
    acc = order_sensitive((slots, width), seed=n + 1)
    index = torch.randint(0, slots, (n,), generator=g)          # unsorted, repeated
    contributions = order_sensitive((n, width), seed=n + 2)
    want = acc.tolist()
    for i, row in zip(index.tolist(), contributions.tolist()):
        for j in range(width):
            want[i][j] = want[i][j] + row[j]
    got = acc.clone()
    fold_rows_into(got, index, contributions)
    assert got.tolist() == want
    # chunked folding in the same global order gives the same bits
    chunked = acc.clone()
    for a in range(0, n, 13):
        fold_rows_into(chunked, index[a:a + 13], contributions[a:a + 13])
    assert torch.equal(chunked, got)


def test_fold_rows_into_with_no_rows_leaves_acc_alone():
    acc = order_sensitive((3, 2), seed=0)
    before = acc.clone()
    fold_rows_into(acc, torch.zeros(0, dtype=torch.int64), torch.zeros((0, 2), dtype=torch.float64))
    assert torch.equal(acc, before)
