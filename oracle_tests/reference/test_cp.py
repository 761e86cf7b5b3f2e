"""Context parallelism (contract section 10).

- ``cp_partition`` is an exact cover of the rows in the documented shape.
- Per-row results (indexer scores, Top-K ids, CSA rows, attention ``out``/``lse``/``dq``,
  teacher/student/KL, the loss gradients ``dq_idx``/``dw``) evaluated on one rank's rows only,
  with every key available, are bitwise identical to the cp=1 rows, for cp in {2, 4} and both
  partition modes. Where an oracle function needs every row (it takes the layout), the other
  ranks' rows are replaced with different values: a rank's rows must not notice.
- The reductions (``dkv``, ``dsink``, ``dk_idx``, the loss) and every per-row output are
  bitwise independent of the chunking (``chunk_rows``).
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.selfcheck import SELFCHECK_CASES, case_tensors
from dsv4_oracle.fixtures import get

CASES = {i: get(i) for i in SELFCHECK_CASES}
CP_CASES = ["selfcheck-csa-padded", "selfcheck-hca", "selfcheck-window-only"]


def other_rows_replaced(x: torch.Tensor, rows: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with every row outside ``rows`` replaced by different values of the same kind."""
    g = torch.Generator().manual_seed(seed)
    if x.is_floating_point():
        y = torch.randn(x.shape, generator=g, dtype=x.dtype) * 3 + 1
    else:
        y = torch.full_like(x, -1)
    y[rows] = x[rows]
    return y


@pytest.mark.parametrize("name", CP_CASES)
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("mode", ["contiguous", "zigzag"])
def test_partition_is_an_exact_cover_of_the_documented_shape(name, cp, mode):
    layout = CASES[name].layout()
    T = layout.num_rows
    parts = R.cp_partition(layout, cp, mode=mode)
    assert len(parts) == cp
    assert all(p.dtype == torch.int64 for p in parts)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(T))
    if mode == "contiguous":
        for r, p in enumerate(parts):
            assert torch.equal(p, torch.arange(r * T // cp, (r + 1) * T // cp))
        return
    bounds = layout.cu_seqlens_padded.tolist()
    if T > bounds[-1]:
        bounds.append(T)                        # the capacity tail is one more segment
    for r, p in enumerate(parts):
        want = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            c = (e - s) // (2 * cp)
            want += list(range(s + r * c, s + (r + 1) * c))
            want += list(range(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c))
        assert p.tolist() == want


@pytest.mark.parametrize("name", CP_CASES)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["contiguous", "zigzag"])
def test_per_rank_rows_are_bitwise_the_cp1_rows(name, cp, mode):
    case = CASES[name]
    x = case_tensors(case)
    layout = x.layout
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, v_dim=case.v_dim,
                                          lengths=x.lengths)
    dq, _, _ = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, out, lse, x.dout,
                                           v_dim=case.v_dim, lengths=x.lengths)
    if case.layer == "csa":
        T = layout.num_rows
        loss = R.sparse_indexer_loss(x.q, x.kv[T:], x.sink, lse, x.cmp_ids, x.scores, layout,
                                     coeff=case.coeff)
        grads = {mode_: R.sparse_indexer_loss_grad(
            x.q_idx, x.k_idx, x.weights, x.cmp_ids, loss.target, loss.predict,
            coeff=case.coeff, num_real=layout.num_real, mode=mode_)
            for mode_ in ("clipped", "autograd")}
    for rank, rows in enumerate(R.cp_partition(layout, cp, mode=mode)):
        seed = 1000 * cp + rank
        if case.layer == "csa":
            # Indices: the indexer sees only this rank's queries; Top-K on its rows; CSA rows
            # from this rank's compressed ids only.
            scores_r = R.indexer_scores(other_rows_replaced(x.q_idx, rows, seed), x.k_idx,
                                        other_rows_replaced(x.weights, rows, seed + 1),
                                        layout, case.ratio)
            assert torch.equal(scores_r[rows], x.scores[rows])
            cmp_r, _ = R.stable_topk(x.scores[rows], case.topk)
            assert torch.equal(cmp_r, x.cmp_ids[rows])
            cmp_only = other_rows_replaced(x.cmp_ids, rows, seed)
        else:
            cmp_only = None
        ids_r, len_r = R.build_csa_indices(layout, window=case.window, ratio=case.ratio,
                                           compressed_ids=cmp_only)
        assert torch.equal(ids_r[rows], x.ids[rows]) and torch.equal(len_r[rows], x.lengths[rows])
        # Attention: the rank's rows only, every key available.
        out_r, lse_r = R.sparse_attention_forward(x.q[rows], x.kv, x.ids[rows], x.sink,
                                                  v_dim=case.v_dim, lengths=x.lengths[rows])
        assert torch.equal(out_r, out[rows]) and torch.equal(lse_r, lse[rows])
        dq_r, _, _ = R.sparse_attention_backward(x.q[rows], x.kv, x.ids[rows], x.sink, out_r,
                                                 lse_r, x.dout[rows], v_dim=case.v_dim,
                                                 lengths=x.lengths[rows])
        assert torch.equal(dq_r, dq[rows])
        if case.layer != "csa":
            continue
        # Loss: per-row teacher, student and KL do not depend on the other ranks' rows.
        T = layout.num_rows
        loss_r = R.sparse_indexer_loss(
            other_rows_replaced(x.q, rows, seed), x.kv[T:], x.sink,
            other_rows_replaced(lse, rows, seed + 1).abs(),
            other_rows_replaced(x.cmp_ids, rows, seed), other_rows_replaced(x.scores, rows, seed + 2),
            layout, coeff=case.coeff)
        for field in ("kl", "target", "predict"):
            assert torch.equal(getattr(loss_r, field)[rows], getattr(loss, field)[rows]), field
        for mode_, (dqi, dw, _) in grads.items():
            dqi_r, dw_r, _ = R.sparse_indexer_loss_grad(
                x.q_idx[rows], x.k_idx, x.weights[rows], x.cmp_ids[rows], loss.target[rows],
                loss.predict[rows], coeff=case.coeff, num_real=layout.num_real, mode=mode_)
            assert torch.equal(dqi_r, dqi[rows]) and torch.equal(dw_r, dw[rows]), mode_


