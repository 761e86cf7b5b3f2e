"""The regression fixture store: verify passes on the checkout and fails on every kind of
tampering (on temporary copies); regen is serial, atomic, NaN-strict and reports changes."""
import json
import math
import os
import shutil
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
    import hashlib
    e["sha256"] = hashlib.sha256(blob).hexdigest()
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
    assert s.removed == ["sink-log-k"] and not (tmp_path / "sink-log-k.safetensors").exists()


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
