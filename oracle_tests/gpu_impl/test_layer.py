"""Oracle tests of the packed layer composition (:func:`gpu_impl.layer.csa_layer`): forward and
autograd backward against the oracle on the consumed inputs, gradient routing (attention ->
q/kv/kv_cmp/sink; indexer loss -> indexer inputs only), grad-mode parity, input immutability
and argument errors (contract sections 4 to 8, 11, 12)."""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle.gpu_impl.layer import csa_layer

from oracle_tests.helpers.impl_harness import IMPLEMENTATIONS, assert_checks, content_hash, judge, skip_large_on_cpu

# catalog cases: every sink mode at once (a +inf head empties the teacher), v_dim < D with
# padding/empty/capacity rows, HCA at ratio 128, window-only, and the public parity shape
CASES = [fixtures.get(n) for n in ("sink-mixed", "v-dim-smaller", "hca-ratio128", "window-only",
                                    "public-det-parity")]
LEAVES = ("q", "kv_raw", "kv_cmp", "sink", "q_idx", "k_idx", "weights")


def _leaves(case, x, requires_grad=True):
    out = {}
    for k in LEAVES:
        if k in x and not (k == "kv_cmp" and case.ratio == 0):
            out[k] = x[k].clone().requires_grad_(requires_grad)
    return out


def _call(case, leaf, impl, **over):
    kw = dict(window=case.window, ratio=case.ratio, v_dim=case.v_dim, coeff=case.coeff,
              order=case.order, backend=impl.request)
    if case.ratio:
        kw["kv_cmp"] = leaf["kv_cmp"]
    if case.layer == "csa":
        kw.update(q_idx=leaf["q_idx"], k_idx=leaf["k_idx"], weights=leaf["weights"],
                  topk=case.topk)
    kw.update(over)
    return csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], case.layout(), **kw)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_layer_against_oracle(impl, case):
    skip_large_on_cpu(impl, case)
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    before = content_hash(x)
    leaf = _leaves(case, x)
    res = _call(case, leaf, impl)
    roots, grads = [res.out], [x["dout"]]
    if res.loss.requires_grad:
        roots.append(res.loss)
        grads.append(torch.ones_like(res.loss))
    torch.autograd.backward(roots, grads)
    assert content_hash(x) == before, "the layer modified an input"
    if impl.backend == "cudnn" and "cudnn" not in res.backends.values():
        pytest.skip(f"the cuDNN backend runs none of this layer's ops ({case})")
    got = dict(out=res.out.detach(), lse=res.lse, ids=res.ids, lengths=res.lengths,
               dq=leaf["q"].grad, dsink=leaf["sink"].grad)
    dkv = [leaf["kv_raw"].grad] + ([leaf["kv_cmp"].grad] if case.ratio else [])
    got["dkv"] = torch.cat(dkv)
    if case.layer == "csa":
        L = res.indexer_loss
        got.update(scores=res.index_scores, cmp_ids=res.compressed_ids,
                   cmp_lengths=res.compressed_lengths, loss=res.loss.detach(), kl=L.kl,
                   target=L.target, predict=L.predict, dq_idx=leaf["q_idx"].grad,
                   dw=leaf["weights"].grad, dk_idx=leaf["k_idx"].grad)
    else:
        assert float(res.loss.detach()) == 0.0 and not res.loss.requires_grad
    assert_checks(judge(impl, case, x, got), f"{impl.id} layer {case} backends={res.backends}")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_gradient_routing(impl):
    """``out`` reaches q/kv/kv_cmp/sink only; ``loss`` reaches the indexer inputs only; with
    ``coeff = 0`` the indexer gradients are exactly zero."""
    case = CASES[1]                     # finite sinks: the teacher has mass on every real row
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    att = ("q", "kv_raw", "kv_cmp", "sink")
    idx = ("q_idx", "k_idx", "weights")

    leaf = _leaves(case, x)
    res = _call(case, leaf, impl)
    res.out.backward(x["dout"])
    assert all(leaf[k].grad is not None for k in att)
    assert all(leaf[k].grad is None for k in idx), "the attention output reached the indexer"

    leaf = _leaves(case, x)
    res = _call(case, leaf, impl)
    res.loss.backward()
    assert all(leaf[k].grad is None for k in att), "the indexer loss reached q/kv/sink"
    assert all(leaf[k].grad is not None and bool(leaf[k].grad.abs().sum() > 0) for k in idx)

    leaf = _leaves(case, x)
    res = _call(case, leaf, impl, coeff=0.0)
    res.loss.backward()
    assert float(res.loss.detach()) == 0.0
    for k in idx:
        assert not bool(leaf[k].grad.any()), f"coeff=0 gave a nonzero gradient for {k}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_layer_grad_mode_parity(impl):
    """Identical ids, lengths, out, lse, loss and scores bits in no_grad, inference_mode and
    training (section 11)."""
    case = CASES[0]
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}

    def fields(r):
        return content_hash(dict(out=r.out.detach(), lse=r.lse, ids=r.ids, lengths=r.lengths,
                                 loss=r.loss.detach(), scores=r.index_scores,
                                 cmp=r.compressed_ids))
    with torch.no_grad():
        a = fields(_call(case, _leaves(case, x, False), impl))
    with torch.inference_mode():
        b = fields(_call(case, _leaves(case, x, False), impl))
    train = _call(case, _leaves(case, x, True), impl)
    assert train.out.requires_grad and train.loss.requires_grad
    c = fields(train)
    assert a == b == c, {k: (a[k] == b[k], a[k] == c[k]) for k in a}


