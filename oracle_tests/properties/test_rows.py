"""Property: a row's oracle bits do not depend on where the row sits (contract section 10).

The pointwise functions of ``reference._pointwise`` give each element the same bits alone and
anywhere in a tensor (torch's own CPU ``logaddexp``/``sigmoid`` do not: vector body and scalar
tail differ), and agree with torch's within a few ulps; the attention and loss results of a
case do not depend on ``chunk_rows``.
"""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_oracle import reference as R
from dsv4_oracle.reference import _pointwise as PW
from dsv4_oracle.fixtures import run_oracle
from dsv4_oracle.fixtures.strategies import cases, settings

values = st.one_of(st.floats(-60, 60), st.sampled_from((-math.inf, math.inf, 0.0, -0.0, 2.4e38)))


def _bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))


@settings(25)
@given(st.lists(st.tuples(values, values), min_size=1, max_size=80), st.data())
def test_pointwise_bits_do_not_depend_on_position(pairs, data):
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    i = data.draw(st.integers(0, len(pairs) - 1))
    j = data.draw(st.integers(i + 1, len(pairs)))
    for f, args in ((PW.logaddexp, (a, b)), (PW.sigmoid, (a,))):
        full = f(*args)
        part = f(*(x[i:j].clone() for x in args))
        assert _bits(part, full[i:j]), f.__name__
    # and they are logaddexp / sigmoid (within 4 ulps of torch's; same infinities)
    ref = torch.logaddexp(a, b)
    got = PW.logaddexp(a, b)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], ref[~fin])
    ulp = torch.nextafter(ref[fin].abs(), torch.tensor(math.inf, dtype=torch.float64)) - ref[fin].abs()
    assert bool(((got[fin] - ref[fin]).abs() <= 4 * ulp + 1e-300).all())
    sg, rs = PW.sigmoid(a), torch.sigmoid(a)
    assert bool(((sg - rs).abs() <= 4 * torch.finfo(torch.float64).eps * rs.abs() + 1e-300).all())


@settings(15)
@given(cases(poison=(False, True)), st.integers(1, 7))
def test_results_do_not_depend_on_chunk_rows(case, chunk):
    x = case.materialize()
    o = run_oracle(case, x)
    lens = o["lengths"] if case.lengths == "layer" else None
    out, lse = R.sparse_attention_forward(x["q"], x["kv"], o["ids"], x["sink"], v_dim=case.v_dim,
                                          lengths=lens, chunk_rows=chunk)
    assert _bits(out, o["out"]) and _bits(lse, o["lse"])
    dq, dkv, dsink = R.sparse_attention_backward(x["q"], x["kv"], o["ids"], x["sink"], out, lse,
                                                 x["dout"], v_dim=case.v_dim, lengths=lens,
                                                 chunk_rows=chunk)
    assert _bits(dq, o["dq"]) and _bits(dkv, o["dkv"]) and _bits(dsink, o["dsink"])
    if "scores" in o:
        s = R.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], case.layout(), case.ratio,
                             chunk_rows=chunk)
        assert _bits(s, o["scores"])
    if "kl" in o:
        res = R.sparse_indexer_loss(x["q"], x["kv_cmp"], x["sink"], o["lse"], o["cmp_ids"],
                                    o["scores"], case.layout(), coeff=case.coeff, chunk_rows=chunk)
        assert _bits(res.kl, o["kl"]) and _bits(res.loss, o["loss"])
        assert _bits(res.target, o["target"]) and _bits(res.predict, o["predict"])
        g = R.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], o["cmp_ids"],
                                       o["target"], o["predict"], coeff=case.coeff,
                                       num_real=int(o["num_real"]), chunk_rows=chunk)
        for a, name in zip(g, ("dq_idx", "dw", "dk_idx")):
            assert _bits(a, o[name]), name
