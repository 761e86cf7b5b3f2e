"""Oracle tests of every gpu_impl op, over implementations (torch on the CPU in CI; torch and
cuDNN on CUDA in the GPU lane) and small cases: numerics against the oracle evaluated on the
exact inputs each implementation consumed (reference.error_model bounds, reported as
error/bound ratios), exact checks on ids, lengths, inf patterns and sink-only rows, hostile ids
and lengths, NaN-poisoned unselected key rows, input immutability, and bad inputs rejected
with a clear error before any kernel launch (contract sections 4 to 9, 11, 12)."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle import fixtures
from dsv4_oracle import compare as C
from dsv4_oracle.fixtures.case import Case
from dsv4_oracle.gpu_impl import api, torch_backend
from dsv4_oracle.reference import error_model as EM

from oracle_tests.helpers.impl_harness import (IMPLEMENTATIONS, TORCH_CPU, assert_checks, content_hash, judge, run_impl,
                           skip_large_on_cpu)



def _dedupe(cases):
    """Catalog cases that differ in what a single-device implementation computes: the CP
    variants of one layout (same inputs, only ``cp``/``cp_mode`` differ) run once."""
    seen, out = set(), []
    for c in cases:
        key = c.replace(name="", seed=0, cp=1, cp_mode="contiguous").to_json()
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# Every catalog category (fixtures.CATEGORIES): layouts, ties, hostile ids and lengths, sinks,
# poison, layer kinds, dtypes, policies, DSv4 shapes, public test shapes.
CASES = _dedupe(fixtures.catalog())
CHUNK_CASES = [fixtures.get(n) for n in ("padding-edge-layout", "v-dim-smaller",
                                          "hostile-ids-mixed-lengths")]


def _on(impl, x):
    return {k: t.to(impl.device) for k, t in x.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_ops_against_oracle(impl, case):
    skip_large_on_cpu(impl, case)
    x = _on(impl, case.materialize())
    before = content_hash(x)
    got = run_impl(impl, case, x)
    assert content_hash(x) == before, "an op modified one of its inputs (contract section 11)"
    if impl.backend == "cudnn" and "cudnn" not in got["backends"].values():
        pytest.skip(f"the cuDNN backend runs none of this case's ops ({case})")
    verdicts = judge(impl, case, x, got)
    for name in ("out", "lse", "dq", "dkv", "dsink"):
        assert got[name].device.type == torch.device(impl.device).type
    assert_checks(verdicts, f"{impl.id} {case} backends={got['backends']}")


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_ops_in_small_row_chunks(impl, case):
    """The same checks with the implementation's rows processed 7 at a time (``chunk_rows``):
    chunk boundaries cut documents, and every cross-row reduction spans several chunks."""
    x = _on(impl, case.materialize())
    got = run_impl(impl, case, x, chunk_rows=7)
    if impl.backend == "cudnn" and "cudnn" not in got["backends"].values():
        pytest.skip(f"the cuDNN backend runs none of this case's ops ({case})")
    assert_checks(judge(impl, case, x, got), f"{impl.id} chunk_rows=7 {case}")


@pytest.mark.parametrize("name", ["nan-poison-layer", "nan-poison-edge-rows"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_poisoned_rows_never_leak(impl, name):
    """NaN in every unselected key row (``nan-poison-edge-rows``: key row 0 and the last raw
    and compressed rows too, the rows a kernel that clamps invalid ids reads): every output
    stays finite where the oracle's is, and equals the implementation's result on the same
    inputs with the poison replaced by zeros."""
    case = fixtures.get(name)
    x = _on(impl, case.materialize())
    clean = dict(x)
    for k in ("kv", "kv_raw", "kv_cmp", "k_idx"):
        clean[k] = torch.nan_to_num(x[k], nan=0.0)
    assert bool(torch.isnan(x["kv"]).any()), "the case must poison some key rows"
    a, b = run_impl(impl, case, x), run_impl(impl, case, clean)
    for name, t in a.items():
        if isinstance(t, torch.Tensor):
            assert not bool(torch.isnan(t).any()), f"NaN leaked into {name}"
            if name not in ("dkv", "dk_idx"):      # gradients of poisoned rows are 0 either way
                assert torch.equal(t, b[name]), f"{name} depends on unselected (poisoned) rows"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_q_rms_norm(impl):
    """Section 9: within the error model of the float64 norm; for the torch backend also bit
    for bit the oracle's bf16 emulation, for contiguous and transposed inputs."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(6, 4, 64, generator=g) * 3).to(torch.bfloat16).to(impl.device)
    before = content_hash({"q": q})
    res = api.q_rms_norm(q, backend=impl.request)
    assert content_hash({"q": q}) == before
    ref = R.q_rms_norm(q)
    prec = impl.precision(torch.bfloat16)
    assert_checks([C.compare_numeric("q_rms_norm", res.q, ref,
                                     EM.q_rms_norm_bound(q, ref, precision=prec))],
                    f"{impl.id} q_rms_norm backend={res.backend}")
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)           # same values, other strides
    assert torch.equal(api.q_rms_norm(qt, backend=impl.request).q, res.q)
    if res.backend == "torch":
        assert torch.equal(res.q.cpu(), R.q_rms_norm_bf16(q))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_q_rms_norm_of_huge_float64_rows(impl):
    """Section 9: float64 ``q = 1e200`` normalises to 1 (squaring first overflowed: 0 or NaN)."""
    q = torch.full((2, 3, 8), 1e200, dtype=torch.float64, device=impl.device)
    q[1] *= -1
    res = api.q_rms_norm(q, backend=impl.request)
    assert res.q.cpu().abs().tolist() == torch.ones(2, 3, 8, dtype=torch.float64).tolist()
    assert bool((res.q.cpu()[1] < 0).all())


