"""CSA row composition, "compressed-first" (contract sections 2, 3 and 5)."""
from __future__ import annotations

import torch

from ._checks import as_index, as_int, check_dim
from .layout import PackedLayout

__all__ = ["build_csa_indices", "compact_rows"]


def compact_rows(ids: torch.Tensor):
    """Section 5 compaction: valid (``>= 0``) entries move to the front in their relative order,
    -1 fills the rest. Returns ``(ids, lengths)``; the input is not modified."""
    invalid = (ids < 0).to(torch.int8)
    _, perm = torch.sort(invalid, dim=1, stable=True)
    packed = torch.gather(ids, 1, perm)
    lengths = (ids >= 0).sum(dim=1).to(torch.int64)
    slot = torch.arange(ids.shape[1]).unsqueeze(0)
    packed = torch.where(slot < lengths.unsqueeze(1), packed, torch.full_like(packed, -1))
    return packed, lengths


def build_csa_indices(layout, *, window, ratio, compressed_ids=None):
    """Section 5: each real row's key ids ``[compressed part | window part]``, compacted.

    - ``window``: ``W >= 0`` raw keys per row; ``W = 0`` (no window part, the DeepSeek-V3.2 DSA
      configuration of section 5.1) needs compressed keys (``ratio > 0``);
    - ``ratio == 0``: window-only layer (no compressed part; ``compressed_ids`` must be None);
    - ``ratio > 0`` without ``compressed_ids``: every visible group ascending (HCA); the part's
      width is the largest group count of any document;
    - ``ratio > 0`` with ``compressed_ids [T, Kc]``: global compressed ids (columns of
      :func:`indexer_scores`, e.g. from :func:`stable_topk`), negative = no selection. Each
      non-negative entry of a real row must be a group visible to that row (section 3).

    Ids are in the logical key space of section 2: raw row ``t`` is ``t``, compressed id ``c``
    is ``T + c``. Padding and capacity rows are all -1 with length 0. Returns int64
    ``(ids [T, Kc + window], lengths [T])``.
    """
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    window = as_int(window, "window", minimum=0)
    ratio = as_int(ratio, "ratio", minimum=0)
    if window == 0 and ratio == 0:
        raise ValueError("window=0 needs compressed keys (ratio > 0): a window-only layer "
                         "(ratio 0) needs window >= 1")
    T = layout.num_rows
    real = layout.is_real
    rows = torch.arange(T)

    # Window part: positions max(0, p-W+1) .. p ascending, width W, -1 past the row's count.
    offs = torch.arange(window).unsqueeze(0)
    first = torch.clamp(layout.pos - window + 1, min=0).unsqueeze(1)
    wpos = first + offs
    win_ok = (wpos <= layout.pos.unsqueeze(1)) & real.unsqueeze(1)
    win = torch.where(win_ok, (rows - layout.pos).unsqueeze(1) + wpos, torch.full_like(wpos, -1))

    if ratio == 0:
        if compressed_ids is not None:
            raise ValueError("compressed_ids must be None for a window-only layer (ratio 0)")
        cmp = torch.empty((T, 0), dtype=torch.int64)
    else:
        cu_comp = layout.compressed_offsets(ratio)
        vis = layout.visible_compressed(ratio)
        base = cu_comp[layout.doc.clamp_min(0)] if layout.num_docs else rows * 0
        if compressed_ids is None:
            width = int(layout.compressed_counts(ratio).max()) if layout.num_docs else 0
            g = torch.arange(width).unsqueeze(0)
            ok = (g < vis.unsqueeze(1)) & real.unsqueeze(1)
            cmp = torch.where(ok, base.unsqueeze(1) + g, torch.full_like(g.expand(T, width), -1))
        else:
            given = as_index(compressed_ids, "compressed_ids", ndim=2)
            check_dim(given, "compressed_ids", 0, T, "layout.num_rows")
            sel = given >= 0
            local = given - base.unsqueeze(1)
            bad = sel & real.unsqueeze(1) & ((local < 0) | (local >= vis.unsqueeze(1)))
            if bool(bad.any()):
                t, j = torch.nonzero(bad)[0].tolist()
                raise ValueError(
                    f"compressed_ids[{t}, {j}] = {int(given[t, j])} is not a compressed group "
                    f"visible to row {t} (visible ids {int(base[t])}..{int(base[t] + vis[t]) - 1})")
            cmp = torch.where(sel & real.unsqueeze(1), given, torch.full_like(given, -1))
        cmp = torch.where(cmp >= 0, cmp + T, cmp)
    return compact_rows(torch.cat([cmp, win], dim=1))
