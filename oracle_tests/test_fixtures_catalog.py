"""The catalog: every category covered, every generator hits its category, every case runs.

Each catalog case runs once through the oracle pipeline (``fixtures.run_oracle``); the checks
below are what its categories promise (e.g. the ties generator really ties on the K-th
boundary), plus the contract's invariants that hold for every case (sink-only rows are exact
zeros, NaN/Inf only where the contract has them).
"""
import math

import pytest
import torch

from fixtures import CATEGORIES, STORED_CASES, catalog, empty_rows, get, run_oracle
from fixtures.case import HOSTILE_IDS, LARGE_SINK
from fixtures.store import check_nonfinite

CASES = catalog()


def _kth(scores, k):
    """K-th and (K+1)-th largest scores per row (float64)."""
    top = torch.sort(scores, dim=1, descending=True).values
    return top[:, k - 1], top[:, k]


# -- one predicate per category: (case, inputs, outputs) -> None, asserting the category is hit
def _padding(c, x, o):
    lay = c.layout()
    pad = lay.doc_padded_lengths - lay.doc_lengths
    nonempty = torch.nonzero(lay.doc_padded_lengths > 0).flatten()
    assert bool((pad > 0).any()), "no padding rows"
    assert bool((~lay.is_real[: int(lay.cu_seqlens_padded[-1])]).any())
    if c.id.startswith("padding-between"):
        assert int(pad[nonempty[0]]) > 0 and int(pad[nonempty[-1]]) > 0, "padding between and at the tail"


def _empty_docs(c, x, o):
    lay = c.layout()
    assert bool((lay.doc_lengths == 0).any()), "no empty document"


def _capacity(c, x, o):
    lay = c.layout()
    assert lay.num_rows > int(lay.cu_seqlens_padded[-1]), "no capacity rows"
    cap = torch.arange(lay.num_rows) >= int(lay.cu_seqlens_padded[-1])
    assert bool((o["lengths"][cap] == 0).all())


def _short_docs(c, x, o):
    real = c.layout().doc_lengths
    real = real[real > 0]
    assert bool((real < c.ratio).any()), "no document shorter than the ratio"
    assert bool((real < c.window).any()), "no document shorter than the window"
    vis = c.layout().visible_compressed(c.ratio)
    assert bool(((vis > 0) & (vis < c.topk)).any()), "no row with fewer visible groups than K"
    assert bool((vis > c.topk).any()), "no row with more visible groups than K (control)"
    assert bool((o["cmp_lengths"] < c.topk).any())


def _no_groups(c, x, o):
    assert c.C == 0, f"C = {c.C}: some document reaches a compressed group"
    assert bool((o["cmp_lengths"] == 0).all()) and bool((o["cmp_ids"] < 0).all())
    assert bool((o["lengths"] > 0).any()), "no row has a window key (control)"


def _sink_only(c, x, o):
    empty = empty_rows(c, x, o)
    assert bool(empty.any()), "no sink-only row"


def _exact_ties(c, x, o):
    s, k = o["scores"], c.topk
    a, b = _kth(s, k) if s.shape[1] > k else (None, None)
    if c.id == "public-det-topk-ties":
        # the public worked example (Megatron determinism test): ratio 2, K 5, zero scores
        assert o["cmp_ids"].tolist() == [[-1] * 5, [0, -1, -1, -1, -1], [0, -1, -1, -1, -1],
                                         [0, 1, -1, -1, -1]]
        assert o["cmp_lengths"].tolist() == [0, 1, 1, 2]
        return
    tie = torch.isfinite(a) & (a == b)
    assert bool(tie.any()), "no exact tie on the K-th boundary"
    # the smaller id wins: in a tied row, every selected tied column is below every unselected one
    t = int(torch.nonzero(tie)[0])
    row = s[t]
    tied = torch.nonzero(row == a[t]).flatten()
    chosen = set(o["cmp_ids"][t][o["cmp_ids"][t] >= 0].tolist())
    sel = [int(i) for i in tied if int(i) in chosen]
    rest = [int(i) for i in tied if int(i) not in chosen]
    assert sel and rest and max(sel) < min(rest)


