"""The regression fixture store: verify passes on the checkout and fails on every kind of
tampering (on temporary copies), reporting each as a problem line, never raising; regen is
serial, atomic (a killed regen leaves only temporary files, which verify reports and the next
regen removes), replaces only the cases it names, is NaN-strict and reports changes."""
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

import fixtures.store as store
from fixtures import STORED_CASES, get, run_oracle
from fixtures.__main__ import main as fixtures_cli

REPO = Path(__file__).resolve().parent.parent
SMALL = "capacity-rows"            # a small stored case for the tampering tests


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}


@pytest.fixture
def copy(tmp_path):
    """A temporary copy of the store."""
    dst = tmp_path / "data"
    shutil.copytree(store.DATA_DIR, dst)
    return dst


def _manifest(d):
    return json.loads((d / store.MANIFEST).read_text())


def _rewrite(d, case_id, mutate):
    """Rewrite one stored file with ``mutate(tensors)`` applied and a consistent manifest
    (new SHA, shapes and dtypes), so that only the recomputation can catch the change."""
    m = _manifest(d)
    e = next(e for e in m["cases"] if e["id"] == case_id)
    path = d / e["file"]
    tensors = {k: v.clone() for k, v in st.load_file(str(path)).items()}
    mutate(tensors)
    blob = st.save(tensors, metadata={"case_id": case_id})
    path.write_bytes(blob)
    e["sha256"] = hashlib.sha256(blob).hexdigest()
    e["bytes"] = len(blob)
    e["tensors"] = {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                    for k, v in tensors.items()}
    (d / store.MANIFEST).write_text(json.dumps(m))


