"""The portable ``torch`` backend: the whole contract in working precision on any device.

Same op-level functions as the oracle (:mod:`reference`), same argument names, plus a keyword
``deterministic: bool = True``. Inputs stay on their device (CPU or CUDA); outputs come back on
it. Precision policy (contract section 12, "working precision"):

- q / kv / indexer inputs are used in their own dtype (normally bf16); every product of two
  such operands is exact in float32 and every sum is accumulated in float32 (on CUDA through
  ``bmm(..., out_dtype=float32)`` on bf16/fp16 tensor cores; elsewhere by converting the
  operands to float32 first, which gives the same products);
- probabilities ``P``, ``dS`` and the indexer's gated gradient are rounded once to the operand
  dtype before the GEMM that consumes them (as flash-attention kernels and cuDNN do);
- statistics (``lse``, scores, the loss, ``kl``, target, predict, ``dsink``) are float32;
- ``out`` and ``dq`` / ``dkv`` / ``dq_idx`` / ``dw`` / ``dk_idx`` are returned in the dtype of
  the tensor they belong to (bf16 for bf16 inputs), rounded once from a float32 accumulator;
- ids and lengths produced here are **int32** (the kernels' index type); ids and lengths given
  to any function may be int32 or int64 and are never modified.

Determinism: with ``deterministic=True`` (the default) every result is bitwise repeatable run
to run on a given device: per-row quantities come from batched GEMMs and reductions of fixed
shape, and the only cross-row scatter sums (``dkv`` and ``dk_idx``) go through
:func:`fixed_order_scatter_add`: contributions are sorted by destination (stable, so in
(row, slot) order) and folded in a fixed order (a pairwise tree on the CPU, torch's
sort-based ``index_put_(accumulate=True)`` on CUDA); no float atomics are involved.
``deterministic=False`` uses ``index_add_`` instead (float atomics on CUDA: faster, not
repeatable there; on the CPU ``index_add_`` is sequential). Every other quantity is computed
the same way in both modes. No function changes global torch state; each runs under a local
``torch.no_grad()`` with autocast disabled, so the grad mode of the caller does not change a
single bit (contract section 11); use :mod:`gpu_impl.layer` for autograd.

fp32 inputs on CUDA go through float32 GEMMs, which follow torch's TF32 setting
(``torch.backends.cuda.matmul.allow_tf32``); bf16/fp16 inputs are not affected by it.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch

from dsv4_oracle.reference.constants import COMPRESSOR_EPS, GRAD_FLOOR, LOSS_FLOOR, QNORM_EPS
from dsv4_oracle.reference.indexer_loss import IndexerLoss
from dsv4_oracle.reference.qnorm import row_scale
from dsv4_oracle.reference.layout import PackedLayout

from .checks import (allocated, as_bool, as_device, as_int, as_real, check_dim, check_layout,
                     choice, float_tensor,
                     head_dim, index_tensor, reject_loss_values, reject_nan, reject_negative,
                     same_device, validate_attention_backward, validate_compressor,
                     validate_attention_forward, validate_indexer_scores,
                     validate_sparse_indexer_loss, validate_sparse_indexer_loss_grad,
                     validate_stable_topk)

__all__ = [
    "BACKEND_NAME", "IndexerLoss", "SCATTER_METHODS", "build_csa_indices",
    "compressor_backward", "compressor_forward", "indexer_compressor_backward",
    "indexer_compressor_forward",
    "fixed_order_scatter_add",
    "indexer_scores", "q_rms_norm", "sparse_attention_backward", "sparse_attention_forward",
    "sparse_indexer_loss", "sparse_indexer_loss_grad", "stable_topk",
]

BACKEND_NAME = "torch"
INDEX_DTYPE = torch.int32          # dtype of the ids and lengths this backend produces
F32 = torch.float32
INF = math.inf
_CHUNK_BUDGET = {"cuda": 1 << 30, "cpu": 1 << 26}   # bytes of temporaries per row chunk


# --------------------------------------------------------------------------------------------
# plumbing
# --------------------------------------------------------------------------------------------
def _op(fn):
    """Run ``fn`` without autograd and without autocast (local, restored on exit)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            return fn(*args, **kwargs)
    return wrapper


