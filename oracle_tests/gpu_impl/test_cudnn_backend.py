"""Oracle tests specific to the cuDNN backend (the H200 lane), beyond the generic implementation
tests of ``gpu_impl/test_ops.py`` / ``gpu_impl/test_determinism.py`` (which run it on small shapes,
where most ops fall back to the torch backend or run the Triton kernels).

- CPU (CI lane): ``import dsv4_oracle.gpu_impl.cudnn_backend`` needs neither cuDNN nor a GPU; on CPU tensors
  every op says clearly that it needs CUDA, and ``why_unsupported``/``describe`` name why.
- GPU lane (``gpu`` + ``cudnn``; ``sm90`` where a kernel is SM90-specific): cases shaped for the
  cuDNN kernels (H 64, D 512/576, H_I 64, D_I 128) through the whole layer pipeline, with every
  op except ``build_csa_indices`` on cuDNN/Triton (asserted), judged against the oracle on the
  consumed inputs (``reference.error_model`` ratios) in deterministic and default modes;
  bitwise replays and grad-mode parity of the deterministic mode; sanitised copies (hostile ids
  reach cuDNN's backward, the caller's tensors are untouched); bad inputs rejected before any
  launch with the CUDA context healthy afterwards. The Triton deterministic backward's own
  stress cases are in ``gpu_impl/test_det_backward.py``.
- ``sm100``: the cuDNN deterministic kernels (written to cuDNN's documented contract; they
  cannot run on the H200 and skip there).
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.compare import compare_numeric
from dsv4_oracle.fixtures.case import Case
from dsv4_oracle.gpu_impl import api
from dsv4_oracle.reference import error_model as EM

from oracle_tests.helpers.impl_harness import CUDNN_CUDA, content_hash, judge, run_impl


def bounded(name, got, want, bound):
    return compare_numeric(name, got, want, bound)


def assert_verdicts(checks, label: str = "") -> None:
    """Fail with every failing check (numeric rows: error/bound ratios), print the table."""
    def ok(c):
        return c.passed if hasattr(c, "passed") else c.ok
    table = "\n".join(f"  {'ok ' if ok(c) else 'BAD'} {c.kind:8s} {c.name:44s} "
                      f"ratio={c.ratio}  {c.detail}" for c in checks)
    print(f"{label}\n{table}")
    bad = [c for c in checks if not ok(c)]
    assert not bad, f"{label}: {len(bad)} check(s) failed\n{table}"



def _marked(*marks):
    def deco(fn):
        for m in marks:
            fn = m(fn)
        return fn
    return deco


on_gpu = _marked(pytest.mark.gpu, pytest.mark.cudnn)                 # Triton + cuDNN installed
on_sm90 = _marked(pytest.mark.gpu, pytest.mark.cudnn, pytest.mark.sm90)

# Cases the cuDNN kernels take: H=64 with D=512 (and D=576 / Dv=512), H_I=64, D_I=128; packed
# documents with padding, an empty document and capacity rows.
_DOCS = dict(cu_seqlens=(0, 150, 150, 300), cu_seqlens_padded=(0, 152, 152, 304), num_rows=310)
CUDNN_CASES = [
    Case(name="cudnn-csa-d512", seed=101, heads=64, head_dim=512, window=64, ratio=4, topk=16,
         index_heads=64, index_dim=128, coeff=0.3, **_DOCS),
    Case(name="cudnn-csa-d576-mixed-sinks", seed=102, heads=64, head_dim=576, v_dim=512,
         window=64, ratio=4, topk=16, index_heads=64, index_dim=128, sink="mixed", **_DOCS),
]
# every op of a CSA layer runs on this backend's kernels, except the index arithmetic
CUDNN_OPS = ("indexer_scores", "stable_topk", "sparse_attention_forward",
             "sparse_attention_backward", "sparse_indexer_loss", "sparse_indexer_loss_grad")


def _cuda(x: dict) -> dict:
    return {k: t.to("cuda") for k, t in x.items()}


def _outputs(got: dict) -> dict:
    return {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}


def _replay_differences(run, n: int) -> dict:
    first = content_hash(run())
    diffs: dict = {}
    for _ in range(n - 1):
        h = content_hash(run())
        for k in set(first) | set(h):
            if first.get(k) != h.get(k):
                diffs[k] = diffs.get(k, 0) + 1
    return diffs


# --------------------------------------------------------------------------------------------
# CPU lane: importable without cuDNN or a GPU, clear refusals
# --------------------------------------------------------------------------------------------
def test_import_needs_no_cudnn_or_gpu():
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    assert cb.BACKEND_NAME == "cudnn"
    for op in api.OPS:
        assert callable(getattr(cb, op)), op
    reason = cb.why_unsupported("sparse_attention_forward", "cpu", True)
    assert "CUDA" in reason
    for op in cb.NO_KERNEL_OPS:
        assert "no kernel" in cb.why_unsupported(op, "cuda", True)


def test_cpu_tensors_are_refused_with_the_reason():
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q = torch.randn(4, 2, 16).to(torch.bfloat16)
    kv = torch.randn(8, 16).to(torch.bfloat16)
    ids = torch.zeros(4, 3, dtype=torch.int32)
    sink = torch.zeros(2)
    with pytest.raises(cb.CudnnBackendUnavailable, match="q is on cpu"):
        cb.sparse_attention_forward(q, kv, ids, sink)
    with pytest.raises(cb.CudnnBackendUnavailable, match="scores is on cpu"):
        cb.stable_topk(torch.randn(3, 5), 2)
    assert cb.describe("stable_topk", torch.randn(3, 5), 2).startswith("unavailable: ")
    assert api.resolve_backend("stable_topk", "cpu", "auto") == "torch"
    with pytest.raises(api.BackendUnavailable, match="CUDA"):
        api.stable_topk(torch.randn(3, 5), 2, backend="cudnn")


def test_bad_arguments_are_named_before_any_device_check():
    """Validation comes first (TypeError/ValueError naming the argument), on any device."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q = torch.randn(4, 2, 16).to(torch.bfloat16)
    kv = torch.randn(8, 16).to(torch.bfloat16)
    sink = torch.zeros(2)
    with pytest.raises(TypeError, match="ids"):
        cb.sparse_attention_forward(q, kv, torch.zeros(4, 3), sink)
    with pytest.raises(ValueError, match="kv"):
        cb.sparse_attention_forward(q, kv[:, :8], torch.zeros(4, 3, dtype=torch.int32), sink)
    with pytest.raises(ValueError, match="k"):
        cb.stable_topk(torch.randn(3, 5), -1)


