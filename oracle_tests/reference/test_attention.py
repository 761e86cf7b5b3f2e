"""Sparse attention with a sink (contract section 6), proven against itself.

- finite differences: ``torch.autograd.gradcheck`` of the differentiable gather forward and of
  the closed-form backward (wrapped as the forward's backward), wrt ``q``, ``kv`` and ``sink``;
- the closed-form backward against autograd of the gather forward, and the gather form against
  the independent dense-mask form (``reference/dense.py``), forward and backward, judged by the
  error model (``reference/error_model.py``, section 12) with ratio ``<= 1``;
- exact closed forms: sink-only rows, ``sink = -inf / +inf / 2.4e38``, duplicate ids, hostile
  invalid ids with and without ``lengths``; unmodified inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.selfcheck import SELFCHECK_CASES, case_tensors
from dsv4_oracle.fixtures import get
from oracle_tests import content_hashes, error_ratio
from dsv4_oracle.reference.dense import dense_attention, dense_visibility, slot_counts
from dsv4_oracle.reference.error_model import (ORACLE_PRECISION, attention_backward_bound,
                                   attention_forward_bound)

INF = math.inf
F64 = torch.float64
CASES = {i: get(i) for i in SELFCHECK_CASES}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def op_case(seed=0, T=6, H=3, D=5, S=9, K=5):
    """An op-level case: random ids with invalid slots (-1, S) and duplicates, ragged lengths,
    one row whose every slot is invalid."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, S + 1, (T, K), generator=g)
    ids[0, :2] = torch.tensor([3, 3])                  # a duplicate
    ids[1] = -1                                         # no valid slot: sink-only
    lengths = torch.randint(0, K + 2, (T,), generator=g)
    lengths[0] = K
    return dict(q=randn(T, H, D, seed=seed + 1), kv=randn(S, D, seed=seed + 2),
                ids=ids, sink=randn(H, seed=seed + 3), lengths=lengths)


def forward_ratio(q, kv, ids, sink, got_out, got_lse, out, lse, **kw):
    b_out, b_lse = attention_forward_bound(q, kv, ids, sink, out, lse,
                                           precision=ORACLE_PRECISION, **kw)
    return max(error_ratio(got_out, out, b_out), error_ratio(got_lse, lse, b_lse))


def backward_ratio(q, kv, ids, sink, out, lse, dout, got, want, **kw):
    bounds = attention_backward_bound(q, kv, ids, sink, out, lse, dout, *want,
                                      precision=ORACLE_PRECISION, **kw)
    return max(error_ratio(g, w, b) for g, w, b in zip(got, want, bounds))


