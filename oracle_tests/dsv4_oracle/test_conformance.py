"""The conformance engine's rules (``dsv4_oracle/conformance.py``): the stage table, the two
backward conventions of contract section 6, stages judged before anything downstream of them,
checks that cannot fail reported as not judged (section 12), per-op precision, and failure
hints that say where the error concentrates."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from dsv4_oracle import fixtures
from dsv4_oracle import conformance as K
from dsv4_oracle.adapters import OPS, Adapter, GpuImplAdapter, default_precision
from dsv4_oracle.invoke import OpError
from dsv4_oracle.report import report_dict, format_summary, validate_report, write_junit
from dsv4_oracle.runner import RunResult, check_case
from dsv4_oracle.reference.error_model import Precision

from dsv4_oracle.examples.megatron_style_adapter import MegatronStyleAdapter
from oracle_tests.helpers import conformance_adapters as CA

# a CSA layer case whose bf16 out makes the "given" dq fail by a ratio of about 67 for an
# autograd-style backward (every ratio measured on the quick catalog is in docs/CHECK.md)
LAYER_CASE = fixtures.get("public-cp-worked-example")
OP_CASE = fixtures.get("lengths-above-width")          # op level, 4 heads, hostile ids


def _adapter(obj) -> Adapter:
    return Adapter(obj, name=obj.name, device="cpu")


def _judged(adapter, case, **kw):
    x = case.materialize()
    run = K.run_ops(adapter, case, x, probe=True)
    checks = K.judge(case, x, run.got, consumed=run.consumed,
                     precision=adapter.precision(case.torch_dtype), **kw)
    return run, {c.extra["quantity"]: c for c in checks if c.kind == "numeric"}, checks


# ---------------------------------------------------------------------------------------------
# the stage table
# ---------------------------------------------------------------------------------------------
def test_stage_table_is_the_pipeline():
    """One table: the adapter protocol's ops in pipeline order; every read is a case input or
    an earlier stage's output; the gradient ops are the stages after which nothing reads."""
    assert tuple(s.op for s in K.STAGES) == OPS
    written: set = set()
    inputs = {"q_idx", "k_idx", "weights", "q", "kv", "sink", "dout", "kv_cmp", "att_lengths",
              "dkv_cmp"} | set(K._CMP_IN) | set(K._IDX_IN)
    for s in K.STAGES:
        assert len(s.stored) == len(s.writes)
        for r in s.reads:
            r = K._LOSS_READS.get(r, r)           # the loss's key set and normaliser
            assert r in written or r in inputs, (s.op, r)
        written |= set(s.writes)
    read = {K._LOSS_READS.get(r, r) for s in K.STAGES if s.op not in K.BACKWARD_OPS
            for r in s.reads}
    assert {s.op for s in K.STAGES if not set(s.writes) & read} >= set(K.BACKWARD_OPS)
    assert set(K.FORWARD_OUTPUTS) <= written


def test_missing_ops_are_fed_the_oracle_rounded_as_stored():
    """An adapter with only the backward gets the oracle's ids, out and lse, stored as a kernel
    stores them (int32 ids, out in the input dtype, float32 lse); only the backward is judged."""
    class BackwardOnly(GpuImplAdapter):
        ops = ("sparse_attention_backward",)
        name = "backward only"

        def __init__(self):
            super().__init__("torch", "cpu")
    run, num, checks = _judged(_adapter(BackwardOnly()), LAYER_CASE)
    assert set(run.got) == {"dq", "dkv", "dsink"}
    con = run.consumed
    assert con["ids"].dtype == torch.int32 and con["out"].dtype == LAYER_CASE.torch_dtype
    assert con["lse"].dtype == torch.float32 and "loss" not in con
    assert {c.extra["quantity"] for c in checks} == {"dq", "dkv", "dsink", "sink_only"}
    assert all(c.passed for c in checks)


