"""Determinism of the gpu_impl implementations (contract section 11).

- bitwise replays: ``--replays N`` (default 3) runs of every op on identical inputs give
  identical bits for ids, lengths, out, lse, scores, loss and every gradient; a stress run of
  100 replays is in the ``slow`` set;
- grad-mode parity: ``torch.no_grad()``, ``torch.inference_mode()`` and grad-enabled calls give
  identical bits;
- negative controls: the replay check itself detects a run-to-run difference (a reduction in
  a random order, on the CPU), and on a GPU it detects the default mode's float atomics (the
  torch backend's ``index_add_`` dkv; cuDNN's SM90 backward ``dkv`` / ``d_sink``).
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle import compare as C
from dsv4_oracle.fixtures.case import Case
from dsv4_oracle.gpu_impl import api

from oracle_tests.helpers.impl_harness import IMPLEMENTATIONS, run_impl, skip_large_on_cpu

# layouts with every edge, exact zero ties, duplicate ids (colliding scatter terms), and the
# public grad-mode parity shape (H 64, D 512, W 32, K 64)
REPLAY_CASES = [fixtures.get(n) for n in ("padding-edge-layout", "zero-score-ties",
                                           "duplicate-ids", "public-det-parity")]


def _outputs(impl, case, x, deterministic=True):
    got = run_impl(impl, case, x, deterministic=deterministic)
    return {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("case", REPLAY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_replays_are_bitwise_identical(impl, case, replays):
    skip_large_on_cpu(impl, case)
    assert replays >= 2, "--replays must be at least 2"
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    r = C.check_replays(lambda: _outputs(impl, case, x), replays)
    assert r.passed, f"{impl.id} {case.id}: {r.detail}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLEMENTATIONS[1:])      # GPU lanes: where atomics could bite
def test_stress_100_replays(impl):
    case = Case(name="stress", seed=44, coeff=0.2, heads=2, cu_seqlens=(0, 20, 32))
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    r = C.check_replays(lambda: _outputs(impl, case, x), 100)
    assert r.passed, f"{impl.id}: {r.detail}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_grad_mode_parity(impl):
    """Identical bits under grad-enabled, no_grad and inference_mode calls, with float inputs
    that require grad (the ops never record autograd history)."""
    case = REPLAY_CASES[0]
    x = {k: (t.to(impl.device).requires_grad_(True) if t.is_floating_point() else t.to(impl.device))
         for k, t in case.materialize().items()}

    def run():
        outs = _outputs(impl, case, x)
        assert not any(t.requires_grad for t in outs.values()), \
            "op-level results must not record autograd history (use gpu_impl.layer)"
        return outs
    r = C.check_grad_mode_parity(run)
    assert r.passed, f"{impl.id}: {r.detail}"


# --------------------------------------------------------------------------------------------
# negative controls
# --------------------------------------------------------------------------------------------
def test_replay_check_detects_a_nondeterministic_reduction():
    """The replay check can fail: a float32 sum in a fresh random order on each call (what
    unordered atomics amount to) is reported as differing."""
    g = torch.Generator().manual_seed(5)
    vals = torch.randn(4096, generator=g) * torch.logspace(-4, 4, 4096)
    vals = vals.float()

    def run():
        perm = torch.randperm(vals.numel())
        acc = torch.zeros(1)
        acc.index_add_(0, torch.zeros(vals.numel(), dtype=torch.int64), vals[perm])
        return {"sum": acc}
    r = C.check_replays(run, 5)
    assert not r.passed and "sum" in r.detail, r.detail


def _contended_attention(device, heads=16, dim=64, rows=4096, keys=32, width=64, seed=6):
    """Every row selects (with repeats) among the same few keys: thousands of float atomics
    hit each dkv row, so their order varies from run to run."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16).to(device)
    kv = torch.randn(keys, dim, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, keys, (rows, width), generator=g).to(torch.int32).to(device)
    sink = torch.randn(heads, generator=g).to(device)
    dout = torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16).to(device)
    return q, kv, ids, sink, dout


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_torch_backend_cuda_atomics_are_detected(deterministic, replays):
    """Negative control on CUDA: the torch backend's default mode (``index_add_``, float
    atomics) changes dkv bits between replays under contention, and the replay check reports
    it; the deterministic mode on the same inputs does not."""
    q, kv, ids, sink, dout = _contended_attention("cuda")
    fwd = api.sparse_attention_forward(q, kv, ids, sink, backend="torch")

    def run():
        r = api.sparse_attention_backward(q, kv, ids, sink, fwd.out, fwd.lse, dout,
                                          backend="torch", deterministic=deterministic)
        return {"dq": r.dq, "dkv": r.dkv, "dsink": r.dsink}
    r = C.check_replays(run, max(replays, 10) if not deterministic else replays)
    print(f"torch backend on CUDA, deterministic={deterministic}: {r.detail}")
    if deterministic:
        assert r.passed, r.detail
    else:
        assert not r.passed and "dkv" in r.extra["differing"].__repr__(), \
            f"the replay check did not see the atomics' effect: {r.detail}"