def test_cli_verify_passes_on_the_checkout():
    r = subprocess.run([sys.executable, "-m", "fixtures", "verify"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fixture store: OK" in r.stdout
    assert f"{len(STORED_CASES)} cases recomputed" in r.stdout


def test_store_is_small_and_complete():
    m = _manifest(store.DATA_DIR)
    assert {e["id"] for e in m["cases"]} == set(STORED_CASES)
    total = sum(p.stat().st_size for p in store.DATA_DIR.iterdir())
    assert total < store.MAX_STORE_BYTES
    for k in ("oracle_version", "torch", "numpy", "safetensors"):
        assert m[k]
    e = next(e for e in m["cases"] if e["id"] == SMALL)
    for name in ("in.q", "in.kv_raw", "in.sink", "out.out", "out.lse", "out.ids", "out.lengths",
                 "out.dq", "out.dkv", "out.dsink", "out.scores", "out.loss", "out.target",
                 "out.predict", "out.dq_idx", "out.dw", "out.dk_idx"):
        assert name in e["tensors"], name


def test_cli_verify_fails_on_a_flipped_byte(copy, capsys):
    e = next(e for e in _manifest(copy)["cases"] if e["id"] == SMALL)
    path = copy / e["file"]
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    # the entry point of `python -m fixtures` (the passing run above starts the interpreter)
    rc = fixtures_cli(["verify", "--data", str(copy), SMALL])
    out = capsys.readouterr().out
    assert rc == 1
    assert "fixture store: FAILED" in out and "SHA-256 mismatch" in out and SMALL in out
    with pytest.raises(ValueError, match="SHA-256"):
        store.load(SMALL, data_dir=copy)


def test_verify_fails_on_an_output_changed_beyond_float64_rounding(copy):
    def bump(t):
        t["out.out"].view(-1)[5] *= 1 + 1e-9
    _rewrite(copy, SMALL, bump)
    rep = store.verify(copy, [SMALL])
    assert not rep.ok
    assert any("output out differs beyond float64 rounding" in p for p in rep.problems), rep.problems


def test_verify_accepts_one_ulp_but_notes_it(copy):
    # a float64 rounding difference (one ulp of one element) is within the error model
    def ulp(t):
        v = t["out.out"].view(-1)
        i = int(torch.nonzero(v != 0)[0])
        v[i] = torch.nextafter(v[i], torch.tensor(math.inf, dtype=torch.float64))
    _rewrite(copy, SMALL, ulp)
    rep = store.verify(copy, [SMALL])
    assert rep.ok, rep.problems
    assert any("not bitwise but within float64 rounding" in n for n in rep.notes)


def test_verify_fails_on_a_changed_index_output(copy):
    def swap(t):
        ids = t["out.ids"]
        row = int(torch.nonzero(t["out.lengths"] >= 2)[0])
        ids[row, 0], ids[row, 1] = ids[row, 1].clone(), ids[row, 0].clone()
    _rewrite(copy, SMALL, swap)
    rep = store.verify(copy, [SMALL])
    assert any("output ids differs" in p for p in rep.problems), rep.problems


def test_verify_fails_when_inputs_no_longer_reproduce(copy):
    def nudge(t):
        t["in.q"].view(-1)[0] = -t["in.q"].view(-1)[0]
    _rewrite(copy, SMALL, nudge)
    rep = store.verify(copy, [SMALL])
    assert any("no longer reproduces input q" in p for p in rep.problems), rep.problems


def test_verify_fails_on_a_dtype_change(copy):
    def narrow(t):
        t["out.lse"] = t["out.lse"].to(torch.float32)
    _rewrite(copy, SMALL, narrow)
    rep = store.verify(copy, [SMALL])
    assert any("output lse dtype float32 -> float64" in p for p in rep.problems), rep.problems


def test_verify_fails_on_a_manifest_dtype_that_disagrees_with_the_file(copy):
    m = _manifest(copy)
    e = next(e for e in m["cases"] if e["id"] == SMALL)
    e["tensors"]["out.dq"]["dtype"] = "float32"
    (copy / store.MANIFEST).write_text(json.dumps(m))
    rep = store.verify(copy, [SMALL])
    assert any("tensor out.dq is float64" in p for p in rep.problems), rep.problems


def test_verify_fails_on_missing_and_extra_files(copy):
    e = next(e for e in _manifest(copy)["cases"] if e["id"] == SMALL)
    (copy / e["file"]).unlink()
    (copy / "stray.safetensors").write_bytes(b"junk")
    rep = store.verify(copy, [])
    assert any(f"missing file {e['file']}" in p for p in rep.problems)
    assert any("extra file stray.safetensors" in p for p in rep.problems)


def test_verify_fails_on_a_case_dropped_from_the_manifest(copy):
    m = _manifest(copy)
    dropped = m["cases"].pop()
    (copy / dropped["file"]).unlink()
    (copy / store.MANIFEST).write_text(json.dumps(m))
    rep = store.verify(copy, [])
    assert any(f"case {dropped['id']} is in STORED_CASES but not in the store" in p
               for p in rep.problems)


def test_verify_fails_when_the_catalog_redefines_a_case(copy):
    m = _manifest(copy)
    e = next(e for e in m["cases"] if e["id"] == SMALL)
    e["case"]["seed"] += 1
    (copy / store.MANIFEST).write_text(json.dumps(m))
    rep = store.verify(copy, [SMALL])
    assert any("defines this case differently" in p for p in rep.problems)


def test_load_gives_inputs_and_expected_outputs():
    case, x, o = store.load(SMALL)
    assert case == get(SMALL)
    fresh = run_oracle(case, x)
    assert torch.equal(fresh["ids"], o["ids"]) and torch.equal(fresh["lengths"], o["lengths"])
    assert torch.equal(x["kv"], torch.cat([x["kv_raw"], x["kv_cmp"]]))
    with pytest.raises(KeyError, match="not in the store"):
        store.load("no-such-case")


def test_regen_refuses_inside_an_xdist_worker(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    with pytest.raises(RuntimeError, match="xdist worker"):
        store.regen(tmp_path, [SMALL], echo=lambda s: None)
    assert not any(tmp_path.iterdir())


def test_regen_writes_atomically_and_summarises_changes(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    lines = []
    s = store.regen(tmp_path, [SMALL, "sink-log-k"], echo=lines.append)
    assert s.added == [SMALL, "sink-log-k"] and not s.changed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [store.MANIFEST, f"{SMALL}.safetensors", "sink-log-k.safetensors"])   # no temp files
    assert lines[0].startswith("fixture store: 2 added")
    # identical recomputation: unchanged, same bytes
    before = (tmp_path / f"{SMALL}.safetensors").read_bytes()
    s = store.regen(tmp_path, [SMALL, "sink-log-k"], echo=lambda x: None)
    assert s.unchanged == [SMALL, "sink-log-k"]
    assert (tmp_path / f"{SMALL}.safetensors").read_bytes() == before
    # a stored value drifted: regen reports the case and the max change of the tensor
    _rewrite(tmp_path, SMALL, lambda t: t["out.dq"].view(-1).__setitem__(3, 99.0))
    s = store.regen(tmp_path, [SMALL], echo=lambda x: None)
    assert list(s.changed) == [SMALL] and "out.dq" in s.changed[SMALL]
    assert "max |change|" in s.changed[SMALL]["out.dq"]
    assert s.kept == ["sink-log-k"] and not s.removed     # only the named case is replaced


def test_full_regen_drops_cases_no_longer_stored(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(store, "STORED_CASES", (SMALL, "sink-log-k"))
    store.regen(tmp_path, echo=lambda x: None)
    monkeypatch.setattr(store, "STORED_CASES", (SMALL,))
    (tmp_path / "stray.safetensors").write_bytes(b"junk")
    (tmp_path / "notes.txt").write_text("kept: not a case file")
    s = store.regen(tmp_path, echo=lambda x: None)
    assert s.removed == ["sink-log-k"] and s.unchanged == [SMALL] and not s.kept
    assert s.cleaned == ["stray.safetensors"]
    (tmp_path / "notes.txt").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([store.MANIFEST,
                                                               f"{SMALL}.safetensors"])
    assert [e["id"] for e in _manifest(tmp_path)["cases"]] == [SMALL]
    assert store.verify(tmp_path, []).ok


def test_regen_of_one_case_keeps_every_other_file_and_entry(monkeypatch, copy, capsys):
    """`python -m fixtures regen CASE` replaces that case only (the old regen kept one entry
    and deleted the other 33 files); entries written with other versions keep them."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    m = _manifest(copy)
    m["torch"] = "0.0.1"          # as if the store had been written with another torch
    (copy / store.MANIFEST).write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in copy.iterdir() if p.name != store.MANIFEST}
    assert fixtures_cli(["regen", "--data", str(copy), SMALL]) == 0
    out = capsys.readouterr().out
    assert f"{len(STORED_CASES) - 1} kept as stored" in out
    after = _manifest(copy)
    assert [e["id"] for e in after["cases"]] == [e["id"] for e in m["cases"]]
    assert after["torch"] == torch.__version__
    for old, new in zip(m["cases"], after["cases"]):
        if old["id"] == SMALL:
            assert "versions" not in new
            continue
        assert new == dict(old, versions={k: m[k] for k in store.VERSION_KEYS}), old["id"]
    assert sorted(p.name for p in copy.iterdir()) == sorted([*before, store.MANIFEST])
    for name, data in before.items():
        if name != f"{SMALL}.safetensors":
            assert (copy / name).read_bytes() == data, name
    rep = store.verify(copy, [SMALL])
    assert rep.ok, rep.problems
    assert any(n.startswith("short-docs: written with") and "torch 0.0.1" in n
               for n in rep.notes), rep.notes


def test_regen_of_one_case_refuses_an_inconsistent_manifest(monkeypatch, copy):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    m = _manifest(copy)
    m["cases"].append(dict(m["cases"][0]))
    (copy / store.MANIFEST).write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    with pytest.raises(ValueError, match="has 2 entries.*without case ids"):
        store.regen(copy, [SMALL], echo=lambda s: None)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before


_KILL_DURING_RENAME = """
import os, signal, sys
import fixtures.store as store
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)   # killed mid-write
store.regen(sys.argv[1], [sys.argv[2]], echo=lambda s: None)
"""


def test_a_killed_regen_leaves_temp_files_that_verify_reports_and_regen_removes(copy):
    e = next(e for e in _manifest(copy)["cases"] if e["id"] == SMALL)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    r = subprocess.run([sys.executable, "-c", _KILL_DURING_RENAME, str(copy), SMALL], cwd=REPO,
                       env=dict(_env(), PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = sorted(set(p.name for p in copy.iterdir()) - set(before))
    assert len(left) == 1 and left[0].startswith(f".{e['file']}.") and left[0].endswith(".tmp")
    for name, data in before.items():          # the store itself is untouched
        assert (copy / name).read_bytes() == data
    rep = store.verify(copy, [])
    assert rep.problems == [f"leftover temporary file {left[0]} of an interrupted regen "
                            "(`python -m fixtures regen` removes it)"]
    lines = []
    s = store.regen(copy, [SMALL], echo=lines.append)
    assert s.cleaned == left
    assert lines[1].startswith("  removed 1 leftover files (temporary files of an interrupted "
                               "regen") and lines[1].endswith(left[0])
    assert sorted(p.name for p in copy.iterdir()) == sorted(before)
    assert store.verify(copy, []).ok


def test_regen_rejects_nan_where_the_contract_has_none(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    real = store.run_oracle

    def poisoned(case, inputs=None):
        out = real(case, inputs)
        out["dq"] = out["dq"].clone()
        out["dq"].view(-1)[0] = math.nan
        return out
    monkeypatch.setattr(store, "run_oracle", poisoned)
    with pytest.raises(ValueError, match="output dq holds .*nan"):
        store.regen(tmp_path, [SMALL], echo=lambda s: None)
    assert not (tmp_path / store.MANIFEST).exists()


def test_nonfinite_policy():
    c = get("nan-poison-layer")
    x = c.materialize()
    o = run_oracle(c, x)
    assert store.check_nonfinite(c, x, o) == []
    # the same NaN inputs in a case that is not declared poisoned are rejected
    assert any("input kv_raw holds ['nan']" in p
               for p in store.check_nonfinite(c.replace(poison=False), x, o))
    bad = dict(o, lse=o["lse"].clone())
    bad["lse"][~torch.isinf(bad["lse"]).all(dim=1)] = math.inf
    assert any("lse is +inf on rows other" in p for p in store.check_nonfinite(c, x, bad))
    s = get("sink-pos-inf")
    xs = s.materialize()
    assert store.check_nonfinite(s, xs, run_oracle(s, xs)) == []
    assert any("input sink holds ['+inf']" in p
               for p in store.check_nonfinite(s.replace(sink="normal"), xs, run_oracle(s, xs)))


# -- every inconsistency is a problem line, never an exception ---------------------------------
def _entry(m, case_id=SMALL):
    return next(e for e in m["cases"] if e.get("id") == case_id)


def _edit_manifest(edit):
    def apply(d):
        m = _manifest(d)
        edit(m)
        (d / store.MANIFEST).write_text(json.dumps(m))
    return apply


INCONSISTENCIES = {
    "duplicate entry": (_edit_manifest(lambda m: m["cases"].append(dict(_entry(m)))),
                        f"case {SMALL} has 2 entries in the manifest"),
    "junk file": (lambda d: (d / "notes.txt").write_text("x"),
                  "extra file notes.txt is not in the manifest"),
    "hidden junk file": (lambda d: (d / ".DS_Store").write_bytes(b"x"),
                         "extra file .DS_Store is not in the manifest"),
    "subdirectory": (lambda d: (d / "old").mkdir(), "unexpected subdirectory old/ in the store"),
    "missing field": (_edit_manifest(lambda m: _entry(m).pop("sha256")),
                      f"({SMALL}): missing field 'sha256'"),
    "missing id": (_edit_manifest(lambda m: _entry(m).pop("id")), "missing field 'id'"),
    "unknown field": (_edit_manifest(lambda m: _entry(m).update(checked=True)),
                      f"({SMALL}): unknown field 'checked'"),
    "bytes as a string": (_edit_manifest(lambda m: _entry(m).update(bytes="12")),
                          f"({SMALL}): field 'bytes' is \"12\", not an integer"),
    "tensors as a list": (_edit_manifest(lambda m: _entry(m).update(tensors=[1, 2])),
                          f"({SMALL}): field 'tensors' is [1, 2], not an object"),
    "case as a list": (_edit_manifest(lambda m: _entry(m).update(case=[1])),
                       f"({SMALL}): field 'case' is [1], not an object"),
    "file as a number": (_edit_manifest(lambda m: _entry(m).update(file=5)),
                         f"({SMALL}): field 'file' is 5, not a string"),
    "file of another case": (_edit_manifest(lambda m: _entry(m).update(
        file="near-ties.safetensors")),
                             f"({SMALL}): file 'near-ties.safetensors' is not "
                             f"'{SMALL}.safetensors'"),
    "shape as a string": (_edit_manifest(lambda m: _entry(m)["tensors"]["out.dq"].update(
        shape="x")),
                          f"({SMALL}): tensor 'out.dq' is described by"),
    "bad sha256": (_edit_manifest(lambda m: _entry(m).update(sha256="abc")),
                   "is not 64 lowercase hex digits"),
    "entry not an object": (_edit_manifest(lambda m: m["cases"].append(5)), "is 5, not an object"),
    "version missing": (_edit_manifest(lambda m: m.pop("torch")),
                        "manifest: field 'torch' is null, not a string"),
    "wrong size": (_edit_manifest(lambda m: _entry(m).update(bytes=_entry(m)["bytes"] + 1)),
                   f"{SMALL}: {SMALL}.safetensors has"),
    "manifest not JSON": (lambda d: (d / store.MANIFEST).write_text('{"format": 1, "cases": ['),
                          "manifest.json is not JSON"),
    "cases not a list": (_edit_manifest(lambda m: m.update(cases={})),
                         "not a format-1 fixture manifest"),
}


@pytest.mark.parametrize("what", list(INCONSISTENCIES))
def test_verify_reports_a_manifest_inconsistency(copy, what):
    damage, needle = INCONSISTENCIES[what]
    damage(copy)
    rep = store.verify(copy, [])        # file-level checks only: no recomputation
    assert not rep.ok and any(needle in p for p in rep.problems), rep.problems


@pytest.mark.parametrize("what", ["missing field", "manifest not JSON"])
def test_cli_verify_prints_inconsistencies_and_load_refuses_them(copy, what, capsys):
    damage, needle = INCONSISTENCIES[what]
    damage(copy)
    assert fixtures_cli(["verify", "--data", str(copy), "near-ties"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("fixture store: FAILED") and needle in out
    with pytest.raises(ValueError):     # a GPU lane never loads from an inconsistent store
        store.load("near-ties", data_dir=copy)


@pytest.mark.parametrize("name", ["out", "lse", "loss"])
def test_verify_reports_a_nan_where_the_oracle_gives_a_number(copy, name):
    def poison(t):
        t[f"out.{name}"].view(-1)[0] = math.nan
    _rewrite(copy, SMALL, poison)
    rep = store.verify(copy, [SMALL])
    assert any(f"output {name} differs beyond float64 rounding: 1 of" in p and
               "non-finite positions differ" in p for p in rep.problems), rep.problems
    assert f"{SMALL}: stored output {name} holds ['nan'] where the contract has none" \
        in rep.problems
