"""``dsv4-oracle check``: the command end to end on a few small cases.

- the built-in ``reference`` adapter shows zero error on every numeric check (a self-test of the
  runner), and ``gpu_impl:torch`` passes with exit status 0;
- ``--report DIR`` writes ``report.json`` that conforms to its versioned schema, ``report.md``
  and two PNG plots; ``--junit FILE`` writes parseable JUnit XML with one testcase per check;
  the schema validator rejects corrupted reports (it can fail);
- the worked example adapter (``examples/megatron_style_adapter.py``) passes;
- a deliberately broken adapter (one sign flipped in the sink gradient) is caught: exit status
  1, and the message names the case, the quantity and the ratio; an adapter that raises or
  writes into its inputs is caught too;
- bad invocations (unknown case, an adapter that cannot be imported or lacks an op, a CUDA
  implementation on a machine without CUDA) print one line and exit 2, without a traceback.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from dsv4_oracle.cli import main
from dsv4_oracle.report import validate_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# small cases: a CSA layer with padding and capacity rows (op level + packed layer) and an
# op-level case with hostile ids and lengths
CASES = ["--case", "capacity-rows", "--case", "lengths-above-width"]
EXAMPLE = "dsv4_oracle.examples.megatron_style_adapter:MegatronStyleAdapter"
SIGN_FLIP = "oracle_tests.helpers.check_adapters:SignFlipAdapter"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)            # module:attr adapters are imported from the current dir


def check(capsys, *args):
    rc = main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def torch_report(tmp_path_factory):
    """One run of the default CPU implementation with a report and a JUnit file."""
    d = tmp_path_factory.mktemp("report")
    rc = main(["check", "--no-progress", "--impl", "gpu_impl:torch", "--device", "cpu",
               *CASES, "--replays", "2", "--report", str(d), "--junit", str(d / "junit.xml")])
    return rc, d


def test_gpu_impl_torch_passes_and_writes_a_report(torch_report):
    rc, d = torch_report
    assert rc == 0
    names = sorted(os.listdir(d))
    assert names == ["junit.xml", "ratios.png", "report.json", "report.md", "worst_case.png"]
    for png in ("ratios.png", "worst_case.png"):
        with open(d / png, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(d / png) > 10_000
    md = (d / "report.md").read_text()
    assert md.startswith("# dsv4-oracle check: PASS") and "![ratios.png](ratios.png)" in md


def test_report_json_conforms_to_its_schema(torch_report):
    _, d = torch_report
    rep = json.loads((d / "report.json").read_text())
    assert validate_report(rep) == []
    assert rep["schema"] == "dsv4-oracle/check-report" and rep["schema_version"] == 2
    assert rep["passed"] is True and rep["run"]["impl"] == "gpu_impl:torch"
    assert [c["id"] for c in rep["cases"]] == ["capacity-rows", "lengths-above-width"]
    csa = rep["cases"][0]
    levels = {ch["level"] for ch in csa["checks"]}
    assert levels == {"op", "layer"}, "a CSA layer case is checked at op level and as a layer"
    quantities = {ch["quantity"] for ch in csa["checks"]}
    assert quantities >= {"scores", "cmp_ids", "ids", "lengths", "out", "lse", "sink_only", "dq",
                          "dkv", "dsink", "loss", "kl", "target", "predict", "dq_idx", "dw",
                          "dk_idx", "replays", "grad_modes", "no_mutation"}
    assert set(csa["backends"]["op"].values()) == {"torch"}
    for ch in csa["checks"]:
        if ch["kind"] == "numeric" and ch["status"] == "passed":
            assert 0 <= ch["ratio"] <= 1
        assert ch["status"] in ("passed", "not_judged")
    # JUnit: one testcase per check, no failures
    suite = ET.parse(d / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) == rep["summary"]["checks"] and suite.get("failures") == "0"


@pytest.mark.parametrize("corrupt, needle", [
    (lambda r: r.pop("cases"), "missing key 'cases'"),
    (lambda r: r.update(schema_version=1), "schema_version"),
    (lambda r: r["cases"][0]["checks"][0].update(kind="fuzzy"), "kind"),
    (lambda r: r["cases"][0]["checks"][0].update(quantity="speed"), "quantity"),
    (lambda r: r["cases"][0]["checks"][0].update(ratio=-1.0), "ratio"),
    (lambda r: r["cases"][0]["checks"][0].update(passed=False), "passed"),
    (lambda r: r["summary"].update(checks=1), "summary.checks"),
    (lambda r: r["run"].update(replays="3"), "run.replays"),
    (lambda r: next(c for c in r["cases"][0]["checks"] if c["kind"] == "numeric")
     .update(ratio=1.5), "ratio <= 1"),
])
def test_schema_validator_rejects_corrupted_reports(torch_report, corrupt, needle):
    _, d = torch_report
    rep = json.loads((d / "report.json").read_text())
    bad = copy.deepcopy(rep)
    corrupt(bad)
    problems = validate_report(bad)
    assert problems and any(needle in p for p in problems), problems


def test_reference_adapter_shows_zero_error(capsys, tmp_path):
    rc, out, _ = check(capsys, "--impl", "reference", *CASES, "--replays", "2",
                       "--report", str(tmp_path))
    assert rc == 0, out
    rep = json.loads((tmp_path / "report.json").read_text())
    numeric = [ch for c in rep["cases"] for ch in c["checks"]
               if ch["kind"] == "numeric" and ch["status"] == "passed"]
    assert numeric and all(ch["ratio"] == 0 for ch in numeric), \
        [(ch["name"], ch["ratio"]) for ch in numeric if ch["ratio"]]
    assert "worst ratio 0 " in out


def test_example_adapter_passes(capsys):
    rc, out, err = check(capsys, "--impl", EXAMPLE, *CASES, "--case", "sink-large")
    assert rc == 0, out + err
    assert out.rstrip().splitlines()[-1].startswith("PASS")
    # it implements the attention forward and backward: only those quantities are judged
    for q in ("out", "lse", "dq", "dkv", "dsink", "sink_only", "replays"):
        assert f"  {q} " in out
    for q in ("scores", "cmp_ids", "dq_idx"):
        assert f"  {q} " not in out


def test_example_adapter_keeps_nan_of_unselected_key_rows_out(capsys):
    """nan-poison-edge-rows puts NaN in key row 0, the row a clamped invalid id reads: the
    example must not let it reach out (0 * NaN is NaN), least of all on sink-only rows."""
    rc, out, err = check(capsys, "--impl", EXAMPLE, "--case", "nan-poison-edge-rows",
                         "--replays", "2")
    assert rc == 0, out + err
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_sign_flipped_adapter_is_caught(capsys, tmp_path):
    rc, out, err = check(capsys, "--impl", SIGN_FLIP, *CASES, "--replays", "2",
                         "--junit", str(tmp_path / "j.xml"))
    assert rc == 1, out
    verdict = [line for line in out.splitlines() if line.startswith("FAIL: ")]
    assert len(verdict) == 1 and verdict[0].startswith("FAIL: 2 of ")
    assert "failed in 2 of 2 cases" in verdict[0]
    fails = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    # exactly the flipped quantity, in each case, with its ratio and the worst element
    assert [f.split(" [op] ")[1].split(":")[0] for f in fails] == ["dsink", "dsink"], fails
    assert fails[0].startswith("  FAIL capacity-rows [op] dsink: ratio ")
    assert "over their bound" in fails[0] and "expected" in fails[0]
    assert fails[0].endswith("a flipped sign: -dsink is within the bound everywhere")
    table = {line.split()[1]: line.split()[0] for line in out.splitlines()
             if line.startswith(("FAIL ", "ok "))}
    assert table.pop("dsink") == "FAIL" and set(table.values()) == {"ok"}
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    assert suite.get("failures") == "2"


def test_raising_and_mutating_adapters_are_caught(capsys):
    rc, out, err = check(capsys, "--impl", "oracle_tests.helpers.check_adapters:RaisingAdapter",
                         "--case", "lengths-above-width")
    assert rc == 1 and "Traceback" not in out + err
    assert "run: sparse_attention_forward: raised RuntimeError: unsupported head dim 32" in out
    rc, out, err = check(capsys, "--impl", "oracle_tests.helpers.check_adapters:MutatingAdapter",
                         "--case", "lengths-above-width", "--replays", "0")
    assert rc == 1
    assert ("FAIL lengths-above-width [op] no_mutation: sparse_attention_forward: wrote into "
            "its argument q: ") in out


def _no_cuda():
    return not torch.cuda.is_available()


@pytest.mark.parametrize("args, needle", [
    (["--case", "no-such-case"], "--case 'no-such-case' matches no case"),
    (["--catalog", "quick", "--case", "dsv4-pro-T16"], "use --catalog full"),
    (["--impl", "no_such_module_xyz:Adapter"], "cannot import module 'no_such_module_xyz'"),
    (["--impl", "dsv4_oracle.examples.megatron_style_adapter:Nope"], "has no attribute 'Nope'"),
    (["--impl", "json"], "provides none of the ops"),
    (["--impl", EXAMPLE, "--ops", "stable_topk"], "lacks op stable_topk"),
    (["--impl", "gpu_impl:torch", "--ops", "attention"], "unknown op 'attention'"),
    (["--impl", "gpu_impl:tpu"], "unknown built-in 'gpu_impl:tpu'"),
    (["--replays", "-1"], "--replays must be >= 0"),
    pytest.param(["--impl", "gpu_impl:cudnn"], "runs on CUDA", marks=pytest.mark.skipif(
        not _no_cuda(), reason="this machine has CUDA")),
    pytest.param(["--impl", "gpu_impl:torch", "--device", "cuda"], "no usable CUDA device",
                 marks=pytest.mark.skipif(not _no_cuda(), reason="this machine has CUDA")),
])
def test_bad_invocations_give_one_line_and_status_2(capsys, args, needle):
    rc, out, err = check(capsys, *args)
    assert rc == 2
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("dsv4-oracle check: error: ") and needle in err, err


def test_console_script_failure_has_no_traceback(tmp_path):
    """The installed entry point (python -m dsv4_oracle.cli): an adapter module that raises
    while importing gives one line and status 2."""
    (tmp_path / "broken_adapter.py").write_text("raise ImportError('cudnn kernels not built')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--impl",
                        "broken_adapter:Adapter"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == ("dsv4-oracle check: error: cannot import module "
                                "'broken_adapter' for --impl broken_adapter:Adapter: "
                                "ImportError: cudnn kernels not built")


def test_list_selects_the_quick_catalog(capsys):
    rc, out, _ = check(capsys, "--list")
    assert rc == 0
    from dsv4_oracle.runner import quick_ids
    listed = [line.split()[0] for line in out.splitlines()[:-1]]
    assert sorted(listed) == sorted(quick_ids())
    rc, out, _ = check(capsys, "--list", "--case", "sink-*")
    assert [line.split()[0] for line in out.splitlines()[:-1]] == [
        "sink-only-rows", "sink-neg-inf", "sink-pos-inf", "sink-large", "sink-log-k",
        "sink-mixed"]