@pytest.mark.gpu
@pytest.mark.cudnn
@pytest.mark.sm90
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_cudnn_sm90_backward_atomics_are_detected(deterministic, replays):
    """Negative control on SM90: cuDNN's sparse-attention backward accumulates dkv and d_sink
    with float atomics in the default mode, so replays differ and the check reports it; the
    deterministic mode replaces those reductions and replays are identical."""
    g = torch.Generator().manual_seed(7)
    T, H, D, K, S = 1024, 64, 512, 256, 2048
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16).cuda()
    kv = torch.randn(S, D, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randint(0, S, (T, K), generator=g).to(torch.int32).cuda()
    sink = torch.randn(H, generator=g).cuda()
    dout = torch.randn(T, H, D, generator=g).to(torch.bfloat16).cuda()
    fwd = api.sparse_attention_forward(q, kv, ids, sink, backend="auto")
    name = api.resolve_backend("sparse_attention_backward", "cuda", "cudnn", deterministic,
                               (q, kv, ids, sink, fwd.out, fwd.lse, dout), {})
    assert name == "cudnn"

    def run():
        r = api.sparse_attention_backward(q, kv, ids, sink, fwd.out, fwd.lse, dout,
                                          backend="cudnn", deterministic=deterministic)
        return {"dq": r.dq, "dkv": r.dkv, "dsink": r.dsink}
    r = C.check_replays(run, max(replays, 5) if not deterministic else replays)
    print(f"cuDNN SM90 backward, deterministic={deterministic}: {r.detail}")
    if deterministic:
        assert r.passed, r.detail
    else:
        differing = repr(r.extra["differing"])
        assert not r.passed and ("dkv" in differing or "dsink" in differing), \
            f"the replay check did not see the SM90 atomics' effect: {r.detail}"


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["tree", "sorted_put"])
def test_fixed_order_scatter_methods_replay_on_cuda(method, replays):
    """Both deterministic scatter methods replay bitwise on CUDA under heavy contention
    (a million terms onto 32 rows), where ``index_add_`` does not."""
    from dsv4_oracle.gpu_impl.torch_backend import fixed_order_scatter_add
    g = torch.Generator().manual_seed(8)
    dest = torch.randint(0, 32, (1 << 20,), generator=g).cuda()
    vals = torch.randn(1 << 20, 64, generator=g).cuda()

    def run(det=True):
        acc = torch.zeros(32, 64, device="cuda")
        fixed_order_scatter_add(acc, dest, vals, deterministic=det, method=method)
        return {"acc": acc}
    r = C.check_replays(run, max(replays, 10))
    assert r.passed, r.detail
    atomics = C.check_replays(lambda: run(det=False), 10)
    print(f"{method}: {r.detail}; index_add_: {atomics.detail}")
    assert not atomics.passed, "index_add_ replayed bitwise: the control lost its power"
