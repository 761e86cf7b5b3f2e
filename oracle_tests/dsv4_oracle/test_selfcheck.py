"""``dsv4-oracle selfcheck`` passes on its catalog cases, prints its table, and fails (exit
status 1, FAIL rows naming the check) when the oracle is broken; its numeric checks are
``compare.compare_numeric`` results (one comparator), and its cases are catalog cases (one case
system)."""
from __future__ import annotations

import torch

from dsv4_oracle import fixtures
from dsv4_oracle import reference as R
from dsv4_oracle import compare, selfcheck
from dsv4_oracle.cli import main

CSA_ONLY = (fixtures.get(selfcheck.GRADCHECK_CASE),)


def test_selfcheck_passes_and_prints_the_table(capsys):
    assert main(["selfcheck", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "check" in text and "contract section" in text and "result" in text and "detail" in text
    assert "FAIL" not in text
    for case_id in selfcheck.SELFCHECK_CASES:
        assert f"{case_id}: " in text
    rows = [line for line in text.splitlines() if " | PASS " in line]
    assert len(rows) >= 30 and f"{len(rows)}/{len(rows)} checks passed" in text


def failing_checks(monkeypatch, name, wrapper):
    monkeypatch.setattr(R, name, wrapper(getattr(R, name)))
    return {r.name.split(": ", 1)[1] for r in selfcheck.selfcheck_results(CSA_ONLY)
            if not r.passed}


def test_a_wrong_backward_fails(monkeypatch):
    def wrong(fn):          # dkv off by one part in 1e12: far above float64 roundoff
        def f(*a, **k):
            dq, dkv, dsink = fn(*a, **k)
            return dq, dkv * (1 + 1e-12), dsink
        return f
    failed = failing_checks(monkeypatch, "sparse_attention_backward", wrong)
    assert {"backward gather == dense autograd", "closed-form backward == autograd"} <= failed


def test_a_row_dependent_forward_fails(monkeypatch):
    def wrong(fn):          # results that depend on how many rows are evaluated together
        def f(q, *a, **k):
            out, lse = fn(q, *a, **k)
            return out, lse + q.shape[0] * 1e-15
        return f
    failed = failing_checks(monkeypatch, "sparse_attention_forward", wrong)
    assert "CP per-rank rows bitwise" in failed


def test_a_wrong_topk_tie_policy_fails(monkeypatch):
    def wrong(fn):          # ties go to the larger id
        def f(scores, k, **kw):
            n = scores.shape[1]
            ids, lengths = fn(torch.flip(scores, dims=[1]), k, **kw)
            mapped = torch.where(ids >= 0, n - 1 - ids, torch.full_like(ids, n))
            if kw.get("order", "id") == "id":
                mapped = torch.sort(mapped, dim=1).values
            return torch.where(mapped < n, mapped, torch.full_like(mapped, -1)), lengths
        return f
    failed = failing_checks(monkeypatch, "stable_topk", wrong)
    assert "Top-K == brute force" in failed


def test_a_crashing_check_fails_with_its_reason(monkeypatch):
    def crash(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(R, "sparse_indexer_loss", crash)
    results = selfcheck.selfcheck_results(CSA_ONLY)
    bad = [r for r in results if not r.passed]
    assert bad and all("RuntimeError: boom" in r.detail for r in bad)
    assert selfcheck.run_selfcheck() == 1


def test_the_cases_are_catalog_cases_of_the_selfcheck_category():
    catalog = {c.id: c for c in fixtures.catalog()}
    assert all(i in catalog for i in selfcheck.SELFCHECK_CASES)
    own = {c.id for c in fixtures.by_category("selfcheck")}
    assert own == set(selfcheck.SELFCHECK_CASES) - {selfcheck.WORKED_EXAMPLE}
    assert {catalog[i].layer for i in selfcheck.SELFCHECK_CASES} == {"csa", "hca", "window"}
    assert not hasattr(selfcheck, "BUILTIN_CASES") and not hasattr(selfcheck, "build_case")


def test_every_result_is_a_compare_check_result_and_numeric_ones_come_from_compare_numeric(
        monkeypatch):
    calls = []
    real = selfcheck.compare_numeric

    def spy(name, *args):
        calls.append(name)
        return real(name, *args)
    monkeypatch.setattr(selfcheck, "compare_numeric", spy)
    results = selfcheck.selfcheck_results(CSA_ONLY)
    assert all(isinstance(r, compare.CheckResult) and r.status == "passed" for r in results)
    numeric = [r for r in results if r.kind == "numeric"]
    assert len(numeric) == 6 and {"out", "lse", "dq", "dkv", "dsink", "kl", "loss", "dq_idx",
                                  "dw", "dk_idx", "dape", "dnorm_weight"} <= set(calls)
    assert all(0 <= r.ratio <= 1 and r.extra["section"] for r in numeric)
    assert not hasattr(selfcheck, "_ratio")


def test_a_quantity_that_cannot_be_judged_is_not_a_pass(monkeypatch):
    # bounds as large as the values they judge: every element ill-conditioned (contract
    # section 12: a bound as large as the value it judges is not a pass)
    monkeypatch.setattr(selfcheck, "compare_numeric",
                        lambda name, a, e, b: compare.compare_numeric(name, a, e,
                                                                      e.abs() + b + 1))
    results = selfcheck.selfcheck_results(CSA_ONLY)
    status = {r.name.split(": ", 1)[1]: r.status for r in results if r.kind == "numeric"}
    # (a check with non-finite expected values keeps exactly judged elements)
    assert status["indexer loss == definition"] == "not_judged"
    assert "failed" not in status.values()
    assert "NOT JUDGED" in selfcheck.format_table(results)
    monkeypatch.setattr(selfcheck, "selfcheck_cases", lambda: CSA_ONLY)
    assert selfcheck.run_selfcheck() == 1