# ---------------------------------------------------------------------------------------------
# two backward conventions (contract section 6)
# ---------------------------------------------------------------------------------------------
def test_recomputed_backward_is_measured_and_judged_as_recomputed():
    """Autograd through the forward (Delta from the unrounded out) ignores the out it is
    handed: the probe measures "recomputed", and only that convention judges it."""
    ad = _adapter(CA.RecomputedBackward())
    _, given, _ = _judged(ad, LAYER_CASE, convention="given")
    assert not given["dq"].passed and given["dq"].ratio > 10
    run, num, checks = _judged(ad, LAYER_CASE)
    assert set(run.consumed[K.PROBE]) == {"out", "dq", "dkv", "dsink"}
    assert all(c.passed for c in checks), [c.detail for c in checks if not c.passed]
    for q in ("dq", "dkv", "dsink"):
        assert num[q].extra["convention"] == "recomputed"
        assert num[q].extra["convention_source"] == "probe"
    # and the report says so
    outcome = check_case(ad, LAYER_CASE, replays=0)
    assert outcome.passed
    result = RunResult(ad, "quick", (), 0, [outcome], "2026-01-01T00:00:00Z", 1.0, ad.ops)
    d = report_dict(result)
    assert d["summary"]["backward_conventions"] == {"op": {"recomputed": 1}}
    assert d["summary"]["backward_convention_sources"] == {"op": {"measured": 1}}
    assert validate_report(d) == []
    assert "op: recomputed in 1 case (measured in 1)" in format_summary(result)


def test_a_given_backward_is_measured_as_given():
    """The example's kernel-style backward uses the out it is handed: the probe says so."""
    run, num, checks = _judged(_adapter(MegatronStyleAdapter()), LAYER_CASE)
    assert all(c.passed for c in checks)
    assert {num[q].extra["convention"] for q in ("dq", "dkv", "dsink")} == {"given"}
    assert num["dq"].extra["convention_source"] == "probe"


def test_a_wrong_backward_fails_under_its_measured_convention():
    _, num, _ = _judged(_adapter(CA.WrongBackward()), LAYER_CASE)
    dq = num["dq"]
    assert not dq.passed and dq.extra["convention"] == "recomputed"
    assert dq.extra["convention_source"] == "probe"
    assert "convention" not in dq.detail        # one convention judged: no second opinion


@pytest.mark.parametrize("defect", ["Bf16DeltaBackward", "Bf16DsinkBackward"])
def test_a_given_backward_with_a_16_bit_defect_fails(defect):
    """A kernel-style backward that keeps Delta in bf16, or accumulates dsink row by row in
    bf16, is within the loose bound of the "recomputed" convention (the forward's whole
    out bound carried into Delta); the probe measures "given", and "given" judges it."""
    _, num, checks = _judged(_adapter(getattr(CA, defect)()), fixtures.get("padding-edge-layout"))
    assert num["dsink"].extra["convention"] == "given"
    assert not num["dsink"].passed and num["dsink"].ratio > 5, num["dsink"].detail


def test_an_adapter_declares_its_convention_and_the_probe_checks_it():
    class DeclaredGiven(CA.RecomputedBackward):
        backward_convention = "given"

    class DeclaredRecomputed(CA.RecomputedBackward):
        backward_convention = "recomputed"
    run, num, checks = _judged(_adapter(DeclaredGiven()), LAYER_CASE)
    assert run.consumed["backward_convention"] == "given"
    assert not num["dq"].passed and num["dq"].extra["convention_pinned"]
    (conv,) = [c for c in checks if c.extra["quantity"] == "convention"]
    assert not conv.passed and "declared 'given', measured 'recomputed'" in conv.detail
    _, num, checks = _judged(_adapter(DeclaredRecomputed()), LAYER_CASE)
    assert num["dq"].passed and num["dq"].extra["convention"] == "recomputed"
    assert all(c.passed for c in checks if c.extra["quantity"] == "convention")

    class Bogus(CA.RecomputedBackward):
        backward_convention = "kernel"
    with pytest.raises(OpError, match="backward_convention"):
        K.run_ops(_adapter(Bogus()), LAYER_CASE, LAYER_CASE.materialize())


