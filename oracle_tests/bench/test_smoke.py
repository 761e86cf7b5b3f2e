"""Smoke test of the oracle benchmark (``bench/bench_oracle.py``): the ``--quick``
shape runs end to end in fresh subprocesses, reports every stage of both forms with the FLOP
counts its docstring states, and its dense form computes the oracle's numbers (ids exactly,
floats within the error model). Speed itself is measured by the benchmark, never asserted here."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_oracle.py"
STAGES = ("indexer_scores", "topk_and_ids", "attn_forward", "attn_backward",
          "indexer_loss", "loss_grad")


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    proc = run_bench("--quick", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_quick_bench_reports_every_stage_of_both_forms(quick_report):
    report, stdout = quick_report
    assert report["gemm"]["gflops"] > 0
    for form in ("oracle_stages", "dense_stages"):
        rows = report[form]
        assert set(rows) == set(STAGES) | {"total"}
        for st in STAGES:
            assert rows[st]["seconds"] > 0, (form, st)
        assert rows["total"]["seconds"] == pytest.approx(sum(rows[st]["seconds"] for st in STAGES))
    for form in ("oracle", "dense"):
        assert report[form]["peak_rss_bytes"] >= report[form]["inputs_rss_bytes"] > 0
        assert report[form]["threads"] == 1
    assert report["oracle_over_floor"] > 0 and report["dense_over_oracle"] > 0
    assert "| attn_backward |" in stdout and "target <= 3" in stdout


def test_quick_bench_flop_counts_follow_the_stated_formulas(quick_report):
    report, _ = quick_report
    s, o = report["shape"], report["oracle"]
    T, H, D, HI, DI, K = s["T"], s["H"], s["D"], s["HI"], s["DI"], s["K"]
    C = o["num_compressed"]
    # rows are evaluated over their own extents (multiples of 64, one extent per row at least)
    for kind, width in (("attn", K + s["W"]), ("loss", K)):
        done, valid = o[f"computed_{kind}_slots"], o[f"valid_{kind}_slots"]
        assert done % 64 == 0 and T * 64 <= done <= T * -(-width // 64) * 64 and valid <= done
    attn, loss = o["computed_attn_slots"], o["computed_loss_slots"]
    oracle = {st: row["flops"] for st, row in report["oracle_stages"].items()}
    assert oracle["attn_forward"] == attn * H * 4 * D
    assert oracle["attn_backward"] == attn * H * 10 * D
    assert oracle["indexer_loss"] == loss * H * 2 * D
    assert oracle["loss_grad"] == loss * HI * (6 * DI + 2)
    assert report["oracle_full_width_flops"]["attn_forward"] == T * (K + s["W"]) * H * 4 * D
    dense_rows = {st: row["flops"] for st, row in report["dense_stages"].items()}
    assert dense_rows["attn_forward"] == T * (T + C) * H * 4 * D
    assert dense_rows["indexer_scores"] == T * C * (2 * HI * DI + 2 * HI)
    useful = report["oracle_useful_flops"]
    assert 0 < useful["attn_forward"] < oracle["attn_forward"]      # padding and short rows


def test_quick_bench_dense_form_computes_the_oracles_numbers(quick_report):
    report, _ = quick_report
    ag = report["agreement"]
    assert ag["ids_equal"] and ag["lengths_equal"] and ag["cmp_ids_equal"]
    ratios = {k: v for k, v in ag.items()
              if k not in ("ids_equal", "lengths_equal", "cmp_ids_equal", "passed",
                           "worst_ratio", "threads", "peak_rss_bytes")}
    assert set(ratios) == {"scores", "out", "lse", "dq", "dkv", "dsink", "loss", "kl", "target",
                           "predict", "dq_idx", "dw", "dk_idx"}
    assert all(0 <= r <= 1 for r in ratios.values()), ratios
    assert ag["passed"]


def test_bench_rejects_bad_arguments():
    proc = run_bench("--T", "7", "--no-dense", timeout=60)
    assert proc.returncode == 2 and "--T" in proc.stderr
    proc = run_bench("--quick", "--threads", "0", timeout=60)
    assert proc.returncode == 2 and "--threads" in proc.stderr


def _bench_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_oracle", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_oracle", mod)        # its dataclasses look themselves up
    spec.loader.exec_module(mod)
    return mod


def test_oracle_pipeline_is_the_stage_table_and_agreement_uses_compare_numeric():
    """In process, at the quick shape: the benchmark's oracle pipeline yields exactly the
    outputs of the conformance stages (their names) with the bits of ``oracle_outputs``, and
    every stage is timed; ``check_agreement`` passes the oracle against itself and
    reports, for a perturbed output, the ratio and verdict of ``compare.compare_numeric``."""
    import torch

    from dsv4_oracle import conformance
    from dsv4_oracle.compare import compare_numeric
    from dsv4_oracle.reference import error_model as em
    bo = _bench_module()
    shape = bo.quick_shape()
    x = bo.make_inputs(shape)
    timer = bo.StageTimer()
    o = bo.oracle_pipeline(shape, x, timer)
    case = bo.bench_case(shape)
    assert set(o) == {w for st in conformance.STAGES if conformance.applies(st.op, case)
                      for w in st.writes}
    ref = conformance.oracle_outputs(case, x)
    assert all(torch.equal(o[k], ref[k]) for k in ref)
    assert set(timer.seconds) == set(STAGES)
    same = bo.check_agreement(shape, o, o)
    assert same["passed"], same              # the loss gradients: vs mode="autograd", not 0
    assert all(same[k] == 0.0 for k in ("scores", "out", "lse", "dq", "dkv", "dsink", "loss",
                                        "kl", "target", "predict")), same
    bad = dict(o, dsink=o["dsink"] * 1.5)
    ag = bo.check_agreement(shape, o, bad)
    b = em.attention_backward_bound(x["q"], x["kv"], o["ids"], x["sink"], o["out"], o["lse"],
                                    x["dout"], o["dq"], o["dkv"], o["dsink"],
                                    precision=em.ORACLE_PRECISION, lengths=o["lengths"])[2]
    want = compare_numeric("dsink", bad["dsink"], o["dsink"], b)
    assert not want.passed and not ag["passed"]
    assert ag["dsink"] == want.ratio


def test_compressor_bench_runs_and_replays_bitwise(tmp_path):
    """``bench/bench_compressor.py`` at a smoke shape on the CPU: one row per configuration,
    bitwise replays, a worst error/bound ratio of at most 1 (speed is never asserted)."""
    out = tmp_path / "compressor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_compressor.py"), "--T", "260",
                           "--device", "cpu", "--iters", "1", "--warmup", "0", "--replays", "1",
                           "--judge", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["config"] for r in rows} == {"csa_main", "csa_indexer", "hca"}
    assert all(r["bitwise_replays"] and r["worst_ratio"] <= 1 for r in rows)
