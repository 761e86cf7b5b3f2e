"""The deterministic SM90 attention backward (:mod:`gpu_impl.kernels_triton_split`, row pass +
column-sliced planes) and the fixed-order indexer-loss gradient
(:mod:`gpu_impl.kernels_triton_indexer_grad`).

- CPU (where triton is installed; skipped otherwise): the kernels under the Triton interpreter
  (``TRITON_INTERPRET=1``, in a subprocess so the interpreter choice cannot leak into other
  tests) on small float16 cases with duplicate and hostile ids, judged against the float64
  oracle through the error model; the split kernel with its P/dS buffer forced into several
  row chunks.
- GPU (``gpu``; Triton only, no cuDNN needed): bf16 cases (heavy contention with duplicates, odd
  shapes with hostile ids, a CSA-like H 64 / D 512 case with window and compressed keys): the
  split route is taken, bitwise replays, inputs untouched, error-model ratios against the
  oracle, through the backend's deterministic route.
- The indexer-loss gradient: under the interpreter (duplicates, hostile ids, an empty row,
  several row chunks) and on the GPU (contention of thousands of slots per key, hostile ids,
  DSv4 head shapes) through the backend's deterministic route: bitwise replays, grad-mode
  parity, inputs untouched, error-model ratios against the oracle.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.compare import compare_numeric
from dsv4_oracle.reference import error_model as EM

from oracle_tests.helpers.impl_harness import CUDNN_CUDA, content_hash

from oracle_tests.gpu_impl.test_cudnn_backend import _attention_inputs, assert_deterministic_backward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_INTERPRETED = textwrap.dedent("""
    import json, sys, torch
    from dsv4_oracle import reference as R
    from dsv4_oracle.reference import error_model as EM
    import importlib
    from oracle_tests.helpers.impl_harness import CUDNN_CUDA
    from dsv4_oracle.compare import compare_numeric
    T, H, D, DV, S, K, module, options = json.loads(sys.argv[1])
    km = importlib.import_module("gpu_impl." + module)
    g = torch.Generator().manual_seed(5)
    dt = torch.float16
    q = torch.randn(T, H, D, generator=g).to(dt)
    kv = torch.randn(S, D, generator=g).to(dt)
    dout = torch.randn(T, H, DV, generator=g).to(dt)
    sink = torch.randn(H, generator=g)
    sink[0] = -float("inf")
    # a causal window plus a few shared keys, duplicates, hostile ids
    t = torch.arange(T).unsqueeze(1)
    ids = torch.cat([t - torch.arange(K // 2), torch.randint(0, 8, (T, K - K // 2),
                                                              generator=g)], 1)
    ids[:, 1] = ids[:, 0]
    bad = torch.tensor([-2 ** 31, -1, S, S + 5, 2 ** 31 - 1])
    m = torch.rand(T, K, generator=g) < 0.15
    ids = torch.where(m, bad[torch.randint(0, 5, (T, K), generator=g)], ids)
    ids = ids.to(torch.int32)
    lengths = torch.randint(0, K + 3, (T,), generator=g).to(torch.int32)
    lengths[2] = -1
    o64, l64 = R.sparse_attention_forward(q.double(), kv.double(), ids, sink.double(),
                                          v_dim=DV, lengths=lengths)
    out, lse = o64.to(dt), l64.float()
    before = [x.clone() for x in (q, kv, ids, lengths)]
    stats = {}
    got = km.attention_backward(q, kv, ids, sink, out, lse, dout, D ** -0.5, DV, lengths,
                                stats=stats, **options)
    same = all(torch.equal(a, b) for a, b in zip(before, (q, kv, ids, lengths)))
    ref = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=DV,
                                      lengths=lengths)
    bounds = EM.attention_backward_bound(q, kv, ids, sink, out, lse, dout, *ref,
                                         precision=CUDNN_CUDA.precision(dt), v_dim=DV,
                                         lengths=lengths)
    ratios = {}
    for name, a, b, bb in zip(("dq", "dkv", "dsink"), got, ref, bounds):
        c = compare_numeric(name, a, b, bb)
        ratios[name] = [bool(c.passed if hasattr(c, "passed") else c.ok), str(c.ratio)]
    print("RESULT " + json.dumps(dict(stats=stats, ratios=ratios, untouched=same)))