def _rows_per_chunk(chunk_rows, per_row_bytes: int, device: torch.device) -> int:
    if chunk_rows is not None:
        return as_int(chunk_rows, "chunk_rows", minimum=1)
    budget = _CHUNK_BUDGET.get(device.type, _CHUNK_BUDGET["cpu"])
    return max(1, budget // max(1, per_row_bytes))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b`` with exact products and float32 accumulation; float32 result."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=F32)
    return torch.bmm(a.to(F32), b.to(F32))


def _operand(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Round a float32 intermediate once to the operand dtype of ``like`` (no-op for fp32)."""
    return x.to(like.dtype) if like.dtype in (torch.bfloat16, torch.float16) else x


def _slots(ids: torch.Tensor, num_keys: int, lengths: torch.Tensor | None):
    """Section 6 validity ``[n, K]`` and int64 ids in which every invalid slot points at row
    ``num_keys``: the all-zero row that :func:`_with_zero_row` appends to the key table."""
    ok = (ids >= 0) & (ids < num_keys)
    if lengths is not None:
        ok &= torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    safe = torch.where(ok, ids, torch.full_like(ids, num_keys)).to(torch.int64)
    return ok, safe


def _with_zero_row(table: torch.Tensor) -> torch.Tensor:
    """``table`` plus one trailing row of zeros (a copy of ``table``, never a write to it).
    Invalid slots gather that row, so their keys are exactly 0 without masking the gathered
    tensor, and a NaN or inf in a row that no valid slot selects can never reach a result."""
    return torch.cat([table, table.new_zeros((1, table.shape[1]))], dim=0)


def _gather_rows(table_z: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    """``table_z[safe]`` as ``[n, K, D]`` (``table_z`` from :func:`_with_zero_row`)."""
    n, k = safe.shape
    return table_z.index_select(0, safe.reshape(-1)).view(n, k, table_z.shape[1])


SCATTER_METHODS = ("auto", "tree", "sorted_put")


def fixed_order_scatter_add(acc: torch.Tensor, dest: torch.Tensor, values: torch.Tensor, *,
                            deterministic: bool = True, method: str = "auto") -> None:
    """``acc[dest[i]] += values[i]`` (in place on ``acc``, which the caller owns).

    Deterministic mode, two fixed-order methods (``"auto"``: ``"sorted_put"`` on CUDA,
    ``"tree"`` elsewhere):

    - ``"tree"``: the contributions are sorted by destination with a stable sort (so each
      destination's terms stay in index order ``i``), each destination's terms are summed by a
      pairwise tree of fixed shape (``((v0+v1)+(v2+v3))+...``), and each destination then
      receives exactly one write. Portable; a handful of host synchronisations per call.
    - ``"sorted_put"``: ``index_put_(accumulate=True)``, which on CUDA sorts the indices
      (stable radix sort) and folds each destination's terms in that order in float32, with
      no float atomics; torch documents it as deterministic on CUDA (it is absent from the
      nondeterministic list of ``torch.use_deterministic_algorithms``; only its CPU version is
      listed). The GPU replay tests check it under heavy contention.

    Either way the bits depend only on the inputs, never on thread timing. Otherwise
    (``deterministic=False``) ``index_add_`` (float atomics on CUDA).
    """
    method = choice(method, "method", SCATTER_METHODS)
    if dest.numel() == 0:
        return
    dest = dest.to(torch.int64)
    values = values.to(acc.dtype)
    if not deterministic:
        acc.index_add_(0, dest, values)
        return
    if method == "sorted_put" or (method == "auto" and acc.is_cuda):
        acc.index_put_((dest,), values, accumulate=True)
        return
    order = torch.argsort(dest, stable=True)
    d = dest[order]
    v = values[order]
    uniq, counts = torch.unique_consecutive(d, return_counts=True)
    n = d.numel()
    seg = torch.repeat_interleave(torch.arange(uniq.numel(), device=d.device), counts,
                                  output_size=n)
    rank = torch.arange(n, device=d.device) - (torch.cumsum(counts, 0) - counts)[seg]
    cnt = counts[seg]
    levels = max(0, math.ceil(math.log2(int(counts.max())))) if n else 0
    for _ in range(levels):
        keep = torch.nonzero(rank % 2 == 0).squeeze(1)
        pair = (rank[keep] + 1 < cnt[keep]).unsqueeze(1)
        partner = v.index_select(0, (keep + 1).clamp(max=v.shape[0] - 1))
        v = v.index_select(0, keep) + torch.where(pair, partner, torch.zeros_like(partner))
        rank = rank[keep] // 2
        cnt = (cnt[keep] + 1) // 2
    # one term per destination (unique indices): each row is written exactly once
    acc.index_copy_(0, uniq, acc.index_select(0, uniq) + v)


def _layout_rows(layout: PackedLayout, device: torch.device):
    return (layout.pos.to(device), layout.is_real.to(device), layout.doc.to(device))


# --------------------------------------------------------------------------------------------
# section 4: stable Top-K
# --------------------------------------------------------------------------------------------
@_op
def stable_topk(scores, k, *, order: str = "id", align: int | None = None,
                deterministic: bool = True):
    """Contract section 4 on the scores' device. Candidates are the columns whose score is not
    ``-inf``; selection order (score descending, column id ascending) with ``-0.0 == +0.0``
    (zeros are canonicalised to ``+0.0`` first: a radix sort would rank ``+0`` above ``-0``).
    Returns int32 ``(ids [T, width], lengths [T])``; unused slots are -1. A stable sort is
    deterministic, so ``deterministic`` changes nothing here.
    """
    s, k, order, align, width, _ = validate_stable_topk(scores, k, order, align, deterministic)
    rows, cols = s.shape
    dev = s.device
    take = min(k, cols)
    ids = allocated(lambda: torch.full((rows, width), -1, dtype=INDEX_DTYPE, device=dev), "k",
                    f"the ids [T, width] = [{rows}, {width}] (k={k})")
    lengths = torch.clamp((s > -INF).sum(dim=1), max=take).to(INDEX_DTYPE)
    if take == 0 or rows == 0:
        return ids, lengths
    canon = s + 0.0                                   # -0.0 + 0.0 == +0.0
    _, perm = torch.sort(canon, dim=1, descending=True, stable=True)
    chosen = perm[:, :take]
    used = torch.arange(take, device=dev).unsqueeze(0) < lengths.unsqueeze(1)
    if order == "id":
        chosen, _ = torch.sort(torch.where(used, chosen, torch.full_like(chosen, cols)), dim=1)
    chosen = torch.where(used, chosen, torch.full_like(chosen, -1))
    ids[:, :take] = chosen.to(INDEX_DTYPE)
    return ids, lengths


# --------------------------------------------------------------------------------------------
# section 7: lightning indexer scores
# --------------------------------------------------------------------------------------------
@_op
def indexer_scores(q_idx, k_idx, weights, layout, ratio, *, scale=None, chunk_rows=None,
                   deterministic: bool = True):
    """Contract section 7: ``I[t,c] = scale * sum_h w[t,h] relu(<q_idx[t,h], k_idx[c]>)`` on the
    compressed groups visible to ``t``, ``-inf`` elsewhere; float32 ``[T, C]`` on the inputs'
    device. Per document, rows in chunks: ``z`` is one float32-accumulated GEMM, the head sum
    an elementwise float32 reduction (no TF32 involved for bf16 inputs).
    """
    q, k, w, ratio, C, scale, dev = validate_indexer_scores(q_idx, k_idx, weights, layout,
                                                            ratio, scale, deterministic)
    if chunk_rows is not None:           # checked even when no document has a row to chunk
        as_int(chunk_rows, "chunk_rows", minimum=1)
    T, HI, DI = q.shape
    out = torch.full((T, C), -INF, dtype=F32, device=dev)
    cu_pad = layout.cu_seqlens_padded.tolist()
    cu_comp = layout.compressed_offsets(ratio).tolist()
    real = layout.doc_lengths.tolist()
    vis = layout.visible_compressed(ratio).to(dev)
    wf = w.to(F32) * scale
    for b in range(layout.num_docs):
        r0, c0, c1 = cu_pad[b], cu_comp[b], cu_comp[b + 1]
        nb = c1 - c0
        if real[b] == 0 or nb == 0:
            continue
        kbt = k[c0:c1].t().unsqueeze(0)                                  # [1, D_I, n_b]
        step = _rows_per_chunk(chunk_rows, HI * nb * 4 * 3, dev)
        for s0 in range(r0, r0 + real[b], step):
            s1 = min(s0 + step, r0 + real[b])
            n = s1 - s0
            z = _mm(q[s0:s1], kbt.expand(n, DI, nb))                      # [n, H_I, n_b]
            sc = (torch.relu(z) * wf[s0:s1].unsqueeze(-1)).sum(dim=1)     # [n, n_b]
            cols = torch.arange(nb, device=dev).unsqueeze(0)
            out[s0:s1, c0:c1] = torch.where(cols < vis[s0:s1].unsqueeze(1), sc,
                                            torch.full_like(sc, -INF))
    return out


# --------------------------------------------------------------------------------------------
# sections 2, 3, 5: compressed-first rows
# --------------------------------------------------------------------------------------------
def _compact(ids: torch.Tensor):
    """Stable compaction of section 5 (valid entries to the front, -1 after) by a scatter to
    positions ``cumsum(valid) - 1``; each target is written once, so it is deterministic."""
    T, K = ids.shape
    valid = ids >= 0
    lengths = valid.sum(dim=1)
    pos = torch.cumsum(valid.to(torch.int64), dim=1) - 1
    pos = torch.where(valid, pos, torch.full_like(pos, K))          # invalid -> a dump column
    out = torch.full((T, K + 1), -1, dtype=ids.dtype, device=ids.device)
    out.scatter_(1, pos, torch.where(valid, ids, torch.full_like(ids, -1)))
    return out[:, :K].contiguous(), lengths


@_op
def build_csa_indices(layout, *, window, ratio, compressed_ids=None, device=None,
                      deterministic: bool = True):
    """Contract section 5: each real row's key ids ``[compressed part | window part]``,
    compacted; int32 ``(ids [T, Kc + window], lengths [T])`` in the logical key space of
    section 2 (raw row ``t`` is ``t``, compressed id ``c`` is ``T + c``).

    Arguments as in the oracle; ``device`` (extension) says where to build the rows when no
    ``compressed_ids`` tensor is given (default: the device of ``compressed_ids``, else CPU).
    Each non-negative ``compressed_ids`` entry of a real row must be visible to it, else
    ``ValueError``. ``compressed_ids`` is never modified.
    """
    check_layout(layout)
    window = as_int(window, "window", minimum=0)
    ratio = as_int(ratio, "ratio", minimum=0)
    if window == 0 and ratio == 0:
        raise ValueError("window=0 needs compressed keys (ratio > 0): a window-only layer "
                         "(ratio 0) needs window >= 1")
    as_bool(deterministic, "deterministic")
    device = as_device(device, "device")
    if compressed_ids is not None:
        compressed_ids = index_tensor(compressed_ids, "compressed_ids", ndim=2)
        same_device(compressed_ids=compressed_ids)           # no meta tensor
        check_dim(compressed_ids, "compressed_ids", 0, layout.num_rows, "layout.num_rows")
        if ratio == 0:
            raise ValueError("compressed_ids must be None for a window-only layer (ratio 0)")
        want = device
        if want is not None and (want.type != compressed_ids.device.type or (
                want.index is not None and want.index != compressed_ids.device.index)):
            raise ValueError(f"device={device} differs from compressed_ids' device "
                             f"{compressed_ids.device}")
        dev = compressed_ids.device
    else:
        dev = torch.device("cpu") if device is None else device
    T = layout.num_rows
    if T + layout.num_compressed(max(ratio, 1)) >= 2 ** 31:
        raise ValueError("the logical key space T + C does not fit int32 ids")
    pos, real, doc = _layout_rows(layout, dev)
    rows = torch.arange(T, device=dev)
    offs = torch.arange(window, device=dev).unsqueeze(0)
    wpos = torch.clamp(pos - window + 1, min=0).unsqueeze(1) + offs
    win_ok = (wpos <= pos.unsqueeze(1)) & real.unsqueeze(1)
    win = torch.where(win_ok, (rows - pos).unsqueeze(1) + wpos, torch.full_like(wpos, -1))
    if ratio == 0:
        cmp = torch.empty((T, 0), dtype=torch.int64, device=dev)
    else:
        cu_comp = layout.compressed_offsets(ratio).to(dev)
        vis = layout.visible_compressed(ratio).to(dev)
        base = cu_comp[doc.clamp_min(0)] if layout.num_docs else rows * 0
        if compressed_ids is None:
            width = int(layout.compressed_counts(ratio).max()) if layout.num_docs else 0
            g = torch.arange(width, device=dev).unsqueeze(0)
            ok = (g < vis.unsqueeze(1)) & real.unsqueeze(1)
            cmp = torch.where(ok, base.unsqueeze(1) + g, torch.full_like(g.expand(T, width), -1))
        else:
            given = compressed_ids.to(torch.int64)
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
    ids, lengths = _compact(torch.cat([cmp, win], dim=1))
    return ids.to(INDEX_DTYPE), lengths.to(INDEX_DTYPE)


# --------------------------------------------------------------------------------------------
# section 6: sparse attention with a sink
# --------------------------------------------------------------------------------------------
def _row_probabilities(s, lse, sink):
    """``P = exp(s - logaddexp(lse, sink))`` (float32); rows with ``lse = +inf`` get 0."""
    empty = torch.isinf(lse) & (lse > 0)
    full = torch.logaddexp(torch.where(empty, torch.zeros_like(lse), lse), sink.unsqueeze(0))
    p = torch.exp(s - full.unsqueeze(-1))
    return p.masked_fill(empty.unsqueeze(-1), 0.0), empty


@_op
def sparse_attention_forward(q, kv, ids, sink, *, scale=None, v_dim=None, lengths=None,
                             chunk_rows=None, deterministic: bool = True):
    """Contract section 6 forward. Returns ``out [T, H, Dv]`` in q's dtype and float32
    ``lse [T, H]`` (natural log, excluding the sink; ``+inf`` and ``out = 0`` on rows with no
    valid slot). Gathers each row's ``K`` key rows (chunked), never a ``T x S`` mask.
    """
    q, kv, ids, sink, scale, dv, lengths, _ = validate_attention_forward(
        q, kv, ids, sink, scale, v_dim, lengths, deterministic)
    reject_nan(sink=sink)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    dev = q.device
    sink32 = sink.to(F32)
    kv_z = _with_zero_row(kv)
    out = torch.empty((T, H, dv), dtype=q.dtype, device=dev)
    lse = torch.empty((T, H), dtype=F32, device=dev)
    step = _rows_per_chunk(chunk_rows, K * (D * kv.element_size() + H * 4 * 3), dev)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        valid, safe = _slots(ids[r0:r1], S, None if lengths is None else lengths[r0:r1])
        kg = _gather_rows(kv_z, safe)                                         # [n, K, D]
        s = (_mm(q[r0:r1], kg.transpose(1, 2)) * scale).masked_fill(~valid.unsqueeze(1), -INF)
        has = valid.any(dim=1, keepdim=True)                                  # [n, 1]
        m = s.amax(dim=-1) if K else torch.zeros((r1 - r0, H), dtype=F32, device=dev)
        m = torch.where(has, m, torch.zeros_like(m))
        e = torch.exp(s - m.unsqueeze(-1))                                    # [n, H, K]
        l = torch.where(has, torch.log(e.sum(dim=-1)) + m, torch.full_like(m, INF))
        # P = exp(s - LSEf) = e * exp(m - LSEf); rows without keys: P = 0 (e is 0 there)
        full = torch.logaddexp(torch.where(has, l, torch.zeros_like(l)), sink32.unsqueeze(0))
        c = torch.where(has, torch.exp(m - full), torch.zeros_like(m))
        p = e * c.unsqueeze(-1)
        out[r0:r1] = _mm(_operand(p, kv), kg[:, :, :dv]).to(q.dtype)
        lse[r0:r1] = l
    return out, lse


@_op
def sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, scale=None, v_dim=None,
                              lengths=None, chunk_rows=None, deterministic: bool = True):
    """Contract section 6 backward from the forward's ``out`` and ``lse``. Returns ``dq`` (q's
    dtype), ``dkv`` (kv's dtype, accumulated in float32 and rounded once) and float32
    ``dsink [H]``. Rows with no valid slot contribute nothing. ``dkv`` goes through
    :func:`fixed_order_scatter_add` (``deterministic=False``: ``index_add_``).
    """
    q, kv, ids, sink, scale, dv, lengths, deterministic, out, lse, dout = \
        validate_attention_backward(q, kv, ids, sink, out, lse, dout, scale, v_dim, lengths,
                                    deterministic)
    reject_nan(sink=sink, lse=lse)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    dev = q.device
    sink32 = sink.to(F32)
    kv_z = _with_zero_row(kv)
    dq = torch.empty_like(q)
    dkv = torch.zeros((S, D), dtype=F32, device=dev)
    dsink = torch.zeros(H, dtype=F32, device=dev)
    step = _rows_per_chunk(chunk_rows, K * (D * 4 * 4 + H * 4 * 6), dev)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        valid, safe = _slots(ids[r0:r1], S, None if lengths is None else lengths[r0:r1])
        kg = _gather_rows(kv_z, safe)
        l = lse[r0:r1].to(F32)
        s = (_mm(q[r0:r1], kg.transpose(1, 2)) * scale).masked_fill(~valid.unsqueeze(1), -INF)
        p, empty = _row_probabilities(s, l, sink32)
        empty = empty | ~valid.any(dim=1, keepdim=True)
        p = p.masked_fill(empty.unsqueeze(-1), 0.0)
        do = dout[r0:r1].to(q.dtype)
        delta = (dout[r0:r1].to(F32) * out[r0:r1].to(F32)).sum(dim=-1)       # [n, H]
        dp = _mm(do, kg[:, :, :dv].transpose(1, 2))                          # [n, H, K]
        ds = _operand(p * (dp - delta.unsqueeze(-1)) * scale, kv)            # scale folded in
        dq[r0:r1] = _mm(ds, kg).to(q.dtype)
        contrib = _mm(ds.transpose(1, 2), q[r0:r1])                          # [n, K, D]
        contrib[:, :, :dv] += _mm(_operand(p, kv).transpose(1, 2), do)
        flat = valid.reshape(-1)
        fixed_order_scatter_add(dkv, safe.reshape(-1)[flat], contrib.reshape(n * K, D)[flat],
                                deterministic=deterministic)
        p_sink = torch.sigmoid(sink32.unsqueeze(0) - l).masked_fill(empty, 0.0)
        dsink += -(p_sink * delta).sum(dim=0)
    return dq, dkv.to(kv.dtype), dsink


# --------------------------------------------------------------------------------------------
# section 8: sparse indexer loss
# --------------------------------------------------------------------------------------------
def _masked_softmax(x, mask):
    x = x.masked_fill(~mask, -INF)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def teacher_normalisers(lse: torch.Tensor, sink: torch.Tensor):
    """Contract section 8: per-head teacher normalisers ``LSEf = logaddexp(lse, sink)`` up to one
    per-row constant, ``(norm [T, H], has_mass [T])``, in the dtype of ``lse``.

    gpu_impl's own implementation (the oracle's is written separately, so that one bug cannot
    pass the comparison on both sides). The teacher depends only on the scores and on the
    differences between heads, so each row is shifted by its smallest live ``LSEf`` (exact
    head differences even at sinks of 2.4e38) and then by the largest ``lse - shifted`` (so
    ``exp(s - norm)`` stays at most about 1 for linear-domain kernels). A head with a ``+inf``
    sink is silenced (``norm = +inf``: no teacher mass from it); ``has_mass`` is False on rows
    whose every head is silenced."""
    full = torch.logaddexp(lse, sink.to(lse.dtype).unsqueeze(0))
    live = full != math.inf
    any_live = live.any(dim=1, keepdim=True)
    inf = torch.full_like(full, math.inf)
    base = torch.where(live, full, inf).amin(dim=1, keepdim=True)
    base = torch.where(any_live, base, torch.zeros_like(base))
    rel = full - base
    top = torch.where(live, lse - rel, -inf).amax(dim=1, keepdim=True)
    top = torch.where(any_live, top, torch.zeros_like(top))
    return torch.where(live, rel + top, inf), any_live.squeeze(1)


def rows_with_teacher_mass(target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Contract section 8: ``[T, 1]``, False on rows whose target is 0 on every valid slot
    (teacher mass zero: zero gradients)."""
    return (valid & (target > 0)).any(dim=1, keepdim=True)


def _kl(tau, p, mask, floor):
    a = torch.clamp_min(tau, floor)
    terms = a * (torch.log(a) - torch.log(torch.clamp_min(p, floor)))
    return torch.where(mask, terms, torch.zeros_like(terms)).sum(dim=-1)


@_op
def sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *, coeff,
                        scale=None, num_real=None, loss_floor=LOSS_FLOOR, chunk_rows=None,
                        deterministic: bool = True):
    """Contract section 8 loss, float32, in the oracle's log-space form with per-head offsets
    (:func:`teacher_normalisers`: the teacher never underflows, heads are
    silenced one by one, huge finite sinks are exact). Rows without teacher mass have
    ``tau = 0`` and ``KL = 0`` and the student softmax as ``predict``. Returns :class:`reference.IndexerLoss` with float32 ``loss`` (0-dim), ``kl``,
    ``target`` and ``predict`` on the inputs' device; ``num_real`` defaults to
    ``layout.num_real`` (pass the global count under CP).
    """
    q, kc, sink, lse, ids, scores, coeff, scale, floor, n_real, dev = \
        validate_sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout,
                                     coeff, scale, num_real, loss_floor, deterministic)
    reject_nan(sink=sink, lse=lse, index_scores=scores)
    reject_loss_values(lse, scores, ids, layout)
    T, H, D = q.shape
    C, Kc = kc.shape[0], ids.shape[1]
    _, real, _ = _layout_rows(layout, dev)
    valid = (ids >= 0) & (ids < C) & real.unsqueeze(1)
    safe = torch.where(valid, ids, torch.zeros_like(ids)).to(torch.int64)     # score columns
    safe_z = torch.where(valid, safe, torch.full_like(safe, C))               # key rows
    kc_z = _with_zero_row(kc)
    # LSEf up to a per-row constant, +inf on silenced heads (per-head offsets, section 8)
    lsef, has_mass = teacher_normalisers(lse.to(F32), sink.to(F32))
    target = torch.zeros((T, Kc), dtype=F32, device=dev)
    predict = torch.zeros((T, Kc), dtype=F32, device=dev)
    kl = torch.zeros(T, dtype=F32, device=dev)
    step = _rows_per_chunk(chunk_rows, Kc * (D * kc.element_size() + H * 4 * 3), dev)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        v = valid[r0:r1]
        massive = v & has_mass[r0:r1].unsqueeze(1)
        kg = _gather_rows(kc_z, safe_z[r0:r1])
        log_a = _mm(q[r0:r1], kg.transpose(1, 2)) * scale - lsef[r0:r1].unsqueeze(-1)
        log_a = log_a.masked_fill(~massive.unsqueeze(1), -INF)
        per_c = torch.logsumexp(log_a, dim=1)                                 # [n, Kc]
        norm = torch.logsumexp(per_c, dim=1, keepdim=True)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        tau = torch.where(massive, torch.exp(per_c - norm), torch.zeros_like(per_c))
        sc = scores[r0:r1].to(F32)
        if C == 0:                        # no compressed key: every slot is invalid (massive is
            sc = sc.new_zeros((r1 - r0, 1))   # all False), gather from one zero column
        p = _masked_softmax(torch.gather(sc, 1, safe[r0:r1]), v)   # every selected row
        target[r0:r1] = tau
        predict[r0:r1] = p
        kl[r0:r1] = _kl(tau, p, massive, floor)
    loss = coeff * kl.sum() / n_real
    return IndexerLoss(loss, kl, target, predict, n_real)


