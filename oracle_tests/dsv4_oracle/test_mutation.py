"""Mutation testing (``dsv4_oracle.mutation``): a handful of planted bugs die on one small case,
the unmutated backend (loaded the same private way) survives it, every mutant still matches
the source, and building a mutant changes no imported module."""
from __future__ import annotations

import sys

import pytest

from dsv4_oracle import fixtures
from dsv4_oracle import mutation as M

CASE = "empty-docs"        # small: empty documents, padding (sink-only) rows, a CSA layer

# one mutant per stage of the pipeline, each killed by a different quantity on CASE
FAST = {
    "compressed-last": "ids",
    "lse-includes-sink": "lse",
    "dsink-sign": "dsink",
    "kl-arguments-swapped": "loss",
    "input-mutated-in-place": "no_mutation",
    "teacher-not-detached": "loss_detached",     # the layer's loss alone must give exact zeros
}

# mutants that need inputs of their own: (mutant, the case built for it, the killing quantity)
AIMED = [
    ("no-max-subtraction", "large-logits", "out"),      # out NaN, lse -inf: unusable outputs
    ("relu-gate-ge", "indexer-zero-dots", "dq_idx"),
    ("grad-floor-mask-dropped", "indexer-score-spread", "dq_idx"),
    ("teacher-row-silenced-by-one-head", "sink-mixed", "loss"),
]


def _run(name):
    m = None if name is None else M.select_mutants([name])[0]
    return M.run_mutant(m, [fixtures.get(CASE)], replays=2)


def test_unmutated_backend_survives():
    r = _run(None)
    assert r.status == "survived", r.killer


@pytest.mark.parametrize("name", sorted(FAST))
def test_mutant_dies_on_the_expected_quantity(name):
    r = _run(name)
    assert r.status == "killed", f"{name} survived {CASE}"
    assert r.killer["case"] == CASE
    assert r.killer["quantity"] == FAST[name], r.killer


@pytest.mark.parametrize("name,case,quantity", AIMED, ids=[a[0] for a in AIMED])
def test_mutant_dies_on_the_case_built_for_it(name, case, quantity):
    r = M.run_mutant(M.select_mutants([name])[0], [fixtures.get(case)], replays=2)
    assert r.status == "killed", f"{name} survived {case}"
    assert r.killer["quantity"] == quantity, r.killer


def test_the_recomputed_backward_convention_survives():
    """Contract section 6: Delta from the backward's own forward is an allowed variant."""
    m = M.select_mutants(["delta-recomputed"])[0]
    assert m.expect == "survives"
    r = M.run_mutant(m, [fixtures.get("padding-edge-layout")], replays=2)
    assert r.status == "survived", r.killer


def test_every_mutant_matches_the_source_exactly_once():
    for m in M.MUTANTS:
        for rel in m.files:
            M.mutant_source(m, rel)          # raises StaleMutant otherwise


def test_a_stale_snippet_is_reported_loudly():
    m = M.Mutant("gone", "a snippet that is not there", ((M.TB, "no such text", "x"),))
    with pytest.raises(M.StaleMutant, match="occurs 0 times"):
        M.mutant_source(m, M.TB)
    r = M.run_mutant(m, [fixtures.get(CASE)])
    assert r.status == "stale" and not r.as_expected
    assert "STALE" in M.format_table([r])


def test_building_a_mutant_changes_no_imported_module():
    from dsv4_oracle.gpu_impl import torch_backend as tb
    M.build_adapter(None)                    # first use imports what the builder needs
    mutant = M.select_mutants(["lse-log2"])[0]
    before = dict(sys.modules)
    fwd = tb.sparse_attention_forward
    M.build_adapter(mutant)
    assert tb.sparse_attention_forward is fwd
    assert set(sys.modules) == set(before)
    assert all(sys.modules[k] is v for k, v in before.items())


def test_mutants_are_named_described_and_expected():
    assert len(M.MUTANTS) >= 49
    for m in M.MUTANTS:
        assert m.expect in ("killed", "survives", "equivalent")
        assert m.description
        assert m.expect == "killed" or m.reason, m.name
        assert all(f in M.IN_PROCESS_FILES for f in m.files) or m.lane, m.name


def test_unknown_mutant_is_a_usage_error(capsys):
    assert M.main(["--mutant", "no-such-mutant"]) == 2
    assert "unknown mutant" in capsys.readouterr().err