def autograd_backward(q, kv, ids, sink, dout, **kw):
    """(out, lse) and (dq, dkv, dsink) by autograd of the differentiable gather forward."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
    out, lse = R.sparse_attention_forward(leaves[0], leaves[1], ids, leaves[2], **kw)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    grads = [torch.zeros_like(l) if g is None else g for g, l in zip(grads, leaves)]
    return (out.detach(), lse.detach()), tuple(grads)


# -- finite differences ------------------------------------------------------------------------

def test_gradcheck_of_the_gather_forward():
    c = op_case(seed=10, T=5, H=2, D=4, S=7, K=4)
    ids, lengths = c["ids"], c["lengths"]
    kw = dict(v_dim=3, lengths=lengths, scale=0.7)
    _, lse0 = R.sparse_attention_forward(c["q"], c["kv"], ids, c["sink"], **kw)
    keyed = torch.isfinite(lse0[:, 0])                 # lse is +inf (constant) on sink-only rows
    assert not bool(keyed.all()) and bool(keyed.any())

    def f(q, kv, sink):
        out, lse = R.sparse_attention_forward(q, kv, ids, sink, **kw)
        return out, lse[keyed]

    leaves = [c[k].clone().requires_grad_(True) for k in ("q", "kv", "sink")]
    assert torch.autograd.gradcheck(f, leaves)


class ClosedFormAttention(torch.autograd.Function):
    """The gather forward with the closed-form backward as its derivative."""

    @staticmethod
    def forward(ctx, q, kv, sink, ids, lengths, v_dim):
        out, lse = R.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths)
        ctx.save_for_backward(q, kv, sink, ids, lengths, out, lse)
        ctx.v_dim = v_dim
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, sink, ids, lengths, out, lse = ctx.saved_tensors
        dq, dkv, dsink = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                     v_dim=ctx.v_dim, lengths=lengths)
        return dq, dkv, dsink, None, None, None


@pytest.mark.parametrize("seed", [20, 21])
def test_gradcheck_of_the_closed_form_backward(seed):
    c = op_case(seed=seed, T=5, H=2, D=4, S=7, K=4)
    leaves = [c[k].clone().requires_grad_(True) for k in ("q", "kv", "sink")]
    assert torch.autograd.gradcheck(
        lambda q, kv, sink: ClosedFormAttention.apply(q, kv, sink, c["ids"], c["lengths"], 3),
        leaves)


# -- closed form vs autograd, gather vs dense (error model) --------------------------------------

def built_in(name):
    case = CASES[name]
    x = case_tensors(case)
    return x, dict(v_dim=case.v_dim, lengths=x.lengths)


@pytest.mark.parametrize("name", list(SELFCHECK_CASES))
def test_closed_form_backward_equals_autograd(name):
    x, kw = built_in(name)
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, **kw)
    want = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, out, lse, x.dout, **kw)
    (a_out, a_lse), got = autograd_backward(x.q, x.kv, x.ids, x.sink, x.dout, **kw)
    assert torch.equal(a_out, out) and torch.equal(a_lse, lse)
    assert backward_ratio(x.q, x.kv, x.ids, x.sink, out, lse, x.dout, got, want, **kw) <= 1


def test_closed_form_backward_equals_autograd_on_hostile_rows():
    c = op_case(seed=30)
    dout = randn(6, 3, 5, seed=31)
    kw = dict(lengths=c["lengths"])
    args = (c["q"], c["kv"], c["ids"], c["sink"])
    out, lse = R.sparse_attention_forward(*args, **kw)
    want = R.sparse_attention_backward(*args, out, lse, dout, **kw)
    _, got = autograd_backward(*args, dout, **kw)
    assert backward_ratio(*args, out, lse, dout, got, want, **kw) <= 1


def dense_reference(q, kv, ids, sink, dout, counts, *, v_dim=None, scale=None):
    """Forward and autograd backward of the dense-mask form."""
    D = q.shape[-1]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kv, sink)]
    out, lse = dense_attention(leaves[0], leaves[1], counts, leaves[2],
                               D ** -0.5 if scale is None else scale, D if v_dim is None else v_dim)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), lse.detach()), grads


@pytest.mark.parametrize("name", list(SELFCHECK_CASES))
def test_gather_equals_the_dense_mask_form(name):
    x, kw = built_in(name)
    S = x.kv.shape[0]
    counts = slot_counts(x.ids, S, x.lengths)
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, **kw)
    grads = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, out, lse, x.dout, **kw)
    (d_out, d_lse), d_grads = dense_reference(x.q, x.kv, x.ids, x.sink, x.dout, counts,
                                              v_dim=kw["v_dim"])
    assert forward_ratio(x.q, x.kv, x.ids, x.sink, d_out, d_lse, out, lse, **kw) <= 1
    assert backward_ratio(x.q, x.kv, x.ids, x.sink, out, lse, x.dout, d_grads, grads, **kw) <= 1


@pytest.mark.parametrize("name", ["selfcheck-hca", "selfcheck-window-only"])
def test_hca_and_window_rows_select_exactly_the_dense_visibility(name):
    case = CASES[name]
    x = case_tensors(case)
    vis = dense_visibility(x.layout, case.window, case.ratio).to(F64)
    assert torch.equal(slot_counts(x.ids, x.kv.shape[0], x.lengths), vis)


def test_gather_equals_dense_on_duplicates_and_hostile_ids():
    c = op_case(seed=40, T=8, K=7)
    c["ids"][2] = torch.tensor([4, 4, 4, 0, 9, -1, 4])   # a key three times (+ one after length)
    c["lengths"][2] = 7
    dout = randn(8, 3, 5, seed=41)
    args = (c["q"], c["kv"], c["ids"], c["sink"])
    kw = dict(lengths=c["lengths"])
    out, lse = R.sparse_attention_forward(*args, **kw)
    grads = R.sparse_attention_backward(*args, out, lse, dout, **kw)
    counts = slot_counts(c["ids"], 9, c["lengths"])
    assert float(counts[2, 4]) == 4.0
    (d_out, d_lse), d_grads = dense_reference(*args, dout, counts)
    assert forward_ratio(*args, d_out, d_lse, out, lse, **kw) <= 1
    assert backward_ratio(*args, out, lse, dout, d_grads, grads, **kw) <= 1


# -- exact closed forms --------------------------------------------------------------------------

def test_sink_only_rows_are_exact_and_contribute_nothing():
    c = op_case(seed=50, T=7, K=4)
    T, H, D = c["q"].shape
    ids, lengths = c["ids"].clone(), c["lengths"].clone()
    lengths[:] = 4
    ids[0] = torch.tensor([2, 5, -1, 8])
    ids[3] = torch.tensor([-1, 9, -7, 1000])           # no valid id
    lengths[5] = 0                                      # valid ids, but none below the length
    lengths[6] = -3
    empty = torch.tensor([3, 5, 6] + [t for t in range(T) if not bool(((ids[t] >= 0) & (ids[t] < 9)).any())])
    dout = randn(T, H, D, seed=51) * 1e6                # large upstream gradient on every row
    args = (c["q"], c["kv"], ids, c["sink"])
    out, lse = R.sparse_attention_forward(*args, lengths=lengths)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert bool((lse[empty] == INF).all())
    dq, dkv, dsink = R.sparse_attention_backward(*args, out, lse, dout, lengths=lengths)
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    # dkv and dsink are bitwise those of the same batch without the sink-only rows.
    keep = torch.tensor([t for t in range(T) if t not in set(empty.tolist())])
    _, dkv_k, dsink_k = R.sparse_attention_backward(c["q"][keep], c["kv"], ids[keep], c["sink"],
                                                    out[keep], lse[keep], dout[keep],
                                                    lengths=lengths[keep])
    assert torch.equal(dkv, dkv_k) and torch.equal(dsink, dsink_k)


def plain_softmax(q, kv, ids, scale=None):
    """Rows without a sink by definition: softmax over the valid slots (all slots valid here)."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    kg = kv[ids]                                                   # [T, K, D]
    s = scale * torch.einsum("thd,tkd->thk", q, kg)
    return torch.einsum("thk,tkd->thd", torch.softmax(s, dim=-1), kg), torch.logsumexp(s, dim=-1)