@_op
def sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target, predict, *, coeff,
                             num_real, grad_loss=1.0, scale=None, grad_floor=GRAD_FLOOR,
                             mode="clipped", loss_floor=LOSS_FLOOR, chunk_rows=None,
                             deterministic: bool = True):
    """Contract section 8 gradients wrt ``q_idx``, ``weights`` and ``k_idx`` (returned in their
    own dtypes, accumulated in float32).

    ``mode="clipped"``: ``gI = gs * (p * sum_c' tau~ m - tau~ m)`` from the given ``target`` and
    ``predict`` (``tau~ = max(tau, grad_floor)``, ``m = 1[p >= grad_floor]``).
    ``mode="autograd"``: the exact derivative of the loss with floor ``loss_floor``, which is
    the same expression with ``p`` recomputed in float32 from the indexer logits and the floor
    ``loss_floor`` (``d log max(p, f) / dp`` vanishes where ``p < f``); ``predict`` is unused.
    Both chain through the indexer with the strict gate ``z > 0``; ``dk_idx`` goes through
    :func:`fixed_order_scatter_add`. Rows whose ``target`` is 0 on every valid slot (teacher
    mass zero) get zero gradients; negative ``target`` / ``predict`` raise ``ValueError``.
    """
    q, k, w, ids, tau, p_in, coeff, n_real, grad_loss, scale, e, floor, mode, deterministic, \
        dev = validate_sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target,
                                                predict, coeff, num_real, grad_loss, scale,
                                                grad_floor, mode, loss_floor, deterministic)
    reject_nan(target=tau, predict=p_in)
    reject_negative(target=tau, predict=p_in)
    T, HI, DI = q.shape
    C, Kc = k.shape[0], ids.shape[1]
    valid = (ids >= 0) & (ids < C)
    valid = valid & rows_with_teacher_mass(tau, valid)     # rows without teacher mass: zero gradients
    safe = torch.where(valid, ids, torch.full_like(ids, C)).to(torch.int64)
    k_z = _with_zero_row(k)
    gs = coeff / n_real * grad_loss
    wf = w.to(F32) * scale
    dq = torch.empty_like(q)
    dw = torch.empty_like(w)
    dk = torch.zeros((C, DI), dtype=F32, device=dev)
    step = _rows_per_chunk(chunk_rows, Kc * (DI * 4 * 3 + HI * 4 * 4), dev)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        v = valid[r0:r1]
        kg = _gather_rows(k_z, safe[r0:r1])                                   # [n, Kc, D_I]
        z = _mm(q[r0:r1], kg.transpose(1, 2))                                 # [n, H_I, Kc]
        t32 = tau[r0:r1].to(F32)
        if mode == "autograd":
            logits = (torch.relu(z) * wf[r0:r1].unsqueeze(-1)).sum(dim=1)
            p, fl = _masked_softmax(logits, v), floor
        else:
            p, fl = p_in[r0:r1].to(F32), e
        tm = torch.where(v & (p >= fl), torch.clamp_min(t32, fl), torch.zeros_like(t32))
        g = gs * (p * tm.sum(dim=1, keepdim=True) - tm)
        g = torch.where(v, g, torch.zeros_like(g))                            # gI [n, Kc]
        dw[r0:r1] = (torch.relu(z) * g.unsqueeze(1)).sum(dim=-1).mul_(scale).to(w.dtype)
        gate = _operand((z > 0).to(F32) * wf[r0:r1].unsqueeze(-1) * g.unsqueeze(1), k)
        dq[r0:r1] = _mm(gate, kg).to(q.dtype)
        contrib = _mm(gate.transpose(1, 2), q[r0:r1])                         # [n, Kc, D_I]
        flat = v.reshape(-1)
        fixed_order_scatter_add(dk, safe[r0:r1].reshape(-1)[flat],
                                contrib.reshape(n * Kc, DI)[flat], deterministic=deterministic)
    return dq, dw, dk.to(k.dtype)