# One real row, H = 2, two selected keys with s = [5, 0] on both heads (the oracle's closed form
# in test_reference_loss): head 0 alone gives tau = softmax([5, 0]).
_CLOSED_TAU = [1 / (1 + math.exp(-5.0)), math.exp(-5.0) / (1 + math.exp(-5.0))]


@pytest.mark.parametrize("sink", [[0.0, math.inf], [2.4e38, 2.4e38], [math.inf, math.inf]],
                         ids=["0,+inf", "huge,huge", "+inf,+inf"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_loss_teacher_per_head_silencing_and_huge_sinks(impl, sink):
    """Section 8 in the backends: a ``+inf``-sink head is silenced alone, huge finite sinks
    cancel exactly (float32 ``s - LSEf`` absorbed ``s``), and a row without teacher mass keeps
    its student, has KL 0 and gets exactly zero gradients."""
    dev = impl.device
    lay = R.PackedLayout([0, 1])
    q = torch.ones((1, 2, 1), dtype=torch.float32, device=dev)
    kc = torch.tensor([[5.0], [0.0]], device=dev)
    lse = torch.full((1, 2), math.log(math.exp(5.0) + 1.0), device=dev)
    ids = torch.tensor([[0, 1]], dtype=torch.int32, device=dev)
    sc = torch.tensor([[0.25, -0.5]], device=dev)
    res = api.sparse_indexer_loss(q, kc, torch.tensor(sink, device=dev), lse, ids, sc, lay,
                                  coeff=1.0, scale=1.0, backend=impl.request)
    p = torch.softmax(torch.tensor([0.25, -0.5], dtype=torch.float64), 0)
    assert torch.allclose(res.predict[0].cpu().double(), p, rtol=1e-6, atol=0)
    if math.isinf(sink[0]):                      # every head silenced: no teacher mass
        assert res.target.cpu().tolist() == [[0.0, 0.0]] and float(res.loss) == 0.0
        qi = torch.randn(1, 2, 4, device=dev)
        g = api.sparse_indexer_loss_grad(qi, torch.randn(2, 4, device=dev),
                                         torch.randn(1, 2, device=dev), ids, res.target,
                                         res.predict, coeff=1.0, num_real=1,
                                         backend=impl.request)
        assert not bool(g.dq_idx.any()) and not bool(g.dw.any()) and not bool(g.dk_idx.any())
        return
    assert torch.allclose(res.target[0].cpu().double(), torch.tensor(_CLOSED_TAU, dtype=torch.float64),
                          rtol=1e-6, atol=0)
    assert float(res.loss) > 0


# --------------------------------------------------------------------------------------------
# bad inputs: a clear error naming the argument, raised before any kernel launch
# --------------------------------------------------------------------------------------------
def _small(device):
    case = Case(name="bad", seed=30, cu_seqlens=(0, 20, 40))
    x = {k: t.to(device) for k, t in case.materialize().items()}
    lay = case.layout()
    ids, lengths = torch_backend.build_csa_indices(lay, window=case.window, ratio=0,
                                                   device=device)
    return case, lay, x, ids, lengths


def _bad_calls(device):
    """(description, callable, exception type, text the message must contain)."""
    case, lay, x, ids, lengths = _small(device)
    q, kv, sink = x["q"], x["kv"], x["sink"]
    T = q.shape[0]
    kvp = kv[:T]
    good = dict(q=q, kv=kvp, ids=ids, sink=sink)
    s = torch.randn(T, 8, device=device)
    s_nan = s.clone()
    s_nan[3, 2] = math.nan
    sink_nan = sink.clone()
    sink_nan[0] = math.nan
    out, lse = torch_backend.sparse_attention_forward(q, kvp, ids, sink, lengths=lengths)
    cmp_bad = torch.full((T, 2), -1, dtype=torch.int32, device=device)
    cmp_bad[0, 0] = 0                      # row 0 sees no compressed group yet
    zs = torch.zeros(T, case.C, device=device)
    s_inf = zs.clone()
    s_inf[0, 0] = math.inf                 # +inf at the selected slot (row 0, id 0)
    lse_nan = lse.clone()
    lse_nan[2, 1] = math.nan
    lse_ninf = lse.clone()
    lse_ninf[2, 1] = -math.inf
    p_ok = torch.zeros(T, 2, device=device)
    p_neg = p_ok.clone()
    p_neg[1, 0] = -0.25
    meta = dict(q=q.to("meta"), kv=kvp.to("meta"), ids=ids.to("meta"), sink=sink.to("meta"))
    return [
        ("q not a tensor", lambda b: api.sparse_attention_forward(q.tolist(), kvp, ids, sink, backend=b), TypeError, "q"),
        ("q 2-D", lambda b: api.sparse_attention_forward(q[0], kvp, ids, sink, backend=b), ValueError, "q"),
        ("kv wrong D", lambda b: api.sparse_attention_forward(q, kvp[:, :5], ids, sink, backend=b), ValueError, "kv"),
        ("ids float", lambda b: api.sparse_attention_forward(q, kvp, ids.float(), sink, backend=b), TypeError, "ids"),
        ("ids wrong rows", lambda b: api.sparse_attention_forward(q, kvp, ids[:-1], sink, backend=b), ValueError, "ids"),
        ("sink wrong H", lambda b: api.sparse_attention_forward(q, kvp, ids, sink[:-1], backend=b), ValueError, "sink"),
        ("sink NaN", lambda b: api.sparse_attention_forward(q, kvp, ids, sink_nan, backend=b), ValueError, "sink"),
        ("lengths bool", lambda b: api.sparse_attention_forward(q, kvp, ids, sink, lengths=lengths.bool(), backend=b), TypeError, "lengths"),
        ("v_dim > D", lambda b: api.sparse_attention_forward(q, kvp, ids, sink, v_dim=10_000, backend=b), ValueError, "v_dim"),
        ("scale NaN", lambda b: api.sparse_attention_forward(q, kvp, ids, sink, scale=math.nan, backend=b), ValueError, "scale"),
        ("dout wrong shape", lambda b: api.sparse_attention_backward(q, kvp, ids, sink, out, lse, out[:, :1], lengths=lengths, backend=b), ValueError, "dout"),
        ("lse wrong shape", lambda b: api.sparse_attention_backward(q, kvp, ids, sink, out, lse[:-1], out, lengths=lengths, backend=b), ValueError, "lse"),
        ("topk NaN scores", lambda b: api.stable_topk(s_nan, 3, backend=b), ValueError, "NaN"),
        ("topk k negative", lambda b: api.stable_topk(s, -1, backend=b), ValueError, "k"),
        ("topk order", lambda b: api.stable_topk(s, 3, order="random", backend=b), ValueError, "order"),
        ("topk k bool", lambda b: api.stable_topk(s, True, backend=b), TypeError, "k"),
        ("indices invisible group", lambda b: api.build_csa_indices(lay, window=4, ratio=4, compressed_ids=cmp_bad, backend=b), ValueError, "compressed_ids"),
        ("indices window 0 without compressed keys", lambda b: api.build_csa_indices(lay, window=0, ratio=0, device=device, backend=b), ValueError, "window"),
        ("indices window -1", lambda b: api.build_csa_indices(lay, window=-1, ratio=4, device=device, backend=b), ValueError, "window"),
        ("indexer layout type", lambda b: api.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], "layout", 4, backend=b), TypeError, "layout"),
        ("indexer k_idx rows", lambda b: api.indexer_scores(x["q_idx"], x["k_idx"][:-1], x["weights"], lay, 4, backend=b), ValueError, "k_idx"),
        ("loss coeff inf", lambda b: api.sparse_indexer_loss(q, x["kv_cmp"], sink, lse, cmp_bad, torch.zeros(T, case.C, device=device), lay, coeff=math.inf, backend=b), ValueError, "coeff"),
        ("grad num_real 0", lambda b: api.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], cmp_bad, torch.zeros(T, 2, device=device), torch.zeros(T, 2, device=device), coeff=1.0, num_real=0, backend=b), ValueError, "num_real"),
        ("grad mode", lambda b: api.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], cmp_bad, torch.zeros(T, 2, device=device), torch.zeros(T, 2, device=device), coeff=1.0, num_real=5, mode="exact", backend=b), ValueError, "mode"),
        ("bwd lse NaN", lambda b: api.sparse_attention_backward(q, kvp, ids, sink, out, lse_nan, out, lengths=lengths, backend=b), ValueError, "lse"),
        ("ids uint64", lambda b: api.sparse_attention_forward(q, kvp, ids.clamp_min(0).to(torch.uint64), sink, backend=b), TypeError, "ids"),
        ("head dim 0", lambda b: api.sparse_attention_forward(q[..., :0], kvp[:, :0], ids, sink, backend=b), ValueError, "q"),
        ("meta tensors", lambda b: api.sparse_attention_forward(meta["q"], meta["kv"], meta["ids"], meta["sink"], backend="torch"), ValueError, "q is a meta tensor"),
        ("meta scores", lambda b: api.stable_topk(s.to("meta"), 3, backend="torch"), ValueError, "scores is a meta tensor"),
        ("meta compressed_ids", lambda b: api.build_csa_indices(lay, window=4, ratio=4, compressed_ids=cmp_bad.to("meta"), backend="torch"), ValueError, "compressed_ids is a meta tensor"),
        ("meta q norm", lambda b: api.q_rms_norm(q.to("meta"), backend="torch"), ValueError, "q is a meta tensor"),
        ("loss +inf selected score", lambda b: api.sparse_indexer_loss(q, x["kv_cmp"], sink, lse, cmp_bad, s_inf, lay, coeff=1.0, backend=b), ValueError, "index_scores"),
        ("loss lse -inf", lambda b: api.sparse_indexer_loss(q, x["kv_cmp"], sink, lse_ninf, cmp_bad, zs, lay, coeff=1.0, backend=b), ValueError, "lse"),
        ("loss head dim 0", lambda b: api.sparse_indexer_loss(q[..., :0], x["kv_cmp"][:, :0], sink, lse, cmp_bad, zs, lay, coeff=1.0, backend=b), ValueError, "q"),
        ("grad target negative", lambda b: api.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], cmp_bad, p_neg, p_ok, coeff=1.0, num_real=5, backend=b), ValueError, "target"),
        ("grad predict negative", lambda b: api.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], cmp_bad, p_ok, p_neg, coeff=1.0, num_real=5, backend=b), ValueError, "predict"),
        ("qnorm head dim 0", lambda b: api.q_rms_norm(q[..., :0], backend=b), ValueError, "q"),
        ("qnorm eps", lambda b: api.q_rms_norm(q, eps=-1.0, backend=b), ValueError, "eps"),
        ("backend name", lambda b: api.q_rms_norm(q, backend="triton"), ValueError, "backend"),
        ("topk k beyond memory", lambda b: api.stable_topk(s, 2 ** 40, backend=b), ValueError, "k: the ids [T, width]"),
        ("indices device string", lambda b: api.build_csa_indices(lay, window=4, ratio=0, device="gpu0", backend=b), ValueError, "device='gpu0' is not a device"),
        ("indices device int", lambda b: api.build_csa_indices(lay, window=4, ratio=0, device=7, backend=b), TypeError, "device must be a str or torch.device"),
        ("forward chunk_rows 0", lambda b: api.sparse_attention_forward(q, kvp, ids, sink, chunk_rows=0, backend=b), ValueError, "chunk_rows"),
        ("indexer chunk_rows 0, no group to chunk", lambda b: api.indexer_scores(x["q_idx"], x["k_idx"][:0], x["weights"], lay, 4096, chunk_rows=0, backend=b), ValueError, "chunk_rows"),
    ], good


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_inputs_rejected(impl):
    calls, good = _bad_calls(impl.device)
    before = content_hash(good)
    for what, call, exc, text in calls:
        with pytest.raises(exc) as info:
            call(impl.request)
        assert text in str(info.value), f"{what}: the message does not name {text!r}: {info.value}"
    assert content_hash(good) == before, "a rejected call modified its inputs"
    if impl.device == "cuda":
        torch.cuda.synchronize()          # the context is healthy: no sticky error
        y = torch.ones(4, device="cuda") * 2
        assert float(y.sum()) == 8.0


