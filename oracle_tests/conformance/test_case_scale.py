"""A case that carries its own attention scale (``Case.scale``, contract sections 6 and 8):
the judge's attention-backward bounds use it under both conventions of section 6, and the
packed layer is handed it."""
from __future__ import annotations

import dataclasses

import pytest

from dsv4_oracle import conformance
from dsv4_oracle.adapters import default_precision, load_adapter
from dsv4_oracle.fixtures import get
from dsv4_oracle.protocol import LAYER_OP
from dsv4_oracle.reference import error_model as EM
from dsv4_oracle.runner import check_case

# larger than the default D ** -0.5 = 0.177 of head dim 32: a bound computed with the default
# scale is too small for these gradients
SCALE = 0.3


def _scaled(case_id):
    return dataclasses.replace(get(case_id), name=f"{case_id}-scaled", scale=SCALE)


@pytest.mark.parametrize("convention", ["given", "recomputed"])
def test_backward_bounds_use_the_cases_scale(convention):
    case = _scaled("padding-edge-layout")
    x = case.materialize()
    o = conformance.oracle_outputs(case, x)
    p = default_precision(case.torch_dtype)
    lengths = o["lengths"]
    out_error = None
    if convention == "recomputed":
        # the judge's charge for a recomputed forward: P and out kept in the accumulator
        inner = EM.Precision(acc=p.acc, io=p.acc, stats=p.stats)
        out_error = EM.attention_forward_bound(x["q"], x["kv"], o["ids"], x["sink"], o["out"],
                                               o["lse"], precision=inner, lengths=lengths,
                                               scale=SCALE, stored=False)[0]
    b_dq = EM.attention_backward_bound(x["q"], x["kv"], o["ids"], x["sink"], o["out"], o["lse"],
                                       x["dout"], o["dq"], o["dkv"], o["dsink"], precision=p,
                                       lengths=lengths, scale=SCALE, out_error=out_error)[0]
    for factor, passes in ((0.9, True), (1.1, False)):
        got = {k: o[k] for k in ("ids", "lengths", "out", "lse", "dkv", "dsink")}
        got["dq"] = o["dq"] + factor * b_dq
        checks = conformance.judge(case, x, got, precision=p, convention=convention)
        dq = [c for c in checks if c.extra["quantity"] == "dq" and c.kind == "numeric"]
        assert [c.passed for c in dq] == [passes], (factor, [c.detail for c in dq])


def test_the_packed_layer_is_handed_the_cases_scale():
    case = _scaled("padding-edge-layout")
    out = check_case(load_adapter("gpu_impl:torch"), case, replays=0, ops=[LAYER_OP])
    assert out.passed, [(c.extra["quantity"], c.detail) for c in out.failed_checks]
    assert {c.extra["level"] for c in out.checks} == {"layer"}
    ratios = {c.extra["quantity"]: c.ratio for c in out.checks if c.ratio is not None}
    assert ratios["out"] <= 1 and ratios["dq"] <= 1
