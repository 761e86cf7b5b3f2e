"""Packed THD layout and compressed groups (contract sections 1 and 2), checked exactly against
the definitions written out as Python loops."""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hash

# (cu_seqlens, cu_seqlens_padded, num_rows): padding, empty documents (first, middle, last),
# capacity rows, no padding at all, and a batch with no real token.
LAYOUTS = [
    ([0, 4], None, None),
    ([0, 3, 3, 9, 10], [0, 4, 4, 12, 16], 20),
    ([0, 0, 5, 5], [0, 0, 8, 8], 11),
    ([0, 1, 2, 3], [0, 1, 2, 3], 3),
    ([0, 0], [0, 6], 8),
    ([0], None, 5),
]


def rows_by_definition(cu, cu_pad, num_rows):
    """Section 1 per row: (doc, pos, is_real); capacity rows are (-1, -1, False)."""
    cu_pad = cu if cu_pad is None else cu_pad
    T = cu_pad[-1] if num_rows is None else num_rows
    out = []
    for t in range(T):
        docs = [b for b in range(len(cu) - 1) if cu_pad[b] <= t < cu_pad[b + 1]]
        if not docs:
            out.append((-1, -1, False))
            continue
        (b,) = docs
        p = t - cu_pad[b]
        out.append((b, p, p < cu[b + 1] - cu[b]))
    return out


@pytest.mark.parametrize("cu,cu_pad,num_rows", LAYOUTS)
def test_rows_match_the_definition(cu, cu_pad, num_rows):
    layout = R.PackedLayout(torch.tensor(cu), None if cu_pad is None else torch.tensor(cu_pad),
                            num_rows)
    want = rows_by_definition(cu, cu_pad, num_rows)
    assert layout.num_rows == len(want)
    assert layout.doc.tolist() == [d for d, _, _ in want]
    assert layout.pos.tolist() == [p for _, p, _ in want]
    assert layout.is_real.tolist() == [r for _, _, r in want]
    assert layout.num_real == cu[-1]
    assert layout.doc.dtype == torch.int64 and layout.is_real.dtype == torch.bool


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 128])
@pytest.mark.parametrize("cu,cu_pad,num_rows", LAYOUTS)
def test_compressed_groups_match_the_definition(cu, cu_pad, num_rows, ratio):
    layout = R.PackedLayout(cu, cu_pad, num_rows)
    pad = cu if cu_pad is None else cu_pad
    n = [(pad[b + 1] - pad[b]) // ratio for b in range(len(cu) - 1)]   # complete groups only
    offsets = [0]
    for nb in n:
        offsets.append(offsets[-1] + nb)
    assert layout.compressed_offsets(ratio).tolist() == offsets
    assert layout.num_compressed(ratio) == offsets[-1]
    # Section 3: a real row at position p sees groups g < min((p+1)//r, n_b); others see none.
    want = [min((p + 1) // ratio, n[b]) if real else 0
            for b, p, real in rows_by_definition(cu, cu_pad, num_rows)]
    assert layout.visible_compressed(ratio).tolist() == want


def test_a_real_row_never_sees_a_group_holding_padding():
    # Document of 5 real tokens padded to 8 at ratio 4: group 1 covers positions 4..7, which
    # hold padding, so no real row may see it.
    layout = R.PackedLayout([0, 5], [0, 8])
    assert layout.visible_compressed(4).tolist() == [0, 0, 0, 1, 1, 0, 0, 0]


def test_list_and_tensor_inputs_agree_and_inputs_are_copied():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_pad = torch.tensor([0, 4, 8], dtype=torch.int32)
    hashes = content_hash(cu), content_hash(cu_pad)
    layout = R.PackedLayout(cu, cu_pad, 10)
    assert (content_hash(cu), content_hash(cu_pad)) == hashes
    assert layout == R.PackedLayout([0, 3, 5], [0, 4, 8], 10)
    assert hash(layout) == hash(R.PackedLayout([0, 3, 5], [0, 4, 8], 10))
    assert layout != R.PackedLayout([0, 3, 5], [0, 4, 8], 12)
    cu[1] = 1                                  # the layout holds its own copy
    assert layout.cu_seqlens.tolist() == [0, 3, 5]


def test_doc_start():
    layout = R.PackedLayout([0, 2, 2, 5], [0, 3, 3, 7], 9)
    assert layout.doc_start().tolist() == [0, 0, 0, 3, 3, 3, 3, 7, 8]
