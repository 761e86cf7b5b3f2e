"""Every bad input raises the documented error (contract sections 1-10).

Each row of the table below changes one argument of an otherwise valid call. The call must raise
``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value or layout), the message
must name the offending argument, and no tensor argument may be modified by the failed call.
Every base call is also run unchanged and must succeed, so a row cannot pass by accident.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hash

F64 = torch.float64
NAN, INF = math.nan, math.inf

# A valid base: a CSA layer of 2 documents with padding and capacity rows.
LAYOUT = R.PackedLayout([0, 7, 18], [0, 8, 24], 28)
T, H, D, HI, DI, RATIO, K = 28, 2, 6, 2, 4, 4, 3
C = LAYOUT.num_compressed(RATIO)


def base():
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    b = dict(q=rnd(T, H, D), kv=rnd(T + C, D), sink=rnd(H), q_idx=rnd(T, HI, DI), k_idx=rnd(C, DI),
             weights=rnd(T, HI), dout=rnd(T, H, D))
    b["scores"] = R.indexer_scores(b["q_idx"], b["k_idx"], b["weights"], LAYOUT, RATIO)
    b["cmp_ids"], _ = R.stable_topk(b["scores"], K)
    b["ids"], b["lengths"] = R.build_csa_indices(LAYOUT, window=3, ratio=RATIO,
                                                 compressed_ids=b["cmp_ids"])
    b["out"], b["lse"] = R.sparse_attention_forward(b["q"], b["kv"], b["ids"], b["sink"],
                                                    lengths=b["lengths"])
    res = R.sparse_indexer_loss(b["q"], b["kv"][T:], b["sink"], b["lse"], b["cmp_ids"],
                                b["scores"], LAYOUT, coeff=0.1)
    b["target"], b["predict"] = res.target, res.predict
    return b


def layout_call(**kw):
    args = dict(cu_seqlens=torch.tensor([0, 3, 5]), cu_seqlens_padded=torch.tensor([0, 4, 8]),
                num_rows=10)
    args.update(kw)
    return R.PackedLayout, (), args


def topk_call(b, **kw):
    args = dict(scores=b["scores"], k=K)
    args.update(kw)
    s = args.pop("scores")
    k = args.pop("k")
    return R.stable_topk, (s, k), args


def indexer_call(b, **kw):
    args = dict(q_idx=b["q_idx"], k_idx=b["k_idx"], weights=b["weights"], layout=LAYOUT, ratio=RATIO)
    args.update(kw)
    pos = [args.pop(n) for n in ("q_idx", "k_idx", "weights", "layout", "ratio")]
    return R.indexer_scores, pos, args


def indices_call(b, **kw):
    args = dict(window=3, ratio=RATIO, compressed_ids=b["cmp_ids"])
    args.update(kw)
    layout = args.pop("layout", LAYOUT)
    return R.build_csa_indices, (layout,), args


def fwd_call(b, **kw):
    args = dict(q=b["q"], kv=b["kv"], ids=b["ids"], sink=b["sink"], lengths=b["lengths"])
    args.update(kw)
    pos = [args.pop(n) for n in ("q", "kv", "ids", "sink")]
    return R.sparse_attention_forward, pos, args


def bwd_call(b, **kw):
    args = dict(q=b["q"], kv=b["kv"], ids=b["ids"], sink=b["sink"], out=b["out"], lse=b["lse"],
                dout=b["dout"], lengths=b["lengths"])
    args.update(kw)
    pos = [args.pop(n) for n in ("q", "kv", "ids", "sink", "out", "lse", "dout")]
    return R.sparse_attention_backward, pos, args


def loss_call(b, **kw):
    args = dict(q=b["q"], kv_cmp=b["kv"][T:], sink=b["sink"], lse=b["lse"],
                compressed_ids=b["cmp_ids"], index_scores=b["scores"], layout=LAYOUT, coeff=0.1)
    args.update(kw)
    pos = [args.pop(n) for n in ("q", "kv_cmp", "sink", "lse", "compressed_ids", "index_scores",
                                 "layout")]
    return R.sparse_indexer_loss, pos, args


def grad_call(b, **kw):
    args = dict(q_idx=b["q_idx"], k_idx=b["k_idx"], weights=b["weights"],
                compressed_ids=b["cmp_ids"], target=b["target"], predict=b["predict"], coeff=0.1,
                num_real=LAYOUT.num_real)
    args.update(kw)
    pos = [args.pop(n) for n in ("q_idx", "k_idx", "weights", "compressed_ids", "target",
                                 "predict")]
    return R.sparse_indexer_loss_grad, pos, args


def qnorm_call(b, **kw):
    args = dict(q=b["q"])
    args.update(kw)
    return R.q_rms_norm, (args.pop("q"),), args


def qnorm_bf16_call(b, **kw):
    args = dict(q=b["q"].to(torch.bfloat16))
    args.update(kw)
    return R.q_rms_norm_bf16, (args.pop("q"),), args


def cp_call(b, **kw):
    args = dict(layout=LAYOUT, cp=2)
    args.update(kw)
    return R.cp_partition, (args.pop("layout"), args.pop("cp")), args


def with_nan(x, where=(0, 0)):
    y = x.clone()
    y[where] = NAN
    return y


def with_inf_at_selected(b):
    """``index_scores`` with ``+inf`` at the first selected slot of a real row (section 8)."""
    t, j = torch.nonzero(b["cmp_ids"] >= 0)[0].tolist()
    y = b["scores"].clone()
    y[t, int(b["cmp_ids"][t, j])] = INF
    return y


def negative_at_first(x):
    y = x.clone()
    y.view(-1)[int(torch.nonzero(x.reshape(-1) > 0)[0])] = -1e-3
    return y


BUILDERS = {"layout": lambda b, **kw: layout_call(**kw), "topk": topk_call,
            "indexer": indexer_call, "indices": indices_call, "fwd": fwd_call, "bwd": bwd_call,
            "loss": loss_call, "grad": grad_call, "qnorm": qnorm_call, "qnorm_bf16": qnorm_bf16_call,
            "cp": cp_call}

# (id, builder, change (base -> kwargs), exception, argument named in the message)
CASES = [
    # section 1: layouts
    ("layout-str", "layout", lambda b: dict(cu_seqlens="0,3,5"), TypeError, "cu_seqlens"),
    ("layout-float", "layout", lambda b: dict(cu_seqlens=torch.tensor([0.0, 3.0, 5.0])), TypeError, "cu_seqlens"),
    ("layout-list-of-floats", "layout", lambda b: dict(cu_seqlens=[0, 3.0, 5]), TypeError, "cu_seqlens"),
    ("layout-2d", "layout", lambda b: dict(cu_seqlens=torch.tensor([[0, 3, 5]])), ValueError, "cu_seqlens"),
    ("layout-empty", "layout", lambda b: dict(cu_seqlens=torch.zeros(0, dtype=torch.int64)), ValueError, "cu_seqlens"),
    ("layout-cu0", "layout", lambda b: dict(cu_seqlens=torch.tensor([1, 3, 5])), ValueError, "cu_seqlens"),
    ("layout-cu-pad0", "layout", lambda b: dict(cu_seqlens_padded=torch.tensor([2, 4, 8])), ValueError, "cu_seqlens_padded"),
    ("layout-non-monotone", "layout", lambda b: dict(cu_seqlens=torch.tensor([0, 3, 2])), ValueError, "cu_seqlens"),
    ("layout-negative", "layout", lambda b: dict(cu_seqlens=torch.tensor([0, -1, 2]), cu_seqlens_padded=None), ValueError, "cu_seqlens"),
    ("layout-pad-non-monotone", "layout", lambda b: dict(cu_seqlens_padded=torch.tensor([0, 4, 3])), ValueError, "cu_seqlens_padded"),
    ("layout-lengths-differ", "layout", lambda b: dict(cu_seqlens_padded=torch.tensor([0, 4, 8, 9])), ValueError, "cu_seqlens_padded"),
    ("layout-real-above-padded", "layout", lambda b: dict(cu_seqlens_padded=torch.tensor([0, 2, 8])), ValueError, "cu_seqlens_padded"),
    ("layout-num-rows-small", "layout", lambda b: dict(num_rows=7), ValueError, "num_rows"),
    ("layout-num-rows-float", "layout", lambda b: dict(num_rows=10.0), TypeError, "num_rows"),
    ("layout-num-rows-bool", "layout", lambda b: dict(num_rows=True), TypeError, "num_rows"),
    ("layout-rows-beyond-memory", "layout", lambda b: dict(cu_seqlens=[0, 2 ** 40], cu_seqlens_padded=None, num_rows=None), ValueError, "cu_seqlens"),
    ("layout-num-rows-beyond-memory", "layout", lambda b: dict(num_rows=2 ** 40), ValueError, "num_rows"),
    ("layout-list-of-bools", "layout", lambda b: dict(cu_seqlens=[0, True, 5]), TypeError, "cu_seqlens"),
    # section 4: stable Top-K
    ("topk-not-tensor", "topk", lambda b: dict(scores=[[1.0, 2.0]]), TypeError, "scores"),
    ("topk-int-scores", "topk", lambda b: dict(scores=torch.ones(3, 4, dtype=torch.int64)), TypeError, "scores"),
    ("topk-1d", "topk", lambda b: dict(scores=torch.ones(4, dtype=F64)), ValueError, "scores"),
    ("topk-nan", "topk", lambda b: dict(scores=with_nan(b["scores"], (20, 1))), ValueError, "scores"),
    ("topk-k-negative", "topk", lambda b: dict(k=-1), ValueError, "k"),
    ("topk-k-float", "topk", lambda b: dict(k=2.0), TypeError, "k"),
    ("topk-order", "topk", lambda b: dict(order="value"), ValueError, "order"),
    ("topk-align-zero", "topk", lambda b: dict(align=0), ValueError, "align"),
    ("topk-k-beyond-memory", "topk", lambda b: dict(k=2 ** 40), ValueError, "k"),
    # section 7: indexer
    ("indexer-layout", "indexer", lambda b: dict(layout=(0, 7, 18)), TypeError, "layout"),
    ("indexer-ratio-zero", "indexer", lambda b: dict(ratio=0), ValueError, "ratio"),
    ("indexer-q-int", "indexer", lambda b: dict(q_idx=b["q_idx"].to(torch.int32)), TypeError, "q_idx"),
    ("indexer-q-2d", "indexer", lambda b: dict(q_idx=b["q_idx"][:, 0]), ValueError, "q_idx"),
    ("indexer-q-rows", "indexer", lambda b: dict(q_idx=b["q_idx"][:-1]), ValueError, "q_idx"),
    ("indexer-k-dim", "indexer", lambda b: dict(k_idx=b["k_idx"][:, :-1]), ValueError, "k_idx"),
    ("indexer-k-rows", "indexer", lambda b: dict(k_idx=b["k_idx"][:-1]), ValueError, "k_idx"),
    ("indexer-w-heads", "indexer", lambda b: dict(weights=b["weights"][:, :1]), ValueError, "weights"),
    ("indexer-w-rows", "indexer", lambda b: dict(weights=b["weights"][1:]), ValueError, "weights"),
    ("indexer-scale-inf", "indexer", lambda b: dict(scale=INF), ValueError, "scale"),
    ("indexer-scale-str", "indexer", lambda b: dict(scale="0.5"), TypeError, "scale"),
    # no document has a group at ratio 64: chunk_rows is checked although no row is chunked
    ("indexer-chunk-zero-unread", "indexer", lambda b: dict(ratio=64, k_idx=b["k_idx"][:0], chunk_rows=0), ValueError, "chunk_rows"),
    ("indexer-head-dim-zero", "indexer", lambda b: dict(q_idx=b["q_idx"][..., :0], k_idx=b["k_idx"][:, :0]), ValueError, "q_idx"),
    # section 5: CSA rows
    ("indices-layout", "indices", lambda b: dict(layout=None), TypeError, "layout"),
    ("indices-window-negative", "indices", lambda b: dict(window=-1), ValueError, "window"),
    # window 0 is legal with compressed keys (section 5.1), not for a window-only layer
    ("indices-window-zero-no-compressed", "indices", lambda b: dict(window=0, ratio=0), ValueError, "window"),
    ("indices-ratio-negative", "indices", lambda b: dict(ratio=-4), ValueError, "ratio"),
    ("indices-ids-with-window-only", "indices", lambda b: dict(ratio=0), ValueError, "compressed_ids"),
    ("indices-ids-float", "indices", lambda b: dict(compressed_ids=b["cmp_ids"].to(F64)), TypeError, "compressed_ids"),
    ("indices-ids-rows", "indices", lambda b: dict(compressed_ids=b["cmp_ids"][:-1]), ValueError, "compressed_ids"),
    ("indices-ids-1d", "indices", lambda b: dict(compressed_ids=b["cmp_ids"][:, 0]), ValueError, "compressed_ids"),
    ("indices-ids-invisible", "indices", lambda b: dict(compressed_ids=torch.full((T, K), C - 1)), ValueError, "compressed_ids"),
    # section 6: attention forward
    ("fwd-q-int", "fwd", lambda b: dict(q=b["q"].to(torch.int64)), TypeError, "q"),
    ("fwd-q-2d", "fwd", lambda b: dict(q=b["q"][:, 0]), ValueError, "q"),
    ("fwd-kv-dim", "fwd", lambda b: dict(kv=b["kv"][:, :-1]), ValueError, "kv"),
    ("fwd-kv-3d", "fwd", lambda b: dict(kv=b["kv"].unsqueeze(0)), ValueError, "kv"),
    ("fwd-ids-float", "fwd", lambda b: dict(ids=b["ids"].to(F64)), TypeError, "ids"),
    ("fwd-ids-bool", "fwd", lambda b: dict(ids=b["ids"] > 0), TypeError, "ids"),
    ("fwd-ids-rows", "fwd", lambda b: dict(ids=b["ids"][1:]), ValueError, "ids"),
    ("fwd-sink-heads", "fwd", lambda b: dict(sink=b["sink"][:1]), ValueError, "sink"),
    ("fwd-sink-nan", "fwd", lambda b: dict(sink=with_nan(b["sink"], 0)), ValueError, "sink"),
    ("fwd-lengths-rows", "fwd", lambda b: dict(lengths=b["lengths"][1:]), ValueError, "lengths"),
    ("fwd-lengths-float", "fwd", lambda b: dict(lengths=b["lengths"].to(F64)), TypeError, "lengths"),
    ("fwd-v-dim-above", "fwd", lambda b: dict(v_dim=D + 1), ValueError, "v_dim"),
    ("fwd-v-dim-zero", "fwd", lambda b: dict(v_dim=0), ValueError, "v_dim"),
    ("fwd-scale-nan", "fwd", lambda b: dict(scale=NAN), ValueError, "scale"),
    ("fwd-chunk-zero", "fwd", lambda b: dict(chunk_rows=0), ValueError, "chunk_rows"),
    ("fwd-ids-uint64", "fwd", lambda b: dict(ids=b["ids"].clamp_min(0).to(torch.uint64)), TypeError, "ids"),
    ("fwd-head-dim-zero", "fwd", lambda b: dict(q=b["q"][..., :0], kv=b["kv"][:, :0]), ValueError, "q"),
    # section 6: attention backward
    ("bwd-out-shape", "bwd", lambda b: dict(out=b["out"][:, :1]), ValueError, "out"),
    ("bwd-lse-shape", "bwd", lambda b: dict(lse=b["lse"][1:]), ValueError, "lse"),
    ("bwd-dout-shape", "bwd", lambda b: dict(dout=b["dout"][..., :-1]), ValueError, "dout"),
    ("bwd-dout-int", "bwd", lambda b: dict(dout=b["dout"].to(torch.int32)), TypeError, "dout"),
    ("bwd-ids-rows", "bwd", lambda b: dict(ids=b["ids"][:-2]), ValueError, "ids"),
    ("bwd-lse-nan", "bwd", lambda b: dict(lse=with_nan(b["lse"], (3, 1))), ValueError, "lse"),
    # section 8: loss
    ("loss-layout", "loss", lambda b: dict(layout="csa"), TypeError, "layout"),
    ("loss-q-rows", "loss", lambda b: dict(q=b["q"][:-1]), ValueError, "q"),
    ("loss-kv-dim", "loss", lambda b: dict(kv_cmp=b["kv"][T:, :-1]), ValueError, "kv_cmp"),
    ("loss-sink-heads", "loss", lambda b: dict(sink=torch.zeros(H + 1, dtype=F64)), ValueError, "sink"),
    ("loss-lse-heads", "loss", lambda b: dict(lse=b["lse"][:, :1]), ValueError, "lse"),
    ("loss-lse-nan", "loss", lambda b: dict(lse=with_nan(b["lse"], (3, 1))), ValueError, "lse"),
    ("loss-ids-rows", "loss", lambda b: dict(compressed_ids=b["cmp_ids"][:-1]), ValueError, "compressed_ids"),
    ("loss-scores-cols", "loss", lambda b: dict(index_scores=b["scores"][:, :-1]), ValueError, "index_scores"),
    ("loss-scores-nan", "loss", lambda b: dict(index_scores=with_nan(b["scores"], (5, 0))), ValueError, "index_scores"),
    ("loss-coeff-nan", "loss", lambda b: dict(coeff=NAN), ValueError, "coeff"),
    ("loss-coeff-missing-type", "loss", lambda b: dict(coeff=None), TypeError, "coeff"),
    ("loss-num-real-zero", "loss", lambda b: dict(num_real=0), ValueError, "num_real"),
    ("loss-floor-zero", "loss", lambda b: dict(loss_floor=0.0), ValueError, "loss_floor"),
    ("loss-scores-pos-inf-selected", "loss", lambda b: dict(index_scores=with_inf_at_selected(b)), ValueError, "index_scores"),
    ("loss-lse-neg-inf", "loss", lambda b: dict(lse=b["lse"].masked_fill(torch.arange(T).unsqueeze(1) == 3, -INF)), ValueError, "lse"),
    ("loss-ids-uint64", "loss", lambda b: dict(compressed_ids=b["cmp_ids"].clamp_min(0).to(torch.uint64)), TypeError, "compressed_ids"),
    ("loss-head-dim-zero", "loss", lambda b: dict(q=b["q"][..., :0], kv_cmp=b["kv"][T:, :0]), ValueError, "q"),
    # section 8: loss gradients
    ("grad-target-shape", "grad", lambda b: dict(target=b["target"][:, :-1]), ValueError, "target"),
    ("grad-predict-shape", "grad", lambda b: dict(predict=b["predict"][1:]), ValueError, "predict"),
    ("grad-predict-nan", "grad", lambda b: dict(predict=with_nan(b["predict"])), ValueError, "predict"),
    ("grad-mode", "grad", lambda b: dict(mode="exactly"), ValueError, "mode"),
    ("grad-kl-form", "grad", lambda b: dict(kl_form="log"), ValueError, "kl_form"),
    ("loss-kl-form", "loss", lambda b: dict(kl_form="log"), ValueError, "kl_form"),
    ("grad-divisors-shape", "grad", lambda b: dict(num_real=torch.ones(3, dtype=torch.float64)), ValueError, "num_real"),
    ("grad-divisors-zero", "grad", lambda b: dict(num_real=torch.zeros(LAYOUT.num_rows, dtype=torch.float64)), ValueError, "num_real"),
    ("loss-divisors-nan", "loss", lambda b: dict(num_real=torch.full((LAYOUT.num_rows,), float("nan"), dtype=torch.float64)), ValueError, "num_real"),
    ("grad-floor-zero", "grad", lambda b: dict(grad_floor=0.0), ValueError, "grad_floor"),
    ("grad-num-real-zero", "grad", lambda b: dict(num_real=0), ValueError, "num_real"),
    ("grad-num-real-float", "grad", lambda b: dict(num_real=18.0), TypeError, "num_real"),
    ("grad-k-dim", "grad", lambda b: dict(k_idx=b["k_idx"][:, :-1]), ValueError, "k_idx"),
    ("grad-w-shape", "grad", lambda b: dict(weights=b["weights"][:, :1]), ValueError, "weights"),
    ("grad-ids-float", "grad", lambda b: dict(compressed_ids=b["cmp_ids"].to(F64)), TypeError, "compressed_ids"),
    ("grad-grad-loss-inf", "grad", lambda b: dict(grad_loss=INF), ValueError, "grad_loss"),
    ("grad-target-negative", "grad", lambda b: dict(target=negative_at_first(b["target"])), ValueError, "target"),
    ("grad-predict-negative", "grad", lambda b: dict(predict=negative_at_first(b["predict"])), ValueError, "predict"),
    ("grad-head-dim-zero", "grad", lambda b: dict(q_idx=b["q_idx"][..., :0], k_idx=b["k_idx"][:, :0]), ValueError, "q_idx"),
    # section 9: q norm
    ("qnorm-list", "qnorm", lambda b: dict(q=[1.0, 2.0]), TypeError, "q"),
    ("qnorm-int", "qnorm", lambda b: dict(q=torch.ones(2, 4, dtype=torch.int32)), TypeError, "q"),
    ("qnorm-eps-zero", "qnorm", lambda b: dict(eps=0.0), ValueError, "eps"),
    ("qnorm-head-dim-zero", "qnorm", lambda b: dict(q=b["q"][..., :0]), ValueError, "q"),
    ("qnorm-bf16-float32", "qnorm_bf16", lambda b: dict(q=b["q"].float()), TypeError, "q"),
    ("qnorm-bf16-eps-negative", "qnorm_bf16", lambda b: dict(eps=-1e-6), ValueError, "eps"),
    # section 10: CP partitions
    ("cp-layout", "cp", lambda b: dict(layout=[0, 7, 18]), TypeError, "layout"),
    ("cp-zero", "cp", lambda b: dict(cp=0), ValueError, "cp"),
    ("cp-float", "cp", lambda b: dict(cp=2.0), TypeError, "cp"),
    ("cp-contiguous-not-dividing", "cp", lambda b: dict(cp=3), ValueError, "cp"),
    ("cp-zigzag-not-dividing", "cp", lambda b: dict(cp=3, mode="zigzag"), ValueError, "cp"),
    ("cp-mode", "cp", lambda b: dict(mode="ring"), ValueError, "mode"),
]


@pytest.fixture(scope="module")
def valid():
    return base()


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_base_call_is_valid(valid, builder):
    fn, args, kwargs = BUILDERS[builder](valid)
    fn(*args, **kwargs)


def tensors_of(args, kwargs):
    return [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("case_id,builder,change,exc,name", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(valid, case_id, builder, change, exc, name):
    fn, args, kwargs = BUILDERS[builder](valid, **change(valid))
    tensors = tensors_of(args, kwargs)
    before = [content_hash(t) for t in tensors]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc
    assert re.search(rf"(?<![A-Za-z0-9_.]){re.escape(name)}(?![A-Za-z0-9_])", str(info.value)), \
        f"message does not name {name!r}: {info.value}"
    assert [content_hash(t) for t in tensors] == before


def test_layout_offsets_may_be_any_integer_type():
    """numpy integers (and any object with ``__index__``) are integers; the layout is the one
    the Python ints give."""
    np = pytest.importorskip("numpy")
    a = R.PackedLayout([np.int64(0), np.int32(3)], [np.int64(0), np.int64(4)], np.int64(6))
    b = R.PackedLayout([0, 3], [0, 4], 6)
    assert a.num_rows == b.num_rows == 6
    assert torch.equal(a.is_real, b.is_real) and torch.equal(a.pos, b.pos)


def test_zigzag_names_the_capacity_tail():
    layout = R.PackedLayout([0, 8], [0, 8], 10)       # a capacity tail of 2 rows
    with pytest.raises(ValueError, match="capacity tail"):
        R.cp_partition(layout, 2, mode="zigzag")


@pytest.mark.parametrize("builder,name", [("fwd", "q"), ("loss", "q"), ("qnorm", "q"),
                                          ("indexer", "q_idx"), ("grad", "q_idx")])
def test_meta_tensors_raise_naming_the_argument(valid, builder, name):
    """A meta tensor holds no data: ValueError naming it (not NotImplementedError)."""
    fn, args, kwargs = BUILDERS[builder](valid, **{name: valid[name].to("meta")})
    with pytest.raises(ValueError, match=rf"{name} is a meta tensor"):
        fn(*args, **kwargs)


def test_q_rms_norm_does_not_overflow():
    """Section 9: ``q = 1e200`` normalises to 1 (``q**2`` would overflow to ``inf``), small
    ``q`` to ``q / sqrt(eps)``, and rows with ``max |q| <= 1`` keep the plain formula's bits."""
    q = torch.tensor([[1e200, -1e200, 1e200, 1e200], [1e-200, 0.0, -1e-200, 1e-200]], dtype=F64)
    out = R.q_rms_norm(q)
    assert out[0].tolist() == [1.0, -1.0, 1.0, 1.0]
    assert torch.allclose(out[1], q[1] / math.sqrt(1e-6), rtol=1e-15, atol=0)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1), dtype=F64) * 0.2
    assert torch.equal(R.q_rms_norm(x), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6))
