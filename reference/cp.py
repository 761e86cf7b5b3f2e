"""Context-parallel row partitions (contract section 10)."""
from __future__ import annotations

import torch

from ._checks import as_int, choice
from .layout import PackedLayout

__all__ = ["MAX_CP", "cp_partition", "cp_size"]

# The largest CP group size accepted (section 10): far above any CP group in use, and small
# enough that the per-rank lists and plans (O(cp) each) stay cheap. A larger cp is rejected
# instead of building millions of empty partitions (any cp divides an empty layout).
MAX_CP = 4096


def cp_size(cp) -> int:
    """Section 10: ``cp`` as an int in ``[1, MAX_CP]``; ``TypeError`` / ``ValueError`` naming
    it otherwise."""
    cp = as_int(cp, "cp", minimum=1)
    if cp > MAX_CP:
        raise ValueError(f"cp must be <= {MAX_CP} (MAX_CP, the largest CP group size "
                         f"accepted), got {cp}")
    return cp


def cp_partition(layout, cp, *, mode="contiguous"):
    """Section 10: the packed rows each of ``cp`` ranks owns, as a list of int64 index tensors.

    - ``"contiguous"`` (DSv4 static CP): rank ``r`` owns ``[r*T/cp, (r+1)*T/cp)``; ``T % cp``
      must be 0.
    - ``"zigzag"`` (generic THD CP): each document's padded rows are cut into ``2*cp`` equal
      chunks and rank ``r`` takes chunks ``r`` and ``2*cp-1-r`` of every document, in document
      order. Capacity rows past ``cu_seqlens_padded[-1]`` are split the same way as one more
      segment. Every segment length must be divisible by ``2*cp``.

    ``cp`` is an int in ``[1, MAX_CP]``.
    """
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    cp = cp_size(cp)
    mode = choice(mode, "mode", ("contiguous", "zigzag"))
    T = layout.num_rows
    if mode == "contiguous":
        if T % cp:
            raise ValueError(f"cp={cp} does not divide the {T} packed rows (contiguous partition)")
        n = T // cp
        return [torch.arange(r * n, (r + 1) * n, dtype=torch.int64) for r in range(cp)]
    bounds = layout.cu_seqlens_padded.tolist()
    if T > bounds[-1]:
        bounds = bounds + [T]
    parts = [[] for _ in range(cp)]
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        size = e - s
        if size % (2 * cp):
            what = f"document {b}" if b < layout.num_docs else "the capacity tail"
            raise ValueError(
                f"cp={cp}: {what} has {size} padded rows, not divisible by 2*cp={2 * cp} "
                "(zigzag partition)")
        c = size // (2 * cp)
        for r in range(cp):
            parts[r].append(torch.arange(s + r * c, s + (r + 1) * c))
            parts[r].append(torch.arange(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c))
    return [torch.cat(p).to(torch.int64) if p else torch.zeros(0, dtype=torch.int64)
            for p in parts]
