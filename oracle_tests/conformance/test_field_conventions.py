"""The checker against the conventions public DSv4 references use (``field_adapters``).

Each test runs one adapter of :mod:`oracle_tests.helpers.field_adapters` through the engine of
``dsv4-oracle check`` (:func:`dsv4_oracle.runner.run_check`) on the few catalog cases that
exercise its convention:

- must pass: ``-1``-padded ids with ``topk_length``; a float32 reference (tighter bounds, io
  float32); CSA rows built per row from the document position; a finite-only sink judged only
  on the cases it declares it supports, and the same code with ``+-inf`` mapped to ``+-``
  float32 max on every sink case; a radix-order Top-K on every tie case but signed zeros; the
  forward of the autograd-recomputed adapter, and its backward judged against the oracle
  evaluated on the ``out`` it recomputed (contract section 6, "recomputed" convention);
- must fail, on the named quantity: scale ``v_dim ** -0.5``, a dropped sink, an ignored
  ``topk_length``, a window off by one, an ``lse`` that includes the sink, ``+0`` ranked above
  ``-0`` (the documented difference of cuDNN's Top-K: it fails on the signed-zero case only);
- the autograd-recomputed backward passes the whole check under the "recomputed" convention of
  contract section 6;
- the field's float32 indexer loss passes on finite, ``-inf`` and mixed sinks (a ``+inf`` head
  silences only itself) and on a row without teacher mass (``predict`` is the student softmax);
  run on ``sink-large``, which it declares it cannot take (its teacher underflows to 0), it
  fails: the section 8 teacher and its bound are exact at huge sinks;
- a NaN in the forward's ``out`` is reported as ``out`` when the adapter also has the backward.
"""
from __future__ import annotations

import pytest

from dsv4_oracle import fixtures
from dsv4_oracle import conformance
from dsv4_oracle.adapters import Adapter
from dsv4_oracle.runner import run_check
from oracle_tests.helpers import field_adapters as FA

FINITE_SINK_MODES = ("normal", "large", "log_k")


def _adapter(cls) -> Adapter:
    obj = cls()
    return Adapter(obj, name=obj.name, spec=f"oracle_tests.helpers.field_adapters:{cls.__name__}")


def supports(adapter: Adapter, case) -> bool:
    """Whether ``adapter`` declares that it takes ``case``: an adapter with ``sinks = "finite"``
    takes only cases whose sinks are all finite; one with ``sinks = "not-huge"`` no case whose
    every head has the ``2.4e38`` sink."""
    sinks = getattr(adapter.target, "sinks", "any")
    if sinks == "finite":
        return case.sink in FINITE_SINK_MODES
    if sinks == "not-huge":
        return case.sink != "large"
    return True


def _check(cls, case_ids, **kw):
    adapter = _adapter(cls)
    cases = [fixtures.get(c) for c in case_ids]
    assert all(supports(adapter, c) for c in cases), "a case the adapter does not take"
    return run_check(adapter, cases, replays=kw.pop("replays", 0), **kw)


def _failures(result) -> dict:
    """quantity -> sorted case ids with a failing check of that quantity."""
    out: dict = {}
    for o in result.outcomes:
        assert o.error is None, o.error
        for c in o.failed_checks:
            out.setdefault(c.extra["quantity"], set()).add(o.case.id)
    return {k: sorted(v) for k, v in out.items()}


def _assert_passes(result):
    assert result.passed, f"{result.adapter.name}: {_failures(result)}"
    judged = {c.extra["quantity"] for o in result.outcomes for c in o.checks}
    assert judged - {"run", "replays", "grad_modes", "no_mutation"}, "nothing was judged"


# ---------------------------------------------------------------------------------------------
# must pass
# ---------------------------------------------------------------------------------------------
LENGTH_CASES = ["hostile-ids-mixed-lengths", "lengths-negative", "lengths-above-width",
                "all-invalid-rows", "sink-mixed"]


def test_minus_one_ids_with_topk_length_pass():
    _assert_passes(_check(FA.MinusOnePaddedAdapter, LENGTH_CASES))