def _signed_zeros(c, x, o):
    s, k = o["scores"], c.topk
    a, b = _kth(s, k)
    hit = (a == 0) & (b == 0)
    rows = torch.nonzero(hit).flatten()
    assert rows.numel(), "no zero tie on the K-th boundary"
    both = False
    for t in rows.tolist():
        z = s[t][s[t] == 0]
        both |= bool(torch.signbit(z).any()) and bool((~torch.signbit(z)).any())
    assert both, "+0.0 and -0.0 never meet on the K-th boundary"


def _near_ties(c, x, o):
    s, k = o["scores"], c.topk
    a, b = _kth(s, k)
    strict = o["near_tie"] & (a != b)
    assert bool(strict.any()), "no near tie (K-th != (K+1)-th within 4 float32 ulps) flagged"


def _hostile_ids(c, x, o):
    S = x["kv"].shape[0]
    present = set(x["ids"].to(torch.int64).flatten().tolist())
    if c.ids == "hostile":
        assert set(HOSTILE_IDS(S, c.index_dtype)) <= present, "a hostile id is missing"
    valid = ((x["ids"].long() >= 0) & (x["ids"].long() < S))
    assert bool((~valid).any())


def _all_invalid(c, x, o):
    S = x["kv"].shape[0]
    ids = x["ids"].long()
    rows = ~((ids >= 0) & (ids < S)).any(dim=1)
    assert bool(rows.any()), "no row whose every slot is invalid"
    assert bool((o["lse"][rows] == math.inf).all())


def _hostile_lengths(c, x, o):
    L = x["lengths"].long()
    width = x["ids"].shape[1]
    hit = {"zero": bool((L == 0).any()), "negative": bool((L < 0).any()),
           "above_width": bool((L > width).any())}
    wanted = [c.lengths] if c.lengths in hit else list(hit)
    assert all(hit[w] for w in wanted), hit


def _duplicates(c, x, o):
    ids = x["ids"].long()
    S = x["kv"].shape[0]
    dup = False
    for row in ids:
        v = row[(row >= 0) & (row < S)]
        dup |= v.unique().numel() < v.numel()
    assert dup, "no row repeats a key"


def _sinks(c, x, o):
    s = x["sink"]
    want = {"neg_inf": -math.inf, "pos_inf": math.inf, "large": LARGE_SINK,
            "log_k": float(torch.tensor(math.log(c.topk), dtype=torch.float32))}
    modes = list(want) if c.sink == "mixed" else [c.sink]
    for m in modes:
        assert bool((s == torch.tensor(want[m], dtype=torch.float32)).any()), m
    if c.sink == "pos_inf":   # the sink takes all mass: out = 0, zero gradients
        assert bool((o["out"] == 0).all()) and bool((o["dq"] == 0).all())


def _poison(c, x, o):
    assert bool(torch.isnan(x["kv"]).any()), "no poisoned key row"
    for k, v in o.items():
        if v.is_floating_point():
            assert not bool(torch.isnan(v).any()), f"NaN leaked into {k}"


def _cp(c, x, o):
    rows = torch.cat(c.rank_rows())
    assert torch.equal(torch.sort(rows).values, torch.arange(c.T))
    assert set(o["rank"].tolist()) == set(range(c.cp))


def _layer_kinds(c, x, o):
    assert c.layer in ("hca", "window")
    if c.layer == "hca":
        assert c.C > 0 and "cmp_ids" not in o
        assert bool((o["ids"] >= c.T).any()), "no compressed key in an HCA row"
    else:
        assert bool((o["ids"] < c.T).all()) and c.C == 0


def _dtypes(c, x, o):
    assert x["q"].dtype == c.torch_dtype


