"""The compressor's implementations (contract sections 13-15): the portable torch backend on the
CPU, the routing and layouts of the GPU paths (testable without a GPU), and, on a GPU, the
Triton pooling (SM90) and cuDNN's fused compressor (SM100) against the oracle within the error
model, with bitwise replays and no input mutation."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle import reference as R
from dsv4_oracle.adapters import default_precision
from dsv4_oracle.gpu_impl import api, cudnn_backend, torch_backend
from dsv4_oracle.reference.error_model import compressor_backward_bound, compressor_forward_bound
from oracle_tests import content_hash, error_ratio

CASES = ("compressor-edges", "compressor-cp2-saturated", "compressor-hca-r128")
ROOT = Path(__file__).resolve().parents[2]


def _inputs(case, prefix, device="cpu"):
    x = case.materialize(device)
    return [x[f"{prefix}_{k}"] for k in ("kv", "score", "ape", "norm")]


def _judge(case, prefix, fwd, bwd, dout):
    """Error/bound ratios of a backend's forward and backward against the oracle."""
    rotate = prefix == "idx"
    args = [t.cpu() for t in _inputs(case, prefix)]
    lay, p = case.layout(), default_precision(case.torch_dtype)
    want = R.compressor_forward(*args, lay, case.ratio, rope=case.rope(), rotate=rotate)
    ratios = [error_ratio(fwd.cpu(), want, compressor_forward_bound(
        *args, lay, case.ratio, want, rope=case.rope(), precision=p, rotate=rotate))]
    grads = R.compressor_backward(*args, lay, case.ratio, dout.cpu(), rope=case.rope(),
                                  rotate=rotate)
    bounds = compressor_backward_bound(*args, lay, case.ratio, dout.cpu(), grads,
                                       rope=case.rope(), precision=p, rotate=rotate)
    ratios += [error_ratio(g.cpu(), e, b) for g, e, b in zip(bwd, grads, bounds)]
    return ratios


def _run(impl, case, prefix, device, **kw):
    args = _inputs(case, prefix, device)
    op = "indexer_compressor" if prefix == "idx" else "compressor"
    out = getattr(impl, f"{op}_forward")(*args, case.layout(), case.ratio, rope=case.rope(), **kw)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    grads = getattr(impl, f"{op}_backward")(*args, case.layout(), case.ratio, dout.to(device),
                                            rope=case.rope(), **kw)
    return args, out, dout, tuple(grads)[:4]


# ---------------------------------------------------------------------------------------------
# the portable torch backend (CPU)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["cmp", "idx"])
def test_torch_backend_is_within_the_bounds_and_replays_bitwise(prefix):
    case = fixtures.get("compressor-cp2-saturated")
    args, out, dout, grads = _run(torch_backend, case, prefix, "cpu")
    assert max(_judge(case, prefix, out, grads, dout)) <= 1
    _, out2, _, grads2 = _run(torch_backend, case, prefix, "cpu")
    assert content_hash(out) == content_hash(out2)
    assert [content_hash(g) for g in grads] == [content_hash(g) for g in grads2]


def test_torch_backend_never_writes_its_inputs_and_ignores_the_grad_mode():
    case = fixtures.get("compressor-edges")
    args = _inputs(case, "idx")
    before = [content_hash(t) for t in args]
    outs = []
    for mode in (torch.no_grad, torch.enable_grad, torch.inference_mode):
        with mode():
            outs.append(torch_backend.indexer_compressor_forward(*args, case.layout(), 4,
                                                                 rope=case.rope()))
    assert len({content_hash(o) for o in outs}) == 1
    assert [content_hash(t) for t in args] == before


def test_torch_backend_rejects_a_non_finite_element_it_reads():
    case = fixtures.get("compressor-edges")
    kv, score, ape, w = _inputs(case, "cmp")
    score = score.clone()
    score[8, 20] = float("nan")                      # row 8: group 0 of the document at row 7
    with pytest.raises(ValueError, match="score"):
        torch_backend.compressor_forward(kv, score, ape, w, case.layout(), 4, rope=case.rope())
    tail = kv.clone()
    tail[21] = float("nan")                          # a tail row: never read
    torch_backend.compressor_forward(tail, score.nan_to_num(), ape, w, case.layout(), 4,
                                     rope=case.rope())


@pytest.mark.parametrize("change,name", [
    (dict(kv=torch.zeros(5, 8)), "kv"), (dict(score=torch.zeros(32, 32, dtype=torch.float64)), "score"),
    (dict(ape=torch.zeros(3, 32)), "ape"), (dict(norm_weight=torch.ones(4)), "norm_weight"),
    (dict(rope=R.RopeSpec(dim=20)), "rope"), (dict(rope="yarn"), "rope"), (dict(ratio=0), "ratio"),
    (dict(rotate=True, kv=torch.zeros(32, 24), score=torch.zeros(32, 24),
          ape=torch.zeros(4, 24), norm_weight=torch.ones(12)), "rotate")])
