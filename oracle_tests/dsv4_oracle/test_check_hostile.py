"""``dsv4-oracle check`` against implementations that try to fool it (negative controls from
``oracle_tests/helpers/check_adapters.py``):

- an op that writes into what it is handed (an intermediate such as ``lse``, ``target``,
  ``lengths``, ``ids`` or the layout, not only a case input) fails its ``no_mutation`` check,
  naming the op, the argument and the elements; the oracle is evaluated on the values handed
  out, never on what the op wrote (each of these adapters passed when the oracle saw its writes);
- an op that exits (``SystemExit``) fails, an adapter that exits while it is loaded is a usage
  error, Ctrl-C ends the run with status 130: never a silent exit 0;
- an op that never returns fails after ``--timeout``; one that swallows every interrupt ends the
  process with status 1 and one line (the watchdog);
- a declared precision looser than the default is shown in the verdict and the report, and
  ``--precision default`` judges with the default;
- a selection that judges nothing, an empty ``--impl``, adapters whose ``name``,
  ``unavailable()`` or ``precision`` raise, ``--device meta`` and parser errors of both
  subcommands exit 2 with one line;
- ``--impl path/to/file.py:attr`` loads an adapter from a file.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from dsv4_oracle import invoke
from dsv4_oracle.adapters import AdapterError, load_adapter
from dsv4_oracle.cli import main
from dsv4_oracle.reference.error_model import Precision

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = "oracle_tests.helpers.check_adapters:"
LAYER_CASE = "capacity-rows"          # a CSA layer case: intermediates fed from op to op
OP_CASE = "lengths-above-width"       # an op-level case


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def check(capsys, *args):
    rc = main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_usage_error(rc, out, err, needle, prog="dsv4-oracle check"):
    assert rc == 2, (rc, out, err)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: ") and needle in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# writes into what an op is handed
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter, level, op, arg", [
    ("LseFillBackwardAdapter", "op", "sparse_attention_backward", "lse"),
    ("ZeroTargetAdapter", "op", "sparse_indexer_loss_grad", "target"),
    ("ZeroLengthsAdapter", "op", "sparse_attention_forward", "lengths"),
    ("ClampIdsAdapter", "op", "sparse_attention_forward", "ids"),
    ("LayoutWriterAdapter", "op", "build_csa_indices", "layout.cu_seqlens"),
    ("LayerLeafWriterAdapter", "layer", "csa_layer", "layout"),
])
def test_a_write_into_an_intermediate_fails_the_op(capsys, adapter, level, op, arg):
    rc, out, err = check(capsys, "--impl", FIX + adapter, "--case", LAYER_CASE, "--replays", "1")
    assert rc == 1, out + err
    fails = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    assert len(fails) == 1, fails
    assert fails[0].startswith(f"  FAIL {LAYER_CASE} [{level}] no_mutation: {op}: wrote into "
                               f"its argument {arg}: "), fails[0]
    if arg != "layout":
        assert re.search(r": \d+ of \d+ elements changed, the first at index ", fails[0])
    else:
        assert "attribute num_rows changed from 40 to 0" in fails[0]


def test_a_result_rewritten_by_a_later_call_is_judged_as_returned(capsys):
    """The forward returns out 2x too large; the backward (called later) halves that tensor in
    place: the judged out is what the forward returned, and the rewrite fails the forward."""
    rc, out, _ = check(capsys, "--impl", FIX + "ResultRewriterAdapter", "--case", LAYER_CASE,
                       "--replays", "1")
    assert rc == 1
    fails = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    assert [f.split("] ")[1].split(":")[0] for f in fails] == ["out", "outputs_stable"], fails
    assert "outputs_stable: sparse_attention_forward: its returned out changed after it was " \
           "returned, during the later call of sparse_attention_backward" in fails[1]


def test_call_op_hands_out_copies_and_names_the_written_elements():
    q = torch.arange(12.0).reshape(3, 4)
    kept = q.clone()

    def fwd(q, kv, ids, sink, *, v_dim=None, lengths=None):
        q[1, 2] = -1.0
        q[2, 0] = -1.0
        return q

    with pytest.raises(invoke.OpError) as e:
        invoke.call_op(fwd, "sparse_attention_forward", (q, None, None, None))
    assert e.value.kind == "mutation"
    assert e.value.message.startswith("wrote into its argument q: 2 of 12 elements changed, the "
                                      "first at index (1, 2)")
    assert torch.equal(q, kept), "the caller's tensor is never handed out"
    # a result is the caller's own: the op cannot reach it after returning
    held = {}

    def keeps(x):
        held["y"] = x * 2
        return held["y"]

    y = invoke.call_op(keeps, "f", (q,))
    held["y"].zero_()
    assert torch.equal(y, kept * 2)


# ---------------------------------------------------------------------------------------------
# exiting, interrupting, hanging
# ---------------------------------------------------------------------------------------------
def test_exit_in_an_op_fails_the_op(capsys, tmp_path):
    rc, out, err = check(capsys, "--impl", FIX + "ExitingAdapter", "--case", OP_CASE,
                         "--junit", str(tmp_path / "j.xml"))
    assert rc == 1 and "Traceback" not in out + err
    assert "run: sparse_attention_forward: exited SystemExit: 0 (at check_adapters.py:" in out
    assert "\nFAIL: 1 of 1 check failed in 1 of 1 case" in out
    assert 'failures="1"' in (tmp_path / "j.xml").read_text()


@pytest.mark.parametrize("spec, needle", [
    ("sys:exit", "--impl sys:exit: calling exit() to make the adapter failed: SystemExit"),
    ("{tmp}/exits_at_import.py:Adapter",
     "cannot import module 'exits_at_import' for --impl {tmp}/exits_at_import.py:Adapter: "
     "SystemExit: 0"),
])
def test_an_adapter_that_exits_while_loaded_is_a_usage_error(capsys, tmp_path, spec, needle):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    rc, out, err = check(capsys, "--impl", spec.format(tmp=tmp_path))
    one_line_usage_error(rc, out, err, needle.format(tmp=tmp_path))


def test_ctrl_c_exits_130_with_one_line(capsys):
    rc, out, err = check(capsys, "--impl", FIX + "InterruptedAdapter", "--case", OP_CASE)
    assert rc == 130 and err == "dsv4-oracle check: interrupted\n" and "Traceback" not in out


def test_an_op_that_never_returns_fails_after_the_timeout(capsys):
    t0 = time.monotonic()
    rc, out, err = check(capsys, "--impl", FIX + "SleeperAdapter", "--case", OP_CASE,
                         "--timeout", "0.5", "--replays", "1")
    assert rc == 1, out + err
    assert "run: sparse_attention_forward: did not return within 0.5 s (--timeout)" in out
    assert time.monotonic() - t0 < 60


def test_an_op_that_swallows_the_timeout_still_fails():
    def swallows(*args):
        try:
            time.sleep(30)
        except BaseException:          # the first interrupt: swallowed, then it returns
            return torch.zeros(1)

    with pytest.raises(invoke.OpError) as e:
        invoke.call_op(swallows, "f", (), timeout=0.3)
    assert e.value.kind == "timeout" and "over the timeout of 0.3 s" in e.value.message


def test_outside_the_main_thread_a_hung_op_is_abandoned():
    release = threading.Event()
    box = {}

    def hangs():
        release.wait(60)
        return torch.zeros(1)

    def caller():
        try:
            invoke.call_op(hangs, "hung_op", (), timeout=0.3)
        except invoke.OpError as exc:
            box["exc"] = exc
        box["abandoned"] = invoke.abandoned()

    t = threading.Thread(target=caller)
    t.start()
    t.join(30)
    release.set()
    assert box["exc"].kind == "timeout" and "did not return within 0.3 s" in box["exc"].message
    assert "hung_op" in box["abandoned"]


def test_a_hung_op_thread_does_not_keep_the_process_alive(tmp_path):
    """check run outside the main thread (no SIGALRM): the op thread is abandoned after the
    timeout, the reports are written, and the process exits 1 instead of waiting for it."""
    junit = tmp_path / "j.xml"
    argv = ["check", "--no-progress", "--impl", FIX + "SleeperAdapter", "--case", OP_CASE,
            "--timeout", "1", "--junit", str(junit)]
    code = (f"import sys, threading\nfrom dsv4_oracle.cli import main\n"
            f"t = threading.Thread(target=main, args=({argv!r},))\nt.start()\nt.join()\n"
            f"sys.exit(0)\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "run: sparse_attention_forward: did not return within 1 s (--timeout)" in p.stdout
    assert p.stderr.strip().splitlines()[-1] == (
        "dsv4-oracle check: sparse_attention_forward never returned; exiting without waiting "
        "for it")
    assert 'failures="1"' in junit.read_text()


def test_an_op_stuck_past_every_interrupt_ends_the_process():
    """The watchdog: one line on stderr, status 1, after the timeout plus a grace period."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "dsv4_oracle.cli", "check", "--no-progress",
                        "--impl", FIX + "StubbornSleeperAdapter", "--case", OP_CASE,
                        "--timeout", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines() == [
        "dsv4-oracle: error: sparse_attention_forward did not return within 1 s (--timeout) "
        "and cannot be interrupted (stuck in native code, or swallowing interrupts); exiting "
        "with status 1"]


