"""``dsv4-oracle check`` as a kernel engineer meets it in the first hour:

- ``--impl path/to/file.py:attr`` imports the modules beside the file (as ``python file.py``
  does) from any directory, and an adapter file named like a standard module (``json.py``)
  shadows nothing for the rest of the run;
- an adapter attribute that misspells an op it lacks (``sparse_attention_foward``) is a usage
  error naming the op, and the summary names the ops judged and those the oracle feeds;
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from dsv4_oracle.adapters import load_adapter
from dsv4_oracle.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OP_CASE = "lengths-above-width"       # a small op-level case

SIBLING = """\
from dsv4_oracle.gpu_impl import api


def forward(q, kv, ids, sink, v_dim, lengths):
    return api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                        backend="torch")
"""
ADAPTER = """\
import {sibling}


class Adapter:
    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        return {sibling}.forward(q, kv, ids, sink, v_dim, lengths)
"""


@pytest.fixture
def isolated_imports(monkeypatch):
    """``sys.path`` and ``sys.modules`` restored after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = dict(sys.modules)
    yield
    for name in set(sys.modules) - set(before):
        del sys.modules[name]
    sys.modules.update(before)


def check(capsys, *args):
    rc = main(["check", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def kernel_folder(tmp_path, adapter_file: str, sibling: str):
    kern = tmp_path / "kern"
    kern.mkdir()
    (kern / f"{sibling}.py").write_text(SIBLING)
    (kern / adapter_file).write_text(ADAPTER.format(sibling=sibling))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return kern, elsewhere


# ---------------------------------------------------------------------------------------------
# --impl path/to/file.py:attr
# ---------------------------------------------------------------------------------------------
def test_a_file_adapter_imports_the_modules_beside_it(capsys, tmp_path, monkeypatch,
                                                      isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "adapters.py", "fh_sibling_kernel")
    monkeypatch.chdir(elsewhere)
    rc, out, err = check(capsys, "--impl", "../kern/adapters.py:Adapter", "--case", OP_CASE,
                         "--replays", "0", "--report", str(tmp_path / "report"))
    assert rc == 0, out + err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["passed"] is True
    assert sys.path[-1] == str(kern)        # after every installed and standard module


def test_an_adapter_named_like_a_standard_module_shadows_nothing(capsys, tmp_path, monkeypatch,
                                                                 isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "json.py", "fh_sibling_kernel_json")
    monkeypatch.chdir(elsewhere)
    standard = sys.modules["json"]
    adapter = load_adapter(f"{kern / 'json.py'}:Adapter")
    assert adapter.ops == ("sparse_attention_forward",)
    assert sys.modules["json"] is standard and json.dumps({"a": 1}) == '{"a": 1}'
    module = sys.modules[type(adapter.target).__module__]
    assert module.__file__ == str(kern / "json.py")
    # end to end: the report (written with the standard json) after the adapter ran
    rc, out, err = check(capsys, "--impl", "../kern/json.py:Adapter", "--case", OP_CASE,
                         "--replays", "0", "--report", str(tmp_path / "report"))
    assert rc == 0, out + err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["passed"] is True


def test_a_file_adapter_reloaded_keeps_its_own_name(tmp_path, monkeypatch, isolated_imports):
    kern, elsewhere = kernel_folder(tmp_path, "fh_my_adapter.py", "fh_sibling_kernel_2")
    monkeypatch.chdir(elsewhere)
    for _ in range(2):                # the pytest plugin loads a spec once per test
        a = load_adapter(f"{kern / 'fh_my_adapter.py'}:Adapter")
        assert type(a.target).__module__ == "fh_my_adapter"
    assert sys.path.count(str(kern)) == 1


# ---------------------------------------------------------------------------------------------
# a misspelled op; the ops judged and the ops the oracle feeds
# ---------------------------------------------------------------------------------------------
class _Forward:
    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        from dsv4_oracle.gpu_impl import api
        return api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                            backend="torch")


class MisspelledForward:
    """The forward misspelled: without the check it passes with the oracle's forward."""

    sparse_attention_foward = _Forward.sparse_attention_forward

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        from dsv4_oracle.gpu_impl import api
        return api.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=v_dim,
                                             lengths=lengths, backend="torch")


class HelpersBesideTheirOps(_Forward):
    """Names close to an op are fine beside the op itself, or private."""

    def sparse_attention_forward_(self, *args, **kwargs):
        return self.sparse_attention_forward(*args, **kwargs)

    def _sparse_attention_backwrd(self):
        pass


class CapitalisedLayer(_Forward):
    Csa_Layer = _Forward.sparse_attention_forward


@pytest.mark.parametrize("attr, op, adapter", [
    ("sparse_attention_foward", "sparse_attention_forward", "MisspelledForward"),
    ("Csa_Layer", "csa_layer", "CapitalisedLayer")])
def test_an_attribute_that_misspells_a_missing_op_is_a_usage_error(capsys, attr, op, adapter):
    rc, out, err = check(capsys, "--impl", f"{__name__}:{adapter}", "--case", OP_CASE)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"its attribute {attr!r} looks like a misspelling of the op {op}, which it lacks" \
        in err


