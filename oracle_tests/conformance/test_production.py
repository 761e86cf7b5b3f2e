"""The production tier (``fixtures.production``) and the oracle's compute device.

CPU (CI): the production catalog's layouts hit what they promise, it stays out of the quick and
full catalogs, and the oracle's explicit ``compute_device="cpu"`` path is bitwise the default.
``gpu``: the oracle's float64 code on CUDA agrees with the CPU oracle over the full catalog
within float64 rounding (twice the error model's bound of the float64 oracle itself).
``production`` (selected only by ``pytest -m production``, on a CUDA machine): the torch
backend on CUDA passes every production case, judged by the oracle on CUDA.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from dsv4_oracle.adapters import load_adapter
from dsv4_oracle.conformance import STAGES, judge, oracle_outputs, oracle_stage
from dsv4_oracle.runner import check_case, select_cases
from dsv4_oracle.fixtures import EXACT_OUTPUTS, catalog, get, oracle_bounds, run_oracle
from dsv4_oracle.fixtures.production import PRODUCTION_ROWS, production_cases, production_layout
from dsv4_oracle.reference import PackedLayout
from dsv4_oracle.reference import error_model as E
from dsv4_oracle.reference._checks import as_device, compute_device, compute_on, to_cpu

PROD = production_cases()


def test_production_catalog_is_its_own():
    ids = [c.id for c in PROD]
    assert len(ids) == len(set(ids)) and all(i.startswith("prod-") for i in ids)
    for name in ("quick", "full"):
        cases, _ = select_cases(name)
        assert not {c.id for c in cases} & set(ids), name
    assert not {c.id for c in catalog()} & set(ids)
    cases, name = select_cases("production")
    assert name == "production" and [c.id for c in cases] == ids
    cases, _ = select_cases("production", ["prod-flash-*"])
    assert cases and all(c.heads == 64 for c in cases)


def test_production_cases_hit_their_shapes():
    flash = {(c.heads, c.head_dim, c.window, c.topk, c.index_heads, c.index_dim, c.ratio)
             for c in PROD if "dsv4_flash" in c.categories}
    pro = {(c.heads, c.head_dim, c.window, c.topk, c.index_heads, c.index_dim, c.ratio)
           for c in PROD if "dsv4_pro" in c.categories}
    assert flash == {(64, 512, 128, 512, 64, 128, 4)}
    assert pro == {(128, 512, 128, 1024, 64, 128, 4)}
    assert {c.T for c in PROD} == set(PRODUCTION_ROWS) == {4096, 16384, 65536}
    assert {c.sink for c in PROD} == {"normal", "neg_inf"}
    assert max(c.T * c.heads * c.topk for c in PROD) > 2 ** 31
    for c in PROD:
        if "index_hazards" in c.categories:
            assert c.T * c.heads * (c.topk + c.window) > 2 ** 31
    assert {(c.cp, c.cp_mode) for c in PROD} >= {(1, "contiguous"), (4, "zigzag"),
                                                  (8, "contiguous")}


@pytest.mark.parametrize("T", PRODUCTION_ROWS)
def test_production_layout(T):
    lay = PackedLayout(**production_layout(T))
    real, padded = lay.doc_lengths, lay.doc_padded_lengths
    assert lay.num_rows == T and lay.num_rows > int(lay.cu_seqlens_padded[-1])   # capacity
    assert bool((real == 0).any()) and int((padded > real).sum()) >= 3           # empty, padding
    assert int(real.max()) > 4 * 512 + 128                  # Flash: Top-K binds past the window
    if T >= 16384:
        assert int(real.max()) > 4 * 1024 + 128             # Pro too
    assert bool((padded % 16 == 0).all())
    with pytest.raises(ValueError, match="multiple of 1024"):
        production_layout(T + 256)


def test_production_case_builds_the_base_cases():
    from dsv4_oracle.fixtures.production import production_case
    by_id = {c.id: c for c in PROD}
    for shape in ("flash", "pro"):
        for T in PRODUCTION_ROWS:
            c = production_case(shape, T)
            assert c.to_json() == by_id[f"prod-{shape}-T{T}"].to_json()
            assert c.sink == "normal" and c.cp == 1 and c.T == T
            assert (tuple(c.cu_seqlens), tuple(c.cu_seqlens_padded)) == \
                (production_layout(T)["cu_seqlens"], production_layout(T)["cu_seqlens_padded"])
            assert {"padding", "empty_docs", "capacity_rows", f"dsv4_{shape}"} <= \
                set(c.categories)
            # the one copy of the 32-bit-offset rule: Flash at 65536, Pro from 16384
            big = (shape, T) in {("flash", 65536), ("pro", 16384), ("pro", 65536)}
            assert ("index_hazards" in c.categories) == big, (shape, T)
    small = production_case("flash", 2048)
    assert small.T == 2048 and small.id == "prod-flash-T2048" and small.heads == 64
    assert "index_hazards" not in small.categories
    with pytest.raises(ValueError, match="shape_name"):
        production_case("ultra", 4096)
    with pytest.raises(ValueError, match="multiple of 1024"):
        production_case("flash", 1000)


def test_production_cp_cases_partition():
    for c in PROD:
        if c.cp > 1:
            rows = torch.cat(c.rank_rows())
            assert torch.equal(torch.sort(rows).values, torch.arange(c.T)), c.id


@pytest.mark.parametrize("case_id", ["dsa-padded", "padding-edge-layout", "hca-ratio128",
                                     "hostile-ids-mixed-lengths", "nan-poison-layer"])
def test_explicit_cpu_compute_device_is_the_default_bitwise(case_id):
    case = get(case_id)
    x = case.materialize()
    a = run_oracle(case, x)
    b = run_oracle(case, x, compute_device="cpu")
    c = run_oracle(case, x, compute_device=torch.device("cpu"))
    assert list(a) == list(b) == list(c)
    for k in a:
        for other in (b, c):
            assert other[k].device.type == "cpu" and other[k].dtype == a[k].dtype
            assert torch.equal(a[k].nan_to_num(), other[k].nan_to_num()), k
            assert torch.equal(a[k].isnan(), other[k].isnan()), k
    ba, bb = oracle_bounds(case, x, a), oracle_bounds(case, x, a, compute_device="cpu")
    assert list(ba) == list(bb)
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k


def test_judge_with_cpu_oracle_device_is_the_default():
    adapter = load_adapter("gpu_impl:torch")
    case = get("dsa-zero-ties")
    a = check_case(adapter, case, replays=1)
    b = check_case(adapter, case, replays=1, oracle_device="cpu")
    assert [(r.name, r.passed, r.ratio) for r in a.checks] == \
        [(r.name, r.passed, r.ratio) for r in b.checks]


def test_compute_on_is_scoped():
    assert compute_device() == torch.device("cpu")
    with compute_on("cpu") as dev:
        assert dev == torch.device("cpu") == compute_device()
    assert compute_device() == torch.device("cpu")
    with pytest.raises(RuntimeError):
        with compute_on("cpu"):
            raise RuntimeError("boom")
    assert compute_device() == torch.device("cpu")


@pytest.mark.parametrize("bad, exc, match", [
    ("tpu", ValueError, "compute_device"), ("meta", ValueError, "compute_device"),
    ("not a device", ValueError, "compute_device"), (3, TypeError, "compute_device"),
])
def test_compute_device_is_validated(bad, exc, match):
    with pytest.raises(exc, match=match):
        as_device(bad)
    case = get("dsa-padded")
    with pytest.raises(exc, match=match):
        run_oracle(case, compute_device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_one_line():
    with pytest.raises(ValueError, match="CUDA is not available"):
        as_device("cuda")
    r = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--oracle-device",
                        "cuda", "--case", "dsa-padded"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "--oracle-device" in r.stderr


# -- the CUDA oracle against the CPU oracle (gpu lane) ---------------------------------------
RUNNABLE = [c for c in catalog() if "cp_invalid" not in c.categories]


def _stagewise(case, x: dict, done: dict) -> dict:
    """Every stage of ``case`` on the compute device, each on the outputs of the stages before
    it in ``done`` (not on its own)."""
    out: dict = {}
    for st in STAGES:
        if st.applies(case):
            out.update(oracle_stage(case, st, x, done))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", RUNNABLE, ids=[c.id for c in RUNNABLE])
def test_cuda_oracle_matches_cpu_oracle(case):
    """Both are float64 evaluations of the same formulas, each within the error model's bound
    of the float64 oracle (``ORACLE_PRECISION``) of the exact value: they differ by at most
    twice that bound; exact outputs are equal."""
    x = case.materialize()
    cpu = run_oracle(case, x)
    gpu = run_oracle(case, x, compute_device="cuda")
    assert list(gpu) == list(cpu)
    if getattr(case, "compressor", False):
        # the compressor's rounding reaches every later stage: each stage is compared on the
        # same inputs (the CPU oracle's outputs of the stages before it), which is what each
        # stage's bound covers
        with compute_on(torch.device("cuda")):
            gpu.update(to_cpu(_stagewise(case, x, cpu)))
    bound = oracle_bounds(case, x, cpu, precision=E.ORACLE_PRECISION)
    for k, e in cpu.items():
        g = gpu[k]
        assert g.device.type == "cpu" and g.dtype == e.dtype and g.shape == e.shape, k
        if k in EXACT_OUTPUTS or not e.is_floating_point():
            assert torch.equal(g, e), k
            continue
        fin = torch.isfinite(e)
        assert torch.equal(fin, torch.isfinite(g)), k
        assert torch.equal(e[~fin].nan_to_num(), g[~fin].nan_to_num()), k
        if k not in bound:
            assert torch.equal(g, e), k
            continue
        b = torch.broadcast_to(bound[k], e.shape)[fin]
        err = (g[fin] - e[fin]).abs()
        assert bool((err <= 2 * b).all()), (k, float((err - 2 * b).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", ["dsv4-flash-T32", "sink-mixed", "dsa-padded",
                                     "nan-poison-edge-rows"])
def test_judging_on_cuda_matches_judging_on_cpu(case_id):
    """With ``oracle_device="cuda"`` the oracle and the judge's numeric comparisons run on the
    GPU: the same checks, the same verdicts, and ratios that differ by no more than the two
    oracles may (contract section 12: CUDA and CPU float64 results agree within twice the float64
    oracle's own error bound). A ratio is ``|actual - expected| / bound``: a difference ``d`` of
    the expected value moves it by ``d / bound``, which cancellation makes large relative to the
    ratio itself when the implementation is very close (the loss of ``dsa-padded``: an error of
    3e-10 on 2.3e-3), so the tolerance is ``2 B64 / bound`` at the worst element, ``B64`` the
    float64 oracle's bound of that quantity, and not a relative one."""
    adapter = load_adapter("gpu_impl:torch")
    case = get(case_id)
    a = check_case(adapter, case, replays=1)
    b = check_case(adapter, case, replays=1, oracle_device="cuda")
    assert [(r.name, r.passed, r.judged, r.mismatches) for r in a.checks] == \
        [(r.name, r.passed, r.judged, r.mismatches) for r in b.checks]
    x = case.materialize()
    b64: dict = {}                      # the float64 oracle's own bounds, per quantity
    judge(case, x, oracle_outputs(case, x), precision=E.ORACLE_PRECISION, record=b64)
    for r, s in zip(a.checks, b.checks):
        if r.kind != "numeric" or r.ratio is None or not math.isfinite(r.ratio):
            continue
        q = r.extra["quantity"]
        at = r.extra.get("worst_bound") or 0.0
        tol = 2 * float(b64[q][1].max()) / at if at > 0 and q in b64 else 0.0
        assert abs(s.ratio - r.ratio) <= tol + 1e-12 * r.ratio, (r.name, r.ratio, s.ratio, tol)
    assert set(a.maps) == set(b.maps)


@pytest.mark.gpu
def test_cuda_oracle_bounds_match_cpu_bounds():
    case = get("dsa-v32-heads")
    x = case.materialize()
    o = run_oracle(case, x)
    prec = load_adapter("gpu_impl:torch").precision(case.torch_dtype)
    a = oracle_bounds(case, x, o, precision=prec)
    b = oracle_bounds(case, x, o, precision=prec, compute_device="cuda")
    for k in a:
        # a bound is itself a float64 evaluation: equal up to a few float64 roundings
        assert torch.allclose(a[k], b[k], rtol=1e-12, atol=0.0), k


# -- the production tier (pytest -m production, on a CUDA machine) ---------------------------
@pytest.fixture
def production_selected(request):
    if "production" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("production cases run only when selected: pytest -m production")
    if not torch.cuda.is_available():
        pytest.skip("the production tier needs a CUDA GPU (torch backend and oracle on CUDA)")


@pytest.mark.production
@pytest.mark.parametrize("case", PROD, ids=[c.id for c in PROD])
def test_production_case_passes_on_cuda(case, production_selected):
    outcome = check_case(load_adapter("gpu_impl:torch", device="cuda"), case, replays=2,
                         oracle_device="cuda")
    assert outcome.error is None, outcome.error
    assert outcome.passed, [(c.name, c.detail) for c in outcome.failed_checks]
    assert math.isfinite(max(c.ratio for c in outcome.checks if c.ratio is not None))


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--compute-device", "tpu"],
                                  ["--T", "1000"], ["--T", "x"], ["--check", "nosuch:thing"]])
def test_bench_production_rejects_bad_arguments(argv):
    r = subprocess.run([sys.executable, "bench/bench_production.py", *argv],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
