"""What a failing check says is wrong (``dsv4_oracle/hints.py``), from the error pattern:

- exactly 0 everywhere, a flipped sign, a constant factor (named when it is a square root, as a
  softmax scale is), exactly 0 wherever it is wrong, NaN where the oracle is finite; none for an
  error without a pattern;
- the forward's sink negated or ignored (the judge compares ``out`` with the oracle on such a
  sink);
- per failing quantity, one line in the terminal summary;
- a check of values the contract makes exactly 0 says "expected exactly 0", without counting
  the failing elements as not judged.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle.adapters import Adapter, GpuImplAdapter
from dsv4_oracle.compare import compare_numeric
from dsv4_oracle.hints import Pattern, nonfinite_pattern, pattern_lines, what_is_wrong
from dsv4_oracle.report import format_summary
from dsv4_oracle.runner import run_check

E = torch.linspace(-2.0, 3.0, 24, dtype=torch.float64).reshape(4, 6) + 0.01
B = torch.full_like(E, 1e-3)


@pytest.mark.parametrize("actual, key, words", [
    (torch.zeros_like(E), "zero", "exactly 0 everywhere"),
    (-E, "sign", "-x is within the bound everywhere"),
    (2 * E, "factor", "2 times the oracle's"),
    (E / math.sqrt(512), "factor", "(1/sqrt(512)?)"),
    (torch.where(E > 1, torch.zeros_like(E), E), "zero_where_wrong", "0 wherever it is wrong"),
])
def test_the_error_pattern_names_what_is_wrong(actual, key, words):
    p = what_is_wrong("x", actual, E, B)
    assert p is not None and p.key == key and words in p.phrase, p


def test_an_error_without_a_pattern_names_nothing():
    noise = E + torch.linspace(-1, 1, E.numel(), dtype=E.dtype).reshape(E.shape) ** 3
    assert what_is_wrong("x", noise, E, B) is None
    assert what_is_wrong("x", E + 1, torch.zeros_like(E), B) is None   # nothing to scale


def test_non_finite_patterns():
    a = E.clone()
    a[1, 2] = math.nan
    assert nonfinite_pattern("out", a, E).key == "nan"
    a[1, 2] = math.inf
    assert nonfinite_pattern("out", a, E).key == "inf"
    e = E.clone()
    e[0, 0] = math.inf
    assert nonfinite_pattern("lse", E, e).key == "finite"


def test_pattern_lines_take_the_most_common_pattern_per_quantity():
    z = Pattern("zero", "dsink is exactly 0")
    s = Pattern("sign", "flipped")
    lines = pattern_lines([("dsink", z), ("dsink", z), ("dsink", s), ("dq", None)])
    assert lines == ["dsink: dsink is exactly 0 (2 of 3 failing checks)"]


def test_a_check_of_exact_zeros_says_expected_exactly_0():
    """The values the contract makes 0 (a -inf sink's gradient): bound ~1e-38, so every
    element is ill-conditioned; an error there fails, and reads as what it is."""
    zero = torch.zeros(4, dtype=torch.float64)
    res = compare_numeric("dsink", torch.full((4,), 1e-3, dtype=torch.float64), zero,
                          torch.full((4,), 1.18e-38))
    assert not res.passed
    assert res.detail.startswith("expected exactly 0 everywhere; actual 0.001 at [0]")
    assert "not judged" not in res.detail and "4 of 4 elements over their bound" in res.detail


class _Forward(GpuImplAdapter):
    """The torch backend with the forward's sink replaced."""

    ops = ("sparse_attention_forward",)
    sink = staticmethod(lambda s: s)

    def sparse_attention_forward(self, q, kv, ids, sink, **kw):
        return super().sparse_attention_forward(q, kv, ids, self.sink(sink), **kw)


class NegatedSink(_Forward):
    sink = staticmethod(lambda s: -s)


class IgnoredSink(_Forward):
    sink = staticmethod(lambda s: torch.full_like(s, -math.inf))


class ZeroSinkGrad(GpuImplAdapter):
    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def sparse_attention_backward(self, *args, **kw):
        dq, dkv, dsink = super().sparse_attention_backward(*args, **kw)[:3]
        return dq, dkv, torch.zeros_like(dsink)


def _run(obj, *ids):
    a = Adapter(obj, name=type(obj).__name__)
    return run_check(a, [fixtures.get(i) for i in ids], replays=0)


@pytest.mark.parametrize("adapter, phrase", [
    (NegatedSink, "out matches the oracle with the sink negated: the sink enters with the "
                  "wrong sign"),
    (IgnoredSink, "out matches the oracle without a sink: the sink is ignored")])
def test_a_forward_with_a_wrong_sink_is_named(adapter, phrase):
    result = _run(adapter(), "capacity-rows")
    out = [c for o in result.outcomes for c in o.failed_checks if c.extra["quantity"] == "out"]
    assert out and out[0].detail.endswith(phrase), out[0].detail
    assert f"  out: {phrase} (1 of 1 failing check)" in format_summary(result).splitlines()


def test_the_summary_says_a_forgotten_sink_gradient_is_exactly_0():
    text = format_summary(_run(ZeroSinkGrad(), "capacity-rows", "lengths-above-width"))
    lines = text.splitlines()
    i = lines.index("what is wrong, from the error pattern of the failing checks:")
    assert lines[i + 1] == ("  dsink: dsink is exactly 0 everywhere and the oracle's is not: "
                            "never computed, or never written? (2 of 2 failing checks)")


class Bf16Statistics(GpuImplAdapter):
    """The torch backend's forward with its lse rounded through bfloat16 (statistics kept in
    bfloat16)."""

    ops = ("sparse_attention_forward",)

    def sparse_attention_forward(self, *args, **kw):
        out, lse = super().sparse_attention_forward(*args, **kw)[:2]
        return out, lse.to(torch.bfloat16).to(torch.float32)


def test_a_forward_with_bfloat16_statistics_is_named():
    result = _run(Bf16Statistics(), "capacity-rows")
    (lse,) = [c for o in result.outcomes for c in o.failed_checks]
    assert lse.extra["quantity"] == "lse" and lse.extra["pattern"] == "bf16_accumulation"
    assert lse.detail.endswith("lse is within the bounds of bfloat16 accumulation: the kernel "
                               "accumulates (or keeps its statistics) in bfloat16 where float32 "
                               "is assumed")