# the compressor's classic defects (contract sections 13-15): each dies on two quick-catalog
# cases of different categories (the killing quantity: the forward output it corrupts (a
# wrong group count is an unusable kv_cmp when the op returns, or the op cannot run: "run"),
# or the replays of a timing-dependent d_ape)
GROUP_COUNT = ("kv_cmp", "run")
COMPRESSOR_MUTANTS = {
    "compressor-overlap-not-reset": "kv_cmp", "compressor-logical-lengths": GROUP_COUNT,
    "compressor-ape-global-position": "kv_cmp", "compressor-rope-last-token": "kv_cmp",
    "compressor-rope-rotate-half": "kv_cmp", "hadamard-unnormalised": "k_idx",
    "hadamard-before-norm": "k_idx", "compressor-tail-forms-group": GROUP_COUNT,
    "dape-timing-order": "replays",
}
COMPRESSOR_KILLERS = ("compressor-edges", "compressor-cp2-saturated")


def test_the_compressor_killers_are_quick_cases_of_different_categories():
    from dsv4_oracle.runner import quick_ids
    assert set(COMPRESSOR_KILLERS) <= set(quick_ids())
    assert len({fixtures.get(c).categories[0] for c in COMPRESSOR_KILLERS}) == 2
    assert set(COMPRESSOR_MUTANTS) <= {m.name for m in M.MUTANTS}


@pytest.mark.parametrize("case", COMPRESSOR_KILLERS)
@pytest.mark.parametrize("name", sorted(COMPRESSOR_MUTANTS))
def test_compressor_mutant_dies_on_two_cases_of_different_categories(name, case):
    m = M.select_mutants([name])[0]
    r = M.run_mutant(m, [fixtures.get(case)], replays=m.replays)
    assert r.status == "killed", f"{name} survived {case}"
    want = COMPRESSOR_MUTANTS[name]
    assert r.killer["quantity"] in (want if isinstance(want, tuple) else (want,)), r.killer


# -- the policy section (dsv4_oracle.mutation_policies) -------------------------------------------
def test_policy_mutants_cover_every_non_default_value():
    from dsv4_oracle.mutation_policies import POLICY_MUTANTS
    from dsv4_oracle.reference.contract_policies import POLICIES
    assert {(m.policy, m.value) for m in POLICY_MUTANTS} == {
        (n, v) for n, p in POLICIES.items() for v in p.values if v != p.default}
    for m in POLICY_MUTANTS:
        assert m.name == f"policy:{m.policy}={m.value}" and m.description
        assert (m.build is None) == bool(m.lane) and (m.build is not None or m.reason)
        assert m.build is None or len(m.first) >= 2
    assert {m.name for m in POLICY_MUTANTS} <= {m.name for m in M.select_mutants()}


@pytest.mark.parametrize("name", ["policy:teacher=dense", "policy:index_grad=autograd"])
def test_a_policy_mutant_dies_undeclared_and_passes_declared(name):
    r = M.run_mutation(M.select_mutants([name]), quick=True, baseline=False)[0]
    assert r.status == "killed" and r.kill_depth == 2 == len(r.mutant.first), r.to_dict()
    assert r.declared["passed"] and r.declared["cases_run"] == 2, r.declared
    assert r.as_expected
    line = M.format_table([r])
    assert "kill depth 2" in line and "declared: passes 2 cases" in line
    assert r.to_dict()["kill_depth"] == 2


def test_rank_mean_is_a_lane_only_entry():
    from dsv4_oracle.mutation_policies import run_policy_mutant
    m = M.select_mutants(["policy:loss_norm=rank_mean"])[0]
    r = run_policy_mutant(m, [fixtures.get("dsa-padded")])
    assert r.status == "lane" and r.as_expected and "context parallelism" in M.format_table([r])


def test_a_declared_policy_the_implementation_does_not_follow_is_unexpected():
    # the contract's defaults, declaring the dense teacher: it follows no non-default value,
    # so nothing kills it under the defaults (what a policy mutant must not do)
    from dsv4_oracle.examples.megatron_dsa_adapter import MegatronDSAAdapter
    from dsv4_oracle.mutation_policies import PolicyMutant, run_policy_mutant
    from dsv4_oracle.reference.contract_policies import DEFAULT_POLICIES

    def build():
        obj = MegatronDSAAdapter(**DEFAULT_POLICIES)
        obj.policies = {**DEFAULT_POLICIES, "teacher": "dense"}
        return obj
    m = PolicyMutant("teacher", "dense", build, "declares dense, computes sparse",
                     ("dsa-zero-ties",))
    r = run_policy_mutant(m, [fixtures.get("dsa-zero-ties")])
    assert r.status == "survived" and not r.as_expected
    assert "SURVIVED" in M.format_table([r]) and "UNEXPECTED" in M.format_table([r])
