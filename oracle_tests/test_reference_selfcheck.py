"""``dsv4-oracle selfcheck`` passes on the built-in cases, prints its table, and fails (exit
status 1, FAIL rows naming the check) when the oracle is broken."""
from __future__ import annotations

import torch

import reference as R
from dsv4_oracle import selfcheck
from dsv4_oracle.cli import main

CSA_ONLY = tuple(c for c in selfcheck.BUILTIN_CASES if c.name == "csa-padded")


def test_selfcheck_passes_and_prints_the_table(capsys):
    assert main(["selfcheck", "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "check" in text and "contract section" in text and "result" in text and "detail" in text
    assert "FAIL" not in text
    for case in selfcheck.BUILTIN_CASES:
        assert f"{case.name}: " in text
    rows = [line for line in text.splitlines() if " | PASS " in line]
    assert len(rows) >= 30 and f"{len(rows)}/{len(rows)} checks passed" in text


def failing_checks(monkeypatch, name, wrapper):
    monkeypatch.setattr(R, name, wrapper(getattr(R, name)))
    return {r.check.split(": ", 1)[1] for r in selfcheck.selfcheck_results(CSA_ONLY) if not r.passed}


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