""")


_INTERPRETED_INDEXER_GRAD = textwrap.dedent("""
    import json, sys, torch
    from dsv4_oracle import reference as R
    from dsv4_oracle.reference import error_model as EM
    from oracle_tests.helpers.impl_harness import CUDNN_CUDA
    from dsv4_oracle.compare import compare_numeric
    from dsv4_oracle.gpu_impl import kernels_triton_indexer_grad as kg
    T, HI, DI, C, Kc, options = json.loads(sys.argv[1])
    g = torch.Generator().manual_seed(3)
    dt = torch.float16
    q = torch.randn(T, HI, DI, generator=g).to(dt)
    k = torch.randn(C, DI, generator=g).to(dt)
    w = torch.randn(T, HI, generator=g).to(dt)
    ids = torch.randint(0, C, (T, Kc), generator=g)
    ids[:, 1] = ids[:, 0]                                  # a duplicate id in every row
    bad = torch.tensor([-2 ** 31, -1, C, C + 5, 2 ** 31 - 1])
    m = torch.rand(T, Kc, generator=g) < 0.2
    ids = torch.where(m, bad[torch.randint(0, 5, (T, Kc), generator=g)], ids).to(torch.int32)
    ids[3] = -1                                            # a row with no valid slot
    tau = torch.rand(T, Kc, generator=g)
    tau = tau / tau.sum(1, keepdim=True)
    tau[1, :4] = 1e-5                                      # targets below the floor
    p = torch.softmax(torch.randn(T, Kc, generator=g), 1)
    p[0, :3] = 0.0                                         # below the gradient floor
    kw = dict(coeff=0.7, num_real=T - 2, grad_floor=0.02)
    before = [x.clone() for x in (q, k, w, ids, tau, p)]
    stats = {}
    args = (q, k, w, ids, tau, p, 0.7 / (T - 2), DI ** -0.5, 0.02)
    got = kg.indexer_loss_grad(*args, stats=stats, **options)
    again = kg.indexer_loss_grad(*args, **options)
    same = all(torch.equal(a, b) for a, b in zip(before, (q, k, w, ids, tau, p)))
    replay = all(torch.equal(a, b) for a, b in zip(got, again))
    ref = R.sparse_indexer_loss_grad(q, k, w, ids, tau, p, **kw)
    bounds = EM.indexer_loss_grad_bound(q, k, w, ids, tau, p, *ref,
                                        precision=CUDNN_CUDA.precision(dt), **kw)
    ratios = {}
    for name, a, b, bb in zip(("dq_idx", "dw", "dk_idx"), got, ref, bounds):
        c = compare_numeric(name, a, b, bb)
        ratios[name] = [bool(c.passed if hasattr(c, "passed") else c.ok), str(c.ratio)]
    print("RESULT " + json.dumps(dict(stats=stats, ratios=ratios, untouched=same,
                                      replay=replay)))
""")


def _interpret(args, script=_INTERPRETED):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=240)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"interpreted run failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the interpreter lane needs it)")


# split: narrow column slices and small slot blocks so that every slice/block path runs; a
# 1-byte buffer budget forces one row group per chunk (many chunks)
SPLIT_SMALL = dict(block_d=16, block_n=16, dkv_block_n=32)
SPLIT_CHUNKED = dict(SPLIT_SMALL, max_buffer_bytes=1)


@needs_triton
@pytest.mark.parametrize("shape", [(40, 4, 32, 32, 60, 12), (33, 3, 48, 32, 50, 10)],
                         ids=["h4-d32", "odd-h3-d48-dv32"])
@pytest.mark.parametrize("options", [SPLIT_SMALL, SPLIT_CHUNKED], ids=["split", "split-chunked"])
def test_interpreted_against_oracle(shape, options):
    """The split kernel (duplicates, hostile ids, bad lengths, empty rows, a -inf sink) agrees
    with the float64 oracle within the error model; the caller's tensors are untouched."""
    res = _interpret(list(shape) + ["kernels_triton_split", options])
    assert res["stats"]["route"] == "split", res
    if options is SPLIT_CHUNKED:
        assert res["stats"]["chunks"] == res["stats"]["groups"] > 1, res
    assert res["untouched"], res
    bad = {k: v for k, v in res["ratios"].items() if not v[0]}
    assert not bad, f"error-model ratios exceeded: {res['ratios']}"