def test_float32_reference_passes_under_float32_bounds():
    res = _check(FA.Float32Adapter, ["hostile-ids-no-lengths", "sink-large", "capacity-rows",
                                     "dtype-float64"])
    _assert_passes(res)
    assert all(p["io"] == "torch.float32" for o in res.outcomes for p in o.precision.values())


def test_per_row_csa_rows_pass():
    _assert_passes(_check(FA.FieldRowsAdapter, ["padding-edge-layout", "hca-ratio128",
                                                "window-only", "no-compressed-groups"]))


def test_finite_only_sink_is_judged_on_the_cases_it_supports():
    adapter = _adapter(FA.FiniteSinkAdapter)
    sink_cases = [c for c in fixtures.catalog() if "sinks" in c.categories]
    taken = [c for c in sink_cases if supports(adapter, c)]
    assert {c.sink for c in taken} <= set(FINITE_SINK_MODES)
    assert {c.sink for c in sink_cases} - {c.sink for c in taken} >= {"pos_inf", "neg_inf",
                                                                     "mixed"}
    res = run_check(adapter, taken, replays=0)
    _assert_passes(res)


def test_finite_only_sink_run_on_an_unsupported_case_fails_loudly():
    """Declaring is what keeps it out: run anyway, it fails the ``run`` check with its reason
    (never a silent NaN)."""
    res = run_check(_adapter(FA.FiniteSinkAdapter), [fixtures.get("sink-pos-inf")], replays=0)
    bad = res.outcomes[0].failed_checks
    assert [c.extra["quantity"] for c in bad] == ["run"]
    assert "finite sinks only" in bad[0].detail


def test_finite_only_sink_mapped_takes_every_sink_case():
    _assert_passes(_check(FA.FiniteSinkMappedAdapter,
                          ["sink-pos-inf", "sink-neg-inf", "sink-mixed", "sink-large"]))


def test_radix_order_topk_passes_every_tie_case_but_signed_zeros():
    _assert_passes(_check(FA.RadixOrderTopkAdapter, ["zero-score-ties", "near-ties",
                                                     "public-det-topk-ties"]))


# ---------------------------------------------------------------------------------------------
# the autograd-recomputed backward (contract section 6: Delta from its own unrounded out)
# ---------------------------------------------------------------------------------------------
RECOMPUTED_CASES = ["capacity-rows", "duplicate-ids", "sink-mixed", "hca-ratio128"]


@pytest.mark.parametrize("case_id", RECOMPUTED_CASES)
def test_autograd_backward_is_right_under_the_recomputed_convention(case_id):
    """Its forward passes as is; its backward passes when the oracle's backward is evaluated
    on the float32 ``out``/``lse`` it recomputed (what the "recomputed" convention means)."""
    case = fixtures.get(case_id)
    adapter = _adapter(FA.AutogradBackwardAdapter)
    x = case.materialize(device="cpu")
    run = conformance.run_ops(adapter, case, x)
    prec = adapter.precision(case.torch_dtype)
    fwd = conformance.judge(case, x, {k: run.got[k] for k in ("out", "lse")}, precision=prec,
                            consumed=run.consumed)
    assert all(c.passed for c in fwd), [c for c in fwd if not c.passed]
    ids, lengths = run.consumed.get("ids", x.get("ids")), x.get("lengths")
    if case.is_layer:
        lengths = run.consumed["lengths"] if case.lengths == "layer" else None
    out32, lse32, _ = adapter.target.recompute(x["q"], x["kv"], ids, x["sink"],
                                               v_dim=case.v_dim, lengths=lengths)
    consumed = dict(run.consumed, out=out32.detach(), lse=FA._contract_lse(lse32.detach()))
    bwd = conformance.judge(case, x, {k: run.got[k] for k in ("dq", "dkv", "dsink")},
                            precision=prec, consumed=consumed)
    assert {c.extra["quantity"] for c in bwd} >= {"dq", "dkv", "dsink"}
    assert all(c.passed for c in bwd), [(c.name, c.ratio) for c in bwd if not c.passed]