def test_bad_arguments_are_named_before_any_work(change, name):
    case = fixtures.get("compressor-edges")
    kv, score, ape, w = (t.float() for t in _inputs(case, "cmp"))
    a = dict(kv=kv, score=score, ape=ape, norm_weight=w, layout=case.layout(), ratio=4,
             rope=case.rope())
    a.update(change)
    pos = [a.pop(k) for k in ("kv", "score", "ape", "norm_weight", "layout", "ratio")]
    with pytest.raises((TypeError, ValueError), match=name):
        api.compressor_forward(*pos, backend="torch", **a)


# ---------------------------------------------------------------------------------------------
# the GPU paths' CPU-side logic: routing and layouts
# ---------------------------------------------------------------------------------------------
def _fake_cudnn(deterministic: bool):
    def bwd(kv, score, ape, cu, cuc, grad_out, ratio=4, head_dim=None, coff=2, stream=None,
            **kw):
        return None
    if deterministic:
        def bwd(kv, score, ape, cu, cuc, grad_out, ratio=4, head_dim=None, coff=2,  # noqa: F811
                stream=None, deterministic=False):
            return None
    return types.SimpleNamespace(csa_compressor_backward_wrapper=bwd,
                                 csa_compressor_forward_wrapper=lambda *a, **k: None)


def test_routes_follow_the_architecture_dtype_ratio_and_determinism():
    kv = torch.zeros(16, 1024, dtype=torch.bfloat16)
    route = cudnn_backend.compressor_route
    assert route(kv, 4, None, True, False, (10, 0), _fake_cudnn(False))[0] == "cudnn"
    assert route(kv, 4, None, True, True, (10, 0), _fake_cudnn(True))[0] == "cudnn"
    r, why = route(kv, 4, None, True, True, (10, 0), _fake_cudnn(False))
    assert r != "cudnn" and "atomics" in why                      # d_ape atomics refused
    assert route(kv, 4, None, False, True, (10, 0), _fake_cudnn(False))[0] == "cudnn"
    r, why = route(kv, 4, None, True, False, (9, 0), _fake_cudnn(True))
    assert r != "cudnn" and "SM100" in why
    assert route(kv.float(), 4, None, True, False, (10, 0), _fake_cudnn(True))[0] == "torch"
    r, why = route(torch.zeros(16, 3 * 64, dtype=torch.bfloat16), 3, False, True, False, (10, 0),
                   _fake_cudnn(True))
    assert r == "torch" and "S = 3" in why                        # not a power of two
    assert cudnn_backend.cudnn_compressor_deterministic(_fake_cudnn(True))
    assert not cudnn_backend.cudnn_compressor_deterministic(types.SimpleNamespace())


@pytest.mark.parametrize("ratio,overlap", [(4, True), (128, False), (2, True), (4, False)])
def test_slot_tables_are_the_contracts(ratio, overlap):
    """The slot table the kernels read and the ape row of each slot are section 15's."""
    lay = fixtures.get("compressor-edges").layout()
    grp = R.compressor_groups(lay, ratio, overlap)
    c = 2 if overlap else 1
    slots = torch_backend._compressor_slots(lay, ratio, c, "cpu")
    assert torch.equal(slots.element, grp.element)
    assert torch.equal(slots.position, grp.position)
    assert torch.equal(cudnn_backend.compressor_slot_ape(ratio, c, "cpu"), grp.ape_row)
    valid = grp.element >= 0
    assert torch.equal(slots.ape_row[valid], grp.ape_row.expand_as(valid)[valid])


def test_the_cudnn_backend_refuses_cpu_tensors_naming_kv():
    case = fixtures.get("compressor-edges")
    args = _inputs(case, "cmp")
    with pytest.raises(cudnn_backend.CudnnBackendUnavailable, match="kv"):
        cudnn_backend._compressor_setup(
            cudnn_backend.validate_compressor(*args, case.layout(), 4, case.rope(), None, False,
                                              1e-6, True), case.layout(), "compressor_forward")