@pytest.mark.parametrize("kernel", ["planes", "keymajor", "fixed"])
def test_removed_backward_kernels_are_refused_by_name(kernel):
    """``kernel=`` of the attention backward accepts only the surviving names ("auto",
    "split"): a removed design is a ValueError naming the argument, before any device check."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q = torch.randn(4, 2, 16).to(torch.bfloat16)
    kv = torch.randn(8, 16).to(torch.bfloat16)
    ids = torch.zeros(4, 3, dtype=torch.int32)
    out, dout = torch.zeros_like(q), torch.zeros_like(q)
    lse, sink = torch.zeros(4, 2), torch.zeros(2)
    assert cb.BACKWARD_KERNELS == ("auto", "split")
    with pytest.raises(ValueError, match="kernel must be one of"):
        cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, kernel=kernel)


def test_removed_forward_kernel_is_refused_by_name():
    """The graph-SDPA forward is gone: ``kernel="cudnn_sdpa"`` is a ValueError naming
    ``kernel``, before any device check."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q = torch.randn(4, 2, 16).to(torch.bfloat16)
    kv = torch.randn(8, 16).to(torch.bfloat16)
    ids = torch.zeros(4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        cb.sparse_attention_forward(q, kv, ids, torch.zeros(2), kernel="cudnn_sdpa")


# --------------------------------------------------------------------------------------------
# GPU lane: cuDNN-shaped layers against the oracle
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("case", CUDNN_CASES, ids=lambda c: c.id)
@on_sm90
def test_cudnn_shaped_layer_against_oracle(case, deterministic):
    x = _cuda(case.materialize())
    before = content_hash(x)
    got = run_impl(CUDNN_CUDA, case, x, deterministic=deterministic)
    assert content_hash(x) == before, "an op modified one of its inputs (contract section 11)"
    wrong = {op: b for op, b in got["backends"].items() if op in CUDNN_OPS and b != "cudnn"}
    assert not wrong, f"expected the cuDNN backend for these ops, got {wrong}"
    assert_verdicts(judge(CUDNN_CUDA, case, x, got),
                    f"cudnn {case} deterministic={deterministic} backends={got['backends']}")


@on_sm90
def test_cudnn_shaped_layer_replays_and_grad_modes(replays):
    """Deterministic mode: bitwise replays of every output of the layer pipeline (ids, lengths,
    scores, out, lse, loss, every gradient), and the same bits under no_grad / inference_mode /
    grad-enabled calls."""
    case = CUDNN_CASES[1]
    x = _cuda(case.materialize())
    diffs = _replay_differences(lambda: _outputs(run_impl(CUDNN_CUDA, case, x)), replays)
    assert not diffs, f"outputs differ across {replays} replays: {diffs}"
    with torch.no_grad():
        a = content_hash(_outputs(run_impl(CUDNN_CUDA, case, x)))
    with torch.inference_mode():
        b = content_hash(_outputs(run_impl(CUDNN_CUDA, case, x)))
    xg = {k: (t.clone().requires_grad_(True) if t.is_floating_point() else t) for k, t in x.items()}
    with torch.enable_grad():
        outs = _outputs(run_impl(CUDNN_CUDA, case, xg))
        assert not any(t.requires_grad for t in outs.values())
        c = content_hash(outs)
    assert a == b == c, {k: (a[k] == b.get(k), a[k] == c.get(k)) for k in a}


# --------------------------------------------------------------------------------------------
# GPU lane: attention inputs and the deterministic-backward judge (shared with
# gpu_impl/test_det_backward.py), cuDNN's default backward
# --------------------------------------------------------------------------------------------
def _attention_inputs(T, H, D, S, K, *, seed, dv=None, dup_keys=None, hostile=False):
    g = torch.Generator().manual_seed(seed)
    dv = dv or D
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, D, generator=g).to(torch.bfloat16)
    hi = dup_keys if dup_keys is not None else S
    ids = torch.randint(0, hi, (T, K), generator=g)
    lengths = torch.randint(0, K + 1, (T,), generator=g)
    lengths[::7] = K
    if hostile:
        bad = torch.tensor([-2 ** 31, -1, S, S + 5, 2 ** 31 - 1])
        mask = torch.rand(T, K, generator=g) < 0.2
        ids = torch.where(mask, bad[torch.randint(0, 5, (T, K), generator=g)], ids)
        lengths[3] = -4
        lengths[5] = K + 9
    sink = torch.randn(H, generator=g)
    sink[0] = -math.inf
    dout = torch.randn(T, H, dv, generator=g).to(torch.bfloat16)
    return q, kv, ids.to(torch.int32), lengths.to(torch.int32), sink, dout


