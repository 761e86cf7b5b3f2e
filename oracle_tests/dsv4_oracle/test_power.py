"""The power table (``dsv4_oracle.power``): element classes and thresholds on hand-made
tensors, and one catalog case end to end."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle import power as P


def test_classes_and_thresholds():
    expected = torch.tensor([2.0, -4.0, 0.0, 1.0, math.inf, 3.0])
    bound = torch.tensor([0.01, 0.02, 0.0, 1.5, 0.1, 0.0])
    r = P.power_of("c", "q", expected, bound)
    assert (r.elements, r.judged, r.exact, r.ill_conditioned, r.ill_zeros, r.nonfinite) == \
        (6, 2, 2, 1, 0, 1)
    assert r.min_threshold == pytest.approx(0.005)
    assert r.max_threshold == pytest.approx(0.005)
    assert r.meets_target


def test_a_bound_as_large_as_the_value_is_not_judged():
    r = P.power_of("c", "q", torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1e-9]))
    assert r.judged == 0 and r.ill_conditioned == 2 and r.ill_zeros == 1
    assert r.min_threshold is None
    assert not r.meets_target
    assert P.exceptions([r]) == [r]


def test_one_case_end_to_end(tmp_path):
    rows = P.case_power(fixtures.get("padding-edge-layout"))
    names = [r.quantity for r in rows]
    # a CSA layer case from given compressed keys has every quantity but the compressor's
    assert names == [q for q in P.QUANTITIES if "cmp" not in q and "idx_" not in q
                     and q != "k_idx"]
    cmp_names = [r.quantity for r in P.case_power(fixtures.get("compressor-cp2-saturated"))]
    assert cmp_names == list(P.QUANTITIES)       # a compressor case has every quantity
    out = {r.quantity: r for r in rows}
    # lse is float32 statistics: its check sees far below 1%
    assert out["lse"].min_threshold < 1e-4
    for r in rows:
        assert r.judged + r.exact + r.ill_conditioned + r.nonfinite == r.elements
    assert P.main(["--case", "window-only", "--json", str(tmp_path / "p.json")]) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert {d["quantity"] for d in data} == {"out", "lse", "dq", "dkv", "dsink"}


def test_unknown_case_is_a_usage_error(capsys):
    assert P.main(["--case", "no-such-case"]) == 2
    assert "matches no case" in capsys.readouterr().err
