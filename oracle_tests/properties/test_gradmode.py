"""Property: the oracle's forward results do not depend on the grad mode (contract section 11).

The forward part of the pipeline (indexer scores, Top-K, key rows, attention forward, indexer
loss) under ``torch.no_grad()``, ``torch.inference_mode()``, grad enabled, and grad enabled
with float64 inputs that require grad (the autograd path of the oracle) gives identical bits.
"""
import torch
from hypothesis import given

from dsv4_oracle import reference as R
from dsv4_oracle.compare import check_grad_mode_parity
from dsv4_oracle.fixtures.strategies import cases, settings


def _forward(case, x, requires_grad=False):
    lay = case.layout()
    q, kv, sink = x["q"], x["kv"], x["sink"]
    if requires_grad:
        q, kv, sink = (t.double().requires_grad_(True) for t in (q, kv, sink))
    res = {}
    cmp_ids = None
    if case.layer == "csa":
        s = R.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], lay, case.ratio)
        cmp_ids, n = R.stable_topk(s, case.topk, order=case.order)
        res.update(scores=s, cmp_ids=cmp_ids, cmp_lengths=n)
    ids, lengths = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                       compressed_ids=cmp_ids)
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, v_dim=case.v_dim, lengths=lengths)
    res.update(ids=ids, lengths=lengths, out=out.detach(), lse=lse.detach())
    if case.layer == "csa" and lay.num_real:
        loss = R.sparse_indexer_loss(q, kv[case.T:], sink, lse, cmp_ids, res["scores"], lay,
                                     coeff=case.coeff)
        res.update(loss=loss.loss.detach(), kl=loss.kl.detach(), target=loss.target.detach(),
                   predict=loss.predict.detach())
    return res


def _bits(a, b):
    if a.is_floating_point():
        return torch.equal(a.double().view(torch.int64), b.double().view(torch.int64))
    return torch.equal(a, b)


@settings(20)
@given(cases(poison=(False,)))
def test_forward_bits_do_not_depend_on_the_grad_mode(case):
    x = case.materialize()
    r = check_grad_mode_parity(lambda: _forward(case, x))
    assert r.passed, r.detail
    ref = _forward(case, x)
    with torch.enable_grad():
        auto = _forward(case, x, requires_grad=True)
    assert ref.keys() == auto.keys()
    for k in ref:
        assert _bits(ref[k], auto[k]), k