def assert_deterministic_backward(run, inputs, dv, replays, what):
    """``run()`` -> ``{"dq", "dkv", "dsink"}`` of a deterministic backward on ``inputs = (q, kv,
    ids, sink, lengths, out, lse, dout)``: bitwise equal over ``max(replays, 5)`` replays, the
    inputs' bytes untouched, every output within the error model against the oracle."""
    q, kv, ids, sink, lengths, out, lse, dout = inputs
    before = content_hash(dict(ids=ids, lengths=lengths, q=q, kv=kv, out=out, dout=dout))
    diffs = _replay_differences(run, max(replays, 5))
    assert not diffs, f"{what}: differs across replays: {diffs}"
    assert content_hash(dict(ids=ids, lengths=lengths, q=q, kv=kv, out=out, dout=dout)) == before
    r = run()
    assert_verdicts(_judge_backward(q, kv, ids, sink, lengths, out, lse, dout,
                                    (r["dq"], r["dkv"], r["dsink"]), dv), what)


def _judge_backward(q, kv, ids, sink, lengths, out, lse, dout, got, dv):
    c = [t.cpu() for t in (q, kv, ids, sink, lengths, out, lse, dout)]
    q_, kv_, ids_, sink_, len_, out_, lse_, dout_ = c
    prec = CUDNN_CUDA.precision(torch.bfloat16)
    dq_o, dkv_o, ds_o = R.sparse_attention_backward(q_, kv_, ids_, sink_, out_, lse_, dout_,
                                                    v_dim=dv, lengths=len_)
    b = EM.attention_backward_bound(q_, kv_, ids_, sink_, out_, lse_, dout_, dq_o, dkv_o, ds_o,
                                    precision=prec, v_dim=dv, lengths=len_)
    return [bounded(n, g, o, bb) for n, g, o, bb in
            zip(("dq", "dkv", "dsink"), got, (dq_o, dkv_o, ds_o), b)]