CHUNKS = [1, 3, 7, None]


@pytest.mark.parametrize("name", list(SELFCHECK_CASES))
def test_attention_is_bitwise_chunking_independent(name):
    case = CASES[name]
    x = case_tensors(case)
    kw = dict(v_dim=case.v_dim, lengths=x.lengths)
    ref_fwd = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, **kw)
    ref_bwd = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, *ref_fwd, x.dout, **kw)
    for chunk in CHUNKS:
        fwd = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, chunk_rows=chunk, **kw)
        bwd = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, *ref_fwd, x.dout,
                                          chunk_rows=chunk, **kw)
        for got, want in zip(fwd + bwd, ref_fwd + ref_bwd):      # out, lse, dq, dkv, dsink
            assert torch.equal(got, want), chunk


@pytest.mark.parametrize("name", ["public-det-topk-ties", "selfcheck-csa-padded"])
def test_indexer_and_loss_are_bitwise_chunking_independent(name):
    case = CASES[name]
    x = case_tensors(case)
    layout = x.layout
    T = layout.num_rows
    lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, v_dim=case.v_dim,
                                     lengths=x.lengths)[1]
    ref_loss = R.sparse_indexer_loss(x.q, x.kv[T:], x.sink, lse, x.cmp_ids, x.scores, layout,
                                     coeff=case.coeff)
    ref_grad = R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, x.cmp_ids, ref_loss.target,
                                          ref_loss.predict, coeff=case.coeff,
                                          num_real=layout.num_real)
    ref_scores = R.indexer_scores(x.q_idx, x.k_idx, x.weights, layout, case.ratio)
    for chunk in CHUNKS:
        scores = R.indexer_scores(x.q_idx, x.k_idx, x.weights, layout, case.ratio,
                                  chunk_rows=chunk)
        assert torch.equal(scores, ref_scores)
        loss = R.sparse_indexer_loss(x.q, x.kv[T:], x.sink, lse, x.cmp_ids, x.scores, layout,
                                     coeff=case.coeff, chunk_rows=chunk)
        for field in ("loss", "kl", "target", "predict"):
            assert torch.equal(getattr(loss, field), getattr(ref_loss, field)), (field, chunk)
        grad = R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, x.cmp_ids, ref_loss.target,
                                          ref_loss.predict, coeff=case.coeff,
                                          num_real=layout.num_real, chunk_rows=chunk)
        for got, want in zip(grad, ref_grad):                     # dq_idx, dw, dk_idx
            assert torch.equal(got, want), chunk


