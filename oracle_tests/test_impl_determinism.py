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

from fixtures.case import Case
from gpu_impl import api

from .impl_harness import IMPLEMENTATIONS, content_hash, run_impl

_DOCS = dict(cu_seqlens=(0, 37, 37, 90), cu_seqlens_padded=(0, 40, 40, 96), num_rows=100)
REPLAY_CASES = [
    Case(name="csa", seed=41, coeff=0.3, sink="mixed", heads=5, **_DOCS),
    Case(name="csa-zero-ties", seed=42, index_inputs="zero_ties", topk=3, **_DOCS),
    Case(name="op-duplicates", seed=43, ids="duplicates", lengths="full", cu_seqlens=(0, 64)),
]


def replay_differences(run, replays: int) -> dict:
    """Call ``run()`` ``replays`` times; return ``{output name: number of replays whose bits
    differ from the first}`` (empty when every replay is bitwise identical)."""
    first = content_hash(run())
    diffs: dict = {}
    for _ in range(replays - 1):
        h = content_hash(run())
        for k in set(first) | set(h):
            if first.get(k) != h.get(k):
                diffs[k] = diffs.get(k, 0) + 1
    return diffs


def _outputs(impl, case, x, deterministic=True):
    got = run_impl(impl, case, x, deterministic=deterministic)
    return {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("case", REPLAY_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_replays_are_bitwise_identical(impl, case, replays):
    assert replays >= 2, "--replays must be at least 2"
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    diffs = replay_differences(lambda: _outputs(impl, case, x), replays)
    assert not diffs, f"{impl.id} {case.id}: outputs differ across {replays} replays: {diffs}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLEMENTATIONS[1:])      # GPU lanes: where atomics could bite
def test_stress_100_replays(impl):
    case = Case(name="stress", seed=44, coeff=0.2, heads=2, cu_seqlens=(0, 20, 32))
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    diffs = replay_differences(lambda: _outputs(impl, case, x), 100)
    assert not diffs, f"{impl.id}: outputs differ across 100 replays: {diffs}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_grad_mode_parity(impl):
    """Identical bits in no_grad, inference_mode and grad-enabled calls, for inputs that require
    grad in the last case (the ops never record autograd history)."""
    case = REPLAY_CASES[0]
    x = {k: t.to(impl.device) for k, t in case.materialize().items()}
    with torch.no_grad():
        a = content_hash(_outputs(impl, case, x))
    with torch.inference_mode():
        b = content_hash(_outputs(impl, case, x))
    xg = {k: (t.clone().requires_grad_(True) if t.is_floating_point() else t)
          for k, t in x.items()}
    with torch.enable_grad():
        outs = _outputs(impl, case, xg)
        assert not any(t.requires_grad for t in outs.values()), \
            "op-level results must not record autograd history (use gpu_impl.layer)"
        c = content_hash(outs)
    assert a == b == c, {k: (a[k] == b.get(k), a[k] == c.get(k)) for k in a}


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
    assert replay_differences(run, 5).get("sum", 0) >= 1


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
    n = max(replays, 10) if not deterministic else replays
    diffs = replay_differences(run, n)
    print(f"torch backend on CUDA, deterministic={deterministic}: differing replays {diffs}")
    if deterministic:
        assert not diffs
    else:
        assert diffs.get("dkv", 0) >= 1, "the replay check did not see the atomics' effect"


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
    n = max(replays, 5) if not deterministic else replays
    diffs = replay_differences(run, n)
    print(f"cuDNN SM90 backward, deterministic={deterministic}: differing replays {diffs}")
    if deterministic:
        assert not diffs
    else:
        assert diffs.get("dkv", 0) + diffs.get("dsink", 0) >= 1, \
            "the replay check did not see the SM90 atomics' effect"