def _csa_like_inputs(T, seed):
    """H 64, D 512: per row a causal window of 32 and 64 compressed keys among the visible
    ones (ids T..T+T/4-1), compacted with lengths, plus a few duplicates."""
    g = torch.Generator().manual_seed(seed)
    H, D, W, KC = 64, 512, 32, 64
    C = T // 4
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(T + C, D, generator=g).to(torch.bfloat16)
    t = torch.arange(T).unsqueeze(1)
    vis = (t // 4 + 1).clamp(max=C)
    cmp = (torch.rand(T, KC, generator=g) * vis).long() + T
    win = t - torch.arange(W).unsqueeze(0)
    ids = torch.cat([win, cmp], 1)
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, -1))
    valid = ids >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    ids = torch.gather(ids, 1, order).to(torch.int32)
    lengths = valid.sum(1).to(torch.int32)
    sink = torch.randn(H, generator=g)
    dout = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    return q, kv, ids, lengths, sink, dout


@pytest.mark.parametrize("shape", [
    dict(T=2048, H=16, D=64, S=24, K=64, dup_keys=24),          # thousands of rows per key
    dict(T=600, H=64, D=576, dv=512, S=5000, K=96),              # many plane tiles
    dict(T=300, H=5, D=48, dv=32, S=200, K=40, hostile=True),    # odd shapes, hostile ids
    "csa-like",
], ids=["contention", "many-tiles-d576", "hostile-odd", "csa-like-h64-d512"])
@pytest.mark.gpu
def test_det_backward_gpu(shape, replays):
    """Bitwise replays (at least 5), inputs untouched, oracle error-model ratios; through the
    backend's deterministic route (the split kernel)."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    from dsv4_oracle.gpu_impl import kernels_triton_split as ks
    if shape == "csa-like":
        q, kv, ids, lengths, sink, dout = (t.cuda() for t in _csa_like_inputs(384, seed=3))
        dv = 512
    else:
        shape = dict(shape)
        dv = shape.pop("dv", None)
        q, kv, ids, lengths, sink, dout = (t.cuda() for t in _attention_inputs(**shape, seed=7,
                                                                                 dv=dv))
        dv = dv or q.shape[2]
    out, lse = cb.sparse_attention_forward(q, kv, ids, sink, v_dim=dv, lengths=lengths)
    stats: dict = {}
    ks.attention_backward(q, kv, ids, sink, out, lse, dout, q.shape[2] ** -0.5, dv, lengths,
                          stats=stats)
    assert stats["route"] == "split", stats
    if importlib.util.find_spec("cudnn") is not None:      # describe() needs the frontend
        assert "kernels_triton_split" in cb.describe("sparse_attention_backward", q, kv, ids,
                                                     sink, out, lse, dout, v_dim=dv)

    def run():
        dq, dkv, ds = cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=dv,
                                                   lengths=lengths, deterministic=True)
        return {"dq": dq, "dkv": dkv, "dsink": ds}
    assert_deterministic_backward(run, (q, kv, ids, sink, lengths, out, lse, dout), dv, replays,
                                  f"split bwd {shape} {stats}")


# --------------------------------------------------------------------------------------------
# the fixed-order indexer-loss gradient (gpu_impl.kernels_triton_indexer_grad)
# --------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("shape,options,chunks", [
    ((20, 4, 32, 30, 12), {}, 1),
    ((33, 3, 48, 50, 20), dict(block_n=16, fold_block=4, buffer_bytes=1), 33),
    ((17, 64, 128, 40, 70), dict(buffer_bytes=200_000), 4),
], ids=["h4-d32", "odd-h3-d48-row-chunks", "h64-d128-chunks"])
def test_interpreted_indexer_grad_against_oracle(shape, options, chunks):
    """The fixed-order indexer gradient under the interpreter (duplicate and hostile ids, an
    empty row, predictions below the floor, several row chunks) agrees with the float64 oracle
    within the error model, replays bitwise and leaves its inputs untouched."""
    res = _interpret(list(shape) + [options], script=_INTERPRETED_INDEXER_GRAD)
    assert res["stats"]["chunks"] == chunks, res
    assert res["untouched"] and res["replay"], res
    bad = {k: v for k, v in res["ratios"].items() if not v[0]}
    assert not bad, f"error-model ratios exceeded: {res['ratios']}"


def _indexer_grad_inputs(T, HI, DI, C, Kc, *, seed, dup_keys=None, hostile=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HI, DI, generator=g).to(torch.bfloat16)
    k = torch.randn(C, DI, generator=g).to(torch.bfloat16)
    w = torch.randn(T, HI, generator=g).to(torch.bfloat16)
    hi = dup_keys if dup_keys is not None else C
    ids = torch.rand(T, hi, generator=g).argsort(dim=1)[:, :Kc] if hi >= Kc else \
        torch.randint(0, hi, (T, Kc), generator=g)
    if hostile:
        bad = torch.tensor([-2 ** 31, -1, C, C + 5, 2 ** 31 - 1])
        mask = torch.rand(T, Kc, generator=g) < 0.2
        ids = torch.where(mask, bad[torch.randint(0, 5, (T, Kc), generator=g)], ids)
    tau = torch.softmax(3 * torch.randn(T, Kc, generator=g), 1)
    p = torch.softmax(3 * torch.randn(T, Kc, generator=g), 1)
    return q, k, w, ids.to(torch.int32), tau, p


@pytest.mark.parametrize("shape", [
    dict(T=1500, HI=64, DI=128, C=8, Kc=32, dup_keys=8),         # ~6000 slots per key, duplicates
    dict(T=300, HI=16, DI=64, C=200, Kc=40, hostile=True),       # odd shapes, hostile ids
    dict(T=512, HI=64, DI=128, C=256, Kc=128),                   # DSv4-like heads, distinct ids
], ids=["contention", "hostile-h16-d64", "dsv4-heads"])
@pytest.mark.gpu
def test_indexer_grad_gpu(shape, replays):
    """Through the backend's deterministic route (the Triton kernels): bitwise replays (at least
    5), the same bits with autograd enabled on the inputs, inputs untouched, every gradient
    within the error model against the oracle."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    cpu = _indexer_grad_inputs(**shape, seed=11)
    q, k, w, ids, tau, p = (t.cuda() for t in cpu)
    kw = dict(coeff=0.3, num_real=shape["T"] - 7)
    if importlib.util.find_spec("cudnn") is not None:      # describe() needs the frontend
        assert cb.describe("sparse_indexer_loss_grad", q, k, w, ids, tau, p,
                           **kw).startswith("triton")
    before = content_hash(dict(q=q, k=k, w=w, ids=ids, tau=tau, p=p))

    def run():
        return dict(zip(("dq_idx", "dw", "dk_idx"), cb.sparse_indexer_loss_grad(
            q, k, w, ids, tau, p, deterministic=True, **kw)))
    first = content_hash(run())
    for _ in range(max(replays, 5) - 1):
        assert content_hash(run()) == first
    with torch.enable_grad():
        qg, wg, kg_ = (t.clone().requires_grad_(True) for t in (q, w, k))
        got = cb.sparse_indexer_loss_grad(qg, kg_, wg, ids, tau, p, deterministic=True, **kw)
        assert not any(t.requires_grad for t in got)
        assert content_hash(dict(zip(("dq_idx", "dw", "dk_idx"), got))) == first
    assert content_hash(dict(q=q, k=k, w=w, ids=ids, tau=tau, p=p)) == before
    got = [t.cpu() for t in run().values()]
    ref = R.sparse_indexer_loss_grad(*cpu, **kw)
    bounds = EM.indexer_loss_grad_bound(*cpu, *ref, precision=CUDNN_CUDA.precision(
        torch.bfloat16), **kw)
    checks = [compare_numeric(n, a, b, bb) for n, a, b, bb in
              zip(("dq_idx", "dw", "dk_idx"), got, ref, bounds)]
    bad = [c for c in checks if not (c.passed if hasattr(c, "passed") else c.ok)]
    assert not bad, [(c.name, c.ratio) for c in checks]