def _policies(c, x, o):
    assert c.order == "score" or c.v_dim is not None or c.coeff == 0 or c.index_inputs != "normal"
    if c.coeff == 0:
        for k in ("dq_idx", "dw", "dk_idx"):
            assert bool((o[k] == 0).all()), f"{k} must be exactly 0 with coeff 0"
    if c.v_dim is not None:
        assert o["out"].shape[-1] == c.v_dim


def _flash(c, x, o):
    assert (c.heads, c.head_dim, c.window, c.topk, c.index_heads, c.index_dim, c.ratio) == \
        (64, 512, 128, 512, 64, 128, 4)


def _pro(c, x, o):
    assert (c.heads, c.head_dim, c.window, c.topk, c.index_heads, c.index_dim, c.ratio) == \
        (128, 512, 128, 1024, 64, 128, 4)


def _public(c, x, o):
    assert c.id.startswith("public-")


def _dsa(c, x, o):
    assert (c.layer, c.ratio, c.window, c.sink) == ("dsa", 1, 0, "neg_inf")
    assert torch.equal(x["kv_cmp"].nan_to_num(), x["kv_raw"][: c.C].nan_to_num())
    assert bool((o["cmp_lengths"] == c.topk).any()), "Top-K never binds"


def _index_hazards(c, x, o):
    S = x["kv"].shape[0]
    if c.poison:
        assert bool(torch.isnan(x["kv"][0]).all()) and bool(torch.isnan(x["kv"][S - 1]).all())
        return
    ids = x["ids"].to(torch.int64)
    assert c.T >= 4096 or S > 2 ** 17, "neither a large-ish layout nor S > 2^17"
    if S > 2 ** 17:
        assert bool(((ids >= 2 ** 17) & (ids < S)).any()), "no valid id at or above 2^17"
    else:
        assert {-(2 ** 31), 2 ** 31 - 1} <= set(ids.flatten().tolist()) or c.index_dtype == "int64"


def _valid_slots(c, o, ids, lengths):
    """Selected, valid slots ``[T, width]`` (real rows only)."""
    width = ids.shape[1]
    ok = (ids >= 0) & (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1))
    return ok & c.layout().is_real.unsqueeze(1)


def _large_logits(c, x, o):
    ids, ok = o["ids"], _valid_slots(c, o, o["ids"], o["lengths"])
    kv = x["kv"].double()[ids.clamp_min(0)]                                    # [T, width, D]
    s = torch.einsum("thd,tkd->thk", x["q"].double(), kv) * c.head_dim ** -0.5
    s = s.masked_fill(~ok.unsqueeze(1), 0.0)
    assert float(s.max()) > math.log(torch.finfo(torch.float32).max), \
        "no attention logit beyond float32's exp range"


def _zero_dots(c, x, o):
    ids = o["cmp_ids"]
    ok = _valid_slots(c, o, ids, o["cmp_lengths"]) & (o["target"] > 0)
    z = torch.einsum("thd,tkd->thk", x["q_idx"].double(), x["k_idx"].double()[ids.clamp_min(0)])
    hit = ok.unsqueeze(1) & (z == 0) & (x["weights"] != 0).unsqueeze(2)
    assert bool(hit.any()), "no selected slot with z == 0 exactly and a nonzero weight"
    assert bool((ok.unsqueeze(1) & (z > 0)).any()), "no selected slot with z > 0 (control)"


def _score_spread(c, x, o):
    ok = _valid_slots(c, o, o["cmp_ids"], o["cmp_lengths"])
    hit = ok & (o["predict"] < math.exp(-100)) & (o["target"] > 1e-3)
    assert bool(hit.any()), "no selected slot with a student probability below exp(-100) " \
                            "and teacher mass"


def _selfcheck(c, x, o):
    assert c.id.startswith("selfcheck-") and c.is_layer and x["q"].dtype == torch.float64