# --------------------------------------------------------------------------------------------
# section 9: query RMS norm
# --------------------------------------------------------------------------------------------
@_op
def q_rms_norm(q, eps: float = QNORM_EPS, *, deterministic: bool = True):
    """Contract section 9 in working precision: float32 compute from the input, one rounding to
    the input dtype. Bit-identical to :func:`reference.q_rms_norm_bf16` for bf16 input on every
    device and memory layout: the mean of squares is accumulated in float64 over a contiguous
    copy and rounded once to float32, ``+ eps`` is a float32 add, ``rsqrt`` is evaluated in
    float64 and rounded once (a correctly rounded float32 rsqrt), the product is float32.
    """
    x = float_tensor(q, "q")
    same_device(q=x)
    if x.dim() < 1:
        raise ValueError("q must have at least one dimension (the head dimension)")
    head_dim(x, "q")
    eps = as_real(eps, "eps", positive=True)
    as_bool(deterministic, "deterministic")
    # float64 rows with max |q| > 1 are first divided by a power of two s >= max |q| (exact),
    # with eps / s^2 in place of eps: q of 1e200 normalises to 1 instead of overflowing float32.
    # Narrower inputs (whose squares never overflow the float64 mean) and rows with
    # max |q| <= 1 keep s = 1, i.e. the formula above bit for bit.
    s = row_scale(x.contiguous()) if x.dtype == torch.float64 else \
        torch.ones((), dtype=torch.float64, device=x.device)
    x32 = (x.contiguous() / s).to(F32)
    ms = x32.to(torch.float64).square().mean(dim=-1, keepdim=True).to(F32)
    denom = ms + (eps / s.to(torch.float64).square()).to(F32)
    inv = torch.rsqrt(denom.to(torch.float64)).to(F32)
    return (x32 * inv).to(x.dtype)