def test_a_declared_recomputed_backward_is_judged_when_out_is_nan():
    """The recomputed convention never reads the out it is handed: a NaN out fails ``out``
    and the backward is still judged."""
    class NaNOutRecomputed(CA.RecomputedBackward):
        backward_convention = "recomputed"

        def sparse_attention_forward(self, q, kv, ids, sink, **kw):
            if torch.is_grad_enabled() and q.requires_grad:     # the backward's own forward
                return super().sparse_attention_forward(q, kv, ids, sink, **kw)
            out, lse = super().sparse_attention_forward(q, kv, ids, sink, **kw)
            out = out.clone()
            out[0, 0, 0] = float("nan")
            return out, lse
    outcome = check_case(_adapter(NaNOutRecomputed()), OP_CASE, replays=0)
    # the NaN is refused when the op returns (an unusable out), not judged numerically
    assert [c.kind for c in outcome.checks
            if c.extra["quantity"] == "out" and not c.passed] == ["error"]
    by = {c.extra["quantity"]: c for c in outcome.checks if c.kind == "numeric"}
    for q in ("dq", "dkv", "dsink"):
        assert by[q].status == "passed", by[q].detail


def test_the_packed_layer_takes_the_convention_measured_on_its_op():
    """The layer's backward takes no out: it is judged under the convention the probe measured
    on the same adapter's backward op for the case; without an op level, the closer one."""
    ad = Adapter(GpuImplAdapter("torch", "cpu"), name="gpu_impl:torch", device="cpu")
    outcome = check_case(ad, LAYER_CASE, replays=0)
    src = {(c.extra["level"], c.extra.get("convention"), c.extra.get("convention_source"))
           for c in outcome.checks if c.extra.get("quantity") == "dq" and c.kind == "numeric"}
    assert src == {("op", "given", "probe"), ("layer", "given", "probe on the op")}
    x = LAYER_CASE.materialize()
    run = K.run_layer(ad, LAYER_CASE, x)
    checks = K.judge(LAYER_CASE, x, run.got, consumed=run.consumed,
                     precision=default_precision(LAYER_CASE.torch_dtype))
    assert {c.extra.get("convention_source") for c in checks
            if c.extra.get("quantity") == "dq" and c.kind == "numeric"} == {"closest"}
    assert all(c.passed for c in checks)


# ---------------------------------------------------------------------------------------------
# each stage judged before anything downstream of it
# ---------------------------------------------------------------------------------------------
def test_nan_forward_fails_the_forward_and_the_backward_is_judged_on_the_oracles_out():
    """A NaN in out is refused when the forward returns: the forward fails, naming out, and its
    backward is fed the oracle's out (rounded) and judged on it."""
    outcome = check_case(_adapter(CA.NaNForward()), OP_CASE, replays=0)
    assert outcome.error is None
    by = {}
    for c in outcome.checks:
        by.setdefault(c.extra["quantity"], []).append(c)
    (bad,) = outcome.failed_checks
    assert (bad.name, bad.extra["quantity"]) == ("run: sparse_attention_forward", "out")
    assert bad.detail.startswith("returned an unusable out: out[0, 0] holds a non-finite value")
    assert "stood in for it downstream" in bad.detail
    for q in ("dq", "dkv", "dsink"):
        (c,) = by[q]
        assert c.status == "passed", c.detail


def test_nan_scores_fail_the_indexer_and_the_pipeline_goes_on():
    """Scores with a NaN at a visible group: the indexer fails when it returns, the oracle's
    scores stand in for them, and the adapter's downstream op is still judged."""
    class NaNScores(GpuImplAdapter):
        ops = ("indexer_scores", "sparse_attention_forward")
        name = "NaN scores"

        def __init__(self):
            super().__init__("torch", "cpu")

        def indexer_scores(self, *args):
            s = super().indexer_scores(*args)[0].clone()
            s[7, 0] = float("nan")            # row 7 sees groups 0 and 1
            return s
    case = fixtures.get("capacity-rows")
    outcome = check_case(_adapter(NaNScores()), case, replays=0)
    assert outcome.error is None
    (bad,) = outcome.failed_checks
    assert (bad.name, bad.extra["quantity"]) == ("run: indexer_scores", "scores")
    assert "scores[7, 0] = nan for a visible group with finite inputs" in bad.detail
    status = {(c.extra["quantity"], c.status) for c in outcome.checks}
    assert ("out", "passed") in status and ("lse", "passed") in status


