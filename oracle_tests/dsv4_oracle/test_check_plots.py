"""The plots of ``dsv4-oracle check --report DIR`` tell the truth (``dsv4_oracle.plots``).

On small synthetic run results (no kernel runs), what the plotting functions compute:

- the colour scale breaks hard at the bound: a ratio of exactly 1 is blue (a pass), 1.01 and
  the next float above 1 are red (a failure), ``inf``/``nan`` red;
- the cells of ``ratios.png``: the worst judged ratio over the levels, a failure always red,
  checks not judged, cases not run and quantities not produced each marked apart, with a legend
  entry for each kind present;
- ``worst_case.png`` shows the summary's worst check (same case, level and quantity), says so
  when that quantity has no map, and draws the map of the worst check's level;
- without matplotlib, the report is written without plots and ``check`` says so in one line.
"""
from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from dsv4_oracle import plots
from dsv4_oracle.compare import CheckResult, not_judged
from dsv4_oracle.report import report_dict
from dsv4_oracle.runner import CaseOutcome, RunResult


# ---------------------------------------------------------------------------------------------
# synthetic run results
# ---------------------------------------------------------------------------------------------
def _case(cid):
    return SimpleNamespace(id=cid, categories=("synthetic",), dtype="bfloat16",
                           to_dict=lambda: {"id": cid})


def num(q, ratio, level="op"):
    """A numeric check of ``q`` with ``ratio`` (fails when the ratio is over 1)."""
    return CheckResult(q, "numeric", not ratio > 1, ratio, 0, f"ratio {ratio}",
                       {"quantity": q, "level": level})


def exact(q, passed=True, level="op"):
    return CheckResult(q, "exact", passed, None, 0 if passed else 3, "exact",
                       {"quantity": q, "level": level})


def unjudged(q, level="op"):
    return not_judged(q, "numeric", "all elements ill-conditioned", quantity=q, level=level)


def outcome(cid, checks=(), error=None, maps=None):
    return CaseOutcome(_case(cid), checks=list(checks), error=error, maps=maps or {})


def result(*outcomes):
    adapter = SimpleNamespace(spec="synthetic", name="synthetic", device="cpu",
                              precision_source="default")
    return RunResult(adapter, "quick", (), 2, list(outcomes), "2026-01-01T00:00:00Z", 1.0,
                     ("sparse_attention_forward",))


def level_maps(T=6, H=2, out=0.1, lse=0.2, dq=0.3, pad=(4, 5)):
    padding = np.zeros(T, bool)
    padding[list(pad)] = True
    return {"out": np.full((T, H), out), "lse": np.full((T, H), lse), "dq": np.full((T, H), dq),
            "padding": padding, "sink_only": np.zeros(T, bool)}


# ---------------------------------------------------------------------------------------------
# the colour scale
# ---------------------------------------------------------------------------------------------
def test_ratio_one_is_blue_and_anything_over_one_is_red():
    assert plots.ratio_color(1.0) in plots.PASS_COLORS
    for r in (1.01, float(np.nextafter(1.0, 2.0)), 10.0, 1e6, math.inf, math.nan):
        assert plots.ratio_color(r) in plots.FAIL_COLORS, r
    for r in (0.0, 1e-9, 1e-4, 0.5, 0.999999):
        assert plots.ratio_color(r) in plots.PASS_COLORS, r
    assert not set(plots.PASS_COLORS) & set(plots.FAIL_COLORS)
    # right-closed decades, monotone in the ratio
    r = np.array([0, 1e-5, 1e-4, 5e-4, 5e-3, 0.05, 0.5, 1.0, 1.01, 10.0, 50.0, 1e3, math.inf])
    bins = plots.ratio_bins(r)
    assert list(bins) == [0, 0, 0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8]
    assert len(plots.BIN_LABELS) == len(plots.PASS_COLORS + plots.FAIL_COLORS)