def test_wide_rows_are_bitwise_rank_and_chunk_independent():
    """The DSv4 head width (576 = 512 + 64 rope, v_dim 512) and hundreds of slots: the
    per-row products must not change bits with the batch they are evaluated in."""
    g = torch.Generator().manual_seed(11)
    T, H, D, S, K = 16, 4, 576, 96, 160
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    ids = torch.randint(-8, S + 8, (T, K), generator=g)
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    dout = torch.randn(T, H, 512, generator=g, dtype=torch.float64)
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, v_dim=512)
    dq, dkv, dsink = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=512)
    for rows in (torch.arange(0, 4), torch.tensor([5, 2, 11]), torch.arange(T - 1, -1, -1)):
        o, l = R.sparse_attention_forward(q[rows], kv, ids[rows], sink, v_dim=512)
        assert torch.equal(o, out[rows]) and torch.equal(l, lse[rows])
        d = R.sparse_attention_backward(q[rows], kv, ids[rows], sink, o, l, dout[rows], v_dim=512)[0]
        assert torch.equal(d, dq[rows])
    for chunk in (1, 5):
        got = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=512,
                                          chunk_rows=chunk)
        for a, b in zip(got, (dq, dkv, dsink)):
            assert torch.equal(a, b), chunk


def odd_attention_case(seed=12, T=20, H=3, D=67, S=45, K=33, dv=61):
    """Row strides that are not multiples of 64 bytes, so chunk views start misaligned."""
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(T, H, D, generator=g, dtype=torch.float64),
                kv=torch.randn(S, D, generator=g, dtype=torch.float64),
                ids=torch.randint(-3, S + 3, (T, K), generator=g),
                sink=torch.randn(H, generator=g, dtype=torch.float64),
                dout=torch.randn(T, H, dv, generator=g, dtype=torch.float64), v_dim=dv)


def test_odd_strides_are_bitwise_chunk_and_rank_independent():
    c = odd_attention_case()
    args = (c["q"], c["kv"], c["ids"], c["sink"])
    out, lse = R.sparse_attention_forward(*args, v_dim=c["v_dim"])
    ref = R.sparse_attention_backward(*args, out, lse, c["dout"], v_dim=c["v_dim"])
    for chunk in (1, 2, 3, 7):
        o, l = R.sparse_attention_forward(*args, v_dim=c["v_dim"], chunk_rows=chunk)
        assert torch.equal(o, out) and torch.equal(l, lse), chunk
        got = R.sparse_attention_backward(*args, out, lse, c["dout"], v_dim=c["v_dim"],
                                          chunk_rows=chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), chunk
    for r0, r1 in ((1, 4), (3, 17), (19, 20)):          # basic slices: views at odd offsets
        o, l = R.sparse_attention_forward(c["q"][r0:r1], c["kv"], c["ids"][r0:r1], c["sink"],
                                          v_dim=c["v_dim"])
        assert torch.equal(o, out[r0:r1]) and torch.equal(l, lse[r0:r1])
        d = R.sparse_attention_backward(c["q"][r0:r1], c["kv"], c["ids"][r0:r1], c["sink"], o, l,
                                        c["dout"][r0:r1], v_dim=c["v_dim"])[0]
        assert torch.equal(d, ref[0][r0:r1])


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """The same values in a buffer that starts one element (8 bytes) past an aligned address."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    return view


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with non-contiguous strides (every other element of a wider buffer)."""
    buf = torch.empty(x.shape + (2,), dtype=x.dtype)
    buf[..., 0] = x
    return buf[..., 0]


@pytest.mark.parametrize("relayout", [misaligned, strided])
def test_bits_do_not_depend_on_the_callers_memory_layout(relayout):
    case = CASES["selfcheck-csa-padded"]
    x = case_tensors(case)
    T = x.layout.num_rows
    kw = dict(v_dim=case.v_dim, lengths=x.lengths)

    def everything(q, kv, sink, dout, q_idx, k_idx, weights):
        out, lse = R.sparse_attention_forward(q, kv, x.ids, sink, **kw)
        grads = R.sparse_attention_backward(q, kv, x.ids, sink, out, lse, dout, **kw)
        scores = R.indexer_scores(q_idx, k_idx, weights, x.layout, case.ratio)
        loss = R.sparse_indexer_loss(q, kv[T:], sink, lse, x.cmp_ids, scores, x.layout,
                                     coeff=case.coeff)
        lgrads = [R.sparse_indexer_loss_grad(q_idx, k_idx, weights, x.cmp_ids, loss.target,
                                             loss.predict, coeff=case.coeff,
                                             num_real=loss.num_real, mode=m)
                  for m in ("clipped", "autograd")]
        return [out, lse, *grads, scores, loss.loss, loss.kl, loss.target, loss.predict,
                *lgrads[0], *lgrads[1]]

    inputs = (x.q, x.kv, x.sink, x.dout, x.q_idx, x.k_idx, x.weights)
    want = everything(*inputs)
    got = everything(*(relayout(t) for t in inputs))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