def test_minus_inf_sink_is_plain_softmax():
    g = torch.Generator().manual_seed(60)
    q, kv = randn(5, 2, 6, seed=61), randn(8, 6, seed=62)
    ids = torch.randint(0, 8, (5, 4), generator=g)
    sink = torch.full((2,), -INF, dtype=F64)
    out, lse = R.sparse_attention_forward(q, kv, ids, sink)
    p_out, p_lse = plain_softmax(q, kv, ids)
    assert forward_ratio(q, kv, ids, sink, p_out, p_lse, out, lse) <= 1
    _, _, dsink = R.sparse_attention_backward(q, kv, ids, sink, out, lse, randn(5, 2, 6, seed=63))
    assert torch.equal(dsink, torch.zeros(2, dtype=F64))


@pytest.mark.parametrize("big", [INF, 2.4e38])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_infinite_or_huge_sink_takes_all_the_mass(big, dtype):
    c = op_case(seed=70)
    T, H, D = c["q"].shape
    sink = torch.full((H,), big, dtype=dtype)
    no_sink = torch.full((H,), -INF, dtype=F64)
    args = (c["q"], c["kv"], c["ids"])
    out, lse = R.sparse_attention_forward(*args, sink, lengths=c["lengths"])
    _, lse_plain = R.sparse_attention_forward(*args, no_sink, lengths=c["lengths"])
    assert torch.equal(out, torch.zeros_like(out))          # exact zeros, no NaN, no overflow
    assert torch.equal(lse, lse_plain)                      # lse excludes the sink
    dout = randn(T, H, D, seed=71)
    dq, dkv, dsink = R.sparse_attention_backward(*args, sink, out, lse, dout, lengths=c["lengths"])
    for grad in (dq, dkv, dsink):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_a_huge_finite_sink_has_finite_zero_autograd_gradients():
    c = op_case(seed=72)
    sink = torch.full((3,), 2.4e38, dtype=F64)
    _, grads = autograd_backward(c["q"], c["kv"], c["ids"], sink, randn(6, 3, 5, seed=73),
                                 lengths=c["lengths"])
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_heads_are_independent_with_mixed_sinks():
    # Heads do not interact: each head of a mixed-sink call equals that head evaluated alone
    # (within the error model: a one-head call is a GEMM of another shape, so bits may differ).
    c = op_case(seed=80, H=4)
    sink = torch.tensor([-INF, 0.3, 2.4e38, INF], dtype=F64)
    dout = randn(6, 4, 5, seed=81)
    args = (c["q"], c["kv"], c["ids"])
    out, lse = R.sparse_attention_forward(*args, sink, lengths=c["lengths"])
    dq, _, dsink = R.sparse_attention_backward(*args, sink, out, lse, dout, lengths=c["lengths"])
    for h in range(4):
        one = (c["q"][:, h:h + 1], c["kv"], c["ids"], sink[h:h + 1])
        o, l = R.sparse_attention_forward(*one, lengths=c["lengths"])
        d, dkv_h, ds = R.sparse_attention_backward(*one, o, l, dout[:, h:h + 1],
                                                   lengths=c["lengths"])
        assert forward_ratio(*one, out[:, h:h + 1], lse[:, h:h + 1], o, l,
                             lengths=c["lengths"]) <= 1
        b_dq, _, b_ds = attention_backward_bound(*one, o, l, dout[:, h:h + 1], d, dkv_h, ds,
                                                 precision=ORACLE_PRECISION, lengths=c["lengths"])
        assert error_ratio(dq[:, h:h + 1], d, b_dq) <= 1
        assert error_ratio(dsink[h:h + 1], ds, b_ds) <= 1
    assert torch.equal(out[:, 2:], torch.zeros_like(out[:, 2:]))     # huge and +inf sinks
    assert torch.equal(dq[:, 2:], torch.zeros_like(dq[:, 2:]))


