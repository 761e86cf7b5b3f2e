"""The Megatron-style DSA adapter (``examples/megatron_dsa_adapter.py``) as a must-pass control
of the named policies of contract section 5.2.

- Under the policies it declares (Megatron-Core's choices by default; the sparse loss over
  real tokens; the contract's defaults) it passes every DSA case of the quick catalog and the
  CSA cases it is run on here;
- each non-default policy value it implements, configured alone and judged under the
  contract's defaults (``check --policy default``: the declaration forgotten), fails on the
  quantities that policy governs, on two quick cases; declared, it passes on the same cases;
- the loss gradient's op is told which rows count when padding rows attend under
  ``loss_norm="real"`` (per-row divisors), so an implementation can follow that policy;
- a judging cache shared across policies keeps their oracle results apart; a NaN-poisoned
  layout does not apply when padding rows attend (``conformance.not_applicable``: they see
  its poisoned keys);
- a bad configuration is a ``TypeError`` / ``ValueError`` naming it.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import conformance
from dsv4_oracle.adapters import Adapter
from dsv4_oracle.examples.megatron_dsa_adapter import (MEGATRON_POLICIES, MegatronDSAAdapter,
                                                       MegatronDSASparseReal)
from dsv4_oracle.fixtures import get
from dsv4_oracle.protocol import OPS
from dsv4_oracle.reference.contract_policies import DEFAULT_POLICIES, POLICIES
from dsv4_oracle.runner import _op_failed, check_case, level_precision, quick_ids

DSA_QUICK = sorted(c for c in quick_ids() if c.startswith("dsa-"))
# CSA cases of the quick catalog the configurations below are run on (padding, sinks of every
# kind, exact ties, the spread scores); the poisoned layouts are left out under
# padding_rows="attend" (padding rows then see the NaN keys their premise keeps unselectable)
CSA_CASES = ["padding-edge-layout", "sink-mixed", "indexer-score-spread"]
_CACHE: dict = {}          # per case: the oracle's results, shared by the configurations


def verdict(obj, case_id: str, *, declared: bool = True, ops=None) -> dict:
    """quantity -> failing check details of ``obj`` (an adapter object) on one case, at op
    level, judged under its declared policies or, with ``declared=False``, under the
    contract's defaults (the declaration forgotten, as ``check --policy default`` does).
    ``ops``: run only these ops of the adapter."""
    adapter = Adapter(obj, name=obj.name, spec="megatron_dsa_adapter")
    if not declared:
        adapter.set_policies({}, forget_declared=True)
    case = get(case_id)
    x = case.materialize()
    run = conformance.run_ops(adapter, case, x, ops=ops, policies=adapter.policies)
    checks = conformance.judge(case, x, run.got, consumed=run.consumed,
                               precision=level_precision(adapter, case.torch_dtype, "op"),
                               cache=_CACHE.setdefault(case_id, {}), policies=adapter.policies)
    # an output the contract's rules refuse when the op returns fails as that quantity
    checks += [_op_failed(e, "op") for e in run.failed.values()]
    want = {"cmp_ids", "out", "dq", "loss"} | ({"scores"} if case.scores == "indexer" else set())
    assert {c.extra["quantity"] for c in checks} >= want
    assert ops is not None or case.scores != "indexer" or \
        "dq_idx" in {c.extra["quantity"] for c in checks}
    out: dict = {}
    for c in checks:
        if not c.passed:
            out.setdefault(c.extra["quantity"], []).append(c.detail)
    return out


def test_the_dsa_quick_cases_are_the_ones_named_here():
    assert {"dsa-padded", "dsa-score-spread", "dsa-zero-ties"} <= set(DSA_QUICK)


@pytest.mark.parametrize("case_id", DSA_QUICK)
@pytest.mark.parametrize("cls", [MegatronDSAAdapter, MegatronDSASparseReal])
def test_passes_every_dsa_quick_case_under_its_declared_policies(cls, case_id):
    assert verdict(cls(), case_id) == {}


@pytest.mark.parametrize("case_id", CSA_CASES)
def test_megatron_configuration_passes_csa_cases(case_id):
    assert verdict(MegatronDSAAdapter(), case_id) == {}


@pytest.mark.parametrize("case_id", DSA_QUICK + ["sink-mixed", "nan-poison-layer"])
def test_contract_default_configuration_passes(case_id):
    assert verdict(MegatronDSAAdapter(**DEFAULT_POLICIES), case_id) == {}


# (policy, value) -> (the quantities it governs, two quick cases where it changes them)
KILLS = {
    ("loss_norm", "rows"): ({"loss", "dq_idx", "dw", "dk_idx"}, ["dsa-padded", "dsa-score-spread"]),
    ("padding_rows", "attend"): ({"scores"}, ["dsa-padded", "dsa-score-spread"]),
    ("topk_ties", "any"): ({"cmp_ids"}, ["dsa-padded", "dsa-zero-ties"]),
    ("index_scale", "dim_heads"): ({"scores", "dq_idx", "dw", "dk_idx"},
                                   ["dsa-zero-ties", "dsa-score-spread"]),
    ("index_grad", "exact"): ({"dq_idx", "dw", "dk_idx"},
                              ["dsa-score-spread", "indexer-score-spread"]),
    ("index_grad", "autograd"): ({"dq_idx", "dw", "dk_idx"},
                                 ["dsa-score-spread", "indexer-score-spread"]),
    ("kl_form", "log_softmax"): ({"loss", "kl"}, ["dsa-score-spread", "indexer-score-spread"]),
    ("teacher", "dense"): ({"loss", "kl", "target", "predict"}, ["dsa-padded", "dsa-zero-ties"]),
}


def test_every_non_default_value_the_adapter_implements_is_covered():
    implemented = {(n, v) for n, p in POLICIES.items() for v in p.values
                   if v != p.default and (n, v) != ("loss_norm", "rank_mean")}
    assert set(KILLS) == implemented
    assert set(MEGATRON_POLICIES.items()) - set(DEFAULT_POLICIES.items()) <= set(KILLS)


@pytest.mark.parametrize("policy,value", sorted(KILLS))
def test_an_undeclared_policy_fails_on_what_it_governs(policy, value):
    governed, cases = KILLS[(policy, value)]
    obj = MegatronDSAAdapter(**{**DEFAULT_POLICIES, policy: value})
    assert obj.policies == {**DEFAULT_POLICIES, policy: value}
    # the dense teacher's target [T, C] does not pair with the Top-K ids its gradient op is
    # handed under the defaults: that op rejects them (a ValueError), so it is left out here
    ops = [o for o in OPS if o != "sparse_indexer_loss_grad"] \
        if (policy, value) == ("teacher", "dense") else None
    for case_id in cases:
        failed = verdict(obj, case_id, declared=False, ops=ops)
        assert set(failed) & governed, (case_id, failed)
        assert set(failed) <= governed | {"cmp_ids", "loss", "kl", "target", "predict",
                                          "dq_idx", "dw", "dk_idx"}, (case_id, failed)
        assert verdict(obj, case_id) == {}, case_id


def test_padding_rows_that_attend_under_real_token_normalisation():
    # the gradient's op is told the per-row divisors (padding rows do not count): followed,
    # it passes; a gradient that counts the padding rows (the int N alone) fails dq_idx
    obj = MegatronDSAAdapter(loss_norm="real")
    assert verdict(obj, "dsa-padded") == {}
    told = conformance._row_divisors(get("dsa-padded"), obj.policies)["num_real"]
    lay = get("dsa-padded").layout()
    assert torch.equal(torch.isfinite(told), lay.is_real)
    assert bool((told[lay.is_real] == lay.num_real).all())

    class CountsPadding(MegatronDSAAdapter):
        def sparse_indexer_loss_grad(self, *args, coeff, num_real):
            return super().sparse_indexer_loss_grad(*args, coeff=coeff,
                                                    num_real=lay.num_real)
    assert {"dq_idx", "dw", "dk_idx"} <= set(verdict(CountsPadding(loss_norm="real"),
                                                     "dsa-padded"))


def test_a_cache_shared_by_judgings_under_other_policies_keeps_them_apart():
    # the oracle's scores differ between the padding policies only through the layout it is
    # evaluated on: a cache filled under the defaults must not answer the declared judging
    obj = MegatronDSAAdapter(**{**DEFAULT_POLICIES, "padding_rows": "attend"})
    case = get("dsa-padded")
    x = case.materialize()
    cache: dict = {}
    verdicts = []
    for declared in (False, True):
        adapter = Adapter(obj, name=obj.name, spec="megatron_dsa_adapter")
        if not declared:
            adapter.set_policies({}, forget_declared=True)
        run = conformance.run_ops(adapter, case, x, ops=["indexer_scores"],
                                  policies=adapter.policies)
        checks = conformance.judge(case, x, run.got, consumed=run.consumed, cache=cache,
                                   precision=level_precision(adapter, case.torch_dtype, "op"),
                                   policies=adapter.policies)
        checks += [_op_failed(e, "op") for e in run.failed.values()]
        verdicts.append([c.passed for c in checks if c.extra["quantity"] == "scores"])
    assert verdicts == [[False], [True]]


def test_a_poisoned_layout_does_not_apply_when_padding_rows_attend():
    # dsa-nan-poison keeps its NaN key rows unselectable by real rows only: padding rows that
    # attend see them (the oracle's scores of those rows are NaN); under the defaults the
    # Megatron-style adapter passes it
    case = get("dsa-nan-poison")
    assert "padding_rows=attend" in conformance.not_applicable(case, MEGATRON_POLICIES)
    assert conformance.not_applicable(case, DEFAULT_POLICIES) is None
    assert conformance.not_applicable(get("dsa-padded"), MEGATRON_POLICIES) is None
    assert verdict(MegatronDSAAdapter(**DEFAULT_POLICIES), "dsa-nan-poison") == {}


def test_bad_configurations_name_the_argument():
    with pytest.raises(TypeError, match="unknown policy argument 'loss_normalisation'"):
        MegatronDSAAdapter(loss_normalisation="rows")
    with pytest.raises(ValueError, match="loss_norm.*has no value 'tokens'"):
        MegatronDSAAdapter(loss_norm="tokens")
    with pytest.raises(ValueError, match="rank_mean.*context parallelism"):
        MegatronDSAAdapter(loss_norm="rank_mean")
    assert MegatronDSAAdapter().policies == MEGATRON_POLICIES
    assert MegatronDSASparseReal().policies == {**MEGATRON_POLICIES, "teacher": "sparse",
                                                "loss_norm": "real"}


def test_check_leaves_a_case_the_declared_policies_void_unjudged():
    # dsv4-oracle check of an adapter declaring padding_rows="attend": the poisoned layouts are
    # one not-judged check each (named, with the reason), not a failure; under the defaults the
    # same adapter class is judged on them as usual
    declared = Adapter(MegatronDSAAdapter(), name="m", spec="megatron_dsa_adapter")
    case = get("nan-poison-layer")
    out = check_case(declared, case, replays=0)
    assert out.passed and len(out.checks) == 1
    (c,) = out.checks
    assert c.status == "not_judged" and "padding_rows=attend" in c.detail
    defaults = Adapter(MegatronDSAAdapter(**DEFAULT_POLICIES), name="d", spec="megatron_dsa_adapter")
    judged = check_case(defaults, case, replays=0)
    assert judged.passed and len(judged.checks) > 10