def test_layer_rejects_bad_arguments():
    case = CASES[0]
    x = case.materialize()
    leaf = _leaves(case, x, False)
    lay = case.layout()
    with pytest.raises(ValueError, match="q_idx, k_idx and weights"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=8, ratio=4,
                  kv_cmp=leaf["kv_cmp"], q_idx=leaf["q_idx"], topk=4)
    with pytest.raises(ValueError, match="window-only"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=8, ratio=0,
                  kv_cmp=leaf["kv_cmp"])
    with pytest.raises(ValueError, match="kv_cmp is required"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=8, ratio=4)
    with pytest.raises(ValueError, match="kv_cmp has"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=8, ratio=4,
                  kv_cmp=leaf["kv_cmp"][:-1])
    with pytest.raises(ValueError, match="unknown op names"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=8, ratio=4,
                  kv_cmp=leaf["kv_cmp"], backend={"attention": "torch"})
    with pytest.raises(TypeError, match="layout"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], "layout", window=8, ratio=0)
    with pytest.raises(ValueError, match="window"):
        csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, window=0, ratio=0)
    # raw key rows other than T shift every compressed id (section 2): rejected, not wrong rows
    pad = torch.zeros((3, leaf["kv_raw"].shape[1]), dtype=leaf["kv_raw"].dtype)
    for kv in (leaf["kv_raw"][:-1], torch.cat([leaf["kv_raw"], pad])):
        with pytest.raises(ValueError, match=r"kv has \d+ rows"):
            csa_layer(leaf["q"], kv, leaf["sink"], lay, window=8, ratio=4, kv_cmp=leaf["kv_cmp"])
        with pytest.raises(ValueError, match=r"kv has \d+ rows"):
            csa_layer(leaf["q"], kv, leaf["sink"], lay, window=8, ratio=0)


def test_layer_backend_per_op_is_recorded():
    case = CASES[0]
    x = case.materialize()
    res = _call(case, _leaves(case, x, False), IMPLEMENTATIONS[0].values[0],
                backend={"stable_topk": "torch", "sparse_attention_forward": "auto"})
    assert res.backends["stable_topk"] == "torch"
    assert res.backends["sparse_attention_forward"] == "torch"      # auto on the CPU
    assert set(res.backends) >= {"indexer_scores", "stable_topk", "build_csa_indices",
                                 "sparse_attention_forward", "sparse_indexer_loss"}