def test_mixed_devices_rejected():
    """Tensors of one call on different devices: ValueError naming both (checked from metadata,
    so it runs without a GPU using the meta device)."""
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    kv = torch.zeros(4, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="kv is on meta"):
        torch_backend.sparse_attention_forward(q, kv, torch.zeros(4, 2, dtype=torch.int32),
                                               torch.zeros(2))


def test_cudnn_backend_unavailable_is_a_clear_error():
    """``backend="cudnn"`` on CPU tensors names the missing piece; ``"auto"`` falls back."""
    s = torch.randn(4, 6)
    with pytest.raises(api.BackendUnavailable, match="CUDA device"):
        api.stable_topk(s, 2, backend="cudnn")
    assert api.stable_topk(s, 2, backend="auto").backend == "torch"
    assert api.resolve_backend("stable_topk", "cpu") == "torch"


def test_fixed_order_scatter_add_is_a_pairwise_tree_in_index_order():
    """The deterministic reduction equals an explicit pairwise fold of each destination's
    terms in index order (float32), and differs from nothing but the order of summation."""
    g = torch.Generator().manual_seed(3)
    dest = torch.randint(0, 5, (200,), generator=g)
    vals = torch.randn(200, 3, generator=g) * torch.logspace(-6, 6, 200).unsqueeze(1)
    vals = vals.float()
    acc = torch.zeros(5, 3)
    torch_backend.fixed_order_scatter_add(acc, dest, vals)

    def tree(terms):
        while len(terms) > 1:
            terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i]
                     for i in range(0, len(terms), 2)]
        return terms[0]
    for d in range(5):
        terms = [vals[i] for i in range(200) if int(dest[i]) == d]
        assert torch.equal(acc[d], tree(terms)), f"destination {d}"


def test_default_backend_on_cpu_is_torch():
    case = fixtures.get("padding-edge-layout")
    x = case.materialize()
    got = run_impl(TORCH_CPU, case, x)
    assert set(got["backends"].values()) == {"torch"}
