"""Index hazards as catalog cases (contract sections 5 and 6): each case hits its hazard, the
oracle and its error model stay finite on it, a plausible wrong implementation fails on it, and
the torch backend passes it."""
from __future__ import annotations


import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.adapters import load_adapter
from dsv4_oracle.runner import check_case
from dsv4_oracle.fixtures import Case, by_category, get, oracle_bounds, run_oracle
from dsv4_oracle.fixtures.case import EDGE_IDS, HOSTILE_IDS
from oracle_tests.helpers.impl_harness import torch_backend_outcome

HAZARDS = by_category("index_hazards")


def test_edge_ids():
    valid, invalid = EDGE_IDS((1 << 17) + 5, "int64")
    assert {0, 1, (1 << 16) - 1, 1 << 16, (1 << 17) - 1, 1 << 17, (1 << 17) + 4} <= set(valid)
    assert all(0 <= v < (1 << 17) + 5 for v in valid)
    assert set(HOSTILE_IDS((1 << 17) + 5, "int64")) <= set(invalid)
    # int64 ids whose low 32 bits are INT32_MIN or the valid ids 0 and 1
    assert {1 << 31, 1 << 32, (1 << 32) + 1, -(1 << 32) + 1} <= set(invalid)
    valid32, invalid32 = EDGE_IDS(300, "int32")
    assert valid32 == (0, 1, 255, 256, 298, 299)
    assert set(invalid32) == set(HOSTILE_IDS(300, "int32"))


def test_each_hazard_case_hits_its_hazard():
    got = {c.id: c for c in HAZARDS}
    c = got["hazard-int32-extremes-large-layout"]
    ids = c.materialize()["ids"]
    assert c.T >= 4096 and ids.dtype == torch.int32
    assert {-(2 ** 31), 2 ** 31 - 1} <= set(ids.flatten().tolist())
    c = got["hazard-int64-wraps-large-layout"]
    ids = c.materialize()["ids"]
    assert c.T >= 4096 and ids.dtype == torch.int64
    assert {(1 << 32) + 1, 1 << 31} <= set(ids.flatten().tolist())
    c = got["hazard-large-key-buffer"]
    x = c.materialize()
    S = x["kv"].shape[0]
    assert S > 2 ** 17 and c.T <= 16 and S == c.num_keys
    assert {1 << 17, S - 1} <= set(x["ids"].flatten().tolist())
    assert bool((x["lengths"].long() > x["ids"].shape[1]).any())
    for cid in ("hazard-nan-rows-first-last", "dsa-nan-poison"):
        kv = get(cid).materialize()["kv"]
        assert bool(kv[0].isnan().all()) and bool(kv[-1].isnan().all())


@pytest.mark.parametrize("case_id", ["hazard-nan-rows-first-last", "dsa-nan-poison"])
def test_error_model_is_finite_with_nan_key_rows_0_and_last(case_id):
    # The section 12 bounds gathered key row 0 for invalid slots and masked by multiplying:
    # a NaN row 0 made every bound NaN (the checker refused to judge). Fails on the old code.
    case = get(case_id)
    x = case.materialize()
    o = run_oracle(case, x)
    for name, b in oracle_bounds(case, x, o, precision=load_adapter("gpu_impl:torch").precision(
            case.torch_dtype)).items():
        assert not bool(b.isnan().any()), name


def test_truncating_int64_ids_to_int32_is_caught():
    # a mutant that reads int64 ids through int32 selects keys for 2**32 + 1 etc.
    case = get("hazard-int64-wraps-large-layout")
    x = case.materialize()
    o = run_oracle(case, x)
    wrapped = x["ids"].to(torch.int32)
    out, lse = R.sparse_attention_forward(x["q"], x["kv"], wrapped, x["sink"],
                                          lengths=x["lengths"])
    b_out = oracle_bounds(case, x, o)["out"]
    assert bool(((out - o["out"]).abs() > b_out).any())


def test_a_key_buffer_above_2_17_rows_is_read_at_its_high_rows():
    case = get("hazard-large-key-buffer")
    x = case.materialize()
    o = run_oracle(case, x)
    # a mutant that reads ids modulo 2**17 (a 17-bit index field) changes the output
    ids = x["ids"].to(torch.int64)
    S = x["kv"].shape[0]
    folded = torch.where((ids >= 0) & (ids < S), ids % (1 << 17), ids)
    out, _ = R.sparse_attention_forward(x["q"], x["kv"], folded, x["sink"], lengths=x["lengths"])
    assert not torch.equal(out, o["out"])


def test_key_rows_validation():
    with pytest.raises(ValueError, match="key_rows"):
        Case(name="x", seed=1, cu_seqlens=(0, 8), key_rows=100)          # a layer case
    with pytest.raises(ValueError, match="key_rows"):
        Case(name="x", seed=1, cu_seqlens=(0, 8), ids="hostile", lengths="none", key_rows=3)
    c = Case(name="x", seed=1, cu_seqlens=(0, 8), ids="hostile", lengths="none")
    assert "key_rows" not in c.to_dict() and Case.from_dict(c.to_dict()) == c
    d = c.replace(key_rows=40)
    assert Case.from_dict(d.to_dict()) == d and d.materialize()["kv"].shape[0] == 40


@pytest.mark.parametrize("case_id", ["hazard-large-key-buffer", "hazard-nan-rows-first-last"])
def test_torch_backend_passes(case_id):
    torch_backend_outcome(case_id)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["hazard-int32-extremes-large-layout",
                                     "hazard-int64-wraps-large-layout"])
def test_torch_backend_passes_large_layouts(case_id):
    outcome = check_case(load_adapter("gpu_impl:torch"), get(case_id), replays=2)
    assert outcome.passed, [(c.name, c.detail) for c in outcome.failed_checks]
