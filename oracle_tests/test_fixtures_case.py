"""fixtures.Case: a frozen, hashable description with a stable id, and deterministic inputs."""
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import Case, catalog, get
from fixtures.case import HOSTILE_IDS, LARGE_SINK

REPO = Path(__file__).resolve().parent.parent
FLOAT_INPUTS = ("q", "kv_raw", "kv_cmp", "kv", "dout", "q_idx", "k_idx", "weights")


def _digests(cases):
    out = {"auto-id": cases[0].replace(name="").id}
    for c in cases:
        for k, v in c.materialize().items():
            b = v.contiguous().view(torch.uint8) if v.dim() else v.reshape(1).view(torch.uint8)
            out[f"{c.id}/{k}"] = hashlib.sha256(b.numpy().tobytes()).hexdigest()
    return out


def test_case_is_frozen_hashable_and_printable():
    c = get("padding-between-and-tail")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 3
    assert hash(c) == hash(c.replace())
    assert c == c.replace(categories=("other",))          # categories are metadata
    assert c != c.replace(seed=c.seed + 1)
    assert len({c, c.replace(), c.replace(seed=1)}) == 2
    s = str(c)
    assert c.id in s and "T=36" in s and "dtype=bfloat16" in s


def test_ids_are_stable_pytest_ids():
    c = get("hostile-ids-int64")
    assert c.id == "hostile-ids-int64"
    auto = c.replace(name="")
    assert auto.id.startswith("auto-") and auto.id == auto.replace().id
    assert auto.id != auto.replace(seed=auto.seed + 1).id
    # (the auto id is a hash of the fields, not of Python's randomised hash(): the
    # cross-process test below checks it in a process with another PYTHONHASHSEED)


def test_round_trip_through_dict_and_json():
    for c in catalog():
        d = json.loads(json.dumps(c.to_dict()))
        back = Case.from_dict(d)
        assert back == c and back.categories == c.categories and back.id == c.id
    with pytest.raises(ValueError, match="unknown fields"):
        Case.from_dict({**get("capacity-rows").to_dict(), "bogus": 1})


@pytest.mark.parametrize("field,value,exc,match", [
    ("dtype", "int8", ValueError, "Case.dtype"),
    ("heads", 0, ValueError, "Case.heads"),
    ("heads", 2.0, TypeError, "Case.heads"),
    ("sink", "huge", ValueError, "Case.sink"),
    ("v_dim", 64, ValueError, "Case.v_dim"),
    ("layer", "window", ValueError, "Case.layer"),
    ("cu_seqlens_padded", (0, 4, 8), ValueError, "cu_seqlens_padded"),
    ("num_rows", 3, ValueError, "num_rows"),
    ("lengths", "mixed", ValueError, "Case.lengths"),
    ("coeff", math.nan, ValueError, "Case.coeff"),
    ("name", "has space", ValueError, "Case.name"),
    ("seed", -1, ValueError, "Case.seed"),
])
def test_bad_fields_raise_naming_the_field(field, value, exc, match):
    base = get("padding-between-and-tail")
    with pytest.raises(exc, match=match):
        base.replace(**{field: value})


def test_materialize_is_deterministic_and_seed_dependent():
    c = get("padding-edge-layout")
    a, b = c.materialize(), c.materialize()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                           b[k].view(torch.uint8) if b[k].is_floating_point() else b[k]), k
    other = c.replace(seed=c.seed + 1).materialize()
    assert not torch.equal(a["q"], other["q"])
    # inputs are independent draws per tensor: changing the head count leaves kv_raw alone
    wider = c.replace(heads=c.heads + 1).materialize()
    assert torch.equal(a["kv_raw"], wider["kv_raw"])


def test_materialize_is_bitwise_reproducible_across_processes():
    cases = catalog()
    here = _digests(cases)
    code = ("import json, torch; torch.set_num_threads(1); from fixtures import catalog; "
            "from oracle_tests.test_fixtures_case import _digests; "
            "print(json.dumps(_digests(catalog())))")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONHASHSEED"] = "777"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    there = json.loads(r.stdout)
    assert there == here


