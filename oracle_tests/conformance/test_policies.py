"""The named policies of contract section 5.2 as a declared part of a verdict.

- every policy name and value is validated, naming what is wrong (``resolve_policies``, the
  adapter attribute, ``check --policy``, ``assert_conforms(policies=...)``);
- for every non-default value, an implementation that follows it passes when it declares it
  and fails when it does not (or when ``--policy default`` overrides its declaration), on two
  cases each: the oracle is evaluated under the declared policies, never under the defaults
  alone. The implementation here is the oracle's own functions under the policy (float64: the
  tightest bounds there are), except for the Top-K ties, where it is an independent Top-K
  whose exact ties go to the larger id; the Megatron-style control adapter
  (``test_megatron_dsa.py``) is the implementation written in another codebase's style;
- the summary, ``report.md`` and ``report.json`` state every non-default policy assumed.
"""
from __future__ import annotations

import json

import pytest
import torch

from dsv4_oracle import conformance as K
from dsv4_oracle import fixtures
from dsv4_oracle import reference as R
from dsv4_oracle.adapters import Adapter, AdapterError
from dsv4_oracle.check import main_check
from dsv4_oracle.cli import build_parser
from dsv4_oracle.pytest_plugin import ConformanceError, assert_conforms
from dsv4_oracle.reference.contract_policies import (DEFAULT_POLICIES, POLICIES, non_default,
                                                     policy_line, resolve_policies)
from dsv4_oracle.reference.error_model import ORACLE_PRECISION
from dsv4_oracle.report import format_summary, report_dict, validate_report
from dsv4_oracle.runner import run_check


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def test_every_policy_has_a_default_and_values():
    for name, p in POLICIES.items():
        assert p.name == name and len(p.values) >= 2 and DEFAULT_POLICIES[name] == p.default
        assert p.section in {"3", "4", "7", "8"}
    assert resolve_policies(None) == DEFAULT_POLICIES
    assert non_default({"loss_norm": "real", "teacher": "dense"}) == {"teacher": "dense"}
    assert policy_line({"teacher": "dense", "loss_norm": "rows"}) == \
        "loss_norm=rows, teacher=dense"


@pytest.mark.parametrize("bad,error,needle", [
    ({"loss_norms": "rows"}, ValueError, "unknown policy 'loss_norms'"),
    ({"loss_norm": "all"}, ValueError, "policy 'loss_norm' has no value 'all'"),
    ({"loss_norm": 1}, TypeError, "the value of 'loss_norm' must be a str"),
    (["loss_norm"], TypeError, "must be a mapping"),
])
def test_bad_policies_are_rejected_naming_what_is_wrong(bad, error, needle):
    with pytest.raises(error, match=needle):
        resolve_policies(bad)


def test_an_adapter_with_bad_policies_cannot_be_loaded():
    class Bad:
        policies = {"teacher": "full"}

        def sparse_attention_forward(self, *a, **k):
            raise AssertionError("never called")
    with pytest.raises(AdapterError, match="policy 'teacher' has no value 'full'"):
        Adapter(Bad(), name="bad")


def _check(capsys, *argv):
    args = build_parser().parse_args(["check", *argv])
    rc = main_check(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("arg,needle", [
    ("loss_norm", "expected NAME=VALUE or 'default'"),
    ("loss_norm=", "expected NAME=VALUE or 'default'"),
    ("teacher=full", "policy 'teacher' has no value 'full'"),
    ("nope=1", "unknown policy 'nope'"),
])
def test_check_policy_usage_errors_exit_2_in_one_line(capsys, arg, needle):
    rc, out, err = _check(capsys, "--policy", arg, "--case", "capacity-rows")
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and not out


# ---------------------------------------------------------------------------------------------
# implementations that follow a policy
# ---------------------------------------------------------------------------------------------
class OracleUnderPolicies:
    """The oracle's own ops, evaluated under ``policies`` for ``case`` (the layout of
    ``padding_rows``, the loss normaliser, the indexer scale, the gradient and KL forms, the
    dense teacher's key set); ``ties_to_larger_id``: a Top-K whose exact ties go to the larger
    column id (any member of a tie is a valid Top-K)."""

    def __init__(self, case, policies, *, declare=True, ties_to_larger_id=False):
        self.case = case
        self.pol = resolve_policies(policies)
        self.name = "oracle under " + (policy_line(self.pol) or "the defaults")
        if declare:
            self.policies = dict(policies)
        self.precision = ORACLE_PRECISION
        self.larger = ties_to_larger_id

    def _lay(self, layout):
        return layout.padding_as_real() if self.pol["padding_rows"] == "attend" else layout

    def _kw(self, op):
        return K._STAGE[op].policy_kw(self.case, self.pol)

    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        return R.indexer_scores(q_idx, k_idx, weights, self._lay(layout), ratio,
                                **self._kw("indexer_scores"))

    def stable_topk(self, scores, k, *, order="id"):
        if not self.larger:
            return R.stable_topk(scores, k, order=order)
        flipped = scores.flip(1)
        ids, lengths = R.stable_topk(flipped, k, order="score")
        n = scores.shape[1]
        ids = torch.where(ids >= 0, n - 1 - ids, ids)
        if order == "id":
            big = torch.iinfo(ids.dtype).max
            ids, _ = torch.sort(torch.where(ids >= 0, ids, torch.full_like(ids, big)), dim=1)
            ids = torch.where(ids == big, torch.full_like(ids, -1), ids)
        return ids, lengths

    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        return R.build_csa_indices(self._lay(layout), window=window, ratio=ratio,
                                   compressed_ids=compressed_ids)

    def sparse_attention_forward(self, *args, **kw):
        return R.sparse_attention_forward(*args, **kw)

    def sparse_attention_backward(self, *args, **kw):
        return R.sparse_attention_backward(*args, **kw)

    def sparse_indexer_loss(self, q, kv_cmp, sink, lse, compressed_ids, index_scores, layout,
                            **kw):
        kw.update(self._kw("sparse_indexer_loss"))
        if self.pol["teacher"] == "dense":           # its own key set and normaliser
            compressed_ids = self._lay(layout).visible_compressed_ids(self.case.ratio)
            _, lse = R.sparse_attention_forward(q, kv_cmp, compressed_ids, sink,
                                                scale=kw.get("scale"))
        return R.sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores,
                                     self._lay(layout), **kw)

    def sparse_indexer_loss_grad(self, *args, **kw):
        kw.update(self._kw("sparse_indexer_loss_grad"))
        return R.sparse_indexer_loss_grad(*args, **kw)