# ---------------------------------------------------------------------------------------------
# not judged: counted, never a pass (report, JSON, JUnit)
# ---------------------------------------------------------------------------------------------
def test_not_judged_checks_are_counted_apart(tmp_path):
    ad = Adapter(GpuImplAdapter("torch", "cpu"), name="gpu_impl:torch", device="cpu")
    outcome = check_case(ad, OP_CASE, replays=0)
    nj = [c for c in outcome.checks if not c.judged]
    assert outcome.passed and nj and all(c.passed and c.status == "not_judged" for c in nj)
    result = RunResult(ad, "quick", (), 0, [outcome], "2026-01-01T00:00:00Z", 1.0, ad.ops)
    d = report_dict(result)
    assert d["schema_version"] == 2 and validate_report(d) == []
    assert d["summary"]["checks_not_judged"] == len(nj)
    statuses = [ch["status"] for ch in d["cases"][0]["checks"]]
    assert statuses.count("not_judged") == len(nj) and "failed" not in statuses
    json.dumps(d, allow_nan=False)
    bad = json.loads(json.dumps(d))
    bad["cases"][0]["checks"][0]["status"] = "failed"
    assert any("contradicts" in p for p in validate_report(bad))
    bad = json.loads(json.dumps(d))
    bad["summary"]["checks_not_judged"] = 0
    assert any("checks_not_judged" in p for p in validate_report(bad))
    write_junit(result, str(tmp_path / "j.xml"))
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert suite.get("skipped") == str(len(nj)) and suite.get("failures") == "0"
    assert len(suite.findall("testcase/skipped")) == len(nj)
    assert f"({len(nj)} not judged)" in format_summary(result)


# ---------------------------------------------------------------------------------------------
# per-op precision
# ---------------------------------------------------------------------------------------------
def test_judge_takes_a_precision_per_op():
    ad = Adapter(GpuImplAdapter("torch", "cpu"), name="gpu_impl:torch", device="cpu")
    x = OP_CASE.materialize()
    run = K.run_ops(ad, OP_CASE, x)
    typical = default_precision(OP_CASE.torch_dtype)
    per_op = {op: typical for op in OPS}
    per_op["sparse_attention_forward"] = Precision.of(torch.float64)    # claims float64 out
    per_op["sparse_attention_backward"] = lambda dtype: default_precision(dtype)
    checks = K.judge(OP_CASE, x, run.got, consumed=run.consumed, precision=per_op)
    failed = {c.extra["quantity"] for c in checks if not c.passed}
    assert "out" in failed and not failed & {"dq", "dkv", "dsink"}
    with pytest.raises(ValueError, match="sparse_attention_backward"):
        K.judge(OP_CASE, x, run.got, precision={"sparse_attention_forward": typical})
    with pytest.raises(TypeError, match="precision"):
        K.judge(OP_CASE, x, run.got, precision="bf16")


# ---------------------------------------------------------------------------------------------
# failure hints
# ---------------------------------------------------------------------------------------------
def test_concentration_hint_names_head_document_padding_and_trailing_columns():
    lay = fixtures.get("capacity-rows").layout()
    T = lay.num_rows
    over = torch.zeros(T, 4, 8, dtype=torch.bool)
    over[:3, 2, 1] = True
    over[5, 2, 0] = True
    doc0_end = int(lay.cu_seqlens_padded[1])
    assert doc0_end > 5
    hint = K.concentration_hint(over, ("row", "head", "col"), lay)
    assert hint == f"all 4 over-bound elements in document 0 (rows 0..{doc0_end - 1}), in head 2"
    pad = torch.nonzero(~lay.is_real).flatten()
    assert pad.numel() >= 2
    over = torch.zeros(T, 4, 8, dtype=torch.bool)
    over[pad, :, 6:] = True
    hint = K.concentration_hint(over, ("row", "head", "col"), lay)
    assert "padding/capacity rows" in hint and "the last 2 of 8 columns" in hint
    assert "head" not in hint
    spread = torch.zeros(T, 4, 8, dtype=torch.bool)
    spread[0, 0, 0] = spread[T - 1, 3, 0] = True
    spread[int(torch.nonzero(lay.is_real)[-1]), 1, 7] = True
    assert K.concentration_hint(spread, ("row", "head", "col"), lay) is None
    assert K.concentration_hint(torch.zeros(4, dtype=torch.bool), ("head",)) is None
    one = torch.zeros(4, dtype=torch.bool)
    one[1] = True
    assert K.concentration_hint(one, ("head",)) is None              # a single element
    with pytest.raises(ValueError, match="axes"):
        K.concentration_hint(one, ("row", "head"))