# --------------------------------------------------------------------------------------------
# sections 13-15: the compressor (RoPE, the Hadamard rotation)
# --------------------------------------------------------------------------------------------
class _Slots(NamedTuple):
    """Per group (compressed-row order): the ``[T * c, d]`` element each slot reads (``-1``:
    invalid), the ``[r * c, d]`` row of ``ape`` it adds, and the RoPE position ``g * r``."""

    element: torch.Tensor      # [C, S] int64
    ape_row: torch.Tensor      # [C, S] int64
    position: torch.Tensor     # [C] int64


def _compressor_slots(layout: PackedLayout, ratio: int, c: int, dev) -> _Slots:
    """Section 15's groups over each document's padded length and the slots they read: with
    the overlap (``c = 2``) the previous group's tokens (channels ``[0, d)``, invalid at a
    document start) then the group's own (channels ``[d, 2d)``); else the own tokens."""
    counts = layout.doc_padded_lengths // ratio
    cu_pad = layout.cu_seqlens_padded
    doc = torch.repeat_interleave(torch.arange(layout.num_docs), counts)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])[doc]
    g = torch.arange(doc.numel()) - first
    doc_start = cu_pad[doc].unsqueeze(1)
    k = torch.arange(ratio).unsqueeze(0)
    own = doc_start + g.unsqueeze(1) * ratio + k                      # token rows [C, r]
    if c == 2:
        prev = own - ratio
        prev = torch.where((g > 0).unsqueeze(1), prev, torch.full_like(prev, -1))
        tok = torch.cat([prev, own], dim=1)
        half = torch.cat([torch.zeros_like(k), torch.ones_like(k)], dim=1)
    else:
        tok, half = own, torch.zeros_like(own)
    valid = tok >= 0
    element = torch.where(valid, tok * c + half, torch.full_like(tok, -1))
    ape_row = ((tok - doc_start) % ratio) * c + half
    return _Slots(element.to(dev), ape_row.to(dev), (g * ratio).to(dev))