# per non-default value: the two cases that must tell it from the default, and the quantity
# the undeclared policy fails on
VARIANTS = [
    ({"loss_norm": "rows"}, ("dsa-padded", "padding-edge-layout"), "loss"),
    ({"loss_norm": "rank_mean"}, ("cp4-zigzag", "cp2-zigzag"), "loss"),
    ({"padding_rows": "attend"}, ("dsa-padded", "padding-edge-layout"), "scores"),
    ({"topk_ties": "any"}, ("dsa-zero-ties", "zero-score-ties"), "cmp_ids"),
    ({"index_scale": "dim_heads"}, ("dsa-padded", "padding-edge-layout"), "scores"),
    ({"index_grad": "exact"}, ("indexer-score-spread", "dsa-score-spread"), "dq_idx"),
    ({"index_grad": "autograd"}, ("indexer-score-spread", "dsa-score-spread"), "dq_idx"),
    ({"kl_form": "log_softmax"}, ("indexer-score-spread", "dsa-score-spread"), "kl"),
    ({"teacher": "dense"}, ("dsa-padded", "padding-edge-layout"), "target"),
]


def _adapter(case, policies, **kw):
    obj = OracleUnderPolicies(case, policies, **kw)
    return Adapter(obj, name=obj.name, spec="oracle_tests.conformance.test_policies")


@pytest.mark.parametrize("policies,cases,quantity", VARIANTS,
                         ids=[policy_line(v[0]) for v in VARIANTS])
def test_a_followed_policy_passes_declared_and_fails_undeclared(policies, cases, quantity):
    ties = policies.get("topk_ties") == "any"
    for cid in cases:
        case = fixtures.get(cid)
        ok = run_check(_adapter(case, policies, ties_to_larger_id=ties), [case], replays=0)
        assert ok.passed, (cid, [(c.extra["quantity"], c.detail) for o in ok.outcomes
                                 for c in o.failed_checks][:3])
        bad = run_check(_adapter(case, policies, declare=False, ties_to_larger_id=ties),
                        [case], replays=0)
        failed = {c.extra["quantity"] for o in bad.outcomes for c in o.failed_checks}
        assert quantity in failed or (quantity == "target" and "run" in failed), (cid, failed)
        forced = _adapter(case, policies, ties_to_larger_id=ties)
        forced.set_policies({}, forget_declared=True)          # check --policy default
        assert not run_check(forced, [case], replays=0).passed


def test_the_verdict_states_the_non_default_policies(tmp_path):
    case = fixtures.get("dsa-padded")
    a = _adapter(case, {"loss_norm": "rows", "teacher": "dense"})
    result = run_check(a, [case], replays=0)
    assert result.passed
    assert ("policies assumed (declared by the adapter; contract section 5.2): "
            "loss_norm=rows, teacher=dense") in format_summary(result)
    d = report_dict(result)
    assert validate_report(d) == []
    assert d["run"]["policies"]["non_default"] == {"loss_norm": "rows", "teacher": "dense"}
    assert d["run"]["policies"]["source"] == "adapter"
    json.dumps(d)
    a.set_policies({"teacher": "dense"}, forget_declared=True)
    assert run_check(a, [case], replays=0).policy_source == "command line"


def test_assert_conforms_takes_policies_and_leaves_the_adapter_alone():
    case = fixtures.get("dsa-padded")
    a = _adapter(case, {"loss_norm": "rows"}, declare=False)
    with pytest.raises(ConformanceError):
        assert_conforms(a, case, replays=0)
    assert_conforms(a, case, replays=0, policies={"loss_norm": "rows"})
    assert a.policies == DEFAULT_POLICIES                   # the caller's object is untouched
    with pytest.raises(ValueError, match="policies: unknown policy"):
        assert_conforms(a, case, policies={"loss": "rows"})