def test_a_failure_in_one_head_says_so():
    _, num, _ = _judged(_adapter(CA.PerturbedHead()), OP_CASE)
    out = num["out"]
    assert not out.passed and "over-bound elements in head 1" in out.detail, out.detail
    assert out.extra["concentration"].startswith("all ")


# ---------------------------------------------------------------------------------------------
# contract section 8: no gradient reaches q, kv or the sink through the indexer loss
# ---------------------------------------------------------------------------------------------
class _LeakyTeacherLayer(GpuImplAdapter):
    """The torch layer whose loss keeps its value but lets a small gradient reach ``q``
    (as an attached teacher does): far below the ``dq`` bound of a bf16 case."""

    def csa_layer(self, q, kv, sink, layout, **kwargs):
        res = super().csa_layer(q, kv, sink, layout, **kwargs)
        real = layout.is_real.to(q.device)
        leak = 1e-6 * q.float()[real].square().sum()             # real rows only
        return res._replace(loss=res.loss + (leak - leak.detach()))


@pytest.mark.parametrize("leaky", [False, True], ids=["detached", "leaky"])
def test_the_loss_alone_must_give_exact_zeros_on_q_kv_sink(leaky):
    cls = _LeakyTeacherLayer if leaky else GpuImplAdapter
    ad = Adapter(cls("torch", "cpu"), name="layer", device="cpu")
    case = fixtures.get("padding-edge-layout")
    x = case.materialize()
    run = K.run_layer(ad, case, x)
    checks = K.judge(case, x, run.got, consumed=run.consumed,
                     precision=default_precision(case.torch_dtype))
    detached = {c.name: c for c in checks if c.extra["quantity"] == "loss_detached"}
    assert sorted(detached) == ["loss alone: dkv == 0", "loss alone: dq == 0",
                                "loss alone: dsink == 0"]
    assert [n for n, c in detached.items() if not c.passed] == (
        ["loss alone: dq == 0"] if leaky else [])
    # the leak is invisible to the combined dq (out and loss backpropagated together)
    assert all(c.passed for c in checks if c.extra["quantity"] != "loss_detached")


@pytest.mark.parametrize("elements", [1, 7, 1 << 30])
def test_error_ratio_map_is_the_same_in_any_chunking(monkeypatch, elements):
    import dsv4_oracle.compare as C
    from dsv4_oracle.conformance import error_ratio_map
    g = torch.Generator().manual_seed(3)
    e = torch.randn(6, 2, 5, dtype=torch.float64, generator=g)
    a = e + 1e-3 * torch.randn(e.shape, dtype=torch.float64, generator=g)
    a[2, 1, 4] = math.nan
    b = torch.full((5,), 1e-3, dtype=torch.float64)
    whole = error_ratio_map(a, e, b)
    monkeypatch.setattr(C, "_COMPARE_ELEMENTS", elements)
    got = error_ratio_map(a, e, b)
    assert torch.equal(got, whole) and got.shape == (6, 2) and got[2, 1] == math.inf
    assert torch.equal(error_ratio_map(a[:, 0, 0], e[:, 0, 0], b[0]),
                       C.error_ratios(a[:, 0, 0], e[:, 0, 0], b[0]).unsqueeze(1))
    assert error_ratio_map(a[:0], e[:0], b).shape == (0, 2)