# ---------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ["LoosePrecisionAdapter", "MappedPrecisionAdapter"])
def test_a_looser_declared_precision_is_flagged(capsys, tmp_path, adapter):
    rc, out, _ = check(capsys, "--impl", FIX + adapter, "--case", LAYER_CASE, "--replays", "1",
                       "--report", str(tmp_path))
    verdict = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL:"))][-1]
    assert rc == 0 and verdict.startswith("PASS")      # the widened bounds let 10% through
    assert verdict.endswith("[bounds widened by the adapter's declared precision: "
                            "sparse_attention_forward]")
    assert ("WARNING: the adapter declares a precision looser than the default, which widens "
            "its own bounds") in out
    assert "sparse_attention_forward (bfloat16): acc bfloat16 > float32" in out
    assert "precision assumed (declared by the adapter): acc bfloat16, io bfloat16, stats " \
           "bfloat16" in out
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["run"]["precision"]["source"] == "adapter"
    assert rep["run"]["precision"]["looser"] == [
        "sparse_attention_forward (bfloat16): acc bfloat16 > float32, stats bfloat16 > float32"]
    assert rep["cases"][0]["precision"]["sparse_attention_forward"]["acc"] == "torch.bfloat16"
    assert "**looser than the default**" in (tmp_path / "report.md").read_text()


