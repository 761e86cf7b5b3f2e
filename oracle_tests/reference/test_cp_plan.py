"""The oracle's per-rank CP plans and expectations (contract section 10, ``reference/cp_plan.py``).

- plans against a brute-force reading of the contract (owned rows, halo, group ownership,
  needed / received groups, physical key layout);
- per-rank results computed on each rank's own buffers equal the cp=1 rows bitwise;
- the canonical reduction of the per-rank partials equals the cp=1 reductions bitwise, and the
  naive sum of per-rank sums does not (which is why the partials are unsummed);
- invalid CP configurations raise before anything is computed.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.conformance import STAGES, applies, oracle_outputs
from dsv4_oracle.reference.cp_plan import cp_halo_width, cp_plans, cp_rank_expected, cp_reduce_partials

from oracle_tests.helpers.cp_lane import CASES, make_inputs

PLAN_CASES = [("csa", "contiguous", 2), ("csa", "contiguous", 4), ("hca", "contiguous", 4),
              ("window", "contiguous", 2), ("csa_zigzag", "zigzag", 2),
              ("csa_zigzag", "zigzag", 4), ("csa_zigzag", "contiguous", 4)]


def _plans(name, mode, cp):
    case = CASES[name]
    return case, cp_plans(case.layout(), cp, window=case.window, ratio=case.ratio, mode=mode)


def _brute_force(case, mode, cp):
    """The plan facts, read off the contract one row / group at a time (Python loops)."""
    lay = case.layout()
    parts = [p.tolist() for p in R.cp_partition(lay, cp, mode=mode)]
    owner = {t: r for r, rows in enumerate(parts) for t in rows}
    doc, pos, real = lay.doc.tolist(), lay.pos.tolist(), lay.is_real.tolist()
    d_win = max(case.window, (2 * case.ratio if case.ratio == 4 else case.ratio))
    groups = []        # (global id, doc, g, owner)
    if case.ratio:
        cu_pad = lay.cu_seqlens_padded.tolist()
        for b in range(lay.num_docs):
            for g in range((cu_pad[b + 1] - cu_pad[b]) // case.ratio):
                last = cu_pad[b] + (g + 1) * case.ratio - 1
                groups.append((len(groups), b, g, owner[last]))
    facts = []
    for r, rows in enumerate(parts):
        mine = set(rows)
        # Rows any owned real row's window reaches that the rank does not own.
        reach = {u for t in rows if real[t]
                 for u in range(t - min(pos[t], case.window - 1), t + 1)} - mine
        needed = sorted({c for (c, b, g, _) in groups for t in rows
                         if real[t] and doc[t] == b and g < (pos[t] + 1) // case.ratio})
        facts.append(dict(rows=rows, reach=reach, d_win=d_win,
                          owned=[c for (c, _, _, o) in groups if o == r],
                          needed=needed,
                          received=[c for c in needed if groups[c][3] != r]))
    return facts


@pytest.mark.parametrize("name,mode,cp", PLAN_CASES)
def test_plan_matches_brute_force(name, mode, cp):
    case, plans = _plans(name, mode, cp)
    facts = _brute_force(case, mode, cp)
    T = case.layout().num_rows
    C = case.layout().num_compressed(case.ratio) if case.ratio else 0
    seen_groups = []
    for plan, f in zip(plans, facts):
        assert plan.rows.tolist() == f["rows"]
        halo = set(plan.halo_rows[plan.halo_rows >= 0].tolist())
        assert f["reach"] <= halo, "a window key row is neither owned nor in the halo"
        assert not (halo & set(f["rows"])), "an owned row is duplicated in the halo"
        lay = case.layout()
        for u in halo:      # halo rows lie within D_win before a run start, in its document
            assert any(0 < s - u <= f["d_win"] and int(lay.doc[u]) == int(lay.doc[s])
                       for s in plan.rows.tolist()), u
        if mode == "contiguous":
            assert plan.num_halo == f["d_win"]
        assert plan.owned_groups.tolist() == f["owned"]
        assert plan.needed_groups.tolist() == f["needed"]
        assert plan.received_groups.tolist() == f["received"]
        seen_groups += f["owned"]
        # The physical layout: halo | local | rank-major gathered groups.
        assert plan.key_ids[plan.num_halo:plan.cmp_offset].tolist() == f["rows"]
        for c in range(C):
            o = int(plan.group_owner[c])
            j = sum(1 for c2 in range(c) if int(plan.group_owner[c2]) == o)
            assert int(plan.group_slot[c]) == o * plan.cmp_capacity + j
            assert int(plan.key_ids[plan.cmp_offset + plan.group_slot[c]]) == T + c
        assert plan.num_keys == plan.cmp_offset + cp * plan.cmp_capacity
        if mode == "contiguous" and case.ratio:
            assert plan.cmp_capacity == -(-(T // cp) // case.ratio)
    assert sorted(seen_groups) == list(range(C)), "every group has exactly one owner"


@pytest.mark.parametrize("name,mode,cp", PLAN_CASES)
def test_id_mappings_round_trip(name, mode, cp):
    case, plans = _plans(name, mode, cp)
    T = case.layout().num_rows
    for plan in plans:
        used = torch.nonzero(plan.key_ids >= 0).flatten()
        assert torch.equal(plan.to_physical(plan.key_ids[used]), used)
        assert torch.equal(plan.to_logical(used), plan.key_ids[used])
        # Invalid ids stay invalid; the input is not modified.
        bad = torch.tensor([-5, -1, T + 10 ** 6, 2 ** 40])
        before = bad.clone()
        assert plan.to_physical(bad).tolist() == [-1] * 4
        assert torch.equal(bad, before)
        assert plan.to_logical(torch.tensor([-1, plan.num_keys])).tolist() == [-1, -1]


def test_contiguous_monotone_slots_preserve_global_id_order():
    """Under the contiguous partition a Top-K over gathered slots breaks ties like one over
    global ids: slot order is global-id order."""
    for name in ("csa", "hca", "csa_zigzag"):
        case, plans = _plans(name, "contiguous", 4)
        slots = plans[0].group_slot
        assert bool((slots[1:] > slots[:-1]).all())


def test_rank_without_a_halo_row_cannot_map_it():
    case, plans = _plans("csa", "contiguous", 4)
    plan = plans[1]                       # owns rows 16..31; its halo is rows 8..15 of doc 0
    with pytest.raises(ValueError, match="neither owns nor receives"):
        plan.to_physical(torch.tensor([[7]]))    # doc 0, but before the halo
    with pytest.raises(ValueError, match="neither owns nor receives"):
        plan.to_physical(torch.tensor([40]))     # owned by rank 2
    assert plan.to_physical(torch.tensor([8, 15, 16])).tolist() == [0, 7, 8]


def test_halo_never_crosses_a_document():
    case, plans = _plans("csa", "contiguous", 2)
    lay = case.layout()
    # Rank 1 starts at row 32 inside document 2's padding (rows 29..33 are rows 31..33
    # padding of doc 2 which spans rows 20..33); its halo rows 24..31 all lie in document 2.
    h = plans[1].halo_rows
    assert h.tolist() == list(range(24, 32))
    assert set(lay.doc[h].tolist()) == {2}
    # Rank 0's halo is before row 0: unused.
    assert plans[0].halo_rows.tolist() == [-1] * plans[0].num_halo
    # cp 4, rank 2 starts at row 32 too; rank 3 starts at 48 inside document 4 (rows 34..59).
    _, p4 = _plans("csa", "contiguous", 4)
    assert p4[3].halo_rows.tolist() == list(range(40, 48))
    # A run starting at a document start has no usable halo.
    lay2 = R.PackedLayout([0, 8, 16], [0, 8, 16])
    p = cp_plans(lay2, 2, window=4, ratio=0)
    assert p[1].halo_rows.tolist() == [-1] * 4


@pytest.mark.parametrize("name,mode,cp", PLAN_CASES + [("csa", "contiguous", 1)])
def test_rank_results_equal_cp1_bitwise(name, mode, cp):
    case, plans = _plans(name, mode, cp)
    x = make_inputs(case)
    ref = oracle_outputs(case, x)
    lay = case.layout()
    expected = [_expected(case, plan, x, ref) for plan in plans]
    for plan, e in zip(plans, expected):
        rows = plan.rows
        assert torch.equal(e.logical_ids, torch.where(ref["ids"][rows] >= 0, ref["ids"][rows], -1))
        assert torch.equal(e.lengths, ref["lengths"][rows])
        assert torch.equal(e.out, ref["out"][rows])
        assert torch.equal(e.lse, ref["lse"][rows])
        assert torch.equal(e.dq, ref["dq"][rows])
        if "kl" in ref:
            assert torch.equal(e.kl, ref["kl"][rows])
            assert torch.equal(e.dq_idx, ref["dq_idx"][rows])
            assert torch.equal(e.dw, ref["dw"][rows])
            sel = ref["cmp_ids"][rows]
            assert torch.equal(e.compressed_slots,
                               torch.where(sel >= 0, plan.group_slot[sel.clamp_min(0)], -1))
    red = cp_reduce_partials([e.partial for e in expected], num_keys=x["kv"].shape[0],
                             num_compressed=x["kv"].shape[0] - lay.num_rows, coeff=case.coeff,
                             num_real=lay.num_real)
    assert torch.equal(red.dkv, ref["dkv"])
    assert torch.equal(red.dsink, ref["dsink"])
    if "loss" in ref:
        assert torch.equal(red.loss, ref["loss"])
        assert torch.equal(red.dk_idx, ref["dk_idx"])


def _expected(case, plan, x, ref):
    kw = {}
    if applies("indexer_scores", case):
        kw = dict(compressed_ids=ref["cmp_ids"], index_scores=ref["scores"],
                  q_idx=x["q_idx"], k_idx=x["k_idx"], weights=x["weights"], coeff=case.coeff)
    return cp_rank_expected(plan, q=x["q"], kv=x["kv_raw"], kv_cmp=x["kv_cmp"], sink=x["sink"],
                            ids=ref["ids"], lengths=ref["lengths"], dout=x["dout"],
                            v_dim=case.v_dim, **kw)


def test_sum_of_rank_sums_is_not_the_canonical_fold():
    """Negative control: summing per-rank *sums* differs from the cp=1 fold in the last bits
    for some key row, so the bitwise test above does detect a non-canonical reduction."""
    case, plans = _plans("csa", "contiguous", 4)
    x = make_inputs(case)
    ref = oracle_outputs(case, x)
    expected = [_expected(case, plan, x, ref) for plan in plans]
    total = torch.zeros_like(ref["dkv"])
    for e in reversed(expected):       # a different association than the canonical fold
        p = e.partial
        part = torch.zeros_like(total)
        ok = p.dkv_dest.reshape(-1) >= 0
        part.index_add_(0, p.dkv_dest.reshape(-1)[ok], p.dkv_contrib.reshape(-1, total.shape[1])[ok])
        total = total + part
    assert torch.allclose(total, ref["dkv"], rtol=0, atol=1e-12)
    assert not torch.equal(total, ref["dkv"])


def test_invalid_cp_configurations_raise():
    lay = R.PackedLayout([0, 30], [0, 30], 30)
    with pytest.raises(ValueError, match="does not divide"):
        cp_plans(lay, 4, window=4, ratio=4)
    with pytest.raises(ValueError, match="fewer than its halo"):
        cp_plans(lay, 5, window=8, ratio=4)          # 6 rows per rank < D_win 8
    with pytest.raises(ValueError, match="not divisible by 2\\*cp"):
        cp_plans(lay, 2, window=4, ratio=4, mode="zigzag")
    with pytest.raises(TypeError, match="layout"):
        cp_plans("not a layout", 2, window=4, ratio=4)
    with pytest.raises(ValueError, match="mode"):
        cp_plans(lay, 2, window=4, ratio=4, mode="ring")
    with pytest.raises(ValueError, match="cp"):
        cp_plans(lay, 0, window=4, ratio=4)
    assert cp_halo_width(128, 4) == 128 and cp_halo_width(4, 4) == 8
    assert cp_halo_width(4, 128) == 128 and cp_halo_width(4, 0) == 4


def test_cp_reduce_partials_rejects_incomplete_cover():
    case, plans = _plans("window", "contiguous", 2)
    x = make_inputs(case)
    ref = oracle_outputs(case, x)
    e = _expected(case, plans[0], x, ref)
    with pytest.raises(ValueError, match="exactly once"):
        cp_reduce_partials([e.partial], num_keys=x["kv"].shape[0])
    with pytest.raises(ValueError, match="exactly once"):
        cp_reduce_partials([e.partial, e.partial], num_keys=x["kv"].shape[0])


@pytest.mark.parametrize("name", ["csa", "hca", "window", "csa_no_groups"])
def test_cp1_reference_is_the_stage_table(name):
    """The CP lane's cp=1 reference, the regression store's pipeline (``fixtures.run_oracle``)
    and the conformance judge walk one stage table: the reference holds exactly the outputs of
    the stages that apply (their names), the store's pipeline has the same bits, and the
    indexer predicate is the table's."""
    from dsv4_oracle import fixtures
    case = CASES[name]
    x = make_inputs(case)
    ref = oracle_outputs(case, x)
    assert set(ref) == {w for st in STAGES if applies(st.op, case) for w in st.writes}
    assert applies("indexer_scores", case) == (case.layer == "csa")
    stored = fixtures.run_oracle(case, x)
    for k, v in ref.items():
        assert torch.equal(stored[k], v), k
    with pytest.raises(ValueError, match="op must be one of"):
        applies("csa", case)
