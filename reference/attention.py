"""Sparse attention with a per-head sink, forward and closed-form backward (contract section 6).

Gather-based: each row reads only its own ``K`` key rows, so work is ``O(T*K*D)`` and memory is
bounded by processing rows in chunks; no ``T x S`` mask is ever built. Every per-row quantity
comes from batched products whose batch element is the row, so a row's bits do not depend on
the chunk it is evaluated in; sums over rows (``dkv``, ``dsink``) are left folds in
(row, slot) order (see ``_reduce``), so they do not depend on chunking either.
"""
from __future__ import annotations

import math

import torch

from ._checks import as_float64, as_index, as_int, as_real, check_dim
from ._checks import chunk_rows as rows_per_chunk
from ._pointwise import logaddexp, sigmoid
from ._reduce import fold_rows_into, row_bmm

__all__ = ["sparse_attention_forward", "sparse_attention_backward", "valid_slots"]

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


SLOT_MULTIPLE = 64


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
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    step = rows_per_chunk(chunk_rows, 8 * K * (2 * D + 3 * H))
    outs, lses = [], []
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        v = valid[r0:r1]
        kg = kv.index_select(0, safe[r0:r1].reshape(-1)).view(n, K, D)
        kg = kg.masked_fill(~v.unsqueeze(-1), 0.0)  # unselected rows (even NaN) never leak
        s = _scores(q[r0:r1], kg, v, scale)
        m = s.amax(dim=-1, keepdim=True) if K else torch.full((n, H, 1), -INF, dtype=s.dtype)
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


def sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, scale=None, v_dim=None,
                              lengths=None, chunk_rows=None):
    """Section 6 backward in closed form, from the forward's ``out`` and ``lse``.

    ``dS = P * (<dO, v> - Delta)``, ``Delta = <dO, out>``; returns float64 ``dq [T,H,D]``,
    ``dkv [S,D]`` and ``dsink [H]``. Rows with no valid slot contribute nothing. ``dkv`` and
    ``dsink`` are left folds in (row, slot) order.
    """
    q, kv, ids, sink, scale, dv, lengths = _inputs(q, kv, ids, sink, scale, v_dim, lengths)
    ids = _pad_slots(ids)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    out = as_float64(out, "out", ndim=3)
    lse = as_float64(lse, "lse", ndim=2)
    dout = as_float64(dout, "dout", ndim=3)
    for name, t, shape in (("out", out, (T, H, dv)), ("lse", lse, (T, H)),
                           ("dout", dout, (T, H, dv))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    valid = valid_slots(ids, S, lengths)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    step = rows_per_chunk(chunk_rows, 8 * K * (4 * D + 4 * H))
    dq = torch.zeros_like(q)
    dkv = torch.zeros_like(kv)
    dsink = torch.zeros((1, H), dtype=torch.float64)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        v = valid[r0:r1]
        kg = kv.index_select(0, safe[r0:r1].reshape(-1)).view(n, K, D)
        kg = kg.masked_fill(~v.unsqueeze(-1), 0.0)  # unselected rows (even NaN) never leak
        l = lse[r0:r1]
        empty = (torch.isinf(l) & (l > 0)) | ~v.any(dim=1, keepdim=True)
        s = _scores(q[r0:r1], kg, v, scale)
        p = _probabilities(s, l, sink).masked_fill(empty.unsqueeze(-1), 0.0)
        do = dout[r0:r1]
        delta = (do * out[r0:r1]).sum(dim=-1)                          # [n, H]
        dp = row_bmm(do, kg[:, :, :dv].transpose(1, 2))              # [n, H, K]
        ds = p * (dp - delta.unsqueeze(-1))
        dq[r0:r1] = scale * row_bmm(ds, kg)
        contrib = scale * row_bmm(ds.transpose(1, 2), q[r0:r1])     # [n, K, D]
        contrib[:, :, :dv] += row_bmm(p.transpose(1, 2), do)
        flat = v.reshape(-1)
        fold_rows_into(dkv, ids[r0:r1].reshape(-1)[flat], contrib.reshape(n * K, D)[flat])
        # p_sink = exp(sink - logaddexp(lse, sink)) = sigmoid(sink - lse); 1 when sink = +inf.
        p_sink = sigmoid(sink.unsqueeze(0) - l).masked_fill(empty, 0.0)
        fold_rows_into(dsink, torch.zeros(n, dtype=torch.int64), -(p_sink * delta))
    return dq, dkv, dsink[0]