def test_names_close_to_an_op_beside_it_or_private_are_no_misspelling():
    a = load_adapter(f"{__name__}:HelpersBesideTheirOps")
    assert a.ops == ("sparse_attention_forward",)


def test_the_summary_names_the_ops_judged_and_the_ops_the_oracle_feeds(capsys):
    rc, out, _ = check(capsys, "--impl", f"{__name__}:HelpersBesideTheirOps", "--case",
                       "capacity-rows", "--replays", "0")
    assert rc == 0
    assert out.splitlines()[1] == ("ops judged: sparse_attention_forward; fed by the oracle "
                                   "(where a case has them): compressor_forward, "
                                   "indexer_compressor_forward, indexer_scores, stable_topk, "
                                   "build_csa_indices")
    rc, out, _ = check(capsys, "--impl", "gpu_impl:torch", "--ops", "sparse_attention_backward",
                       "--case", OP_CASE, "--replays", "0")
    assert rc == 0
    assert out.splitlines()[1] == ("ops judged: sparse_attention_backward; fed by the oracle "
                                   "(where a case has them): compressor_forward, "
                                   "indexer_compressor_forward, indexer_scores, stable_topk, "
                                   "build_csa_indices, sparse_attention_forward")


# ---------------------------------------------------------------------------------------------
# common slips: one line that points at the fix
# ---------------------------------------------------------------------------------------------
def _slip_folder(tmp_path, monkeypatch):
    kern, _ = kernel_folder(tmp_path, "adapters.py", "fh_sibling_kernel_slips")
    monkeypatch.chdir(kern)
    return kern


