"""Property: padding and other documents are invisible to real rows (contract sections 1-3, 10).

A base case is extended by extra padding rows in its documents, extra capacity rows and, in
one property, new documents inserted anywhere; the extension's inputs carry the base values
on the base's real rows and compressed groups and fresh random values (or NaN poison)
everywhere else. Every per-row result of a real row (scores of its visible groups, Top-K
selection, key rows, out, lse, dq, KL, teacher, student, indexer gradients) and every gradient
of a key it sees must be bitwise unchanged; with padding only, the sink gradient and the loss
too (padding rows add exact zeros; N is unchanged), and the indexer gradients, which carry
``coeff / N``.
"""
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_oracle.fixtures import run_oracle
from dsv4_oracle.fixtures.strategies import cases, layouts, settings

ROW_INPUTS = ("q", "kv_raw", "dout", "q_idx", "weights")
GROUP_INPUTS = ("kv_cmp", "k_idx")


@st.composite
def extended(draw, *, new_docs: bool):
    base = draw(cases(layout=layouts(max_docs=3, max_len=20)))
    lay = base.layout()
    docs = list(zip(lay.doc_lengths.tolist(), lay.doc_padded_lengths.tolist()))
    grown = [(L, P + draw(st.integers(0, 6))) for L, P in docs]
    order = list(range(len(grown)))                  # new position -> base doc (or None)
    if new_docs:
        for _ in range(draw(st.integers(1, 2))):
            L = draw(st.integers(0, 14))
            grown.append((L, L + draw(st.integers(0, 3))))
            order.insert(draw(st.integers(0, len(order))), len(grown) - 1)
    cu, cu_pad = [0], [0]
    for i in order:
        L, P = grown[i]
        cu.append(cu[-1] + L)
        cu_pad.append(cu_pad[-1] + P)
    cap = lay.num_rows - int(lay.cu_seqlens_padded[-1]) + draw(st.integers(0, 5))
    ext = base.replace(cu_seqlens=tuple(cu), cu_seqlens_padded=tuple(cu_pad),
                       num_rows=cu_pad[-1] + cap, seed=(base.seed + 1) % 2**31)
    new_index = {b: order.index(b) for b in range(len(docs))}
    return base, ext, new_index


def _maps(base, ext, new_index):
    """Base real row -> extension row; base compressed id -> extension compressed id."""
    bl, el = base.layout(), ext.layout()
    rows_b, rows_e, g_b, g_e = [], [], [], []
    for b, nb in new_index.items():
        L = int(bl.doc_lengths[b])
        rows_b += range(int(bl.cu_seqlens_padded[b]), int(bl.cu_seqlens_padded[b]) + L)
        rows_e += range(int(el.cu_seqlens_padded[nb]), int(el.cu_seqlens_padded[nb]) + L)
        if base.ratio:
            n = int(bl.compressed_counts(base.ratio)[b])
            c0, e0 = int(bl.compressed_offsets(base.ratio)[b]), int(el.compressed_offsets(base.ratio)[nb])
            g_b += range(c0, c0 + n)
            g_e += range(e0, e0 + n)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return t(rows_b), t(rows_e), t(g_b), t(g_e)


def _embed(base, ext, xb, rb, re, gb, ge):
    xe = ext.materialize()
    for k in ROW_INPUTS:
        if k in xe:
            xe[k][re] = xb[k][rb]
    for k in GROUP_INPUTS:
        if k in xe:
            xe[k][ge] = xb[k][gb]
    xe["sink"] = xb["sink"].clone()
    xe["kv"] = torch.cat([xe["kv_raw"], xe["kv_cmp"]])
    return xe


def _map_ids(ids, Tb, Te, rb, re, gb, ge):
    """Logical key ids of the base (raw t, compressed Tb + c) in the extension's key space."""
    lut = torch.full((Tb + gb.numel(),), -2, dtype=torch.int64)
    lut[rb] = re
    if gb.numel():
        lut[Tb + gb] = Te + ge
    out = torch.where(ids >= 0, lut[ids.clamp_min(0)], ids)
    assert not bool((out == -2).any()), "a base row references a non-real raw row"
    return out


def _bits_equal(a, b):
    return a.shape == b.shape and torch.equal(a.double().view(torch.int64), b.double().view(torch.int64))


def _check(base, ext, new_index, padding_only):
    xb = base.materialize()
    rb, re, gb, ge = _maps(base, ext, new_index)
    xe = _embed(base, ext, xb, rb, re, gb, ge)
    ob, oe = run_oracle(base, xb), run_oracle(ext, xe)
    Tb, Te = base.T, ext.T
    for k in ("out", "lse", "dq"):
        assert _bits_equal(ob[k][rb], oe[k][re]), k
    assert torch.equal(ob["lengths"][rb], oe["lengths"][re])
    width = int(ob["lengths"].max()) if ob["lengths"].numel() else 0
    mapped = _map_ids(ob["ids"][rb, :width], Tb, Te, rb, re, gb, ge)
    assert torch.equal(mapped, oe["ids"][re, :width])
    assert bool((oe["ids"][re, width:] == -1).all())
    kb = torch.cat([rb, Tb + gb])                 # keys of the base's real rows and groups
    ke = torch.cat([re, Te + ge])
    assert _bits_equal(ob["dkv"][kb], oe["dkv"][ke])
    if "scores" in ob:
        assert _bits_equal(ob["scores"][rb][:, gb], oe["scores"][re][:, ge])
        others = torch.ones(oe["scores"].shape[1], dtype=torch.bool)
        others[ge] = False
        assert bool((oe["scores"][re][:, others] == float("-inf")).all())
        assert torch.equal(gb, torch.arange(gb.numel()))      # every base group is mapped
        sel = ob["cmp_ids"][rb]
        cmp_map = torch.where(sel >= 0, ge[sel.clamp_min(0)] if ge.numel() else sel, sel)
        assert torch.equal(cmp_map, oe["cmp_ids"][re])
        assert torch.equal(ob["cmp_lengths"][rb], oe["cmp_lengths"][re])
        assert torch.equal(ob["near_tie"][rb], oe["near_tie"][re])
    if "kl" in ob and "kl" in oe:
        for k in ("kl", "target", "predict"):
            assert _bits_equal(ob[k][rb], oe[k][re]), k
        # the indexer gradients carry coeff / N: bitwise only when N is unchanged
        if "dq_idx" in ob and padding_only:
            for k in ("dq_idx", "dw"):
                assert _bits_equal(ob[k][rb], oe[k][re]), k
            assert _bits_equal(ob["dk_idx"][gb], oe["dk_idx"][ge])
    if padding_only:
        assert _bits_equal(ob["dsink"], oe["dsink"])
        if "loss" in ob:
            assert _bits_equal(ob["loss"], oe["loss"])


@settings(15)
@given(extended(new_docs=False))
def test_padding_and_capacity_rows_change_no_real_row(t):
    base, ext, new_index = t
    _check(base, ext, new_index, padding_only=True)


@settings(15)
@given(extended(new_docs=True))
def test_other_documents_change_no_real_row(t):
    base, ext, new_index = t
    _check(base, ext, new_index, padding_only=False)
