"""Property: invalid slots are invisible (contract section 6), over hypothesis index patterns.

Attention with any mix of valid ids, -1, hostile ids (INT_MIN, -123456, S, S+17, INT_MAX) and
any lengths (none, in range, 0, negative, above the width) equals, bit for bit, attention over
the same row with every invalid slot written as -1 and no lengths; key rows that no valid slot
selects may hold NaN without effect; rows with no valid slot give out 0, lse +inf and no
gradient. Compacting the valid slots to the front changes only the summation order: equal
within the float64 error model (section 12).
"""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_oracle import reference as R
from dsv4_oracle.compare import compare_numeric
from dsv4_oracle.reference import error_model as E
from dsv4_oracle.fixtures.strategies import index_patterns, lengths_patterns, settings, sink_values


@st.composite
def op_inputs(draw):
    T, S = draw(st.integers(1, 6)), draw(st.integers(1, 10))
    width = draw(st.integers(1, 8))
    H, D = draw(st.integers(1, 3)), 8
    itype = draw(st.sampled_from(("int32", "int64")))
    ids = draw(index_patterns(T, width, S, itype))
    lengths = draw(lengths_patterns(T, width, itype))
    sink = draw(sink_values(H, k=width))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    return q, kv, ids, lengths, sink, dout


def _compacted(ids, lengths, S):
    valid = R.attention.valid_slots(ids.long(), S, None if lengths is None else lengths.long())
    rows = [ids.long()[t][valid[t]].tolist() for t in range(ids.shape[0])]
    width = max([len(r) for r in rows] + [1])
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64), valid


def _bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))


@settings(25)
@given(op_inputs())
def test_invalid_slots_and_lengths_are_invisible(inp):
    q, kv, ids, lengths, sink, dout = inp
    S = kv.shape[0]
    clean, valid = _compacted(ids, lengths, S)
    before = (ids.clone(), None if lengths is None else lengths.clone())
    # poison every key row that no valid slot selects
    used = torch.zeros(S, dtype=torch.bool)
    used[ids.long()[valid]] = True
    kv_p = torch.where(used.unsqueeze(1), kv, torch.full_like(kv, math.nan))
    masked = torch.where(valid, ids.long(), -1)
    out, lse = R.sparse_attention_forward(q, kv_p, ids, sink, lengths=lengths)
    ref_out, ref_lse = R.sparse_attention_forward(q, kv, masked, sink)
    assert _bits(out, ref_out) and _bits(lse, ref_lse)
    dq, dkv, dsink = R.sparse_attention_backward(q, kv_p, ids, sink, out, lse, dout, lengths=lengths)
    rq, rkv, rsink = R.sparse_attention_backward(q, kv, masked, sink, ref_out, ref_lse, dout)
    assert _bits(dq, rq) and _bits(dkv, rkv) and _bits(dsink, rsink)
    # compacted rows: the same sums in another order, within float64 rounding
    c_out, c_lse = R.sparse_attention_forward(q, kv, clean, sink)
    b_out, b_lse = E.attention_forward_bound(q, kv, clean, sink, c_out, c_lse,
                                             precision=E.ORACLE_PRECISION)
    for name, a, e, b in (("out", out, c_out, b_out), ("lse", lse, c_lse, b_lse)):
        r = compare_numeric(name, a, e, b)
        assert r.passed, r.detail
    c_grads = R.sparse_attention_backward(q, kv, clean, sink, c_out, c_lse, dout)
    b_grads = E.attention_backward_bound(q, kv, clean, sink, c_out, c_lse, dout, *c_grads,
                                         precision=E.ORACLE_PRECISION)
    for name, a, e, b in zip(("dq", "dkv", "dsink"), (dq, dkv, dsink), c_grads, b_grads):
        r = compare_numeric(name, a, e, b)
        assert r.passed, r.detail
    empty = ~valid.any(dim=1)
    assert bool((out[empty] == 0).all()) and bool((lse[empty] == math.inf).all())
    assert bool((dq[empty] == 0).all()) and bool((dkv[~used] == 0).all())
    assert torch.equal(ids, before[0])                       # caller's tensors untouched
    assert lengths is None or torch.equal(lengths, before[1])