def test_autograd_backward_passes_the_check():
    _assert_passes(_check(FA.AutogradBackwardAdapter, RECOMPUTED_CASES))


# ---------------------------------------------------------------------------------------------
# must fail
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, case_ids, quantities", [
    (FA.ValueDimScaleAdapter, ["v-dim-smaller"], {"out", "lse", "dq", "dkv"}),
    (FA.DroppedSinkAdapter, ["capacity-rows", "sink-log-k"], {"out"}),
    (FA.IgnoredLengthsAdapter, ["hostile-ids-mixed-lengths", "lengths-negative"],
     {"out", "lse", "sink_only"}),
    (FA.WindowOffByOneAdapter, ["padding-edge-layout", "window-only"], {"ids", "lengths"}),
    # its lse is finite on rows without a key: refused when the forward returns
    (FA.LseWithSinkAdapter, ["capacity-rows", "sink-log-k"], {"lse"}),
    (FA.RadixOrderTopkAdapter, ["signed-zero-ties"], {"cmp_ids"}),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_must_fail_controls_fail_on_every_case(cls, case_ids, quantities):
    res = _check(cls, case_ids)
    fails = _failures(res)
    assert not res.passed
    for q in quantities:
        assert fails.get(q) == sorted(case_ids), (q, fails)
    # a wrong forward may also fail the backward judged on it (dq, dkv, dsink); nothing else
    assert set(fails) <= quantities | {"sink_only", "dq", "dkv", "dsink"}, fails


def test_must_fail_controls_pass_where_their_mistake_does_not_matter():
    """The same code is right where its mistake has no effect (so each failure above is the
    mistake, not the adapter): the scale where ``v_dim == D``, the lengths where there are
    none, the sink where it is ``-inf``."""
    _assert_passes(_check(FA.ValueDimScaleAdapter, ["capacity-rows"]))
    _assert_passes(_check(FA.IgnoredLengthsAdapter, ["hostile-ids-no-lengths"]))
    _assert_passes(_check(FA.DroppedSinkAdapter, ["sink-neg-inf"]))
    _assert_passes(_check(FA.LseWithSinkAdapter, ["sink-neg-inf"]))


def test_a_nan_forward_is_reported_as_out_when_the_adapter_has_a_backward():
    """Ignoring ``topk_length`` on ``nan-poison-hostile-ids`` attends NaN-poisoned key rows:
    ``out`` must fail as ``out`` (as it does for a forward-only adapter), not as a judge
    error."""
    res = _check(FA.IgnoredLengthsAdapter, ["nan-poison-hostile-ids"])
    assert "out" in _failures(res)


# ---------------------------------------------------------------------------------------------
# the indexer loss with the field's absolute float32 teacher (contract section 8)
# ---------------------------------------------------------------------------------------------
def test_field_indexer_loss_passes():
    _assert_passes(_check(FA.FieldIndexerLossAdapter, ["capacity-rows", "public-dev-csa-r4",
                                                       "coeff-zero", "sink-neg-inf"]))


def test_field_indexer_loss_passes_with_one_head_silenced():
    _assert_passes(_check(FA.FieldIndexerLossAdapter, ["sink-mixed"]))


def test_field_indexer_loss_predict_on_rows_without_teacher_mass():
    _assert_passes(_check(FA.FieldIndexerLossAdapter, ["sink-pos-inf"]))


def test_an_underflowed_teacher_does_not_pass_on_huge_sinks():
    """The absolute float32 teacher underflows to exactly 0 when every head's sink is 2.4e38:
    loss, KL and teacher all 0 where the contract's are not. Run on the case it declares it
    cannot take, it must fail."""
    adapter = _adapter(FA.FieldIndexerLossAdapter)
    case = fixtures.get("sink-large")
    assert not supports(adapter, case)
    res = run_check(adapter, [case], replays=0)
    got = conformance.run_ops(adapter, case, case.materialize()).got
    assert float(got["target"].abs().max()) == 0.0            # the teacher did underflow
    assert {"loss", "kl", "target"} & set(_failures(res))