# ---------------------------------------------------------------------------------------------
# GPU: the Triton pooling on SM90, cuDNN's fused compressor on SM100
# ---------------------------------------------------------------------------------------------
def _gpu_case(cid):
    c = fixtures.get(cid)
    return c


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("cid", CASES)
@pytest.mark.parametrize("prefix", ["cmp", "idx"])
def test_sm90_triton_compressor_within_bounds_bitwise_replays_no_mutation(cid, prefix):
    case = _gpu_case(cid)
    if prefix == "idx" and not case.has_indexer:
        pytest.skip("HCA layers have no indexer compressor")
    args = _inputs(case, prefix, "cuda")
    kv = args[0]
    assert cudnn_backend.compressor_route(kv, case.ratio, None, True, True)[0] == "triton"
    before = [content_hash(t) for t in args]
    _, out, dout, grads = _run(cudnn_backend, case, prefix, "cuda")
    assert max(_judge(case, prefix, out, grads, dout)) <= 1
    for _ in range(3):
        _, out2, _, grads2 = _run(cudnn_backend, case, prefix, "cuda")
        assert content_hash(out2) == content_hash(out)
        assert [content_hash(g) for g in grads2] == [content_hash(g) for g in grads]
    assert [content_hash(t) for t in args] == before


@pytest.mark.gpu
@pytest.mark.sm90
def test_sm90_flash_shapes_pass_the_check():
    """The DSv4-Flash compressor cases through dsv4-oracle's own runner (gpu_impl:cudnn)."""
    from dsv4_oracle.adapters import load_adapter
    from dsv4_oracle.runner import check_case
    adapter = load_adapter("gpu_impl:cudnn")
    for cid in ("dsv4-flash-compressor-T32", "dsv4-flash-hca-compressor-T256"):
        out = check_case(adapter, fixtures.get(cid), replays=3)
        assert out.passed, [c.detail for c in out.failed_checks][:3]


@pytest.mark.gpu
@pytest.mark.sm100
@pytest.mark.cudnn
@pytest.mark.parametrize("cid", CASES)
def test_sm100_cudnn_compressor_deterministic_dape(cid):
    """cuDNN's fused compressor (SM100): within the bounds; in deterministic mode d_ape
    replays bitwise (the backend passes deterministic=True or refuses cuDNN)."""
    case = _gpu_case(cid)
    args = _inputs(case, "cmp", "cuda")
    route, why = cudnn_backend.compressor_route(args[0], case.ratio, None, True, True)
    _, out, dout, grads = _run(cudnn_backend, case, "cmp", "cuda")
    assert max(_judge(case, "cmp", out, grads, dout)) <= 1
    for _ in range(3):
        _, _, _, grads2 = _run(cudnn_backend, case, "cmp", "cuda")
        assert content_hash(grads2[2]) == content_hash(grads[2]), why


# ---------------------------------------------------------------------------------------------
# the packed layer from raw tokens
# ---------------------------------------------------------------------------------------------
def _raw_layer(case, **over):
    from dsv4_oracle.gpu_impl.layer import csa_layer
    x = case.materialize()
    leaf = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in x.items()}
    kw = dict(window=case.window, ratio=case.ratio, coeff=case.coeff, topk=case.topk,
              q_idx=leaf["q_idx"], weights=leaf["weights"], rope=case.rope(),
              compressor=R.CompressorInputs(*(leaf[f"cmp_{k}"] for k in ("kv", "score", "ape",
                                                                          "norm"))),
              index_compressor=R.CompressorInputs(*(leaf[f"idx_{k}"] for k in (
                  "kv", "score", "ape", "norm"))), backend="torch")
    kw.update(over)
    return leaf, csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], case.layout(), **kw)


def test_the_raw_layer_routes_gradients_as_the_contract_says():
    """out reaches the main compressor's inputs and not the indexer's; the loss reaches the
    indexer compressor's inputs and not the main's (section 8: the teacher is detached)."""
    case = fixtures.get("compressor-cp2-saturated")
    leaf, res = _raw_layer(case)
    assert res.kv_cmp.shape == (case.C, case.head_dim) and res.k_idx.shape == (case.C, 8)
    cmp = [leaf[f"cmp_{k}"] for k in ("kv", "score", "ape", "norm")]
    idx = [leaf[f"idx_{k}"] for k in ("kv", "score", "ape", "norm")]
    g_out = torch.autograd.grad(res.out.float().sum(), cmp + idx, allow_unused=True,
                                retain_graph=True)
    assert all(g is not None and bool(g.abs().sum() > 0) for g in g_out[:4])
    assert all(g is None or not bool(g.any()) for g in g_out[4:])
    g_loss = torch.autograd.grad(res.loss, cmp + idx, allow_unused=True)
    assert all(g is None or not bool(g.any()) for g in g_loss[:4])
    assert all(g is not None and bool(g.abs().sum() > 0) for g in g_loss[4:])


def test_the_raw_layer_matches_the_layer_on_its_own_compressed_keys():
    case = fixtures.get("compressor-edges")
    leaf, res = _raw_layer(case)
    from dsv4_oracle.gpu_impl.layer import csa_layer
    again = csa_layer(leaf["q"], leaf["kv_raw"], leaf["sink"], case.layout(), window=case.window,
                      ratio=case.ratio, coeff=case.coeff, topk=case.topk, q_idx=leaf["q_idx"],
                      weights=leaf["weights"], kv_cmp=res.kv_cmp.detach(),
                      k_idx=res.k_idx.detach(), backend="torch")
    assert torch.equal(res.out, again.out) and torch.equal(res.ids, again.ids)
    assert torch.equal(res.loss, again.loss)