# ---------------------------------------------------------------------------------------------
# ratios.png
# ---------------------------------------------------------------------------------------------
def _grid_result():
    mixed = outcome("mixed", [
        num("out", 0.2), num("out", 0.9, level="layer"),      # worst over the levels: 0.9
        num("lse", 1.0),                                       # exactly at the bound: a pass
        num("dq", 1.01),                                       # just over: a failure
        exact("ids"), exact("sink_only", passed=False),
        unjudged("dsink"), unjudged("dkv"), num("dkv", 0.5, level="layer")])
    no_setup = outcome("no-setup", error="cannot materialize the case's inputs: boom")
    raised = outcome("raised", [CheckResult("run: sparse_attention_forward", "error", False,
                                            None, None, "raised RuntimeError",
                                            {"quantity": "run", "level": "op"})])
    partial = outcome("partial", [num("out", 0.0)])
    return result(mixed, no_setup, raised, partial)


def test_grid_cells_say_what_each_case_and_quantity_got():
    g = plots.ratio_grid(_grid_result())
    cell = {(c, q): (g.kind[i, j], g.ratio[i, j], g.color[i, j], g.failed[i, j])
            for i, c in enumerate(g.cases) for j, q in enumerate(g.quantities)}
    assert g.quantities == ["ids", "out", "lse", "sink_only", "dq", "dkv", "dsink", "run"]
    assert g.failed_cases == [True, True, True, False]
    kind, ratio, color, failed = cell[("mixed", "out")]
    assert (kind, ratio, failed) == ("ratio", 0.9, False) and color in plots.PASS_COLORS
    kind, ratio, color, failed = cell[("mixed", "lse")]
    assert (kind, ratio, failed) == ("ratio", 1.0, False) and color in plots.PASS_COLORS
    kind, ratio, color, failed = cell[("mixed", "dq")]
    assert (kind, ratio, failed) == ("ratio", 1.01, True) and color in plots.FAIL_COLORS
    assert cell[("mixed", "ids")][0] == "exact" and cell[("mixed", "ids")][2] in plots.PASS_COLORS
    kind, _, color, failed = cell[("mixed", "sink_only")]
    assert kind == "failed" and failed and color in plots.FAIL_COLORS
    assert cell[("mixed", "dsink")][0] == "not_judged"
    assert cell[("mixed", "dkv")][:2] == ("ratio", 0.5)   # judged at one level: that ratio
    assert cell[("mixed", "run")][0] == "absent"
    assert {cell[("no-setup", q)][0] for q in g.quantities} == {"not_run"}
    assert cell[("raised", "run")][0] == "failed" and cell[("raised", "run")][3]
    assert {cell[("raised", q)][0] for q in g.quantities if q != "run"} == {"not_run"}
    assert cell[("partial", "out")][:2] == ("ratio", 0.0)
    assert {cell[("partial", q)][0] for q in g.quantities if q != "out"} == {"absent"}
    # every cell over the bound or failed is red, every other judged cell blue
    for i in range(len(g.cases)):
        for j in range(len(g.quantities)):
            if g.kind[i, j] in ("ratio", "exact", "failed"):
                red = g.failed[i, j] or g.ratio[i, j] > 1
                assert (g.color[i, j] in plots.FAIL_COLORS) == bool(red), (i, j)
            else:
                assert g.color[i, j] not in plots.PASS_COLORS + plots.FAIL_COLORS


def test_grid_legend_names_every_kind_of_cell_present():
    g = plots.ratio_grid(_grid_result())
    legend = dict(plots.grid_legend(g))
    assert list(legend) == ["exact", "failed", "not_judged", "not_run", "absent", "outline"]
    assert "not judged" in legend["not_judged"] and "hatched" in legend["not_judged"]
    assert "not run" in legend["not_run"] and "not produced" in legend["absent"]
    assert plots.CELL_STYLES["not_judged"]["hatch"]
    faces = [plots.CELL_STYLES[k]["face"] for k in ("not_judged", "not_run", "absent")]
    assert len(set(faces)) == 3
    # a clean run has no blank-cell entries
    clean = plots.ratio_grid(result(outcome("a", [num("out", 0.3), exact("ids")])))
    assert [k for k, _ in plots.grid_legend(clean)] == ["exact"]
    assert plots.ratio_grid(result()) is None