@pytest.mark.parametrize("args, needle", [
    (["--impl", "adapters.py"], "module 'adapters' provides none of the ops itself; Adapter "
                                "does: name one, as in --impl adapters.py:Adapter"),
    (["--impl", "adapters"], "as in --impl adapters:Adapter"),
    (["--impl", "adapters.Adapter"], "did you mean adapters:Adapter? (module:attr)"),
    (["--impl", "adapters.py:Adaptr"], "has no attribute 'Adaptr' (--impl adapters.py:Adaptr); "
                                       "did you mean 'Adapter'?"),
    (["--impl", "adapter.py:Adapter"], "does not exist; did you mean 'adapters.py'?"),
    (["--impl", "refrence"], "did you mean 'reference'?"),
    (["--impl", "gpu_impl:torhc"], "did you mean 'gpu_impl:torch'?"),
    (["--impl", "gpu_impl:torch", "--ops", "sparse_attention_foward"],
     "unknown op 'sparse_attention_foward'; ops are compressor_forward, indexer_compressor_forward"),
    (["--case", "sink-mixd"], "--case 'sink-mixd' matches no case of the full catalog; did you "
                              "mean 'sink-mixed'?"),
    (["--impl", "adapters.py:Adapter", "--device", "cpus"], "--device 'cpus' is not a torch "
                                                            "device"),
    pytest.param(["--impl", "adapters.py:Adapter", "--device", "cuda"],
                 "--device cuda: this machine has no usable CUDA device "
                 "(torch.cuda.is_available() is False); leave out --device to run on the "
                 "adapter's own device", marks=pytest.mark.skipif(
                     __import__("torch").cuda.is_available(), reason="this machine has CUDA")),
])
def test_a_slip_gets_one_line_that_points_at_the_fix(capsys, tmp_path, monkeypatch,
                                                     isolated_imports, args, needle):
    _slip_folder(tmp_path, monkeypatch)
    rc, out, err = check(capsys, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert needle in err, err
    assert "gpu_impl:torch" not in err or "gpu_impl" in " ".join(args)  # never replaces yours


def test_a_cuda_adapter_without_cuda_is_not_told_to_use_another_kernel(tmp_path, monkeypatch,
                                                                       isolated_imports):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    kern = _slip_folder(tmp_path, monkeypatch)
    text = (kern / "adapters.py").read_text().replace("class Adapter:",
                                                      "class Adapter:\n    device = 'cuda'\n")
    (kern / "adapters.py").write_text(text)
    why = load_adapter("adapters.py:Adapter").unavailable()
    assert why == ("adapter adapters.py:Adapter runs on 'cuda' (its device), and this machine "
                   "has no usable CUDA device (torch.cuda.is_available() is False): run it on a "
                   "CUDA machine, or on the CPU if it can (device 'cpu')")


@pytest.mark.parametrize("call, needle", [
    (lambda p: p.cases(pattern="sink-mixd"), "pattern 'sink-mixd' matches no case of the quick "
                                             "catalog; did you mean 'sink-mixed'?"),
    (lambda p: p.cases("quick", pattern="dsv4-pro-T16"), "(cases('full', ...))"),
    (lambda p: p.assert_conforms("gpu_impl:torch", "sink-mixd"), "did you mean 'sink-mixed'?"),
    (lambda p: p.assert_conforms("no_such_module_xyz:Adapter", OP_CASE),
     "implementation: cannot import module 'no_such_module_xyz' for implementation "
     "'no_such_module_xyz:Adapter'"),
    (lambda p: p.assert_conforms("adapters.py", OP_CASE),
     "as in implementation adapters.py:Adapter"),
])
def test_the_pytest_plugin_speaks_of_its_own_arguments(tmp_path, monkeypatch, isolated_imports,
                                                      call, needle):
    """Inside a pytest file there is no --impl, --case or --list."""
    from dsv4_oracle import pytest_plugin
    _slip_folder(tmp_path, monkeypatch)
    with pytest.raises(ValueError) as e:
        call(pytest_plugin)
    assert needle in str(e.value), str(e.value)
    assert not any(opt in str(e.value) for opt in ("--impl", "--case", "--list", "--catalog"))


# ---------------------------------------------------------------------------------------------
# your own shapes
# ---------------------------------------------------------------------------------------------
SHAPE = "H=2,D=16,K=4,W=8,T=32,sink=finite"


def test_check_at_your_own_shapes(capsys, tmp_path):
    rc, out, err = check(capsys, "--impl", "gpu_impl:torch", "--shape", SHAPE, "--shape",
                         "H=2,D=16,T=24,sink=none,layout=single", "--replays", "0",
                         "--ops", "sparse_attention_forward,sparse_attention_backward",
                         "--junit", str(tmp_path / "junit.xml"))
    assert rc == 0, out + err
    assert out.startswith("dsv4-oracle check: gpu_impl:torch on cpu (backends: torch); 2 cases "
                          "at your shapes, replays 0")
    junit = (tmp_path / "junit.xml").read_text()
    assert "dsv4_oracle.shape-H2-D16-K4-W8-T32-sink_finite" in junit
    assert "dsv4_oracle.shape-H2-D16-T24-sink_none-layout_single" in junit
    rc, out, _ = check(capsys, "--shape", SHAPE, "--list")
    assert rc == 0 and out.splitlines() == [
        "shape-H2-D16-K4-W8-T32-sink_finite H 2, D 16, Dv 16, K 4, W 8, ratio 4, H_I 64, D_I 128, "
        "T 32, bfloat16, sink normal, layer csa", "1 case at your shapes"]


@pytest.mark.parametrize("args, needle", [
    (["--shape", "H=2,T=8"], "--shape 'H=2,T=8': layout=mixed needs T >= 16"),
    (["--shape", "h=2"], "--shape 'h=2': unknown key 'h'; keys are H, D"),
    (["--shape", SHAPE, "--case", "sink-mixed"], "--shape builds its own cases: leave out "
                                                 "--case and --catalog"),
])
def test_a_bad_shape_is_one_line(capsys, args, needle):
    rc, out, err = check(capsys, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def test_the_pytest_plugin_builds_cases_at_your_shapes():
    from dsv4_oracle import pytest_plugin
    params = pytest_plugin.cases(shape=[SHAPE, {"H": 2, "D": 16, "T": 24, "layout": "single"}])
    assert [p.id for p in params] == ["shape-H2-D16-K4-W8-T32-sink_finite",
                                      "shape-H2-D16-T24-layout_single"]
    outcome = pytest_plugin.assert_conforms("gpu_impl:torch", params[0].values[0], replays=0,
                                            ops=["sparse_attention_forward"])
    assert outcome.passed
    with pytest.raises(ValueError, match="shape 'T=8': layout=mixed needs T >= 16"):
        pytest_plugin.cases(shape="T=8")
    with pytest.raises(ValueError, match="leave out catalog and pattern"):
        pytest_plugin.cases("full", shape=SHAPE)


def test_counts_take_their_plural(capsys):
    rc, out, _ = check(capsys, "--impl", "gpu_impl:torch", "--ops", "sparse_attention_forward",
                       "--case", OP_CASE, "--replays", "0")
    assert rc == 0
    assert "; full catalog, 1 case, replays 0" in out.splitlines()[0]
    assert " on 1 case;" in out.splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# polish: help texts, the power table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["check"], ["selfcheck"], ["init-adapter"], ["mutate"],
                                  ["power"], []])
def test_help_texts_are_plain_text_for_an_installed_command(capsys, argv):
    assert main([*argv, "--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and "examples/" not in text, text
    if argv == ["check"]:
        assert "Exit status: 0 every check holds; 1 a check failed" in text
        assert "dsv4_oracle.examples.megatron_style_adapter:MegatronStyleAdapter" in text


def test_the_power_table_keeps_its_columns_aligned_beside_a_flag():
    from dsv4_oracle.power import PowerRow, format_table
    rows = [PowerRow("a", "dq", 10, 9, 0, 1, 1, 0, 0.012, 0.017, 0.02),
            PowerRow("a", "out", 10, 10, 0, 0, 0, 0, 0.0078, 0.011, 0.02)]
    head, *lines = format_table(rows).splitlines()
    end = len(head)                       # every row's median ends under the header's
    assert [line[:end].endswith(("1.7%", "1.1%")) for line in lines] == [True, True]
    assert lines[0][end:] == "  <-- above 1%" and lines[1][end:] == ""