@on_sm90
def test_cudnn_default_backward_on_sanitised_copies():
    """Default mode on SM90 runs cuDNN's backward: hostile ids and lengths are sanitised on
    copies (the caller's tensors keep their bytes) and the result agrees with the oracle."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q, kv, ids, lengths, sink, dout = (t.cuda() for t in _attention_inputs(
        T=256, H=64, D=512, S=700, K=64, seed=8, hostile=True))
    out, lse = cb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    before = content_hash(dict(ids=ids, lengths=lengths, out=out, lse=lse))
    assert "cudnn.sparse_attention_backward_wrapper" in cb.describe(
        "sparse_attention_backward", q, kv, ids, sink, out, lse, dout, deterministic=False)
    got = cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, lengths=lengths,
                                       deterministic=False)
    assert content_hash(dict(ids=ids, lengths=lengths, out=out, lse=lse)) == before
    assert_verdicts(_judge_backward(q, kv, ids, sink, lengths, out, lse, dout, got, 512),
                    "cudnn default backward, hostile ids")


@on_gpu
def test_bad_inputs_rejected_before_launch_and_context_healthy():
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q, kv, ids, lengths, sink, dout = (t.cuda() for t in _attention_inputs(
        T=64, H=4, D=32, S=80, K=16, seed=10))
    torch.cuda.synchronize()
    cases = [
        (ValueError, "sink contains NaN", lambda: cb.sparse_attention_forward(
            q, kv, ids, torch.full_like(sink, math.nan))),
        (ValueError, "kv", lambda: cb.sparse_attention_forward(q, kv[:, :16], ids, sink)),
        (TypeError, "ids", lambda: cb.sparse_attention_forward(q, kv, ids.float(), sink)),
        (ValueError, "lengths", lambda: cb.sparse_attention_forward(q, kv, ids, sink,
                                                                   lengths=lengths[:5])),
        (ValueError, "same device", lambda: cb.sparse_attention_forward(q, kv, ids.cpu(), sink)),
        (ValueError, "scores contains NaN", lambda: cb.stable_topk(
            torch.tensor([[1.0, math.nan]], device="cuda"), 1)),
        (ValueError, "dout", lambda: cb.sparse_attention_backward(
            q, kv, ids, sink, dout, dout[:, :, 0].float(), dout[:5])),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
    torch.cuda.synchronize()                                  # no launch failed asynchronously
    out, lse = cb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


# --------------------------------------------------------------------------------------------
# SM100: cuDNN's deterministic kernels (cannot run on the H200: these skip there)
# --------------------------------------------------------------------------------------------
@pytest.mark.sm100
@pytest.mark.gpu
@pytest.mark.cudnn
def test_sm100_deterministic_kernels(replays):
    """On SM100 the forward is cuDNN's DSA forward and the deterministic backward cuDNN's
    ``deterministic=True`` kernel: bitwise replays and oracle agreement."""
    from dsv4_oracle.gpu_impl import cudnn_backend as cb
    q, kv, ids, lengths, sink, dout = (t.cuda() for t in _attention_inputs(
        T=256, H=64, D=512, S=700, K=128, seed=11))
    assert cb.describe("sparse_attention_forward", q, kv, ids, sink).startswith("cudnn_dsa")
    out, lse = cb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)

    def run():
        dq, dkv, ds = cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                   lengths=lengths, deterministic=True)
        return {"dq": dq, "dkv": dkv, "dsink": ds}
    assert not _replay_differences(run, replays)
    r = run()
    assert_verdicts(_judge_backward(q, kv, ids, sink, lengths, out, lse, dout,
                                    (r["dq"], r["dkv"], r["dsink"]), 512), "sm100 deterministic")


# --------------------------------------------------------------------------------------------
# stress (slow set)
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
@on_sm90
def test_stress_100_replays_cudnn_shapes():
    """100 bitwise replays of the deterministic layer pipeline at cuDNN shapes."""
    case = CUDNN_CASES[0]
    x = _cuda(case.materialize())
    diffs = _replay_differences(lambda: _outputs(run_impl(CUDNN_CUDA, case, x)), 100)
    assert not diffs, f"outputs differ across 100 replays: {diffs}"