PREDICATES = {
    "padding": _padding, "empty_docs": _empty_docs, "capacity_rows": _capacity,
    "short_docs": _short_docs, "no_groups": _no_groups, "sink_only_rows": _sink_only,
    "exact_ties": _exact_ties,
    "signed_zeros": _signed_zeros, "near_ties": _near_ties, "hostile_ids": _hostile_ids,
    "all_invalid_rows": _all_invalid, "hostile_lengths": _hostile_lengths,
    "duplicate_ids": _duplicates, "sinks": _sinks, "nan_poison": _poison, "cp": _cp,
    "layer_kinds": _layer_kinds, "dtypes": _dtypes, "policies": _policies,
    "dsv4_flash": _flash, "dsv4_pro": _pro, "public_small": _public, "dsa_v32": _dsa,
    "index_hazards": _index_hazards,
    "large_logits": _large_logits, "zero_dots": _zero_dots, "score_spread": _score_spread,
    "selfcheck": _selfcheck,
}


def test_every_category_has_a_predicate_and_cases():
    assert set(PREDICATES) | {"cp_invalid"} == set(CATEGORIES)
    covered = {cat for c in CASES for cat in c.categories}
    assert covered == set(CATEGORIES), set(CATEGORIES) - covered


def test_catalog_ids_are_unique_and_cases_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(set(CASES)) == len(CASES)
    assert set(STORED_CASES) <= set(ids) and len(set(STORED_CASES)) == len(STORED_CASES)
    for c in CASES:
        assert c.categories and set(c.categories) <= set(CATEGORIES), c.id


def test_catalog_spans_the_required_variants():
    by = lambda cat: [c for c in CASES if cat in c.categories]  # noqa: E731
    assert {(c.cp, c.cp_mode) for c in by("cp")} >= {(p, m) for p in (1, 2, 4)
                                                        for m in ("contiguous", "zigzag")}
    assert {c.cp_mode for c in by("cp_invalid")} == {"contiguous", "zigzag"}
    assert {c.sink for c in by("sinks")} >= {"neg_inf", "pos_inf", "large", "log_k"}
    assert {c.lengths for c in by("hostile_ids")} >= {"none", "full", "mixed"}
    assert {c.lengths for c in by("hostile_lengths")} >= {"zero", "negative", "above_width"}
    assert {c.dtype for c in by("dtypes")} == {"bfloat16", "float16", "float32", "float64"}
    assert {c.index_dtype for c in by("hostile_ids")} == {"int32", "int64"}
    assert {c.layer for c in CASES} == {"csa", "hca", "window", "dsa"}
    assert {c.order for c in CASES} == {"id", "score"}


def test_poison_reaches_the_rows_clamped_invalid_ids_read():
    """Some stored NaN-poison case has NaN in key row 0 (where ``-1`` slots clamp) and in the
    last row (where ``S``/``INT_MAX`` clamp) of the raw and of the compressed buffer, of the
    logical key buffer and of the indexer keys, and every oracle output stays NaN-free."""
    hits = []
    for name in STORED_CASES:
        c = get(name)
        if "nan_poison" not in c.categories:
            continue
        x = c.materialize()
        if all(bool(torch.isnan(x[k][0]).any()) and bool(torch.isnan(x[k][-1]).any())
               for k in ("kv_raw", "kv_cmp", "kv", "k_idx")):
            hits.append(name)
            _poison(c, x, run_oracle(c, x))
    assert hits, "no stored NaN-poison case poisons key row 0 and the last key rows"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case_runs_and_hits_its_categories(case):
    x = case.materialize()
    if "cp_invalid" in case.categories:
        with pytest.raises(ValueError, match="cp="):
            run_oracle(case, x)
        return
    o = run_oracle(case, x)
    # contract invariants for every case
    assert check_nonfinite(case, x, o) == []
    empty = empty_rows(case, x, o)
    assert bool((o["out"][empty] == 0).all()) and bool((o["dq"][empty] == 0).all())
    assert bool((o["lse"][empty] == math.inf).all())
    if case.is_layer:
        real = case.layout().is_real
        assert bool((o["lengths"][~real] == 0).all()) and bool((o["ids"][~real] == -1).all())
        assert torch.equal(empty, ~real)          # a real row always sees itself
    for cat in case.categories:
        if cat != "cp_invalid":
            PREDICATES[cat](case, x, o)