def test_duplicate_ids_count_once_per_slot():
    q, kv = randn(1, 2, 4, seed=90), randn(5, 4, seed=91)
    sink = torch.tensor([0.25, -1.5], dtype=F64)
    ids = torch.tensor([[3, 1, 3, -1, 3]])
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, scale=0.5)
    # By definition: key 3 appears in three valid slots, key 1 in one.
    s = 0.5 * torch.einsum("hd,sd->hs", q[0], kv)                  # [H, S]
    z = 3 * torch.exp(s[:, 3]) + torch.exp(s[:, 1])
    want_lse = torch.log(z)
    want_out = (3 * torch.exp(s[:, 3:4]) * kv[3] + torch.exp(s[:, 1:2]) * kv[1]) \
        / (z + torch.exp(sink)).unsqueeze(-1)
    assert forward_ratio(q, kv, ids, sink, want_out.unsqueeze(0), want_lse.unsqueeze(0), out, lse,
                         scale=0.5) <= 1
    # The contract's backward with the duplicates counted per slot, written out per slot.
    dout = randn(1, 2, 4, seed=92)
    _, dkv, _ = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, scale=0.5)
    full = torch.logaddexp(lse[0], sink)
    p = torch.exp(s - full.unsqueeze(-1))                          # per slot of key s
    delta = (dout[0] * out[0]).sum(-1)
    want = torch.zeros_like(kv)
    for j in (3, 1, 3, 3):
        ds = p[:, j] * (dout[0] @ kv[j] - delta)
        want[j] += 0.5 * (ds.unsqueeze(-1) * q[0]).sum(0) + (p[:, j:j + 1] * dout[0]).sum(0)
    b_dkv = attention_backward_bound(q, kv, ids, sink, out, lse, dout,
                                     *R.sparse_attention_backward(q, kv, ids, sink, out, lse,
                                                                  dout, scale=0.5),
                                     precision=ORACLE_PRECISION, scale=0.5)[1]
    assert error_ratio(want, dkv, b_dkv) <= 1
    assert not torch.equal(dkv[3], torch.zeros(4, dtype=F64))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_hostile_invalid_ids_are_as_if_removed(index_dtype, with_lengths):
    info = torch.iinfo(index_dtype)
    T, H, D, S, K = 6, 2, 4, 7, 8
    hostile = [info.min, -123456, S, S + 17, info.max]
    q, kv, sink = randn(T, H, D, seed=100), randn(S, D, seed=101), randn(H, seed=102)
    g = torch.Generator().manual_seed(103)
    ids = torch.randint(0, S, (T, K), generator=g)
    for t in range(T):                                  # sprinkle every hostile id in each row
        slots = torch.randperm(K, generator=g)[:len(hostile)]
        ids[t, slots] = torch.tensor(hostile)
    ids = ids.to(index_dtype)
    # lengths: zero, negative, above the width, the width, and partial ones
    lengths = torch.tensor([0, -5, K + 3, K, 3, 6], dtype=index_dtype) if with_lengths else None
    dout = randn(T, H, D, seed=104)
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    dq, dkv, dsink = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, lengths=lengths)
    # The same rows with every invalid slot (and every slot at or past the length) set to -1:
    # bitwise the same results.
    lim = torch.full((T,), K) if lengths is None else lengths.to(torch.int64).clamp(0, K)
    keep = (ids.to(torch.int64) >= 0) & (ids.to(torch.int64) < S) & \
        (torch.arange(K).unsqueeze(0) < lim.unsqueeze(1))
    masked = torch.where(keep, ids.to(torch.int64), torch.full((T, K), -1))
    m_out, m_lse = R.sparse_attention_forward(q, kv, masked, sink)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    for a, b in zip(R.sparse_attention_backward(q, kv, masked, sink, out, lse, dout), (dq, dkv, dsink)):
        assert torch.equal(a, b)
    # The same rows with those slots removed (compacted, a narrower width): equal to the error
    # model's bound.
    width = int(keep.sum(1).max())
    compact = torch.full((T, max(width, 1)), -1)
    for t in range(T):
        row = masked[t][keep[t]]
        compact[t, : row.numel()] = row
    c_out, c_lse = R.sparse_attention_forward(q, kv, compact, sink)
    assert forward_ratio(q, kv, ids, sink, c_out, c_lse, out, lse, lengths=lengths) <= 1
    c_grads = R.sparse_attention_backward(q, kv, compact, sink, out, lse, dout)
    assert backward_ratio(q, kv, ids, sink, out, lse, dout, c_grads, (dq, dkv, dsink),
                          lengths=lengths) <= 1
    if with_lengths:
        assert bool((lse[:2] == INF).all())            # lengths 0 and -5: sink-only rows