def _rope_cos_sin(rope, position: torch.Tensor):
    """float32 ``(cos, sin)`` ``[n, dim/2]`` at ``position`` (section 13): from the parameters
    in float32 (as the kernels compute them), or read from a ``(cos, sin)`` table."""
    if isinstance(rope, torch.Tensor):
        rows = rope.to(device=position.device, dtype=F32).index_select(0, position)
        return rows[:, :, 0], rows[:, :, 1]
    dev = position.device
    i = torch.arange(rope.dim // 2, dtype=F32, device=dev)
    f = torch.pow(torch.tensor(float(rope.base), dtype=F32, device=dev), -2.0 * i / rope.dim)
    if rope.original_seq_len > 0:
        def corr(b):
            return rope.dim * math.log(rope.original_seq_len / (b * 2 * math.pi)) / \
                (2 * math.log(rope.base))
        low = max(math.floor(corr(rope.beta_fast)), 0)
        high = min(math.ceil(corr(rope.beta_slow)), rope.dim - 1)
        high = high + 0.001 if high == low else high
        smooth = 1 - torch.clamp((i - low) / (high - low), 0, 1)
        f = f / rope.factor * (1 - smooth) + f * smooth
    theta = position.to(F32).unsqueeze(1) * f.unsqueeze(0)
    return torch.cos(theta), torch.sin(theta)


def _rope32(x: torch.Tensor, cos, sin, inverse: bool = False) -> torch.Tensor:
    """Interleaved-pair rotation of the last ``dim`` channels of float32 rows (section 13)."""
    n, d = x.shape
    dim = 2 * cos.shape[1]
    if inverse:
        sin = -sin
    tail = x[:, d - dim:]
    a, b = tail[:, 0::2], tail[:, 1::2]
    y = x.clone()
    y[:, d - dim:] = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=2).reshape(n, dim)
    return y