def test_inputs_are_rounded_nonzero_and_of_the_case_dtype():
    for c in catalog():
        x = c.materialize()
        T, C, H, D = c.T, c.C, c.heads, c.head_dim
        assert x["q"].shape == (T, H, D) and x["kv"].shape == (c.num_keys, D)
        assert x["kv_raw"].shape == (T, D) and x["kv_cmp"].shape == (C, D)
        assert x["dout"].shape == (T, H, c.v_dim or D)
        assert x["sink"].dtype == torch.float32 and x["sink"].shape == (H,)
        assert torch.equal(x["kv"][:T].view(torch.uint8), x["kv_raw"].view(torch.uint8))
        assert x["cu_seqlens"].dtype == torch.int32
        for k in FLOAT_INPUTS:
            if k in x:
                assert x[k].dtype == c.torch_dtype, (c.id, k)
                vals = x[k][~torch.isnan(x[k])]
                if c.index_inputs == "zero_dots" and k in ("q_idx", "k_idx"):
                    continue              # disjoint supports: exact zeros by design
                assert not bool((vals == 0).any()), (c.id, k, "zero input")
        if c.has_indexer:
            assert x["q_idx"].shape == (T, c.index_heads, c.index_dim)
            assert x["k_idx"].shape == (C, c.index_dim) and x["weights"].shape == (T, c.index_heads)
        else:
            assert "q_idx" not in x


def test_low_precision_inputs_are_exact_values_of_their_dtype():
    c = get("dtype-float16")
    x = c.materialize()
    for k in ("q", "kv", "dout"):
        assert x[k].dtype == torch.float16
        # what the oracle sees (float64) is exactly the float16 value
        assert torch.equal(x[k].double().half(), x[k])


@pytest.mark.parametrize("mode,expected", [
    ("neg_inf", -math.inf), ("pos_inf", math.inf), ("large", LARGE_SINK), ("log_k", None)])
def test_sink_modes(mode, expected):
    c = get(f"sink-{mode.replace('_', '-')}")
    s = c.materialize()["sink"]
    want = torch.tensor(math.log(c.topk) if expected is None else expected, dtype=torch.float32)
    assert torch.equal(s, want.expand_as(s))
    mixed = get("sink-mixed").materialize()["sink"].tolist()
    assert mixed[1] == -math.inf and mixed[2] == math.inf and mixed[3] == pytest.approx(2.4e38)
    assert math.isfinite(mixed[0]) and mixed[4] == pytest.approx(math.log(get("sink-mixed").topk))


def test_hostile_ids_and_lengths():
    c = get("hostile-ids-mixed-lengths")
    x = c.materialize()
    S = x["kv"].shape[0]
    present = set(x["ids"].flatten().tolist())
    assert set(HOSTILE_IDS(S, "int32")) <= present
    assert x["ids"].dtype == torch.int32 and x["lengths"].dtype == torch.int32
    L = x["lengths"].to(torch.int64)
    width = x["ids"].shape[1]
    assert bool((L == 0).any()) and bool((L < 0).any()) and bool((L > width).any())
    assert int(L.min()) == torch.iinfo(torch.int32).min and int(L.max()) == torch.iinfo(torch.int32).max
    c64 = get("hostile-ids-int64").materialize()
    assert c64["ids"].dtype == torch.int64
    assert {torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max} <= set(c64["ids"].flatten().tolist())
    assert "lengths" not in c64


def test_poisoned_rows_are_exactly_the_unreferenced_ones():
    c = get("nan-poison-hostile-ids")
    x = c.materialize()
    from reference.attention import valid_slots
    ok = valid_slots(x["ids"].long(), x["kv"].shape[0], x["lengths"].long())
    used = torch.zeros(x["kv"].shape[0], dtype=torch.bool)
    used[x["ids"].long()[ok]] = True
    nan_rows = torch.isnan(x["kv"]).all(dim=1)
    assert torch.equal(nan_rows, ~used) and bool(nan_rows.any())
    lay = get("nan-poison-layer")
    xl = lay.materialize()
    assert bool(torch.isnan(xl["kv_raw"][~lay.layout().is_real]).all())
    assert not bool(torch.isnan(xl["kv_raw"][lay.layout().is_real]).any())


@pytest.mark.gpu
def test_materialize_on_cuda_has_the_cpu_bits():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    c = get("padding-edge-layout")
    a, b = c.materialize(), c.materialize(device="cuda")
    for k in a:
        assert b[k].device.type == "cuda"
        assert torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                           b[k].cpu().view(torch.uint8) if b[k].is_floating_point() else b[k].cpu())