# ---------------------------------------------------------------------------------------------
# worst_case.png
# ---------------------------------------------------------------------------------------------
def test_worst_view_is_the_summarys_worst_check_not_the_largest_map():
    # "first" has the larger maps, but the summary's worst check is dsink of "second"
    first = outcome("first", [num("out", 0.9), num("dsink", 0.1)],
                    maps={"op": level_maps(out=0.9, lse=0.8, dq=0.7)})
    second = outcome("second", [num("out", 0.05), num("dsink", 3.0)],
                     maps={"op": level_maps(out=0.05, lse=0.01, dq=0.02)})
    res = result(first, second)
    w = report_dict(res)["summary"]["worst"]
    v = plots.worst_view(res)
    assert (v.case, v.level, v.quantity) == (w["case"], w["level"], w["quantity"]) == \
        ("second", "op", "dsink")
    assert v.ratio == 3.0 and not v.case_passed
    assert v.note and "no per-(row, head) map exists for dsink" in v.note
    assert list(v.panels) == ["out", "lse", "dq"]             # the same case's maps only
    assert float(v.panels["out"].max()) == 0.05


def test_worst_view_draws_the_worst_quantity_at_its_level_first():
    maps = {"op": level_maps(out=0.1, lse=0.2, dq=0.3),
            "layer": level_maps(out=0.4, lse=0.5, dq=1.5)}
    o = outcome("layered", [num("dq", 0.3), num("dq", 1.5, level="layer"),
                            num("out", 0.4, level="layer")], maps=maps)
    v = plots.worst_view(result(outcome("other", [num("out", 0.2)]), o))
    assert (v.case, v.level, v.quantity, v.note) == ("layered", "layer", "dq", None)
    assert list(v.panels) == ["dq", "out", "lse"]
    assert float(v.panels["dq"].max()) == 1.5                # the layer map, not the op one
    assert list(v.padding) == [False] * 4 + [True] * 2


def test_a_run_keeps_float64_maps_per_level_that_agree_with_its_checks():
    """One real case at both levels (the portable torch backend): each level has its own maps,
    in float64 (a ratio just over 1 must not round to 1), consistent with that level's checks."""
    from dsv4_oracle.adapters import load_adapter
    from dsv4_oracle.runner import check_case, select_cases
    cases, _ = select_cases("quick", ["capacity-rows"])
    o = check_case(load_adapter("gpu_impl:torch", device="cpu"), cases[0], replays=1)
    assert set(o.maps) == {"op", "layer"}
    for lv, maps in o.maps.items():
        for q in plots.MAPPED:
            (c,) = [c for c in o.checks if c.extra.get("quantity") == q and c.name == q
                    and c.extra.get("level") == lv]
            m = maps[q]
            assert m.dtype == np.float64 and m.shape == (len(maps["padding"]), 4)
            assert float(m.max()) >= c.ratio and bool((m > 1).any()) == (not c.passed), (lv, q)
    v = plots.worst_view(result(o))
    w = report_dict(result(o))["summary"]["worst"]
    assert (v.case, v.level, v.quantity) == (w["case"], w["level"], w["quantity"])
    if v.quantity in plots.MAPPED:
        assert np.array_equal(v.panels[v.quantity], o.maps[v.level][v.quantity])
    else:
        assert v.quantity not in v.panels and v.quantity in v.note


def test_worst_view_says_when_no_map_exists_and_none_without_ratios(tmp_path):
    # the worst check's level has no maps at all: a figure that says so, nothing else drawn
    o = outcome("nomaps", [num("out", 0.4, level="layer")], maps={"op": level_maps()})
    v = plots.worst_view(result(o))
    assert (v.level, v.panels) == ("layer", {})
    assert "no per-(row, head) map of out at level layer" in v.note
    exact_only = result(outcome("e", [exact("ids")]))
    assert plots.worst_view(exact_only) is None
    assert not plots.plot_worst_case(exact_only, str(tmp_path / "none.png"))
    assert not os.path.exists(tmp_path / "none.png")