def _hadamard32(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard rotation of float32 rows (section 14): butterflies, then
    the scale ``d ** -0.5``."""
    n, d = x.shape
    y, h = x, 1
    while h < d:
        v = y.view(n, d // (2 * h), 2, h)
        y = torch.stack([v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1]], dim=2).reshape(n, d)
        h *= 2
    return y * d ** -0.5


def _store(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A stage's float32 result stored once in the operand dtype of ``like`` (and read back)."""
    return x.to(like.dtype).to(F32)


def _compressor_pool(a, slots: _Slots, g0: int, g1: int):
    """Pooling of groups ``[g0, g1)`` in float32: values ``v [G, S, d]``, weights ``alpha``,
    pooled ``ctil [G, d]``, validity ``[G, S]``; a non-finite element read raises."""
    T = a.kv.shape[0]
    el = slots.element[g0:g1]
    valid = el >= 0
    safe = torch.where(valid, el, torch.full_like(el, T * a.coff))       # the zero row
    G, S = el.shape
    kv_z = _with_zero_row(a.kv.reshape(T * a.coff, a.d))
    sc_z = _with_zero_row(a.score.reshape(T * a.coff, a.d))
    v = _gather_rows(kv_z, safe).to(F32)
    z = _gather_rows(sc_z, safe).to(F32) + a.ape.to(F32).reshape(-1, a.d)[slots.ape_row[g0:g1]]
    for name, t in (("kv", v), ("score", z)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has a non-finite value in an element the compressor reads")
    z = z.masked_fill(~valid.unsqueeze(-1), -INF)
    alpha = torch.softmax(z, dim=1)
    return v, alpha, (alpha * v).sum(dim=1), valid


def compressor_stages(ctil, norm_weight, eps, cos, sin, rotate, like):
    """Section 15 after the pooling, for float32 pooled rows ``ctil [G, d]``: stored once in
    the dtype of ``like``, RMSNorm (stored), RoPE (stored), the Hadamard rotation (``rotate``);
    float32 result, to be stored by the caller."""
    ctil = _store(ctil, like)
    n = _store(norm_weight * ctil * torch.rsqrt(ctil.square().mean(dim=-1, keepdim=True) + eps),
               like)
    y = _store(_rope32(n, cos, sin), like)
    if rotate:
        y = _hadamard32(y)
    return y


def compressor_stages_backward(g, ctil, norm_weight, eps, cos, sin, rotate, like):
    """The backward of :func:`compressor_stages` for the upstream ``g [G, d]`` (float32) and the
    stored pooled rows ``ctil``: ``(dctil [G, d], dnorm_weight terms summed over the G rows)``,
    each stage's result stored once in the dtype of ``like``."""
    if rotate:
        g = _store(_hadamard32(g), like)
    dn = _store(_rope32(g, cos, sin, inverse=True), like)
    s = torch.rsqrt(ctil.square().mean(dim=-1, keepdim=True) + eps)
    mean = (norm_weight * dn * ctil).mean(dim=-1, keepdim=True)
    dctil = _store(s * norm_weight * dn - ctil * s ** 3 * mean, like)
    return dctil, (dn * ctil * s).sum(dim=0)


@_op
def compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                       rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None,
                       deterministic: bool = True):
    """Contract section 15 forward in working precision: float32 softmax, sums, statistics and
    rotations; every stage (pooled row, normalised row, RoPE, Hadamard) stored once in ``kv``'s
    dtype. Returns ``kv_cmp [C, d]`` in ``kv``'s dtype (``rotate``: the indexer's ``k_idx``)."""
    a = validate_compressor(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate,
                            eps, deterministic)
    slots = _compressor_slots(layout, a.ratio, a.coff, a.device)
    C = slots.position.numel()
    out = torch.empty((C, a.d), dtype=a.kv.dtype, device=a.device)
    w = a.norm_weight.to(F32)
    step = _rows_per_chunk(chunk_rows, slots.element.shape[1] * a.d * 4 * 4, a.device)
    for g0 in range(0, C, step):
        g1 = min(g0 + step, C)
        _, _, ctil, _ = _compressor_pool(a, slots, g0, g1)
        cos, sin = _rope_cos_sin(a.rope, slots.position[g0:g1])
        y = compressor_stages(ctil, w, a.eps, cos, sin, a.rotate, a.kv)
        out[g0:g1] = y.to(a.kv.dtype)
    return out


@_op
def compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope, overlap=None,
                        rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None,
                        deterministic: bool = True):
    """Contract section 15 backward in working precision (the stages of the forward in reverse,
    each stored once in ``kv``'s dtype). Returns ``(dkv, dscore)`` in ``kv``'s dtype (exact
    zeros on unread elements: every element is written by at most one slot, ``index_copy_``)
    and float32 ``(dape, dnorm_weight)``: ``dape`` through :func:`fixed_order_scatter_add`
    (``deterministic=False``: ``index_add_``, float atomics on CUDA), ``dnorm_weight`` a sum per
    chunk (one reduction of fixed shape) added chunk by chunk."""
    a = validate_compressor(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate,
                            eps, deterministic, dout)
    slots = _compressor_slots(layout, a.ratio, a.coff, a.device)
    C, S = slots.element.shape
    T, c, d = a.kv.shape[0], a.coff, a.d
    w = a.norm_weight.to(F32)
    dkv = torch.zeros((T * c, d), dtype=a.kv.dtype, device=a.device)
    dscore = torch.zeros((T * c, d), dtype=a.kv.dtype, device=a.device)
    dape = torch.zeros((a.ratio * c, d), dtype=F32, device=a.device)
    dweight = torch.zeros(d, dtype=F32, device=a.device)
    step = _rows_per_chunk(chunk_rows, S * d * 4 * 8, a.device)
    for g0 in range(0, C, step):
        g1 = min(g0 + step, C)
        v, alpha, ctil32, valid = _compressor_pool(a, slots, g0, g1)
        cos, sin = _rope_cos_sin(a.rope, slots.position[g0:g1])
        dctil, dw = compressor_stages_backward(dout[g0:g1].to(F32), _store(ctil32, a.kv), w,
                                               a.eps, cos, sin, a.rotate, a.kv)
        dctil = dctil.unsqueeze(1)
        dv = alpha * dctil
        dz = (alpha * (v - ctil32.unsqueeze(1)) * dctil).masked_fill(~valid.unsqueeze(-1), 0.0)
        rows = slots.element[g0:g1][valid]
        dkv.index_copy_(0, rows, dv[valid].to(a.kv.dtype))
        dscore.index_copy_(0, rows, dz[valid].to(a.kv.dtype))
        fixed_order_scatter_add(dape, slots.ape_row[g0:g1].reshape(-1), dz.reshape(-1, d),
                                deterministic=a.deterministic)
        dweight += dw
    return (dkv.view(T, c * d), dscore.view(T, c * d), dape.view(a.ratio, c * d), dweight)


@_op
def indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                               eps=COMPRESSOR_EPS, chunk_rows=None, deterministic: bool = True):
    """Section 15, the indexer's compressor: :func:`compressor_forward` with ``rotate=True``."""
    return compressor_forward(kv, score, ape, norm_weight, layout, ratio, rope=rope,
                              overlap=overlap, rotate=True, eps=eps, chunk_rows=chunk_rows,
                              deterministic=deterministic)


@_op
def indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope,
                                overlap=None, eps=COMPRESSOR_EPS, chunk_rows=None,
                                deterministic: bool = True):
    """Section 15 backward of the indexer's compressor (``rotate=True``)."""
    return compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, rope=rope,
                               overlap=overlap, rotate=True, eps=eps, chunk_rows=chunk_rows,
                               deterministic=deterministic)
