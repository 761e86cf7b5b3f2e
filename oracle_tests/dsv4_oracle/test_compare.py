"""The comparison engine (``dsv4_oracle/compare.py``): every check passes on a conforming input
and fails on a planted defect (negative controls), bad arguments raise naming the argument,
and no check modifies its inputs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dsv4_oracle.compare import (CheckResult, check_grad_mode_parity, check_no_mutation,
                                 check_replays, compare_exact, compare_numeric, compare_topk,
                                 near_tie_rows)
from dsv4_oracle.reference import stable_topk

INF, NAN = math.inf, math.nan


# ---------------------------------------------------------------------------------------------
# CheckResult
# ---------------------------------------------------------------------------------------------

def test_check_result_to_dict_is_json_ready():
    r = CheckResult("x", "numeric", False, INF, 3, "d", {"worst_index": [1, 2], "m": NAN})
    d = r.to_dict()
    assert d["ratio"] == "inf" and d["m"] == "nan" and d["worst_index"] == [1, 2]
    json.dumps(d, allow_nan=False)
    with pytest.raises(AssertionError, match="x"):
        r.raise_if_failed()
    ok = CheckResult("y", "exact", True)
    assert ok.raise_if_failed() is ok


# ---------------------------------------------------------------------------------------------
# compare_numeric
# ---------------------------------------------------------------------------------------------

def test_numeric_ratio_worst_index_and_pass():
    e = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    a = e + torch.tensor([[0.0, 0.1], [0.0, -0.3]], dtype=torch.float64)
    b = torch.full_like(e, 0.5)
    r = compare_numeric("out", a, e, b)
    assert r.passed and r.kind == "numeric"
    assert r.ratio == pytest.approx(0.6) and r.extra["worst_index"] == [1, 1]
    assert r.extra["max_error"] == pytest.approx(0.3)
    r = compare_numeric("out", a, e, torch.tensor(0.1, dtype=torch.float64))  # broadcast bound
    assert not r.passed and r.ratio == pytest.approx(3.0) and r.mismatches == 2


def test_numeric_accepts_low_precision_actual():
    e = torch.randn(16, dtype=torch.float64)
    a = e.to(torch.bfloat16)
    assert compare_numeric("bf16", a, e, e.abs() * 2.0 ** -8).passed
    assert not compare_numeric("bf16", a, e, e.abs() * 2.0 ** -12).passed


def test_numeric_zero_bound_is_an_exact_check():
    e = torch.zeros(4, dtype=torch.float64)
    assert compare_numeric("sink_only", torch.zeros(4), e, torch.zeros(4)).ratio == 0.0
    r = compare_numeric("sink_only", torch.tensor([0.0, 0, 1e-30, 0]), e, torch.zeros(4))
    assert not r.passed and r.ratio == INF and r.extra["worst_index"] == [2]


@pytest.mark.parametrize("actual", [[INF, 1.0, NAN, -INF, 2.0],      # +inf where -inf expected
                                    [-INF, 1.0, 0.0, -INF, 2.0],     # NaN position missing
                                    [-INF, INF, NAN, -INF, 2.0],     # +inf at a finite position
                                    [-INF, 1.0, NAN, 5.0, 2.0]])     # finite at -inf position
def test_numeric_nonfinite_positions_must_match_exactly(actual):
    e = torch.tensor([-INF, 1.0, NAN, -INF, 2.0])
    ok = compare_numeric("lse", e.clone(), e, torch.full((5,), 1e9))
    assert ok.passed and ok.ratio == 0.0
    r = compare_numeric("lse", torch.tensor(actual), e, torch.full((5,), 1e9))
    assert not r.passed and r.ratio == INF and r.mismatches == 1


def test_numeric_shape_mismatch_fails_and_bad_bound_raises():
    e = torch.zeros(3, 4)
    r = compare_numeric("x", torch.zeros(4, 3), e, torch.ones(3, 4))
    assert not r.passed and "shape" in r.detail
    with pytest.raises(ValueError, match="bound"):
        compare_numeric("x", e, e, torch.ones(5))
    with pytest.raises(ValueError, match="bound"):
        compare_numeric("x", e, e, -torch.ones(3, 4))
    with pytest.raises(TypeError, match="actual"):
        compare_numeric("x", [0.0], e, torch.ones(3, 4))
    with pytest.raises(TypeError, match="name"):
        compare_numeric(3, e, e, torch.ones(3, 4))


def test_numeric_ill_conditioned_elements_are_not_judged():
    """Section 12, power: an element whose bound reaches |expected| is counted as not judged;
    the ratio of a passing check comes from the judged elements only."""
    e = torch.tensor([1.0, 1e-6, 0.0], dtype=torch.float64)
    b = torch.tensor([0.01, 1e-5, 1e-7], dtype=torch.float64)
    r = compare_numeric("x", e + torch.tensor([0.0025, 9e-6, 9e-8], dtype=torch.float64), e, b)
    assert r.passed and r.judged and r.status == "passed"
    assert r.ratio == pytest.approx(0.25) and r.extra["worst_index"] == [0]
    assert r.extra["ill_conditioned"] == 2 and "2 of 3 elements not judged" in r.detail


def test_numeric_all_ill_conditioned_is_not_judged_never_a_pass():
    e = torch.tensor([1e-6, 0.0, -2e-6], dtype=torch.float64)
    r = compare_numeric("dsink", e * 1.5, e, torch.full((3,), 1e-5, dtype=torch.float64))
    assert r.status == "not_judged" and not r.judged and r.passed
    assert r.detail.startswith("not judged: all 3 elements ill-conditioned")
    assert r.to_dict()["status"] == "not_judged"
    empty = compare_numeric("x", torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert empty.status == "not_judged"
    assert compare_exact("x", torch.zeros(0), torch.zeros(0)).status == "not_judged"


def test_numeric_ill_conditioned_element_over_its_bound_still_fails():
    e = torch.tensor([1.0, 0.0], dtype=torch.float64)
    b = torch.tensor([0.01, 1e-7], dtype=torch.float64)
    r = compare_numeric("x", torch.tensor([1.0, 1e-6], dtype=torch.float64), e, b)
    assert not r.passed and r.status == "failed" and r.ratio == pytest.approx(10.0)
    assert r.extra["worst_index"] == [1] and r.mismatches == 1


def test_a_failed_check_is_judged():
    with pytest.raises(ValueError, match="judged"):
        CheckResult("x", "numeric", False, judged=False)
    assert CheckResult("x", "numeric", False).status == "failed"


# ---------------------------------------------------------------------------------------------
# compare_exact
# ---------------------------------------------------------------------------------------------

def test_exact_counts_and_locates_mismatches():
    e = torch.arange(12).reshape(3, 4)
    assert compare_exact("ids", e.to(torch.int32), e).passed       # values, not dtypes
    a = e.clone()
    a[1, 2] = -1
    a[2, 0] = 7
    r = compare_exact("ids", a, e)
    assert not r.passed and r.mismatches == 2 and r.extra["first_index"] == [1, 2]
    assert "actual -1" in r.detail and "expected 6" in r.detail
    assert not compare_exact("ids", e[:2], e).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_exact_compares_the_kind_of_dtype(dtype):
    """Float ids (or lengths) never equal integer ids, whatever their values: ids and lengths
    are integers (contract section 5)."""
    e = torch.tensor([[0, 1, -1], [1, 0, 0]])
    r = compare_exact("ids", e.to(dtype), e)
    assert not r.passed and r.extra["expected_dtype"] == "torch.int64"
    assert r.detail.startswith(f"dtype {dtype} is ") and "expected integer like torch.int64" \
        in r.detail


def test_exact_float_values_and_bits():
    e = torch.tensor([0.0, NAN, 1.0])
    a = torch.tensor([-0.0, NAN, 1.0])
    assert compare_exact("z", a, e).passed                          # -0 == +0, NaN == NaN
    r = compare_exact("z", a, e, bitwise=True)
    assert not r.passed and r.mismatches == 1 and r.extra["first_index"] == [0]
    assert compare_exact("z", e.clone(), e, bitwise=True).passed
    assert not compare_exact("z", e.double(), e, bitwise=True).passed   # dtype differs


# ---------------------------------------------------------------------------------------------
# compare_topk and near_tie_rows
# ---------------------------------------------------------------------------------------------

def _scores(seed=0, T=12, N=20):
    s = torch.randn(T, N, generator=torch.Generator().manual_seed(seed))
    s[3, 5:] = -INF                     # a row with fewer candidates than k
    return s


def test_topk_sets_and_lengths_match_across_orders_and_widths():
    s = _scores()
    ids_id, len_id = stable_topk(s, 8, order="id")
    ids_sc, len_sc = stable_topk(s, 8, order="score", align=16)
    assert compare_topk(ids_sc, len_sc, ids_id, len_id).passed       # sets only, widths differ
    assert compare_topk(ids_id.to(torch.int32), len_id.to(torch.int32), ids_id, len_id,
                        order="id").passed
    r = compare_topk(ids_sc, len_sc, ids_id, len_id, order="id")
    assert not r.passed and r.extra["order_mismatch_rows"] > 0 and r.extra["set_mismatch_rows"] == 0


def test_topk_wrong_set_length_tail_and_duplicates_are_caught():
    s = _scores(1)
    ids, lengths = stable_topk(s, 8)
    bad = ids.clone()
    bad[0, 0] = int(torch.argsort(s[0])[0])          # the worst column, never selected
    r = compare_topk(bad, lengths, ids, lengths)
    assert not r.passed and r.mismatches == 1 and r.extra["first_row"] == 0
    assert r.extra["set_mismatch_rows"] == 1 and r.extra["first_row_extra"] == [int(bad[0, 0])]
    short = lengths.clone()
    short[2] -= 1
    r = compare_topk(ids, short, ids, lengths)
    assert not r.passed and r.extra["length_mismatch_rows"] == 1
    tail = ids.clone()
    tail[3, 7] = 0                                   # row 3 has 5 selections; slot 7 must be -1
    assert compare_topk(tail, lengths, ids, lengths).extra["tail_not_minus_one_rows"] == 1
    dup = ids.clone()
    dup[4, 1] = dup[4, 0]
    r = compare_topk(dup, lengths, ids, lengths)
    assert not r.passed and r.extra["duplicate_rows"] == 1


def test_topk_near_tie_rows_are_excluded_and_counted():
    s = _scores(2).to(torch.float32)
    ids, lengths = stable_topk(s, 8, order="score")
    kth, nxt = int(ids[6, 7]), int(torch.argsort(-s[6], stable=True)[8])
    s[6, nxt] = torch.nextafter(s[6, kth], torch.tensor(-INF))      # one ulp below the K-th
    ids, lengths = stable_topk(s, 8, order="score")
    flagged = near_tie_rows(s, 8)
    assert bool(flagged[6]) and int(flagged.sum()) == 1
    # an implementation that breaks the near tie the other way
    swapped = ids.clone()
    swapped[6, 7] = nxt
    r = compare_topk(swapped, lengths, ids, lengths)
    assert not r.passed and r.mismatches == 1
    r = compare_topk(swapped, lengths, ids, lengths, near_tie_rows=flagged)
    assert r.passed and r.extra["excluded_near_tie"] == 1
    r = compare_topk(swapped, lengths, ids, lengths, near_tie_rows=torch.tensor([6]))
    assert r.passed and r.extra["excluded_near_tie"] == 1


def test_near_tie_rows_ulps_bound_and_candidates():
    s = torch.tensor([[3.0, 2.0, 1.0, 0.0],
                      [3.0, 1.0, 1.0, 0.0],            # exact tie at K/K+1 (k=2)
                      [3.0, 1.0, 0.99, 0.0],
                      [3.0, 1.0, -INF, -INF]])         # only 2 candidates: never a near tie
    assert near_tie_rows(s, 2).tolist() == [False, True, False, False]
    assert near_tie_rows(s, 2, ulps=0).tolist() == [False, True, False, False]
    b = torch.full_like(s, 0.006)
    assert near_tie_rows(s, 2, bound=b).tolist() == [False, True, True, False]
    assert not bool(near_tie_rows(s, 4).any())         # N <= k
    with pytest.raises(ValueError, match="NaN"):
        near_tie_rows(torch.tensor([[NAN, 1.0]]), 1)
    with pytest.raises(ValueError, match="k"):
        near_tie_rows(s, 0)


def test_topk_bad_arguments_raise():
    ids, lengths = stable_topk(_scores(), 4)
    with pytest.raises(ValueError, match="order"):
        compare_topk(ids, lengths, ids, lengths, order="value")
    with pytest.raises(TypeError, match="ids_ref"):
        compare_topk(ids, lengths, ids.float(), lengths)
    with pytest.raises(ValueError, match="near_tie_rows"):
        compare_topk(ids, lengths, ids, lengths, near_tie_rows=torch.tensor([99]))
    assert not compare_topk(ids[:3], lengths, ids, lengths).passed    # wrong shape = failure


# ---------------------------------------------------------------------------------------------
# Determinism checks
# ---------------------------------------------------------------------------------------------

def test_replays_pass_on_a_deterministic_function():
    x = torch.randn(64)
    r = check_replays(lambda: {"y": x * 2, "z": (x.sum(), 3)}, 4)
    assert r.passed and r.kind == "replay" and r.extra["tensors"] == ["out['y']", "out['z'][0]"]


def test_replays_catch_injected_nondeterminism():
    x = torch.randn(64, dtype=torch.float32)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        y = x * 2
        if calls["n"] == 3:                      # the third call flips the last bit of one element
            y.view(torch.int32)[5] ^= 1
        return x.clone(), y

    r = check_replays(flaky, 4)
    assert not r.passed and r.mismatches == 1
    assert r.extra["differing"] == {"out[1]": 1} and r.extra["differing_calls"] == [2]


def test_replays_catch_dtype_or_shape_changes_and_reject_bad_n():
    calls = {"n": 0}

    def f():
        calls["n"] += 1
        return torch.zeros(3 + (calls["n"] == 2))

    assert not check_replays(f, 3).passed
    with pytest.raises(ValueError, match="n"):
        check_replays(f, 1)
    with pytest.raises(TypeError, match="fn"):
        check_replays(3, 2)


def test_grad_mode_parity():
    x = torch.randn(8, requires_grad=True)
    assert check_grad_mode_parity(lambda: (x * 3).tanh()).passed

    def mode_dependent():
        return x * (2.0 if torch.is_grad_enabled() else 2.0000002)

    r = check_grad_mode_parity(mode_dependent)
    assert not r.passed and set(r.extra["differing"]) == {"no_grad", "inference_mode"}

    def inference_only():
        return x.detach() + (1e-3 if torch.is_inference_mode_enabled() else 0.0)

    r = check_grad_mode_parity(inference_only)
    assert not r.passed and set(r.extra["differing"]) == {"inference_mode"}


def test_no_mutation():
    q, k = torch.randn(4, 8), torch.randn(4, 8).to(torch.bfloat16)
    assert check_no_mutation(lambda a, b: a @ b.float().t(), (q, k)).passed
    assert check_no_mutation(lambda a, b: a + 1, {"a": q, "b": [k]}).passed

    def mutating(a, b):
        b.view(-1)[3] += 1
        return a

    r = check_no_mutation(mutating, (q, k))
    assert not r.passed and r.mismatches == 1 and r.extra["changed"] == ["inputs[1]"]
    r = check_no_mutation(lambda a, b: a.resize_(2, 8), {"a": q.clone(), "b": k})
    assert not r.passed and r.extra["changed"] == ["inputs['a']"]
    with pytest.raises(TypeError, match="inputs"):
        check_no_mutation(lambda a: a, q)


def test_checks_do_not_mutate_their_inputs():
    e = torch.tensor([1.0, -INF, NAN])
    a = torch.tensor([1.5, -INF, NAN])
    b = torch.tensor([1.0, 0.0, 0.0])
    r = check_no_mutation(compare_numeric, ("x", a, e, b))
    assert r.passed
    ids, lengths = stable_topk(_scores(), 4)
    assert check_no_mutation(compare_topk, (ids, lengths, ids.flip(1), lengths)).passed


def test_content_hash_over_pieces(monkeypatch):
    """A tensor larger than one hash piece: the value depends on every byte, on the dtype and
    on the shape, and is the same on every call (the pieces are hashed in parallel)."""
    import dsv4_oracle.compare as C
    monkeypatch.setattr(C, "_HASH_CHUNK", 1000)
    x = torch.randn(4096, dtype=torch.float64)            # 32768 bytes: 33 pieces
    h = C.content_hash(x)
    assert all(C.content_hash(x) == h for _ in range(3))
    for i in (0, 124, 125, 4095):                          # first, both sides of a piece edge, last
        y = x.clone()
        y[i] = torch.nextafter(y[i], torch.tensor(math.inf, dtype=torch.float64))
        assert C.content_hash(y) != h, i
    assert C.content_hash(x.view(64, 64)) != h
    assert C.content_hash(x.view(torch.int64)) != h
    assert C.content_hash(x[::2]) == C.content_hash(x[::2].contiguous())


def _numeric_inputs():
    g = torch.Generator().manual_seed(7)
    e = torch.randn(5, 3, 4, dtype=torch.float64, generator=g)
    b = torch.full_like(e, 1e-3)
    small = e + 5e-4 * torch.randn(e.shape, dtype=torch.float64, generator=g).clamp(-1, 1)
    over = small.clone()
    over[1, 2, 3] += 0.5
    over[3, 0, 0] += 0.5                                      # the same error twice: a tie
    over[3, 0, 0] = over[1, 2, 3] - e[1, 2, 3] + e[3, 0, 0]
    nonfin_e = e.clone()
    nonfin_e[2, 1, 1] = math.inf
    nonfin_e[4, 0, 2] = math.nan
    nonfin_a = small.clone()
    nonfin_a[2, 1, 1] = math.inf
    nonfin_a[4, 0, 2] = math.nan
    swapped = nonfin_a.clone()
    swapped[4, 0, 2] = -math.inf
    ill_b = e.abs() * 2
    part_ill = b.clone()
    part_ill[:2] = e[:2].abs() * 2
    zero_b = torch.zeros_like(e)
    yield "pass", small, e, b
    yield "over, tied worst", over, e, b
    yield "non-finite positions equal", nonfin_a, nonfin_e, b
    yield "non-finite positions differ", swapped, nonfin_e, b
    yield "all ill-conditioned", small, e, ill_b
    yield "part ill-conditioned", small, e, part_ill
    yield "part ill-conditioned, failing", over, e, part_ill
    yield "zero bound, equal", e.clone(), e, zero_b
    yield "zero bound, different", small, e, zero_b
    yield "scalar bound", small, e, torch.tensor(1e-3, dtype=torch.float64)
    yield "bound per last dim", over, e, torch.full((4,), 1e-3, dtype=torch.float64)
    yield "bound [1, 3, 4]", over, e, torch.full((1, 3, 4), 1e-3, dtype=torch.float64)
    yield "1-D", small.reshape(-1), e.reshape(-1), b.reshape(-1)
    yield "0-d", small[0, 0, 0], e[0, 0, 0], b[0, 0, 0]
    yield "float32 actual", over.float(), e, b


@pytest.mark.parametrize("elements", [1, 5, 12, 13, 1 << 30])
def test_compare_numeric_is_the_same_in_any_chunking(monkeypatch, elements):
    """compare_numeric scans row chunks: every field of the result (verdict, ratio, counts,
    worst element, detail) is the whole-tensor one, whatever the chunk size."""
    import dsv4_oracle.compare as C
    whole = {k: C.compare_numeric(k, a, e, b) for k, a, e, b in _numeric_inputs()}
    monkeypatch.setattr(C, "_COMPARE_ELEMENTS", elements)
    for k, a, e, b in _numeric_inputs():
        r = C.compare_numeric(k, a, e, b)
        assert r == whole[k], k
    assert whole["over, tied worst"].extra["worst_index"] == [1, 2, 3]       # the first of a tie
    assert whole["non-finite positions differ"].extra["worst_index"] == [4, 0, 2]
    assert not whole["over, tied worst"].passed and whole["over, tied worst"].mismatches == 2
    assert whole["all ill-conditioned"].status == "not_judged"
    assert whole["part ill-conditioned"].extra["ill_conditioned"] == 24
    assert not whole["zero bound, different"].passed and whole["zero bound, equal"].passed