def test_both_plots_draw(tmp_path):
    pytest.importorskip("matplotlib")
    maps = {"op": level_maps(dq=1.2)}
    res = result(*_grid_result().outcomes,
                 outcome("mapped", [num("dq", 4.0), num("out", 0.1)], maps=maps))
    nomaps = result(outcome("nomaps", [num("out", 0.4, level="layer")],
                            maps={"op": level_maps()}))
    for fn, r, name in ((plots.plot_ratio_grid, res, "r.png"),
                        (plots.plot_worst_case, res, "w.png"),
                        (plots.plot_worst_case, nomaps, "text_only.png")):
        assert fn(r, str(tmp_path / name))
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# matplotlib is optional
# ---------------------------------------------------------------------------------------------
def test_report_without_matplotlib_skips_the_plots_in_one_line(monkeypatch, tmp_path, capsys):
    from dsv4_oracle import runner
    from dsv4_oracle.cli import main
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib fails
    assert "matplotlib is not installed" in plots.unavailable()
    res = result(outcome("a", [num("out", 0.3), exact("ids")], maps={"op": level_maps()}))
    monkeypatch.setattr(runner, "run_check", lambda *a, **k: res)
    d = tmp_path / "rep"
    rc = main(["check", "--no-progress", "--impl", "reference", "--case", "capacity-rows",
               "--report", str(d)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert sorted(os.listdir(d)) == ["report.json", "report.md"]
    assert json.loads((d / "report.json").read_text())["passed"] is True
    assert "PNG plots skipped: matplotlib is not installed" in (d / "report.md").read_text()
    skipped = [line for line in out.splitlines() if "plots skipped" in line]
    assert skipped == ["report: PNG plots skipped: matplotlib is not installed "
                       "(pip install 'dsv4-oracle[report]')"]
    assert "Traceback" not in out + err


def test_a_failing_run_shows_a_typical_failure_not_the_most_extreme_ratio():
    """An exactly-0 value missed by 1e-3 has a ratio of 1e35 against its bound near 0: the
    figure shows the median failing check of the quantity with a map that fails most."""
    outlier = CheckResult("dsink", "numeric", False, 6.7e39, 4, "expected exactly 0",
                          {"quantity": "dsink", "level": "op", "expected_zero": True})
    cases = [outcome(f"c{i}", [num("out", r), num("lse", 0.1)], maps={"op": level_maps(out=r)})
             for i, r in enumerate((9.0, 2.0, 5.0))]
    res = result(outcome("zero", [outlier]), *cases,
                 outcome("lone", [num("dsink", 50.0), num("out", 0.2)]))
    assert report_dict(res)["summary"]["worst"]["quantity"] == "dsink"   # the summary's worst
    v = plots.worst_view(res)
    assert (v.case, v.quantity, v.ratio, v.typical_of) == ("c2", "out", 5.0, 3)
    assert plots.typical_failure(result(outcome("zero", [outlier]))) is None
    assert plots.worst_view(result(outcome("zero", [outlier]))).quantity == "dsink"


def test_report_md_gives_each_precision_line_its_own_bullet(tmp_path):
    from dsv4_oracle.report import write_report
    p32 = {"acc": "torch.float32", "io": "torch.float32", "stats": "torch.float32"}
    p16 = {"acc": "torch.float32", "io": "torch.bfloat16", "stats": "torch.float32"}
    a, b = outcome("a", [num("out", 0.5)]), outcome("b", [num("out", 0.5)])
    b.case = SimpleNamespace(id="b", categories=("synthetic",), dtype="float32",
                             to_dict=lambda: {"id": "b"})
    a.precision, b.precision = {"sparse_attention_forward": p16}, {"sparse_attention_forward": p32}
    write_report(result(a, b), str(tmp_path))
    md = (tmp_path / "report.md").read_text().splitlines()
    i = md.index("- precision assumed (the default):")
    assert md[i + 1:i + 3] == ["  - bfloat16 inputs: acc float32, io bfloat16, stats float32",
                               "  - float32 inputs: acc float32, io float32, stats float32"]
