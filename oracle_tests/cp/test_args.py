"""Bad arguments of the CP helpers raise one clear ``TypeError`` / ``ValueError`` naming the
argument, before anything is computed (contract section 10; ``reference/cp.py``,
``reference/cp_plan.py``, the host-side helpers of ``gpu_impl/cp.py``).

A CP size above ``MAX_CP`` is rejected at once: any cp divides an empty layout, and the
partition of ``PackedLayout([0])`` into 10**8 ranks used to build 10**8 empty tensors.
"""
from __future__ import annotations

import re

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.conformance import oracle_outputs
from dsv4_oracle.gpu_impl.cp import cp_geometry, owned_group_counts
from dsv4_oracle.reference.cp import MAX_CP
from dsv4_oracle.reference.cp_plan import cp_halo_width, cp_plans, cp_rank_expected, cp_reduce_partials

from oracle_tests.helpers.cp_lane import CASES, make_inputs

EMPTY = R.PackedLayout([0])
LAY = R.PackedLayout([0, 5, 9], [0, 8, 16], 16)


@pytest.mark.parametrize("fn", [
    lambda cp: R.cp_partition(EMPTY, cp),
    lambda cp: R.cp_partition(EMPTY, cp, mode="zigzag"),
    lambda cp: cp_plans(EMPTY, cp, window=4, ratio=4),
    lambda cp: owned_group_counts(EMPTY, cp, ratio=4),
    lambda cp: cp_geometry(EMPTY, cp, 0, window=4, ratio=4),
], ids=["partition", "partition-zigzag", "plans", "owned_group_counts", "geometry"])
@pytest.mark.parametrize("cp", [MAX_CP + 1, 10**8])
def test_a_cp_above_max_cp_is_rejected(fn, cp):
    with pytest.raises(ValueError, match=rf"^cp must be <= {MAX_CP} .*got {cp}$"):
        fn(cp)


def test_max_cp_itself_is_accepted():
    parts = R.cp_partition(EMPTY, MAX_CP)
    assert len(parts) == MAX_CP and all(p.numel() == 0 for p in parts)


def _bad_expected(**kw):
    case = CASES["csa"]
    x = make_inputs(case)
    o = oracle_outputs(case, x)
    plan = cp_plans(case.layout(), 2, window=case.window, ratio=case.ratio)[1]
    args = dict(q=x["q"], kv=x["kv_raw"], sink=x["sink"], ids=o["ids"], lengths=o["lengths"],
                kv_cmp=x["kv_cmp"], dout=x["dout"], compressed_ids=o["cmp_ids"],
                index_scores=o["scores"], q_idx=x["q_idx"], k_idx=x["k_idx"],
                weights=x["weights"], coeff=case.coeff, v_dim=case.v_dim)
    for k, v in kw.items():
        args[k] = v(args[k]) if callable(v) else v
    return lambda: cp_rank_expected(plan, **args)


def _short(t):
    return t[:-1]


BAD = {
    # name: (call, exception type, argument the message names)
    "cp-bool": (lambda: R.cp_partition(LAY, True), TypeError, "cp"),
    "cp-float": (lambda: R.cp_partition(LAY, 2.0), TypeError, "cp"),
    "cp-tensor": (lambda: R.cp_partition(LAY, torch.tensor(2)), TypeError, "cp"),
    "cp-zero": (lambda: R.cp_partition(LAY, 0), ValueError, "cp"),
    "cp-not-dividing": (lambda: R.cp_partition(LAY, 3), ValueError, "cp"),
    "mode-none": (lambda: R.cp_partition(LAY, 2, mode=None), TypeError, "mode"),
    "mode-unknown": (lambda: R.cp_partition(LAY, 2, mode="ring"), ValueError, "mode"),
    "layout-dict": (lambda: R.cp_partition({}, 2), TypeError, "layout"),
    "plans-window-zero": (lambda: cp_plans(LAY, 2, window=0, ratio=4), ValueError, "window"),
    "plans-ratio-negative": (lambda: cp_plans(LAY, 2, window=4, ratio=-1), ValueError, "ratio"),
    "halo-window-str": (lambda: cp_halo_width("4", 4), TypeError, "window"),
    "expected-plan": (lambda: cp_rank_expected(None, q=None, kv=None, sink=None, ids=None),
                      TypeError, "plan"),
    "expected-q-rows": (_bad_expected(q=_short), ValueError, "q"),
    "expected-lengths-rows": (_bad_expected(lengths=_short), ValueError, "lengths"),
    "expected-dout-rows": (_bad_expected(dout=_short), ValueError, "dout"),
    "expected-compressed-ids-rows": (_bad_expected(compressed_ids=_short), ValueError,
                                     "compressed_ids"),
    "expected-index-scores-rows": (_bad_expected(index_scores=_short), ValueError,
                                   "index_scores"),
    "expected-index-scores-cols": (_bad_expected(index_scores=lambda t: t[:, :-1]), ValueError,
                                   "index_scores"),
    "expected-q-idx-rows": (_bad_expected(q_idx=_short), ValueError, "q_idx"),
    "expected-weights-rows": (_bad_expected(weights=_short), ValueError, "weights"),
    "expected-grad-mode": (_bad_expected(grad_mode="x"), ValueError, "grad_mode"),
    "reduce-none": (lambda: cp_reduce_partials(None, num_keys=3), TypeError, "partials"),
    "reduce-int": (lambda: cp_reduce_partials(5, num_keys=3), TypeError, "partials"),
    "reduce-empty": (lambda: cp_reduce_partials([], num_keys=3), ValueError, "partials"),
    "owned-cp-zero": (lambda: owned_group_counts(LAY, 0, ratio=4), ValueError, "cp"),
    "owned-layout": (lambda: owned_group_counts(None, 2, ratio=4), TypeError, "layout"),
    "geometry-rank": (lambda: cp_geometry(LAY, 2, 2, window=4, ratio=4), ValueError, "rank"),
    "geometry-cp-str": (lambda: cp_geometry(LAY, "2", 0, window=4, ratio=4), TypeError, "cp"),
    "geometry-layout": (lambda: cp_geometry(None, 2, 0, window=4, ratio=4), TypeError, "layout"),
    "geometry-window": (lambda: cp_geometry(LAY, 2, 0, window=None, ratio=4), TypeError,
                        "window"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_argument_raises_one_clear_error_naming_it(name):
    call, exc, arg = BAD[name]
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert type(info.value) is exc, f"{name}: {type(info.value).__name__}: {info.value}"
    assert re.search(rf"(?<![A-Za-z0-9_.]){re.escape(arg)}(?![A-Za-z0-9_])", str(info.value)), \
        f"{name}: the message does not name {arg!r}: {info.value}"
