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
    before = dict(sys.modules)
    fwd = tb.sparse_attention_forward
    M.build_adapter(M.select_mutants(["lse-log2"])[0])
    assert tb.sparse_attention_forward is fwd
    assert set(sys.modules) == set(before)
    assert all(sys.modules[k] is v for k, v in before.items())


def test_mutants_are_named_described_and_expected():
    assert len(M.MUTANTS) >= 40
    for m in M.MUTANTS:
        assert m.expect in ("killed", "survives", "equivalent")
        assert m.description
        assert m.expect == "killed" or m.reason, m.name
        assert all(f in M.IN_PROCESS_FILES for f in m.files) or m.lane, m.name


def test_unknown_mutant_is_a_usage_error(capsys):
    assert M.main(["--mutant", "no-such-mutant"]) == 2
    assert "unknown mutant" in capsys.readouterr().err
