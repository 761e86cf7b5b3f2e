"""DeepSeek-V3.2 DSA (contract section 5.1): ratio 1, window 0, no sink, ``kv_cmp = kv_raw``.

The oracle's DSA rows, attention and loss are checked against a dense, independent statement of
V3.2's DSA (a causal token-level indexer ``g <= p``, Top-K with the smaller id winning ties,
softmax attention over the selected tokens without a sink, the teacher as the per-head softmax
over the selected set summed over heads and L1-normalised, ``N`` real tokens); the torch
backend passes the conformance check on the DSA cases; window 0 is accepted exactly where the
layer has compressed keys.
"""
from __future__ import annotations


import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.runner import select_cases
from dsv4_oracle.fixtures import Case, get, run_oracle
from dsv4_oracle.gpu_impl import torch_backend
from dsv4_oracle.gpu_impl.layer import csa_layer
from oracle_tests.helpers.impl_harness import torch_backend_outcome

DSA = dict(layer="dsa", ratio=1, window=0, sink="neg_inf")


def _dense_dsa(case: Case, x: dict):
    """V3.2 DSA from its definition, densely per document (float64)."""
    lay = case.layout()
    T = lay.num_rows
    H, D = case.heads, case.head_dim
    dv = case.v_dim or D
    q, kv, q_idx, k_idx, w = (x[k].to(torch.float64) for k in ("q", "kv_raw", "q_idx", "k_idx",
                                                                  "weights"))
    ids = torch.full((T, case.topk), -1, dtype=torch.int64)
    out = torch.zeros((T, H, dv), dtype=torch.float64)
    tau = torch.zeros((T, case.topk), dtype=torch.float64)
    for t in range(T):
        if not bool(lay.is_real[t]):
            continue
        b, p = int(lay.doc[t]), int(lay.pos[t])
        start = int(lay.cu_seqlens_padded[b])
        keys = torch.arange(start, start + p + 1)                       # g <= p: causal
        z = torch.einsum("hd,cd->hc", q_idx[t], k_idx[keys])
        score = case.index_dim ** -0.5 * (w[t].unsqueeze(1) * torch.relu(z)).sum(0)
        order = sorted(range(keys.numel()), key=lambda i: (-float(score[i]), int(keys[i])))
        sel = torch.sort(keys[order[: case.topk]]).values                # emit order "id"
        ids[t, : sel.numel()] = sel
        s = D ** -0.5 * torch.einsum("hd,cd->hc", q[t], kv[sel])        # [H, k]
        P = torch.softmax(s, dim=1)                                      # no sink
        out[t] = P @ kv[sel, :dv]
        A = P.sum(0)
        tau[t, : sel.numel()] = A / A.sum()
    return ids, out, tau


@pytest.mark.parametrize("case_id", ["dsa-padded", "dsa-zero-ties"])
def test_the_oracle_is_v32_dsa(case_id):
    case = get(case_id)
    x = case.materialize()
    o = run_oracle(case, x)
    ids, out, tau = _dense_dsa(case, x)
    T = case.T
    assert torch.equal(o["cmp_ids"], ids)
    assert torch.equal(o["ids"], torch.where(ids >= 0, ids + T, ids))   # window 0: Top-K only
    torch.testing.assert_close(o["out"], out, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(o["target"], tau, rtol=1e-12, atol=1e-14)
    assert torch.isinf(o["lse"][~case.layout().is_real]).all()
    assert int(o["num_real"]) == int(case.layout().num_real)


def test_dsa_visibility_is_g_le_p():
    # one document of 5 tokens and 3 padding rows, ratio 1, window 0, every visible group
    lay = R.PackedLayout([0, 5], [0, 8], 10)
    ids, lengths = R.build_csa_indices(lay, window=0, ratio=1)
    assert lengths.tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 0, 0]
    for p in range(5):
        assert ids[p, : p + 1].tolist() == [10 + g for g in range(p + 1)]
        assert bool((ids[p, p + 1:] == -1).all())
    got, glen = torch_backend.build_csa_indices(lay, window=0, ratio=1)
    assert torch.equal(got.long(), ids) and torch.equal(glen.long(), lengths)


def test_dsa_case_shares_the_raw_keys():
    case = get("dsa-nan-poison")
    x = case.materialize()
    assert torch.equal(x["kv_cmp"].isnan(), x["kv_raw"][: case.C].isnan())
    keep = ~x["kv_cmp"].isnan()
    assert torch.equal(x["kv_cmp"][keep], x["kv_raw"][: case.C][keep])
    assert case.C == int(case.layout().cu_seqlens_padded[-1])


@pytest.mark.parametrize("fields, match", [
    (dict(DSA, ratio=4), "layer='dsa'"),
    (dict(DSA, window=1), "layer='dsa'"),
    (dict(DSA, sink="normal"), "layer='dsa'"),
    (dict(layer="window", ratio=0, window=0), "window=0 needs compressed keys"),
])
def test_case_rejects_a_dsa_that_is_not_v32(fields, match):
    with pytest.raises(ValueError, match=match):
        Case(name="x", seed=1, cu_seqlens=(0, 8), **fields)


def test_window_zero_needs_compressed_keys():
    lay = R.PackedLayout([0, 8])
    for build in (R.build_csa_indices, torch_backend.build_csa_indices):
        with pytest.raises(ValueError, match="window=0 needs compressed keys"):
            build(lay, window=0, ratio=0)
        with pytest.raises(ValueError, match="window"):
            build(lay, window=-1, ratio=1)
    q = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="window=0 needs compressed keys"):
        csa_layer(q, torch.randn(8, 16), torch.zeros(2), lay, window=0, ratio=0)


def test_csa_with_window_zero_and_ratio_one_runs():
    # a CSA layer may drop its window too (W = 0 with compressed keys, section 3)
    case = Case(name="csa-w0", seed=3, cu_seqlens=(0, 12), ratio=1, window=0, topk=4)
    o = run_oracle(case, case.materialize())
    assert bool((o["ids"][o["ids"] >= 0] >= case.T).all())            # compressed keys only


def test_dsa_cases_are_in_the_quick_catalog():
    quick, _ = select_cases("quick")
    assert {"dsa-padded", "dsa-zero-ties"} <= {c.id for c in quick}


@pytest.mark.parametrize("case_id", ["dsa-padded", "dsa-nan-poison"])
def test_torch_backend_passes_dsa(case_id):
    outcome = torch_backend_outcome(case_id)
    assert {c.extra["level"] for c in outcome.checks} == {"op", "layer"}