def test_low_precision_inputs_are_evaluated_on_their_exact_values():
    c = op_case(seed=110)
    dout = randn(6, 3, 5, seed=111)
    low = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v.to(torch.int32))
           for k, v in c.items()}
    up = {k: (v.to(F64) if v.is_floating_point() else v) for k, v in low.items()}
    got = R.sparse_attention_forward(low["q"], low["kv"], low["ids"], low["sink"], lengths=low["lengths"])
    want = R.sparse_attention_forward(up["q"], up["kv"], up["ids"], up["sink"], lengths=up["lengths"])
    assert all(torch.equal(a, b) and a.dtype == F64 for a, b in zip(got, want))
    g_low = R.sparse_attention_backward(low["q"], low["kv"], low["ids"], low["sink"], *got,
                                        dout.to(torch.float32), lengths=low["lengths"])
    g_up = R.sparse_attention_backward(up["q"], up["kv"], up["ids"], up["sink"], *want,
                                       dout.to(torch.float32).to(F64), lengths=up["lengths"])
    assert all(torch.equal(a, b) and a.dtype == F64 for a, b in zip(g_low, g_up))


def test_default_scale_is_inverse_sqrt_head_dim():
    c = op_case(seed=120, D=6)
    args = (c["q"], c["kv"], c["ids"], c["sink"])
    a = R.sparse_attention_forward(*args, lengths=c["lengths"])
    b = R.sparse_attention_forward(*args, lengths=c["lengths"], scale=6 ** -0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_shapes():
    q, kv, sink = randn(3, 2, 4, seed=130), randn(5, 4, seed=131), randn(2, seed=132)
    out, lse = R.sparse_attention_forward(q, kv, torch.zeros((3, 0), dtype=torch.int64), sink)
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=F64)) and bool((lse == INF).all())
    out, lse = R.sparse_attention_forward(q[:0], kv, torch.zeros((0, 4), dtype=torch.int64), sink)
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)


def test_inputs_are_not_modified():
    c = op_case(seed=140)
    q = c["q"].to(torch.float32).requires_grad_(True)
    kv, ids, sink, lengths = c["kv"], c["ids"].to(torch.int32), c["sink"], c["lengths"]
    dout = randn(6, 3, 5, seed=141)
    before = content_hashes(q, kv, ids, sink, lengths, dout)
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    o_lse = content_hashes(out, lse)
    R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, lengths=lengths)
    assert content_hashes(q, kv, ids, sink, lengths, dout) == before
    assert content_hashes(out, lse) == o_lse