def test_precision_default_ignores_the_declaration(capsys):
    rc, out, _ = check(capsys, "--impl", FIX + "LoosePrecisionAdapter", "--case", LAYER_CASE,
                       "--replays", "1", "--precision", "default")
    assert rc == 1
    assert "precision assumed (the default, --precision default): acc float32, io bfloat16, " \
           "stats float32" in out
    fails = [line for line in out.splitlines() if line.startswith("  FAIL ")]
    assert len(fails) == 1 and fails[0].startswith(f"  FAIL {LAYER_CASE} [op] out: ratio ")
    assert "WARNING" not in out


def test_precision_resolves_per_op():
    bf = Precision(acc=torch.bfloat16, io=torch.bfloat16)
    a = load_adapter(FIX + "MappedPrecisionAdapter")
    assert a.precision(torch.bfloat16, op="sparse_attention_forward") == bf
    assert a.precision(torch.bfloat16, op="sparse_attention_backward").acc == torch.float32
    assert a.precision(torch.bfloat16).acc == torch.float32
    a._precision = {"stable_topk": lambda dt: Precision.of(dt)}
    assert a.precision(torch.float16, op="stable_topk") == Precision.of(torch.float16)
    bad = type("Bad", (), {"precision": {"attention": bf},
                           "sparse_attention_forward": lambda *a, **k: None})
    with pytest.raises(AdapterError, match="its precision names unknown op 'attention'"):
        from dsv4_oracle.adapters import Adapter
        Adapter(bad(), name="bad")


