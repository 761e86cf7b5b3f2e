"""Lightning indexer scores (contract section 7) and the worked example of contract section 4 (sections 4, 7).

Integer-valued inputs make every float64 operation of the definition exact, so the scores are
checked with ``torch.equal`` against the definition written as Python loops; random inputs are
checked with the error model (section 12)."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hashes, error_ratio
from dsv4_oracle.reference.dense import dense_visibility
from dsv4_oracle.reference.error_model import ORACLE_PRECISION, indexer_scores_bound

INF = math.inf
F64 = torch.float64

LAYOUTS = [
    ([0, 4], None, None),
    ([0, 7, 7, 18], [0, 8, 8, 24], 32),
    ([0, 0, 5, 13], [0, 2, 8, 16], 19),
]


def scores_by_definition(q_idx, k_idx, w, layout, ratio, scale):
    T, HI, _ = q_idx.shape
    C = k_idx.shape[0]
    vis = dense_visibility(layout, 1, ratio)[:, T:]          # compressed part of section 3
    out = [[-INF] * C for _ in range(T)]
    for t in range(T):
        for c in range(C):
            if bool(vis[t, c]):
                acc = 0.0
                for h in range(HI):
                    acc += float(w[t, h]) * max(float(q_idx[t, h] @ k_idx[c]), 0.0)
                out[t][c] = scale * acc
    return torch.tensor(out, dtype=F64).reshape(T, C)


def integer_inputs(layout, ratio, HI=3, DI=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, C = layout.num_rows, layout.num_compressed(ratio)
    return (torch.randint(-3, 4, (T, HI, DI), generator=g).to(F64),
            torch.randint(-3, 4, (C, DI), generator=g).to(F64),
            torch.randint(-4, 5, (T, HI), generator=g).to(F64) / 4)


def test_the_worked_example():
    layout = R.PackedLayout([0, 4])
    q_idx, k_idx, _ = integer_inputs(layout, 2)
    scores = R.indexer_scores(q_idx, k_idx, torch.zeros(4, 3, dtype=F64), layout, 2)
    ids, lengths = R.stable_topk(scores, 5)
    assert ids.tolist() == [[-1] * 5, [0, -1, -1, -1, -1], [0, -1, -1, -1, -1],
                            [0, 1, -1, -1, -1]]
    assert lengths.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("cu,cu_pad,num_rows", LAYOUTS)
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_integer_scores_equal_the_definition_exactly(cu, cu_pad, num_rows, ratio):
    layout = R.PackedLayout(cu, cu_pad, num_rows)
    q_idx, k_idx, w = integer_inputs(layout, ratio, seed=ratio)
    # D_I = 4: the default scale 4**-0.5 = 0.5 is exact, so every operation is exact.
    got = R.indexer_scores(q_idx, k_idx, w, layout, ratio)
    assert torch.equal(got, scores_by_definition(q_idx, k_idx, w, layout, ratio, 0.5))
    got = R.indexer_scores(q_idx, k_idx, w, layout, ratio, scale=0.25)
    assert torch.equal(got, scores_by_definition(q_idx, k_idx, w, layout, ratio, 0.25))


@pytest.mark.parametrize("cu,cu_pad,num_rows", LAYOUTS)
def test_random_scores_match_the_definition_within_the_error_model(cu, cu_pad, num_rows):
    layout = R.PackedLayout(cu, cu_pad, num_rows)
    g = torch.Generator().manual_seed(5)
    T, C = layout.num_rows, layout.num_compressed(2)
    q_idx, k_idx, w = (torch.randn(T, 4, 16, generator=g, dtype=F64),
                       torch.randn(C, 16, generator=g, dtype=F64),
                       torch.randn(T, 4, generator=g, dtype=F64))
    got = R.indexer_scores(q_idx, k_idx, w, layout, 2)
    want = scores_by_definition(q_idx, k_idx, w, layout, 2, 0.25)
    bound = indexer_scores_bound(q_idx, k_idx, w, layout, 2, got, precision=ORACLE_PRECISION)
    assert error_ratio(want, got, bound) <= 1
    assert torch.equal(torch.isinf(got), ~dense_visibility(layout, 1, 2)[:, T:])


def test_negative_products_are_gated_by_relu():
    layout = R.PackedLayout([0, 2])                   # ratio 1: row 1 sees groups 0 and 1
    q_idx = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]] * 2)
    k_idx = torch.tensor([[-2.0, 3.0], [5.0, -7.0]])
    w = torch.tensor([[1.0, 10.0]] * 2)
    s = R.indexer_scores(q_idx, k_idx, w, layout, 1, scale=1.0)
    # row 1: group 0 -> 1*relu(-2) + 10*relu(3) = 30; group 1 -> 1*relu(5) + 10*relu(-7) = 5
    assert s.tolist() == [[30.0, -INF], [30.0, 5.0]]


def test_low_precision_inputs_are_evaluated_on_their_exact_values():
    layout = R.PackedLayout([0, 7, 18], [0, 8, 24], 32)
    g = torch.Generator().manual_seed(9)
    T, C = 32, layout.num_compressed(4)
    args = (torch.randn(T, 2, 8, generator=g), torch.randn(C, 8, generator=g),
            torch.randn(T, 2, generator=g))
    low = [a.to(torch.bfloat16) for a in args]
    got = R.indexer_scores(*low, layout, 4)
    assert got.dtype == F64
    assert torch.equal(got, R.indexer_scores(*[a.to(F64) for a in low], layout, 4))


def test_inputs_are_not_modified():
    layout = R.PackedLayout([0, 7, 18], [0, 8, 24], 32)
    q_idx, k_idx, w = integer_inputs(layout, 4)
    q_idx = q_idx.to(torch.float32)
    before = content_hashes(q_idx, k_idx, w)
    R.indexer_scores(q_idx, k_idx, w, layout, 4)
    assert content_hashes(q_idx, k_idx, w) == before
