"""``dsv4-oracle check`` against ops that fail, return something no later op can use, or change
what they returned afterwards (negative controls from ``oracle_tests/helpers/check_adapters.py``):

- an op that raises, or returns an output of the wrong kind, dtype, shape or device, or breaks
  the exact non-finite pattern of the contract (``-inf`` scores of invisible groups, ``+inf``
  lse of rows without a key, ids of visible groups), fails *that* op, naming the output and what
  was expected; the oracle stands in for it downstream, and every other op is still run and
  judged (before, the level ended in one ``run`` failure, or the op that read the bad output
  was blamed for it);
- a tensor an op returned is judged as returned and must keep its bits: a view of a workspace
  the next call rewrites, a backward that writes into the forward's ``out``, a packed layer that
  fills ``out`` in during its backward each fail ``outputs_stable``, naming the tensor and the
  call that changed it;
- messages that no terminal, file or XML parser takes as they are (a lone surrogate, ANSI
  escapes, a NUL, 5 MB, a ``__str__`` that raises) and non-string backend names are made
  printable: the summary, ``report.json``, ``report.md`` and the JUnit XML are written and
  readable, on an ASCII terminal too;
- a watchdog that needs no Python thread ends an op that holds the GIL in native code, and the
  adapter's import and construction are bounded by ``--timeout`` too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from dsv4_oracle import fixtures
from dsv4_oracle.adapters import load_adapter
from dsv4_oracle.cli import main
from dsv4_oracle.runner import check_case

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = "oracle_tests.helpers.check_adapters:"
LAYER_CASE = "capacity-rows"          # a CSA layer case: every op, T 40, H 4, Dv 32
OP_CASE = "lengths-above-width"       # an op-level case


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def check(capsys, *args):
    rc = main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


# (adapter, case, level, the failing checks as (name, quantity), text of the first failure,
#  quantities still judged and passing at that level)
ATTENTION = {"dq", "dkv", "dsink"}
BAD_OPS = [
    # the op raises: that op fails, the oracle stands in, the rest is judged
    ("RaisingTopkAdapter", LAYER_CASE, "op", [("run: stable_topk", "run")],
     "raised RuntimeError: top-k kernel rejects this shape (test fixture) (at "
     "check_adapters.py:", {"scores", "ids", "lengths", "out", "lse", "loss", "dq_idx"} | ATTENTION),
    ("MissingKeywordAdapter", OP_CASE, "op", [("run: sparse_attention_forward", "run")],
     "cannot be called as the protocol calls it, sparse_attention_forward(q, kv, ids, sink, *, "
     "v_dim, lengths): got an unexpected keyword argument 'v_dim'; its signature is (q, kv, ids, "
     "sink)", set()),
    ("RaisingLayerBackwardAdapter", LAYER_CASE, "layer", [("run: csa_layer", "run")],
     "in the backward: raised RuntimeError: backward kernel failed (test fixture)",
     {"scores", "cmp_ids", "ids", "out", "lse", "loss", "target"}),
    # an output no later op can use: refused when the op returns, named, the oracle stands in
    ("FloatIdsAdapter", LAYER_CASE, "op", [("run: build_csa_indices", "ids")],
     "returned an unusable ids: dtype torch.float32, expected a signed integer dtype",
     {"cmp_ids", "out", "lse", "loss"} | ATTENTION),
    ("FloatTopkIdsAdapter", LAYER_CASE, "op", [("run: stable_topk", "cmp_ids")],
     "returned an unusable cmp_ids: dtype torch.float32, expected a signed integer dtype",
     {"scores", "ids", "out", "loss", "dq_idx"}),
    ("InvisibleTopkAdapter", LAYER_CASE, "op", [("run: stable_topk", "cmp_ids")],
     "returned an unusable cmp_ids: cmp_ids[0, 0] = 0 is not a compressed group visible to row "
     "0 (its visible ids are none", {"scores", "ids", "out", "loss"}),
    ("WrongRowsOutAdapter", LAYER_CASE, "op", [("run: sparse_attention_forward", "out")],
     "returned an unusable out: shape (59, 4, 32), expected (40, 4, 32) = [T, H, v_dim]; the "
     "oracle's result, rounded as a kernel stores it, stood in for it downstream",
     {"ids", "loss"} | ATTENTION),
    ("IntOutAdapter", LAYER_CASE, "op", [("run: sparse_attention_forward", "out")],
     "returned an unusable out: dtype torch.int32, expected a floating-point dtype",
     {"loss"} | ATTENTION),
    ("MetaOutAdapter", LAYER_CASE, "op", [("run: sparse_attention_forward", "out")],
     "returned an unusable out: a tensor on the meta device, which holds no values",
     {"loss"} | ATTENTION),
    ("NaNLseAdapter", LAYER_CASE, "op", [("run: sparse_attention_forward", "lse")],
     "returned an unusable lse: lse[10, 0] = nan on a row with no valid slot: the contract's "
     "lse there is +inf (section 6)", {"loss", "target"} | ATTENTION),
    ("HugeScoresAdapter", LAYER_CASE, "op", [("run: indexer_scores", "scores")],
     "returned an unusable scores: scores[0, 0] = -1.0000000150474662e+30, but group 0 is not "
     "visible to row 0: the contract's score there is -inf", {"cmp_ids", "ids", "out", "loss"}),
    ("ExpandedScoresAdapter", LAYER_CASE, "op", [("run: indexer_scores", "scores")],
     "returned an unusable scores: scores[3, 0] = -inf for a visible group with finite inputs",
     {"cmp_ids", "ids", "out", "loss", "dq_idx"}),
    # outputs changed after they were returned
    ("WorkspaceForwardAdapter", LAYER_CASE, "op",
     [("outputs_stable: sparse_attention_forward", "outputs_stable")],
     "its returned out changed after it was returned, during the later call of "
     "sparse_attention_forward (a call on other inputs, after the replays): ",
     {"out", "lse"} | ATTENTION),
    ("RepointedOutAdapter", LAYER_CASE, "op",
     [("outputs_stable: sparse_attention_forward", "outputs_stable")],
     "its returned out changed after it was returned, during the ", {"out", "lse"} | ATTENTION),
    ("ScratchOutBackwardAdapter", LAYER_CASE, "op",
     [("outputs_stable: sparse_attention_forward", "outputs_stable")],
     "its returned out changed after it was returned, during the later call of "
     "sparse_attention_backward (the grad-enabled run): ", {"out", "lse"} | ATTENTION),
    # its backward forms Delta from an out the judge never saw (neither the zeros returned nor
    # the oracle's unrounded out): dq and dsink fail with it, under either convention
    ("LateOutLayerAdapter", LAYER_CASE, "layer",
     [("out", "out"), ("dq", "dq"), ("dsink", "dsink"),
      ("outputs_stable: csa_layer", "outputs_stable")],
     "ratio ", {"lse", "ids", "loss", "dkv"}),
    # messages made printable: one line, escapes, cut at TEXT_LIMIT
    ("StrRaisesAdapter", OP_CASE, "op", [("run: sparse_attention_forward", "run")],
     "raised _StrRaises: <a _StrRaises whose str() raised ValueError>", set()),
    ("ControlCharsMessageAdapter", OP_CASE, "op", [("run: sparse_attention_forward", "run")],
     "raised RuntimeError: \\x1b[31mred\\x1b[0m\\x00 and more", set()),
    ("SurrogateMessageAdapter", OP_CASE, "op", [("run: sparse_attention_forward", "run")],
     "raised RuntimeError: bad byte \\udcff in a path, caf\u00e9", set()),
    ("HugeMessageAdapter", OP_CASE, "op", [("run: sparse_attention_forward", "run")],
     "xxxxx ... (5000000 characters in all)", set()),
]


@pytest.mark.parametrize("adapter, case, level, failing, text, judged", BAD_OPS,
                         ids=[r[0] for r in BAD_OPS])
def test_a_bad_op_fails_alone_and_the_rest_is_judged(adapter, case, level, failing, text, judged):
    outcome = check_case(load_adapter(FIX + adapter), fixtures.get(case), replays=0)
    assert outcome.error is None
    got = [(c.name, c.extra["quantity"]) for c in outcome.failed_checks]
    assert got == failing, [c.detail for c in outcome.failed_checks]
    first = outcome.failed_checks[0]
    assert first.extra["level"] == level
    assert text in first.detail, first.detail
    assert len(first.detail) < 3000 and "\n" not in first.detail
    passed = {c.extra["quantity"] for c in outcome.checks
              if c.extra["level"] == level and c.status == "passed"}
    assert judged <= passed, judged - passed


def test_a_right_implementation_keeps_every_returned_tensor():
    outcome = check_case(load_adapter("gpu_impl:torch"), fixtures.get(LAYER_CASE), replays=2)
    stable = [c for c in outcome.checks if c.extra["quantity"] == "outputs_stable"]
    assert [c.extra["level"] for c in stable] == ["op", "layer"]
    assert all(c.passed and c.judged for c in stable)
    assert stable[0].detail.startswith("20 returned tensors kept their bits through ")


def test_the_runner_reads_what_the_op_returned_not_what_it_holds_later(capsys):
    """The workspace adapter's out is right when returned: only outputs_stable fails, and the
    summary names the tensor, the op and the call."""
    rc, out, _ = check(capsys, "--impl", FIX + "WorkspaceForwardAdapter", "--case", LAYER_CASE,
                       "--replays", "2")
    assert rc == 1
    fails = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    assert len(fails) == 1 and fails[0].startswith(
        f"  FAIL {LAYER_CASE} [op] outputs_stable: sparse_attention_forward: its returned out "
        f"changed after it was returned"), fails
    assert "; also changed: lse of sparse_attention_forward" in fails[0]


# ---------------------------------------------------------------------------------------------
# what the reports make of odd adapter text
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ["SurrogateMessageAdapter", "ControlCharsMessageAdapter"])
def test_odd_messages_leave_every_report_readable(capsys, tmp_path, adapter):
    junit = tmp_path / "j.xml"
    rc, out, err = check(capsys, "--impl", FIX + adapter, "--case", OP_CASE, "--report",
                         str(tmp_path / "r"), "--junit", str(junit))
    assert rc == 1 and "Traceback" not in out + err, err
    tree = ET.parse(junit)                       # a JUnit parser reads it
    (failure,) = tree.getroot().iter("failure")
    assert failure.get("message").startswith("run: sparse_attention_forward (error): raised ")
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["summary"]["checks_failed"] == 1
    md = (tmp_path / "r" / "report.md").read_text(encoding="utf-8")
    assert "run: sparse_attention_forward" in md


def test_odd_messages_print_on_an_ascii_terminal():
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONIOENCODING="ascii")
    p = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--no-progress",
                        "--impl", FIX + "SurrogateMessageAdapter", "--case", OP_CASE],
                       cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert b"Traceback" not in p.stderr and b"\\udcff in a path, caf\\xe9" in p.stdout


def test_odd_backend_names_do_not_break_the_summary(capsys):
    rc, out, err = check(capsys, "--impl", FIX + "OddBackendsLayerAdapter", "--case",
                         LAYER_CASE, "--replays", "0")
    assert rc == 0, out + err
    assert "(backends: 2.5, <object object at 0x" in out.splitlines()[0]
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_an_adapter_file_named_like_a_standard_module_does_not_replace_it(capsys, tmp_path):
    (tmp_path / "json.py").write_text(
        "from dsv4_oracle.adapters import GpuImplAdapter\n\n\n"
        "class Adapter(GpuImplAdapter):\n"
        "    ops = ('sparse_attention_forward',)\n\n"
        "    def __init__(self):\n"
        "        super().__init__('torch', 'cpu')\n")
    stdlib_json = sys.modules["json"]
    try:
        rc, out, err = check(capsys, "--impl", f"{tmp_path}/json.py:Adapter", "--case", OP_CASE,
                             "--replays", "0", "--report", str(tmp_path / "r"))
        assert rc == 0, out + err
        assert sys.modules["json"] is stdlib_json
        assert json.loads((tmp_path / "r" / "report.json").read_text())["passed"] is True
    finally:
        sys.modules["json"] = stdlib_json


# ---------------------------------------------------------------------------------------------
# the watchdog and the time limit of loading
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ctypes.PyDLL(None).sleep")
def test_an_op_holding_the_gil_in_native_code_ends_the_process():
    """No Python thread can run while the op sleeps in C holding the GIL (a threading.Timer
    never fires): faulthandler's watchdog ends the process, the supervisor prints the line."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--no-progress",
                        "--impl", FIX + "GilHoldingSleeperAdapter", "--case", OP_CASE,
                        "--timeout", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines() == [
        "dsv4-oracle: error: sparse_attention_forward did not return within 1 s (--timeout) "
        "and cannot be interrupted (stuck in native code, or swallowing interrupts); exiting "
        "with status 1"]


@pytest.mark.parametrize("spec, needle", [
    (FIX + "HangingConstructorAdapter",
     "loading the adapter oracle_tests.helpers.check_adapters:HangingConstructorAdapter did not "
     "finish within 1 s (--timeout)"),
    ("{tmp}/hangs_at_import.py:Adapter",
     "loading the adapter {tmp}/hangs_at_import.py:Adapter did not finish within 1 s "
     "(--timeout)"),
])
def test_loading_the_adapter_is_bounded_by_the_timeout(tmp_path, spec, needle):
    """An import or a construction that never ends is a usage error after --timeout (run in
    a process of its own: without the bound it would never end)."""
    (tmp_path / "hangs_at_import.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--no-progress",
                        "--impl", spec.format(tmp=tmp_path), "--timeout", "1"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout) == (2, ""), p.stdout + p.stderr
    assert p.stderr == f"dsv4-oracle check: error: {needle.format(tmp=tmp_path)}\n"