@pytest.mark.parametrize("over,err,name", [
    (dict(kv_cmp=torch.zeros(1, 16)), ValueError, "kv_cmp"),
    (dict(rope=None), ValueError, "rope"),
    (dict(compressor=(1, 2, 3, 4)), TypeError, "compressor"),
    (dict(ratio=0, window=4), ValueError, "ratio")])
def test_the_raw_layer_rejects_bad_arguments_by_name(over, err, name):
    with pytest.raises(err, match=name):
        _raw_layer(fixtures.get("compressor-edges"), **over)


# ---------------------------------------------------------------------------------------------
# the Triton pooling kernels under the Triton interpreter (CPU, TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------
_INTERPRETED = r"""
import json, sys, torch
from dsv4_oracle import fixtures, reference as R
from dsv4_oracle.adapters import default_precision
from dsv4_oracle.gpu_impl import cudnn_backend as CB, torch_backend as TB
from dsv4_oracle.gpu_impl import kernels_triton_compressor as K
from dsv4_oracle.reference.error_model import compressor_backward_bound, compressor_forward_bound
case_id, prefix = json.loads(sys.argv[1])
case = fixtures.get(case_id)
x = case.materialize()
lay, rope, rotate = case.layout(), case.rope(), prefix == "idx"
kv, score, ape, w = (x[f"{prefix}_{k}"] for k in ("kv", "score", "ape", "norm"))
c = 2 if case.overlap else 1
T, d = kv.shape[0], kv.shape[1] // c
slots = TB._compressor_slots(lay, case.ratio, c, "cpu")
sa = CB.compressor_slot_ape(case.ratio, c, "cpu")
views = (kv.reshape(T * c, d).contiguous(), score.reshape(T * c, d).contiguous(),
         ape.float().reshape(-1, d).contiguous())
cos, sin = TB._rope_cos_sin(rope, slots.position)

def run():
    ctil = K.pool_forward(*views, slots.element, sa)
    out = TB.compressor_stages(ctil, w, 1e-6, cos, sin, rotate, kv).to(kv.dtype)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(kv.dtype)
    dctil, dw = TB.compressor_stages_backward(dout.float(), TB._store(ctil, kv), w, 1e-6, cos,
                                              sin, rotate, kv)
    dkv, dsc, dslots = K.pool_backward(*views, slots.element, sa, dctil.to(kv.dtype))
    dape = torch.zeros(case.ratio * c, d).index_copy_(0, sa, dslots)
    return out, dout, (dkv.view(T, c * d), dsc.view(T, c * d), dape.view(case.ratio, c * d), dw)

before = [t.clone() for t in (kv, score, ape, w)]
out, dout, grads = run()
out2, _, grads2 = run()
p = default_precision(kv.dtype)
o = R.compressor_forward(kv, score, ape, w, lay, case.ratio, rope=rope, rotate=rotate)
ratios = {"kv_cmp": float(((out.double() - o).abs() / compressor_forward_bound(
    kv, score, ape, w, lay, case.ratio, o, rope=rope, precision=p, rotate=rotate)).max())}
g = R.compressor_backward(kv, score, ape, w, lay, case.ratio, dout, rope=rope, rotate=rotate)
b = compressor_backward_bound(kv, score, ape, w, lay, case.ratio, dout, g, rope=rope, precision=p,
                              rotate=rotate)
for n, a_, e, bb in zip(("dkv", "dscore", "dape", "dnorm_weight"), grads, g, b):
    err = (a_.double() - e).abs()
    ratios[n] = float(torch.where(err == 0, torch.zeros_like(err), err / bb).max())
same = all(torch.equal(a_, b_) for a_, b_ in zip((out,) + grads, (out2,) + grads2))
untouched = all(torch.equal(a_, b_) for a_, b_ in zip(before, (kv, score, ape, w)))
print("RESULT " + json.dumps({"ratios": ratios, "replay": same, "untouched": untouched}))
"""


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (the interpreter lane needs it)")


@needs_triton
@pytest.mark.parametrize("cid,prefix", [("compressor-edges", "cmp"), ("compressor-edges", "idx"),
                                        ("compressor-hca-r128", "cmp")])
def test_interpreted_triton_pooling_against_the_oracle(cid, prefix):
    """The Triton pooling kernels (run by the Triton interpreter on the CPU) with the torch
    stages: within the error model, the same bits on a second run, inputs untouched."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps([cid, prefix])], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"interpreted run failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["replay"] and res["untouched"], res
    assert all(v <= 1 for v in res["ratios"].values()), res["ratios"]