# ---------------------------------------------------------------------------------------------
# one line, status 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--ops", "csa_layer", "--case", "hostile-ids-no-lengths"], "nothing was judged: --ops "
     "csa_layer on the 1 selected case (hostile-ids-no-lengths) yield no check that can "
     "fail"),
    (["--ops", "stable_topk", "--case", "hostile-ids-no-lengths"], "nothing was judged: --ops "
     "stable_topk on the 1 selected case"),
    (["--impl", ""], "--impl must name an adapter"),
    (["--impl", FIX + "RaisingNameAdapter"], "reading its attribute 'name': RuntimeError: "
     "adapter attribute failed"),
    (["--impl", FIX + "RaisingUnavailableAdapter", "--case", OP_CASE],
     "unavailable(): RuntimeError: cannot probe the GPU"),
    (["--impl", FIX + "RaisingPrecisionAdapter", "--case", OP_CASE],
     "precision(torch.bfloat16) for sparse_attention_forward: RuntimeError: no precision table"),
    (["--impl", "gpu_impl:torch", "--device", "meta"], "device 'meta' holds no values"),
    (["--impl", "reference", "--device", "meta"], "device 'meta' holds no values"),
    (["--replays", "x"], "argument --replays: invalid int value: 'x'"),
    (["--catalog", "nope"], "argument --catalog: invalid choice: 'nope'"),
    (["--precision", "loose"], "argument --precision: invalid choice: 'loose'"),
    (["--timeout", "-1"], "--timeout must be a number of seconds in [0, 1e+06]"),
    (["--timeout", "nan"], "--timeout must be a number of seconds in [0, 1e+06]"),
    (["--impl", "examples/no_such_file.py:Adapter"],
     "the file 'examples/no_such_file.py' does not exist"),
    (["--impl", "examples/megatron_style_adapter.py:Nope"], "has no attribute 'Nope'"),
])
def test_usage_errors_are_one_line(capsys, args, needle):
    rc, out, err = check(capsys, *args)
    one_line_usage_error(rc, out, err, needle)


@pytest.mark.parametrize("argv, prog, needle", [
    (["selfcheck", "--fast"], "dsv4-oracle", "unrecognized arguments: --fast"),
    (["selfcheck", "extra"], "dsv4-oracle", "unrecognized arguments: extra"),
    ([], "dsv4-oracle", "the following arguments are required: command"),
    (["selfchek"], "dsv4-oracle", "invalid choice: 'selfchek'"),
])
def test_parser_errors_of_every_subcommand_are_one_line(capsys, argv, prog, needle):
    rc = main(argv)
    out, err = capsys.readouterr()
    one_line_usage_error(rc, out, err, needle, prog=prog)


# ---------------------------------------------------------------------------------------------
# --impl path/to/file.py:attr
# ---------------------------------------------------------------------------------------------
def test_impl_from_a_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # not importable as a module from here
    path = os.path.join(ROOT, "examples", "megatron_style_adapter.py")
    rc, out, err = check(capsys, "--impl", f"{path}:MegatronStyleAdapter", "--case", OP_CASE,
                         "--replays", "1")
    assert rc == 0, out + err
    assert out.startswith(f"dsv4-oracle check: {path}:MegatronStyleAdapter on cpu")
    (tmp_path / "adapters.py").mkdir()
    rc, out, err = check(capsys, "--impl", "adapters.py:Adapter")
    one_line_usage_error(rc, out, err, "the file 'adapters.py' is a directory")
