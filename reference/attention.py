"""Sparse attention with a per-head sink, forward and closed-form backward (contract section 6).

Gather-based: each row reads only its own ``K`` key rows, so work is ``O(T*K*D)`` and memory is
bounded by processing rows in chunks; no ``T x S`` mask is ever built. Each row is evaluated
over its own slot extent (its last valid slot + 1 rounded up to 64, ``_reduce.row_extents``),
in runs of consecutive rows of equal extent. Every per-row quantity comes from batched products
whose batch element is the row, so a row's bits depend only on its own ids, never on the chunk
it is evaluated in or on the caller's width; sums over rows (``dkv``, ``dsink``) are left folds
in (row, slot) order (see ``_reduce``), so they do not depend on chunking either. Without a
gradient to track, the work runs in buffers reused across chunks (speed: ``bench/bench_oracle.py``
and ``docs/PERFORMANCE.md``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import as_float64, as_index, as_int, as_real, check_dim, head_dim
from ._checks import chunk_rows as rows_per_chunk
from ._pointwise import logaddexp, sigmoid
from ._reduce import (_round_up, carve, fold_rows_into, fold_slot_rows_into, row_bmm,
                      row_bmm_buffer, row_extents, row_runs)
from .constants import CHUNK_BYTES, SLOT_MULTIPLE

__all__ = ["sparse_attention_forward", "sparse_attention_backward", "valid_slots",
           "AttentionGradSums"]

INF = math.inf


def valid_slots(ids: torch.Tensor, num_keys: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """Section 6: slot ``j`` of row ``t`` is valid iff ``j < lengths[t]`` (when given) and
    ``0 <= ids[t, j] < num_keys``. Negative lengths count as 0, lengths above the width as the width."""
    ok = (ids >= 0) & (ids < num_keys)
    if lengths is not None:
        ok &= torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return ok


def _inputs(q, kv, ids, sink, scale, v_dim, lengths):
    q = as_float64(q, "q", ndim=3)
    kv = as_float64(kv, "kv", ndim=2)
    ids = as_index(ids, "ids", ndim=2)
    sink = as_float64(sink, "sink", ndim=1, allow_nan=False)
    T, H, D = q.shape
    head_dim(q, "q")
    check_dim(kv, "kv", 1, D, "q head dim D")
    check_dim(ids, "ids", 0, T, "q rows T")
    check_dim(sink, "sink", 0, H, "q heads H")
    if lengths is not None:
        lengths = as_index(lengths, "lengths", ndim=1)
        check_dim(lengths, "lengths", 0, T, "q rows T")
    dv = D if v_dim is None else as_int(v_dim, "v_dim", minimum=1)
    if dv > D:
        raise ValueError(f"v_dim={dv} exceeds the head dim D={D}")
    scale = D ** -0.5 if scale is None else as_real(scale, "scale")
    return q, kv, ids, sink, scale, dv, lengths



def _pad_slots(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with invalid (-1) slots appended up to a multiple of ``SLOT_MULTIPLE``.

    Sums over the slot axis (softmax denominators, ``P @ V``, ``dS @ K``) are vectorized, and
    their association depends on the axis length: without padding, a row's bits would depend
    on how many trailing invalid slots the caller's width has (e.g. an HCA row's width follows
    the layout's largest document). Extra invalid slots add exact zeros, so any two widths in
    the same multiple give the same bits."""
    K = ids.shape[1]
    width = -(-max(K, 1) // SLOT_MULTIPLE) * SLOT_MULTIPLE
    if width == K:
        return ids
    return torch.cat([ids, ids.new_full((ids.shape[0], width - K), -1)], dim=1)


def _scores(q, kg, valid, scale):
    """Masked logits ``[n, H, K]``: ``scale * <q, kv[id]>`` on valid slots, -inf elsewhere."""
    s = scale * row_bmm(q, kg.transpose(1, 2))
    return s.masked_fill(~valid.unsqueeze(1), -INF)


def _probabilities(s, lse, sink):
    """``P = exp(s - logaddexp(lse, sink))``; rows with ``lse = +inf`` (no valid slot) get 0."""
    empty = torch.isinf(lse) & (lse > 0)
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    full = logaddexp(lse_safe, sink.unsqueeze(0))                  # [n, H]
    p = torch.exp(s - full.unsqueeze(-1))
    return p.masked_fill(empty.unsqueeze(-1), 0.0)


def _zero_row_table(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` with one zero row appended (row ``S``): invalid slots gather it, which gives the
    same rows as gathering any row and zeroing it (unselected rows, even NaN, never leak)."""
    return torch.cat([kv, kv.new_zeros((1, kv.shape[1]))])


def _forward_no_grad(q, kv, ids, valid, sink, scale, dv, step):
    """The forward of :func:`sparse_attention_forward` when no gradient is needed: the same
    operations on the same layouts (hence the same bits, see ``oracle_tests``), in reused work
    buffers and in place, without the per-chunk allocations of the differentiable version."""
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    table = _zero_row_table(kv)
    rows = torch.where(valid, ids, torch.full_like(ids, S))
    out = torch.empty((T, H, dv), dtype=torch.float64)
    lse = torch.empty((T, H), dtype=torch.float64)
    m_rows = min(step, T)
    kg_buf = torch.empty(m_rows * K * D, dtype=torch.float64)
    s_mm, s_buf, e_buf = (torch.empty(m_rows * H * K, dtype=torch.float64) for _ in range(3))
    o_mm = row_bmm_buffer(m_rows, H, dv)
    for r0, r1, w in row_runs(row_extents(valid, SLOT_MULTIPLE), step):
        n = r1 - r0
        v = valid[r0:r1, :w]
        kg = torch.index_select(table, 0, rows[r0:r1, :w].reshape(-1),
                                out=carve(kg_buf, n * w, D)).view(n, w, D)
        s = torch.mul(row_bmm(q[r0:r1], kg.transpose(1, 2), out=carve(s_mm, n, H, w)), scale,
                      out=carve(s_buf, n, H, w))
        s.masked_fill_(~v.unsqueeze(1), -INF)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        has_key = v.any(dim=1, keepdim=True)                           # [n, 1]
        total = torch.sub(s, m, out=carve(e_buf, n, H, w)).exp_().sum(dim=-1)
        total = torch.where(has_key, total, torch.ones_like(total))
        lse_c = torch.where(has_key, torch.log(total) + m.squeeze(-1), torch.full_like(total, INF))
        empty = torch.isinf(lse_c) & (lse_c > 0)                        # as _probabilities
        full = logaddexp(torch.where(empty, torch.zeros_like(lse_c), lse_c), sink.unsqueeze(0))
        p = torch.sub(s, full.unsqueeze(-1), out=carve(e_buf, n, H, w)).exp_()
        p.masked_fill_(empty.unsqueeze(-1), 0.0)
        out[r0:r1] = row_bmm(p, kg[:, :, :dv], out=o_mm[:n])
        lse[r0:r1] = lse_c
    return out, lse


def sparse_attention_forward(q, kv, ids, sink, *, scale=None, v_dim=None, lengths=None,
                             chunk_rows=None):
    """Section 6 forward. ``q [T,H,D]``, ``kv [S,D]``, ``ids [T,K]``, ``sink [H]``.

    Returns float64 ``out [T, H, Dv]`` and ``lse [T, H]`` (natural log, excluding the sink;
    ``+inf`` on rows with no valid slot, whose output is exactly 0). Differentiable with
    respect to ``q``, ``kv`` and ``sink`` when they are float64 CPU tensors requiring grad
    (used by the gradchecks); the closed-form backward is :func:`sparse_attention_backward`.
    """
    q, kv, ids, sink, scale, dv, lengths = _inputs(q, kv, ids, sink, scale, v_dim, lengths)
    ids = _pad_slots(ids)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    valid = valid_slots(ids, S, lengths)
    step = rows_per_chunk(chunk_rows, 8 * K * (2 * D + 4 * H), CHUNK_BYTES)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, kv, sink))):
        return _forward_no_grad(q, kv, ids, valid, sink, scale, dv, step)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    outs, lses = [], []
    for r0, r1, w in row_runs(row_extents(valid, SLOT_MULTIPLE), step):
        n = r1 - r0
        v = valid[r0:r1, :w]
        kg = kv.index_select(0, safe[r0:r1, :w].reshape(-1)).view(n, w, D)
        kg = kg.masked_fill(~v.unsqueeze(-1), 0.0)  # unselected rows (even NaN) never leak
        s = _scores(q[r0:r1], kg, v, scale)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        has_key = v.any(dim=1, keepdim=True)                           # [n, 1]
        total = torch.exp(s - m).sum(dim=-1)
        total = torch.where(has_key, total, torch.ones_like(total))  # no log(0) in autograd
        lse = torch.where(has_key, torch.log(total) + m.squeeze(-1), torch.full_like(total, INF))
        p = _probabilities(s, lse, sink)
        outs.append(row_bmm(p, kg[:, :, :dv]))
        lses.append(lse)
    if not outs:
        return torch.zeros((0, H, dv), dtype=torch.float64), torch.zeros((0, H), dtype=torch.float64)
    return torch.cat(outs), torch.cat(lses)


class AttentionGradSums(NamedTuple):
    """The section 6 backward's sums over rows, as running left folds in (row, slot) order:
    ``dkv [S + 1, D]`` (row ``S``: the fold's discard row for invalid slots) and
    ``dsink [1, H]``. Handed to :func:`sparse_attention_backward` block of rows after block of
    rows (in row order), they end with the bits of one call over all the rows."""

    dkv: torch.Tensor
    dsink: torch.Tensor

    @classmethod
    def zeros(cls, num_keys: int, dim: int, heads: int) -> "AttentionGradSums":
        return cls(torch.zeros((num_keys + 1, dim), dtype=torch.float64),
                   torch.zeros((1, heads), dtype=torch.float64))

    def result(self) -> tuple:
        """``(dkv [S, D], dsink [H])`` of the rows folded so far."""
        return self.dkv[:-1], self.dsink[0]


def sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, scale=None, v_dim=None,
                              lengths=None, chunk_rows=None, sums=None):
    """Section 6 backward in closed form, from the forward's ``out`` and ``lse``.

    ``dS = P * (<dO, v> - Delta)``, ``Delta = <dO, out>``; returns float64 ``dq [T,H,D]``,
    ``dkv [S,D]`` and ``dsink [H]``. Rows with no valid slot contribute nothing. ``dkv`` and
    ``dsink`` are left folds in (row, slot) order.

    ``sums`` (an :class:`AttentionGradSums`): the rows given are the next block of a longer
    set of rows (``q``, ``ids``, ``out``, ``lse``, ``dout`` and ``lengths`` sliced alike): the
    folds continue in ``sums`` (updated in place) and the ``dkv`` and ``dsink`` returned are
    the running ones. Each row's ``dq`` depends only on that row, so the blocks' ``dq`` and the
    final folds are bitwise those of one call (a judge that streams rows relies on it).
    """
    q, kv, ids, sink, scale, dv, lengths = _inputs(q, kv, ids, sink, scale, v_dim, lengths)
    ids = _pad_slots(ids)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    out = as_float64(out, "out", ndim=3)
    lse = as_float64(lse, "lse", ndim=2, allow_nan=False)   # P = exp(s - LSE'): NaN undefined
    dout = as_float64(dout, "dout", ndim=3)
    # The closed form is not differentiated (the gradchecks differentiate the forward).
    q, kv, sink, out, lse, dout = (t.detach() for t in (q, kv, sink, out, lse, dout))
    for name, t, shape in (("out", out, (T, H, dv)), ("lse", lse, (T, H)),
                           ("dout", dout, (T, H, dv))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    valid = valid_slots(ids, S, lengths)
    step = rows_per_chunk(chunk_rows, 8 * K * (3 * D + 4 * H), CHUNK_BYTES)
    # Every product and pointwise step below is the differentiable forward's (same operations on
    # the same layouts), in work buffers reused across chunks and in place where the value it
    # replaces is dead.
    table = _zero_row_table(kv)
    rows = torch.where(valid, ids, torch.full_like(ids, S))  # invalid slots: zero row / discard row
    dq = torch.empty_like(q)
    if sums is None:
        sums = AttentionGradSums.zeros(S, D, H)
    elif tuple(sums.dkv.shape) != (S + 1, D) or tuple(sums.dsink.shape) != (1, H):
        raise ValueError(f"sums must hold dkv [{S + 1}, {D}] and dsink [1, {H}], got "
                         f"{tuple(sums.dkv.shape)} and {tuple(sums.dsink.shape)}")
    dkv = sums.dkv                                           # row S: discard row of the fold
    sink_terms = torch.empty((T, H), dtype=torch.float64)
    m_rows = min(step, T)
    kg_buf = torch.empty(m_rows * K * D, dtype=torch.float64)
    hk_mm, p_buf, ds_buf = (torch.empty(m_rows * H * K, dtype=torch.float64) for _ in range(3))
    hd_mm = row_bmm_buffer(m_rows, H, D)
    kd_mm = torch.empty(m_rows * K * _round_up(D, 8), dtype=torch.float64)
    kv_mm = torch.empty(m_rows * K * _round_up(dv, 8), dtype=torch.float64)
    c_buf = torch.empty(m_rows * K * D, dtype=torch.float64)
    for r0, r1, w in row_runs(row_extents(valid, SLOT_MULTIPLE), step):
        n = r1 - r0
        v = valid[r0:r1, :w]
        kg = torch.index_select(table, 0, rows[r0:r1, :w].reshape(-1),
                                out=carve(kg_buf, n * w, D)).view(n, w, D)
        l = lse[r0:r1]
        empty = (torch.isinf(l) & (l > 0)) | ~v.any(dim=1, keepdim=True)
        # p = _probabilities(_scores(q, kg, v, scale), l, sink), masked on empty rows
        p = torch.mul(row_bmm(q[r0:r1], kg.transpose(1, 2), out=carve(hk_mm, n, H, w)), scale,
                      out=carve(p_buf, n, H, w))
        p.masked_fill_(~v.unsqueeze(1), -INF)
        no_key = torch.isinf(l) & (l > 0)
        full = logaddexp(torch.where(no_key, torch.zeros_like(l), l), sink.unsqueeze(0))
        p.sub_(full.unsqueeze(-1)).exp_()
        p.masked_fill_(no_key.unsqueeze(-1), 0.0).masked_fill_(empty.unsqueeze(-1), 0.0)
        do = dout[r0:r1]
        delta = (do * out[r0:r1]).sum(dim=-1)                          # [n, H]
        dp = row_bmm(do, kg[:, :, :dv].transpose(1, 2), out=carve(hk_mm, n, H, w))  # [n,H,w]
        ds = torch.sub(dp, delta.unsqueeze(-1), out=carve(ds_buf, n, H, w)).mul_(p)
        torch.mul(row_bmm(ds, kg, out=hd_mm[:n]), scale, out=dq[r0:r1])
        contrib = torch.mul(row_bmm(ds.transpose(1, 2), q[r0:r1],
                                    out=carve(kd_mm, n, w, _round_up(D, 8))), scale,
                            out=carve(c_buf, n, w, D))                 # [n, w, D]
        contrib[:, :, :dv] += row_bmm(p.transpose(1, 2), do,
                                      out=carve(kv_mm, n, w, _round_up(dv, 8)))
        fold_slot_rows_into(dkv, rows[r0:r1, :w], contrib)
        # p_sink = exp(sink - logaddexp(lse, sink)) = sigmoid(sink - lse); 1 when sink = +inf.
        p_sink = sigmoid(sink.unsqueeze(0) - l).masked_fill(empty, 0.0)
        sink_terms[r0:r1] = -(p_sink * delta)
    fold_rows_into(sums.dsink, torch.zeros(T, dtype=torch.int64), sink_terms)
    return (dq,) + sums.result()
