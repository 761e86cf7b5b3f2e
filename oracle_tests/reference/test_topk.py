"""Stable Top-K (contract section 4), checked exactly against a brute-force Python selection."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hash

INF = math.inf


def brute_topk(row: list[float], k: int, order: str) -> list[int]:
    """Section 4 by definition: candidates are the non ``-inf`` columns, ranked by (score
    descending, id ascending) with Python float comparison (so ``-0.0 == +0.0``)."""
    ranked = sorted((-v, j) for j, v in enumerate(row) if v != -INF)
    chosen = [j for _, j in ranked[:k]]
    return sorted(chosen) if order == "id" else chosen


def expected(scores: torch.Tensor, k: int, order: str, width: int):
    ids, lengths = [], []
    for row in scores.tolist():
        sel = brute_topk(row, k, order)
        ids.append(sel + [-1] * (width - len(sel)))
        lengths.append(len(sel))
    return (torch.tensor(ids, dtype=torch.int64).reshape(scores.shape[0], width),
            torch.tensor(lengths, dtype=torch.int64))


def tie_heavy_scores(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Scores from a tiny alphabet: many exact ties, signed zeros, -inf and +inf."""
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.tensor([-INF, -1.0, -0.0, 0.0, 0.5, 1.0, 2.0, INF], dtype=torch.float64)
    weights = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.3])
    pick = torch.multinomial(weights, rows * cols, replacement=True, generator=g)
    return alphabet[pick].reshape(rows, cols)


@pytest.mark.parametrize("order", ["id", "score"])
@pytest.mark.parametrize("k", [0, 1, 3, 7, 12])
def test_matches_brute_force_on_tie_heavy_rows(order, k):
    scores = tie_heavy_scores(rows=40, cols=9, seed=100 + k)
    ids, lengths = R.stable_topk(scores, k, order=order)
    want_ids, want_len = expected(scores, k, order, width=k)
    assert torch.equal(lengths, want_len)
    assert torch.equal(ids, want_ids)
    assert ids.dtype == torch.int64 and lengths.dtype == torch.int64


def test_exact_ties_go_to_the_smaller_id():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0],
                           [3.0, 3.0, 3.0, 3.0, 3.0]], dtype=torch.float64)
    ids, lengths = R.stable_topk(scores, 2, order="score")
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert lengths.tolist() == [2, 2]


def test_signed_zeros_are_equal():
    # -0.0 at column 0 must tie with +0.0 at column 1, and win because its id is smaller.
    for row in ([-0.0, 0.0, -0.0], [0.0, -0.0, 0.0]):
        ids, _ = R.stable_topk(torch.tensor([row], dtype=torch.float64), 2, order="score")
        assert ids.tolist() == [[0, 1]]
    ids, _ = R.stable_topk(torch.tensor([[-1.0, -0.0, 0.0]], dtype=torch.float64), 1)
    assert ids.tolist() == [[1]]


def test_minus_inf_is_never_selected():
    scores = torch.tensor([[-INF, -INF, -INF],
                           [-INF, -1e308, -INF],
                           [INF, -INF, 5.0]], dtype=torch.float64)
    ids, lengths = R.stable_topk(scores, 3, order="score")
    assert ids.tolist() == [[-1, -1, -1], [1, -1, -1], [0, 2, -1]]
    assert lengths.tolist() == [0, 1, 2]


def test_rows_shorter_than_k():
    scores = torch.tensor([[0.25, -3.0], [-INF, 7.0]], dtype=torch.float64)
    ids, lengths = R.stable_topk(scores, 5)
    assert ids.tolist() == [[0, 1, -1, -1, -1], [1, -1, -1, -1, -1]]
    assert lengths.tolist() == [2, 1]


def test_both_orders_select_the_same_set():
    scores = tie_heavy_scores(rows=60, cols=11, seed=7)
    by_id, len_id = R.stable_topk(scores, 4, order="id")
    by_score, len_score = R.stable_topk(scores, 4, order="score")
    assert torch.equal(len_id, len_score)
    assert torch.equal(torch.sort(by_score, dim=1).values, torch.sort(by_id, dim=1).values)
    # "id" emits ascending ids; "score" emits non-increasing scores (ties by ascending id).
    for ids, n, row in zip(by_id.tolist(), len_id.tolist(), scores.tolist()):
        assert ids[:n] == sorted(ids[:n])
    for ids, n, row in zip(by_score.tolist(), len_score.tolist(), scores.tolist()):
        keys = [(-row[j], j) for j in ids[:n]]
        assert keys == sorted(keys)


@pytest.mark.parametrize("k,align,width", [(5, 4, 8), (8, 4, 8), (1, 128, 128), (0, 128, 0),
                                           (3, 1, 3)])
def test_align_pads_the_width_with_minus_one(k, align, width):
    scores = tie_heavy_scores(rows=6, cols=10, seed=k)
    ids, lengths = R.stable_topk(scores, k, align=align)
    plain, plain_len = R.stable_topk(scores, k)
    assert ids.shape == (6, width)
    assert torch.equal(ids[:, :k], plain)
    assert bool((ids[:, k:] == -1).all())
    assert torch.equal(lengths, plain_len)


def test_empty_shapes():
    ids, lengths = R.stable_topk(torch.zeros((0, 4), dtype=torch.float64), 3)
    assert ids.shape == (0, 3) and lengths.shape == (0,)
    ids, lengths = R.stable_topk(torch.zeros((2, 0), dtype=torch.float64), 3)
    assert ids.tolist() == [[-1] * 3] * 2 and lengths.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_scores_select_on_their_exact_values(dtype):
    scores = tie_heavy_scores(rows=20, cols=8, seed=3).to(dtype)
    ids, lengths = R.stable_topk(scores, 3, order="score")
    want_ids, want_len = expected(scores.to(torch.float64), 3, "score", 3)
    assert torch.equal(ids, want_ids) and torch.equal(lengths, want_len)


def test_scores_are_not_modified():
    scores = tie_heavy_scores(rows=10, cols=6, seed=5)
    before = content_hash(scores)
    R.stable_topk(scores, 3, order="score", align=4)
    assert content_hash(scores) == before
