"""Lightning indexer scores (contract section 7)."""
from __future__ import annotations

import math

import torch

from ._checks import as_float64, as_int, as_real, check_dim, head_dim
from ._checks import chunk_rows as rows_per_chunk
from ._reduce import _aligned_batch, _round_up, row_bmm, row_bmm_buffer
from .constants import CHUNK_BYTES
from .layout import PackedLayout

__all__ = ["indexer_scores"]


def _inputs(q_idx, k_idx, weights, layout, ratio, scale):
    """Section 7 arguments, validated and converted (shared with the section 12 bound)."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    ratio = as_int(ratio, "ratio", minimum=1)
    q = as_float64(q_idx, "q_idx", ndim=3)
    k = as_float64(k_idx, "k_idx", ndim=2)
    w = as_float64(weights, "weights", ndim=2)
    T, HI, DI = q.shape
    head_dim(q, "q_idx")
    check_dim(q, "q_idx", 0, layout.num_rows, "layout.num_rows")
    check_dim(k, "k_idx", 1, DI, "q_idx head dim D_I")
    C = layout.num_compressed(ratio)
    check_dim(k, "k_idx", 0, C, f"compressed groups of the layout at ratio {ratio}")
    check_dim(w, "weights", 0, T, "rows T")
    check_dim(w, "weights", 1, HI, "indexer heads H_I")
    scale = DI ** -0.5 if scale is None else as_real(scale, "scale")
    return q, k, w, ratio, scale


def row_range(rows, T: int) -> tuple:
    """``rows`` (``None`` or ``(a, b)`` with ``0 <= a <= b <= T``) as ``(a, b)``."""
    if rows is None:
        return 0, T
    if not (isinstance(rows, tuple) and len(rows) == 2):
        raise TypeError(f"rows must be None or a tuple (start, stop), got {rows!r}")
    a, b = (as_int(r, "rows", minimum=0) for r in rows)
    if not a <= b <= T:
        raise ValueError(f"rows must satisfy 0 <= start <= stop <= {T}, got {rows!r}")
    return a, b


def indexer_scores(q_idx, k_idx, weights, layout, ratio, *, scale=None, chunk_rows=None,
                   rows=None):
    """Section 7: ``I[t,c] = scale * sum_h w[t,h] * relu(<q_idx[t,h], k_idx[c]>)`` if ``c`` is
    visible to ``t`` (section 3), ``-inf`` otherwise. Returns float64 ``[T, C]``.

    Work is per document (a real row only ever sees its own document's groups) and per row:
    each row's scores come from a batched product whose batch element is that row, so a row's
    bits never depend on which other rows are evaluated with it (CP invariance, section 10).
    ``rows=(a, b)``: only the rows ``a:b`` (``[b - a, C]``), bitwise those rows of the whole
    result (a judge that streams rows relies on it).
    """
    q, k, w, ratio, scale = _inputs(q_idx, k_idx, weights, layout, ratio, scale)
    if chunk_rows is not None:           # checked even when no document has a row to chunk
        as_int(chunk_rows, "chunk_rows", minimum=1)
    T, HI, DI = q.shape
    a, stop = row_range(rows, T)
    C = k.shape[0]
    out = torch.full((stop - a, C), -math.inf, dtype=torch.float64)
    cu_pad = layout.cu_seqlens_padded
    cu_comp = layout.compressed_offsets(ratio)
    vis = layout.visible_compressed(ratio)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, w))
    for b in range(layout.num_docs):
        r0, real = int(cu_pad[b]), int(layout.doc_lengths[b])
        c0, c1 = int(cu_comp[b]), int(cu_comp[b + 1])
        if real == 0 or c1 == c0:
            continue
        kb = k[c0:c1]                                   # [n_b, D_I]
        nb = c1 - c0
        step = rows_per_chunk(chunk_rows, HI * nb * 8 * 3, CHUNK_BYTES)
        if not grad:
            # The same products without per-chunk copies: the document's keys placed once as
            # row_bmm places them (aligned, columns padded to 8) and shared by every row, z and
            # relu(z) in work buffers reused across chunks.
            padded = _round_up(nb, 8)
            kbt = _aligned_batch(kb.t().unsqueeze(0), padded)
            m_rows = min(step, real)
            z_mm, sc_mm = row_bmm_buffer(m_rows, HI, padded), row_bmm_buffer(m_rows, 1, nb)
            relu_buf = torch.empty((m_rows, HI, nb), dtype=torch.float64)
        for s0 in range(r0, r0 + real, step):
            s0, s1 = max(s0, a), min(s0 + step, r0 + real, stop)
            if s1 <= s0:
                continue
            n = s1 - s0
            if grad:
                z = row_bmm(q[s0:s1], kb.t().unsqueeze(0).expand(n, DI, nb))  # [n, H_I, n_b]
                sc = scale * row_bmm(w[s0:s1].unsqueeze(1), torch.relu(z)).squeeze(1)  # [n, n_b]
            else:
                z = row_bmm(q[s0:s1], kbt.expand(n, DI, padded), out=z_mm[:n])[:, :, :nb]
                relu_z = relu_buf[:n].copy_(z).relu_()
                sc = scale * row_bmm(w[s0:s1].unsqueeze(1), relu_z, out=sc_mm[:n]).squeeze(1)
            cols = torch.arange(c1 - c0).unsqueeze(0)
            visible = cols < vis[s0:s1].unsqueeze(1)
            out[s0 - a:s1 - a, c0:c1] = torch.where(visible, sc, torch.full_like(sc, -math.inf))
    return out
