"""CSA row composition, "compressed-first" (contract sections 2, 3 and 5), checked exactly
against the definition written as Python loops and against the independent dense visibility
of ``reference/dense.py``."""
from __future__ import annotations

import random

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hash
from dsv4_oracle.reference.dense import dense_visibility

# (cu_seqlens, cu_seqlens_padded, num_rows): padding, an empty document, capacity rows.
LAYOUTS = [
    ([0, 9], [0, 9], 9),
    ([0, 5, 5, 11], [0, 8, 8, 14], 16),
    ([0, 0, 7, 10], [0, 4, 12, 16], 18),
]


def layout_of(spec):
    return R.PackedLayout(*spec)


def rows_by_definition(layout, window, ratio, compressed_ids=None):
    """Section 5 for every row, by definition; returns python lists (ids, lengths)."""
    T = layout.num_rows
    cu_pad = layout.cu_seqlens_padded.tolist()
    n = layout.compressed_counts(ratio).tolist() if ratio else []
    cu_comp = layout.compressed_offsets(ratio).tolist() if ratio else []
    if ratio == 0:
        width_c = 0
    elif compressed_ids is None:
        width_c = max(n, default=0)
    else:
        width_c = compressed_ids.shape[1]
    ids, lengths = [], []
    for t in range(T):
        b, p, real = int(layout.doc[t]), int(layout.pos[t]), bool(layout.is_real[t])
        if not real:
            ids.append([-1] * (width_c + window))
            lengths.append(0)
            continue
        if ratio == 0:
            comp = []
        elif compressed_ids is None:                      # HCA: every visible group ascending
            vis = min((p + 1) // ratio, n[b])
            comp = [T + cu_comp[b] + g for g in range(vis)] + [-1] * (width_c - vis)
        else:
            comp = [T + c if c >= 0 else -1 for c in compressed_ids[t].tolist()]
        win = [cu_pad[b] + q for q in range(max(0, p - window + 1), p + 1)]
        win += [-1] * (window - len(win))
        row = comp + win
        valid = [i for i in row if i >= 0]                 # stable compaction
        ids.append(valid + [-1] * (len(row) - len(valid)))
        lengths.append(len(valid))
    return ids, lengths


def random_compressed_ids(layout, ratio, width, seed):
    """Per real row, a random subset of its visible groups in random order with -1 holes
    (the shape of a Top-K result emitted in score order); padding rows get junk ids."""
    rng = random.Random(seed)
    vis = layout.visible_compressed(ratio).tolist()
    cu_comp = layout.compressed_offsets(ratio).tolist()
    C = cu_comp[-1]
    rows = []
    for t in range(layout.num_rows):
        if bool(layout.is_real[t]):
            b = int(layout.doc[t])
            pool = [cu_comp[b] + g for g in range(vis[t])]
            chosen = rng.sample(pool, min(len(pool), rng.randint(0, width)))
            row = chosen + [-1] * (width - len(chosen))
            rng.shuffle(row)
        else:
            row = [rng.randint(-1, max(C - 1, 0)) for _ in range(width)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).reshape(layout.num_rows, width)


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize("window", [1, 3, 16])
def test_window_only_rows(spec, window):
    layout = layout_of(spec)
    ids, lengths = R.build_csa_indices(layout, window=window, ratio=0)
    want_ids, want_len = rows_by_definition(layout, window, 0)
    assert ids.tolist() == want_ids and lengths.tolist() == want_len


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize("window,ratio", [(2, 2), (3, 4), (5, 128)])
def test_hca_rows(spec, window, ratio):
    layout = layout_of(spec)
    ids, lengths = R.build_csa_indices(layout, window=window, ratio=ratio)
    want_ids, want_len = rows_by_definition(layout, window, ratio)
    assert ids.tolist() == want_ids and lengths.tolist() == want_len


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize("window,ratio,width", [(2, 2, 3), (3, 4, 2), (4, 1, 5)])
def test_csa_rows_are_compressed_first_then_window_stably_compacted(spec, window, ratio, width):
    layout = layout_of(spec)
    cmp = random_compressed_ids(layout, ratio, width, seed=window * 10 + ratio)
    ids, lengths = R.build_csa_indices(layout, window=window, ratio=ratio, compressed_ids=cmp)
    want_ids, want_len = rows_by_definition(layout, window, ratio, cmp)
    assert ids.tolist() == want_ids and lengths.tolist() == want_len


def test_compaction_keeps_the_given_order_of_compressed_ids():
    layout = R.PackedLayout([0, 8])                 # groups of 2: row 7 sees groups 0..3
    cmp = torch.tensor([[-1, -1, -1, -1]] * 7 + [[2, -1, 0, 3]])
    ids, lengths = R.build_csa_indices(layout, window=2, ratio=2, compressed_ids=cmp)
    assert ids[7].tolist() == [8 + 2, 8 + 0, 8 + 3, 6, 7, -1]
    assert int(lengths[7]) == 5


@pytest.mark.parametrize("spec", LAYOUTS)
@pytest.mark.parametrize("window,ratio", [(3, 0), (2, 2), (4, 4)])
def test_hca_and_window_rows_are_exactly_the_dense_visibility(spec, window, ratio):
    layout = layout_of(spec)
    ids, lengths = R.build_csa_indices(layout, window=window, ratio=ratio)
    vis = dense_visibility(layout, window, ratio)
    for t in range(layout.num_rows):
        row = ids[t, : int(lengths[t])].tolist()
        assert len(row) == len(set(row))
        assert sorted(row) == torch.nonzero(vis[t]).flatten().tolist()


@pytest.mark.parametrize("spec", LAYOUTS)
def test_documents_are_never_crossed(spec):
    layout = layout_of(spec)
    ratio = 2
    T = layout.num_rows
    cmp = random_compressed_ids(layout, ratio, 3, seed=1)
    ids, lengths = R.build_csa_indices(layout, window=4, ratio=ratio, compressed_ids=cmp)
    group_doc = torch.repeat_interleave(torch.arange(layout.num_docs),
                                        layout.compressed_counts(ratio))
    for t in range(T):
        for key in ids[t, : int(lengths[t])].tolist():
            owner = int(layout.doc[key]) if key < T else int(group_doc[key - T])
            assert owner == int(layout.doc[t])


@pytest.mark.parametrize("spec", LAYOUTS)
def test_padding_and_capacity_rows_are_sink_only(spec):
    layout = layout_of(spec)
    cmp = random_compressed_ids(layout, 2, 3, seed=2)
    for kwargs in ({"ratio": 0}, {"ratio": 2}, {"ratio": 2, "compressed_ids": cmp}):
        ids, lengths = R.build_csa_indices(layout, window=3, **kwargs)
        fake = ~layout.is_real
        assert bool((ids[fake] == -1).all()) and bool((lengths[fake] == 0).all())
        assert bool((lengths[layout.is_real] >= 1).all())   # a real row sees at least itself


def test_empty_documents_and_a_batch_without_real_tokens():
    layout = R.PackedLayout([0, 0, 3, 3], [0, 0, 4, 4], 6)
    ids, lengths = R.build_csa_indices(layout, window=2, ratio=2)
    # Rows 0..2 are real (document 1), row 3 is padding, rows 4 and 5 are capacity rows;
    # T = 6, so compressed group 0 of document 1 has key id 6.
    assert ids.tolist() == [[0, -1, -1, -1], [6, 0, 1, -1], [6, 1, 2, -1],
                            [-1, -1, -1, -1], [-1, -1, -1, -1], [-1, -1, -1, -1]]
    assert lengths.tolist() == [1, 3, 3, 0, 0, 0]
    empty = R.PackedLayout([0], None, 3)
    ids, lengths = R.build_csa_indices(empty, window=2, ratio=4)
    assert ids.tolist() == [[-1, -1]] * 3 and lengths.tolist() == [0, 0, 0]


def test_topk_emit_order_changes_only_the_order_of_the_compressed_part():
    layout = R.PackedLayout([0, 7, 12], [0, 8, 14])
    g = torch.Generator().manual_seed(0)
    scores = R.indexer_scores(torch.randn(14, 2, 4, generator=g), torch.randn(7, 4, generator=g),
                              torch.randn(14, 2, generator=g), layout, 2)
    rows = {}
    for order in ("id", "score"):
        cmp, _ = R.stable_topk(scores, 2, order=order)
        rows[order] = R.build_csa_indices(layout, window=3, ratio=2, compressed_ids=cmp)
    assert torch.equal(rows["id"][1], rows["score"][1])
    assert torch.equal(torch.sort(rows["id"][0], dim=1).values,
                       torch.sort(rows["score"][0], dim=1).values)


def test_inputs_are_not_modified():
    layout = R.PackedLayout([0, 5, 11], [0, 8, 14], 16)
    cmp = random_compressed_ids(layout, 2, 3, seed=3).to(torch.int32)
    before = [content_hash(x) for x in (cmp, layout.cu_seqlens, layout.cu_seqlens_padded,
                                        layout.doc, layout.pos, layout.is_real)]
    R.build_csa_indices(layout, window=3, ratio=2, compressed_ids=cmp)
    R.build_csa_indices(layout, window=3, ratio=2)
    after = [content_hash(x) for x in (cmp, layout.cu_seqlens, layout.cu_seqlens_padded,
                                       layout.doc, layout.pos, layout.is_real)]
    assert after == before
