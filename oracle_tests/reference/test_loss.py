"""Sparse indexer KL loss and its gradients (contract sections 7 and 8), proven against itself.

- finite differences: ``sparse_indexer_loss_grad(mode="autograd")`` is the derivative of
  ``sparse_indexer_loss(...).loss`` as a function of ``q_idx``, ``weights`` and ``k_idx``
  (through ``indexer_scores``, the compressed ids held fixed): ``torch.autograd.gradcheck``;
- ``mode="clipped"`` equals ``mode="autograd"`` where no clamp is hit, and differs where one is
  (the negative control), judged by the error model (section 12);
- the teacher, student and KL against the definitions written out, and exact properties:
  normalisation by N, padding rows, a detached teacher, the strict ``z > 0`` gate, invalid
  slots, unmodified inputs.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.selfcheck import SELFCHECK_CASES, case_tensors
from dsv4_oracle.fixtures import get
from oracle_tests import content_hashes, error_ratio
from dsv4_oracle.reference.constants import FLT_MIN, GRAD_FLOOR
from dsv4_oracle.reference.error_model import ORACLE_PRECISION, indexer_loss_bound, indexer_loss_grad_bound

INF = math.inf
F64 = torch.float64
CASES = {i: get(i) for i in SELFCHECK_CASES}
CSA_CASES = ["public-det-topk-ties", "selfcheck-csa-padded"]
# the autograd form differentiates the student recomputed from the indexer inputs: it needs
# scores that come from them (the worked example's scores are given, all zero)
INDEXER_CASES = [n for n in CSA_CASES if CASES[n].scores == "indexer"]


def pipeline(name, *, sink=None):
    """A CSA case through the oracle: attention lse over all keys, then the loss inputs."""
    case = CASES[name]
    x = case_tensors(case)
    sink = x.sink if sink is None else sink
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, sink, v_dim=case.v_dim,
                                          lengths=x.lengths)
    T = x.layout.num_rows
    loss_args = (x.q, x.kv[T:], sink, lse, x.cmp_ids, x.scores, x.layout)
    return case, x, loss_args


class IndexerLossOf(torch.autograd.Function):
    """``sparse_indexer_loss(...).loss`` as a function of the indexer inputs, with
    ``sparse_indexer_loss_grad(mode="autograd")`` as its derivative."""

    @staticmethod
    def forward(ctx, q_idx, weights, k_idx, case, x, loss_args):
        q, kv_cmp, sink, lse, cmp_ids, _, layout = loss_args
        scores = R.indexer_scores(q_idx, k_idx, weights, layout, case.ratio)
        res = R.sparse_indexer_loss(q, kv_cmp, sink, lse, cmp_ids, scores, layout, coeff=case.coeff)
        ctx.save_for_backward(q_idx, weights, k_idx, cmp_ids, res.target, res.predict)
        ctx.coeff, ctx.num_real = case.coeff, res.num_real
        return res.loss

    @staticmethod
    def backward(ctx, grad):
        q_idx, weights, k_idx, cmp_ids, target, predict = ctx.saved_tensors
        dq, dw, dk = R.sparse_indexer_loss_grad(q_idx, k_idx, weights, cmp_ids, target, predict,
                                                coeff=ctx.coeff, num_real=ctx.num_real,
                                                grad_loss=float(grad), mode="autograd")
        return dq, dw, dk, None, None, None


@pytest.mark.parametrize("name", CSA_CASES)
def test_gradcheck_of_the_loss_wrt_the_indexer_inputs(name):
    case, x, loss_args = pipeline(name)
    leaves = [t.clone().requires_grad_(True) for t in (x.q_idx, x.weights, x.k_idx)]
    assert torch.autograd.gradcheck(
        lambda q_idx, w, k_idx: IndexerLossOf.apply(q_idx, w, k_idx, case, x, loss_args), leaves)


def loss_and_grads(name, **grad_kw):
    case, x, loss_args = pipeline(name)
    res = R.sparse_indexer_loss(*loss_args, coeff=case.coeff)
    common = (x.q_idx, x.k_idx, x.weights, x.cmp_ids, res.target, res.predict)
    kw = dict(coeff=case.coeff, num_real=res.num_real, **grad_kw)
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw)
    return case, x, res, common, kw, clipped, auto


def grad_ratio(common, kw, got, want, mode):
    bounds = indexer_loss_grad_bound(*common, *want, precision=ORACLE_PRECISION, mode=mode, **kw)
    return max(error_ratio(g, w, b) for g, w, b in zip(got, want, bounds))


@pytest.mark.parametrize("name", INDEXER_CASES)
def test_clipped_equals_autograd_where_no_clamp_is_hit(name):
    case, x, res, common, kw, clipped, auto = loss_and_grads(name)
    sel = (x.cmp_ids >= 0)
    assert bool(sel.any())
    # Precondition: no clamp is hit (every selected tau and p is above both floors).
    assert bool((res.target[sel] > FLT_MIN).all()) and bool((res.predict[sel] > FLT_MIN).all())
    assert grad_ratio(common, kw, clipped, auto, "autograd") <= 1


def hand_case(logit_gap):
    """One row, one indexer head of dim 1, three selected groups with logits
    ``(1e-3, logit_gap, 1)`` (scale 1, weight 1) and teacher ``(0.5, 0.3, 0.2)``."""
    layout = R.PackedLayout([0, 6], None)                        # ratio 2: row 5 sees 3 groups
    q_idx = torch.ones(6, 1, 1, dtype=F64)
    k_idx = torch.tensor([[1e-3], [logit_gap], [1.0]], dtype=F64)
    weights = torch.ones(6, 1, dtype=F64)
    ids = torch.full((6, 3), -1)
    ids[5] = torch.tensor([0, 1, 2])
    target = torch.zeros(6, 3, dtype=F64)
    target[5] = torch.tensor([0.5, 0.3, 0.2])
    scores = R.indexer_scores(q_idx, k_idx, weights, layout, 2, scale=1.0)
    logits = scores[5, ids[5]]
    predict = torch.zeros(6, 3, dtype=F64)
    predict[5] = torch.softmax(logits, dim=0)
    return (q_idx, k_idx, weights, ids, target, predict), dict(coeff=1.0, num_real=6, scale=1.0)


def test_clipped_differs_from_autograd_where_a_clamp_is_hit():
    # p_0 = exp(-90) / Z lies between the gradient floor exp(-100) and the loss floor 2**-126:
    # the clipped form keeps its term (m_0 = 1), the exact derivative of the clamped loss drops it.
    common, kw = hand_case(90.0)
    p0 = float(common[5][5, 0])
    assert GRAD_FLOOR < p0 < FLT_MIN
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw)
    assert grad_ratio(common, kw, clipped, auto, "autograd") > 1
    # Control of the control: with the gradient floor at the loss floor, the two agree.
    kw_same = dict(kw, grad_floor=FLT_MIN)
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw_same)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw_same)
    assert grad_ratio(common, kw_same, clipped, auto, "autograd") <= 1
    # And without a tiny probability at all, the default floors agree too.
    common, kw = hand_case(3.0)
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw)
    assert grad_ratio(common, kw, clipped, auto, "autograd") <= 1


def loss_by_definition(q, kv_cmp, sink, lse, cmp_ids, scores, layout, coeff):
    """Section 8 written out row by row (python loops over rows, float64 tensors per row)."""
    T, H, D = q.shape
    scale = D ** -0.5
    Kc = cmp_ids.shape[1]
    target = torch.zeros(T, Kc, dtype=F64)
    predict = torch.zeros(T, Kc, dtype=F64)
    kl = torch.zeros(T, dtype=F64)
    for t in range(T):
        slots = [j for j in range(Kc) if int(cmp_ids[t, j]) >= 0]
        if not bool(layout.is_real[t]) or not slots:
            continue
        c = cmp_ids[t, slots]
        lsef = torch.logaddexp(lse[t], sink)                           # [H]
        A = torch.exp(scale * (q[t] @ kv_cmp[c].T) - lsef.unsqueeze(1))  # [H, n]
        tau = A.sum(0) / A.sum()
        p = torch.softmax(scores[t, c], dim=0)
        a, b = tau.clamp_min(FLT_MIN), p.clamp_min(FLT_MIN)
        target[t, slots], predict[t, slots] = tau, p
        kl[t] = (a * (a.log() - b.log())).sum()
    return coeff * kl.sum() / layout.num_real, kl, target, predict


@pytest.mark.parametrize("name", CSA_CASES)
def test_teacher_student_and_kl_match_the_definition(name):
    case, x, loss_args = pipeline(name)
    res = R.sparse_indexer_loss(*loss_args, coeff=case.coeff)
    want = loss_by_definition(*loss_args, case.coeff)
    bound = indexer_loss_bound(*loss_args, res, coeff=case.coeff, precision=ORACLE_PRECISION)
    for field, w in zip(("loss", "kl", "target", "predict"), want):
        assert error_ratio(w, getattr(res, field), getattr(bound, field)) <= 1, field
    fake = ~x.layout.is_real
    assert bool((res.kl[fake] == 0).all()) and bool((res.target[fake] == 0).all())
    assert bool((res.predict[fake] == 0).all())
    assert res.num_real == x.layout.num_real


def test_loss_is_normalised_by_all_real_tokens():
    case, x, loss_args = pipeline("selfcheck-csa-padded")
    res = R.sparse_indexer_loss(*loss_args, coeff=case.coeff)
    N = int(x.layout.cu_seqlens[-1])
    assert res.num_real == N
    kl_sum = 0.0
    for v in res.kl.tolist():                          # the canonical left fold in row order
        kl_sum = kl_sum + v
    assert float(res.loss) == case.coeff * kl_sum / N
    # N is global across CP ranks: a caller-supplied N divides the same sum.
    res2 = R.sparse_indexer_loss(*loss_args, coeff=case.coeff, num_real=2 * N)
    assert float(res2.loss) == float(res.loss) / 2 and torch.equal(res2.kl, res.kl)


def test_rows_with_no_selection_or_no_teacher_mass_count_zero():
    _, _, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = loss_args
    case = CASES["selfcheck-csa-padded"]
    res = R.sparse_indexer_loss(*loss_args, coeff=case.coeff)
    none = ~(cmp_ids >= 0).any(dim=1)
    assert bool(none.any()) and bool((res.kl[none] == 0).all())
    inf_sink = torch.full_like(sink, INF)                # teacher mass exactly 0 everywhere
    res_inf = R.sparse_indexer_loss(q, kv_cmp, inf_sink, lse, cmp_ids, scores, layout,
                                    coeff=case.coeff)
    assert float(res_inf.loss) == 0.0 and bool((res_inf.target == 0).all())


def test_a_key_set_of_width_zero_has_no_loss_and_no_gradient():
    # the dense teacher of a layer without compressed keys (policy teacher="dense"): every
    # row ranges over C = 0 keys, so compressed_ids is [T, 0]
    _, _, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = loss_args
    T = q.shape[0]
    empty = torch.empty((T, 0), dtype=torch.int64)
    res = R.sparse_indexer_loss(q, kv_cmp[:0], sink, lse, empty, scores[:, :0], layout,
                                coeff=0.5, kl_form="log_softmax")
    assert float(res.loss) == 0.0 and bool((res.kl == 0).all())
    assert res.target.shape == res.predict.shape == (T, 0)
    q_idx = torch.randn(T, 2, 4, dtype=torch.float64)
    w = torch.randn(T, 2, dtype=torch.float64)
    for mode in ("clipped", "exact", "autograd"):
        dq, dw, dk = R.sparse_indexer_loss_grad(q_idx, torch.zeros(0, 4, dtype=torch.float64), w,
                                                empty, res.target, res.predict, coeff=0.5,
                                                num_real=layout.num_real, mode=mode)
        assert dq.shape == q_idx.shape and dw.shape == w.shape and dk.shape == (0, 4)
        assert not bool(dq.any()) and not bool(dw.any())


def test_no_gradient_reaches_q_kv_or_the_sink_through_the_loss():
    case, x, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, _, layout = loss_args
    leaves = [t.clone().requires_grad_(True) for t in (q, kv_cmp, sink, lse)]
    q_idx, weights, k_idx = (t.clone().requires_grad_(True) for t in (x.q_idx, x.weights, x.k_idx))
    scores = R.indexer_scores(q_idx, k_idx, weights, layout, case.ratio)
    res = R.sparse_indexer_loss(*leaves[:4], cmp_ids, scores, layout, coeff=case.coeff)
    grads = torch.autograd.grad(res.loss, leaves + [q_idx], allow_unused=True)
    for g in grads[:4]:                               # the teacher is detached
        assert g is None or torch.equal(g, torch.zeros_like(g))
    assert grads[4] is not None and bool((grads[4] != 0).any())   # the student is not


@pytest.mark.parametrize("mode", ["clipped", "autograd"])
def test_strict_gate_blocks_gradients_at_z_equal_zero(mode):
    q_idx = torch.zeros(4, 1, 2, dtype=F64)              # ratio 2: row 3 sees groups 0 and 1
    q_idx[:, 0, 0] = 1.0
    k_idx = torch.tensor([[0.0, 1.0], [0.0, 2.0]], dtype=F64)   # <q, k> = 0 exactly
    weights = torch.ones(4, 1, dtype=F64)
    ids = torch.tensor([[-1, -1], [0, -1], [0, -1], [0, 1]])
    target = torch.tensor([[0, 0], [1, 0], [1, 0], [0.9, 0.1]], dtype=F64)
    predict = torch.tensor([[0, 0], [1, 0], [1, 0], [0.5, 0.5]], dtype=F64)
    grads = R.sparse_indexer_loss_grad(q_idx, k_idx, weights, ids, target, predict, coeff=1.0,
                                       num_real=4, mode=mode)
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_invalid_slots_and_unselected_groups_get_no_gradient():
    _, x, res, common, kw, clipped, _ = loss_and_grads("selfcheck-csa-padded")
    dq, dw, dk = clipped
    C = x.k_idx.shape[0]
    selected = torch.zeros(C, dtype=torch.bool)
    selected[x.cmp_ids[x.cmp_ids >= 0]] = True
    assert bool((~selected).any())
    assert torch.equal(dk[~selected], torch.zeros_like(dk[~selected]))
    no_sel = ~(x.cmp_ids >= 0).any(dim=1)
    assert torch.equal(dq[no_sel], torch.zeros_like(dq[no_sel]))
    assert torch.equal(dw[no_sel], torch.zeros_like(dw[no_sel]))
    # Out-of-range ids (>= C, INT_MAX, INT_MIN) are invalid slots, like -1.
    hostile = x.cmp_ids.clone()
    hostile[x.cmp_ids < 0] = torch.tensor([C, 2 ** 31 - 1, -2 ** 31])[
        torch.arange(int((x.cmp_ids < 0).sum())) % 3]
    got = R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, hostile, res.target,
                                     res.predict, mode="clipped", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, clipped))


def test_grad_loss_scales_the_clipped_gradients_exactly():
    _, x, res, common, kw, clipped, _ = loss_and_grads("selfcheck-csa-padded")
    doubled = R.sparse_indexer_loss_grad(*common, mode="clipped", grad_loss=2.0, **kw)
    assert all(torch.equal(a, 2 * b) for a, b in zip(doubled, clipped))


def test_inputs_are_not_modified():
    case, x, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = loss_args
    cmp32 = cmp_ids.to(torch.int32)
    before = content_hashes(q, kv_cmp, sink, lse, cmp32, scores, x.q_idx, x.k_idx, x.weights)
    res = R.sparse_indexer_loss(q, kv_cmp, sink, lse, cmp32, scores, layout, coeff=case.coeff)
    t_p = content_hashes(res.target, res.predict)
    for mode in ("clipped", "autograd"):
        R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, cmp32, res.target, res.predict,
                                   coeff=case.coeff, num_real=res.num_real, mode=mode)
    assert content_hashes(q, kv_cmp, sink, lse, cmp32, scores, x.q_idx, x.k_idx,
                          x.weights) == before
    assert content_hashes(res.target, res.predict) == t_p


# ---------------------------------------------------------------------------------------------
# Section 8: heads silenced one by one, huge finite sinks, rows without teacher mass
# ---------------------------------------------------------------------------------------------
# One real row, H = 2 heads with q = [1], two selected compressed keys kv_cmp = [5], [0],
# scale 1: s = [5, 0] on both heads, lse = log(e^5 + 1) on both. Head 0 alone gives
# tau = softmax(s) = [1/(1+e^-5), e^-5/(1+e^-5)] = [0.99331, 0.00669].
CLOSED_LAYOUT = R.PackedLayout([0, 1])
CLOSED = dict(q=torch.ones((1, 2, 1), dtype=F64), kv_cmp=torch.tensor([[5.0], [0.0]], dtype=F64),
              lse=torch.full((1, 2), math.log(math.exp(5.0) + 1.0), dtype=F64),
              compressed_ids=torch.tensor([[0, 1]]),
              index_scores=torch.tensor([[0.25, -0.5]], dtype=F64))
CLOSED_TAU = [1 / (1 + math.exp(-5.0)), math.exp(-5.0) / (1 + math.exp(-5.0))]
CLOSED_P = [1 / (1 + math.exp(-0.75)), math.exp(-0.75) / (1 + math.exp(-0.75))]


def closed_loss(sink):
    c = CLOSED
    return R.sparse_indexer_loss(c["q"], c["kv_cmp"], torch.tensor(sink, dtype=F64), c["lse"],
                                 c["compressed_ids"], c["index_scores"], CLOSED_LAYOUT,
                                 coeff=1.0, scale=1.0)


@pytest.mark.parametrize("sink", [[0.0, INF], [INF, 0.0], [2.4e38, 2.4e38], [0.0, 2.4e38],
                                  [-2.4e38, -2.4e38], [-INF, INF]],
                         ids=["0,+inf", "+inf,0", "huge,huge", "0,huge", "-huge,-huge", "-inf,+inf"])
def test_teacher_closed_form_with_silenced_and_huge_sink_heads(sink):
    """A ``+inf``-sink head has A = 0 and the other head still carries the teacher (the old
    whole-row silencing gave [0, 0]); equal huge finite sinks cancel exactly (``s - LSEf`` in
    float64 absorbed ``s`` and gave [0.5, 0.5]); a huge sink on one head silences it."""
    res = closed_loss(sink)
    assert torch.allclose(res.target[0], torch.tensor(CLOSED_TAU, dtype=F64), rtol=1e-14, atol=0)
    assert torch.allclose(res.predict[0], torch.tensor(CLOSED_P, dtype=F64), rtol=1e-14, atol=0)
    kl = sum(t * (math.log(t) - math.log(p)) for t, p in zip(CLOSED_TAU, CLOSED_P))
    assert math.isclose(float(res.loss), kl, rel_tol=1e-13)


def test_row_without_teacher_mass_keeps_its_student_and_gets_zero_gradients():
    """Every head silenced: tau = 0, KL = 0, predict = the student softmax (not 0), and both
    gradient forms are exactly 0 on that row while the other rows keep theirs."""
    res = closed_loss([INF, INF])
    assert res.target.tolist() == [[0.0, 0.0]] and float(res.loss) == 0.0
    assert torch.allclose(res.predict[0], torch.tensor(CLOSED_P, dtype=F64), rtol=1e-14, atol=0)
    case, x, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = loss_args
    rows = torch.nonzero((cmp_ids >= 0).any(dim=1) & layout.is_real).flatten()
    dead = rows[::2]                                   # every other selecting row: lse = +inf
    lse_dead = lse.clone()
    lse_dead[dead] = INF                               # LSEf = +inf on every head of those rows
    res = R.sparse_indexer_loss(q, kv_cmp, sink, lse_dead, cmp_ids, scores, layout,
                                coeff=case.coeff)
    ref = R.sparse_indexer_loss(*loss_args, coeff=case.coeff)
    assert bool((res.target[dead] == 0).all()) and bool((res.kl[dead] == 0).all())
    assert torch.equal(res.predict, ref.predict)        # the student ignores the teacher
    live = torch.ones(layout.num_rows, dtype=torch.bool)
    live[dead] = False
    assert torch.equal(res.target[live], ref.target[live])
    for mode in ("clipped", "autograd"):
        dq, dw, _ = R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, cmp_ids, res.target,
                                               res.predict, coeff=case.coeff,
                                               num_real=res.num_real, mode=mode)
        dq0, dw0, _ = R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, cmp_ids,
                                                 ref.target, ref.predict, coeff=case.coeff,
                                                 num_real=ref.num_real, mode=mode)
        assert bool((dq[dead] == 0).all()) and bool((dw[dead] == 0).all()), mode
        assert bool((dw0[dead] != 0).any()), mode      # those rows had gradients before
        if mode == "clipped":                          # per-row: the live rows are unchanged
            assert torch.equal(dq[live], dq0[live]) and torch.equal(dw[live], dw0[live])


def test_loss_bits_do_not_depend_on_chunking_with_mixed_sinks():
    """Per-head offsets are per row: the same bits for any ``chunk_rows``, with ordinary,
    ``+inf`` and huge finite sinks in one call."""
    case, _, loss_args = pipeline("selfcheck-csa-padded")
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = loss_args
    mixed = torch.tensor([0.3, INF, 2.4e38, -1.0, -INF, 5.0][: sink.numel()], dtype=F64)
    ref = R.sparse_indexer_loss(q, kv_cmp, mixed, lse, cmp_ids, scores, layout, coeff=case.coeff)
    for rows in (1, 3, 5):
        res = R.sparse_indexer_loss(q, kv_cmp, mixed, lse, cmp_ids, scores, layout,
                                    coeff=case.coeff, chunk_rows=rows)
        for a, b in zip(res[:4], ref[:4]):
            assert torch.equal(a, b), rows
