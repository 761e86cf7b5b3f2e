"""Split deterministic attention backward: a row pass, then column-sliced fixed-order planes
(contract section 6).

Why two passes: a single kernel that adds every ``dkv`` contribution into program-private
float32 planes of the full head dim needs, with one program per SM, ~345 MB of planes at
T=4096, far beyond the H200's 50 MB L2, so every contribution is an HBM read-modify-write and
each program's long chain of them runs latency-bound (docs/CUDNN.md). Here the work is split in
two passes, so that the contributions are formed from stored ``P``/``dS`` by many small
programs:

1. :func:`row_pass` (``_row_kernel``): one program per query row (all heads), like the forward:
   gather the row's selected keys block by block, recompute ``S`` and ``dP``, form ``P`` and
   ``dS``, accumulate ``dq`` in registers (written once) and, when asked, store ``P`` and
   ``dS`` (rounded once to the operand dtype, as flash-attention kernels do) into a
   ``[rows, H_pad, K_pad]`` buffer.
2. ``_dkv_kernel``: program ``(g, c)`` owns row group ``g`` (a contiguous block of rows) and
   head-dim column slice ``c``. It walks its rows in order and, per block of slots, reads
   ``P``/``dS`` back, forms ``contrib = scale dS^T q_c + P^T dO_c`` and adds it into the
   group's private float32 plane (read-modify-write, no atomics; a CTA barrier separates
   rows; each slot's plane row is precomputed by :func:`plane_rows`, so the read-modify-write
   waits on one index load, not on an id and a tile-table lookup). The column split
   multiplies the programs without multiplying the planes (groups x touched key tiles x 64 x D
   x 4 bytes). Measured on the H200 (docs/PERFORMANCE.md), many groups win: the default, 8
   programs per SM, keeps 303 MB of planes in HBM and runs at about the bandwidth floor of the
   read-modify-write, while L2-sized planes (8-34 groups) are latency-bound and slower. The
   ``n_c`` programs of a group are adjacent in launch order and read the same ``P``/``dS`` at
   about the same time (L2 hits).
3. :func:`gpu_impl.kernels_triton.fold_planes` sums each key tile over groups in group order.

Every ``dkv`` element is therefore a fixed-order sum (row order inside a group, group order in
the fold): bitwise repeatable, whatever the thread timing. Duplicate valid ids within a row are
merged first (:func:`gpu_impl.kernels_triton.slot_multiplicity`: the first slot carries the
multiplicity). Rows are processed in chunks of whole groups so that the ``P``/``dS`` buffer
stays under ``max_buffer_bytes``.

Precision: as the forward in :mod:`gpu_impl.kernels_triton` (operands bf16, float32
accumulation, ``P``/``dS`` rounded once to the operand dtype, ``dq``/``dkv`` rounded once from
float32).

Importing this module needs triton; nothing here runs at import time.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import kernels_triton as kt
from .kernels_triton import _pow2, _row_slots, _slot_block

__all__ = ["attention_backward", "row_pass", "plane_rows", "SPLIT_CONFIG"]

LOG2E = 1.4426950408889634

# Launch parameters (chosen on the H200 with bench/bench_gpu.py --det-backward-only; see
# docs/CUDNN.md). Row pass: block_n slots per step, the head dim in d_chunks register chunks.
# dkv pass: block_d columns per program, groups = ceil(SMs * programs_per_sm / column slices).
SPLIT_CONFIG = dict(block_n=64, d_chunks=4, num_warps=8, num_stages=1,
                    block_d=64, dkv_block_n=64, programs_per_sm=8, groups=None,
                    dkv_warps=4, dkv_stages=2, max_buffer_bytes=2 ** 31)


@triton.jit
def _row_kernel(q_ptr, kv_ptr, ids_ptr, len_ptr, do_ptr, full_ptr, delta_ptr, dq_ptr,
                p_ptr, ds_ptr, row0, H, D, DV, S, K, K_PAD, scale, scale_log2,
                stride_qt, stride_qh, stride_kv, stride_it, stride_dot, stride_doh,
                HAS_LEN: tl.constexpr, STORE_PDS: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, DC: tl.constexpr, NCH: tl.constexpr):
    local = tl.program_id(0).to(tl.int64)
    t = row0 + local
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, DC)
    n_slots = _row_slots(len_ptr, t, K, HAS_LEN)
    full2 = tl.load(full_ptr + t * H + offs_h, mask=h_ok, other=float("inf"))
    delta = tl.load(delta_ptr + t * H + offs_h, mask=h_ok, other=0.0)
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    do_row = do_ptr + t * stride_dot + offs_h[:, None] * stride_doh
    buf_rows = local * (BLOCK_H * K_PAD) + offs_h[:, None] * K_PAD
    acc0 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
    for j0 in range(0, n_slots, BLOCK_N):
        slot, in_len, valid, sid = _slot_block(ids_ptr + t * stride_it, j0, n_slots, S, offs_n)
        kv_rows = kv_ptr + sid[:, None] * stride_kv
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        dp = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for ci in tl.static_range(NCH):
            dd = ci * DC + offs_c
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & (dd < D)[None, :], other=0.0)
            qc = tl.load(q_row + dd[None, :], mask=h_ok[:, None] & (dd < D)[None, :], other=0.0)
            oc = tl.load(do_row + dd[None, :], mask=h_ok[:, None] & (dd < DV)[None, :], other=0.0)
            s = tl.dot(qc, tl.trans(kc), s)
            dp = tl.dot(oc, tl.trans(kc), dp)
        keep = valid[None, :] & h_ok[:, None]
        p = tl.where(keep, tl.exp2(s * scale_log2 - full2[:, None]), 0.0)
        ds = tl.where(keep, p * (dp - delta[:, None]), 0.0).to(q_ptr.dtype.element_ty)
        if STORE_PDS:
            tl.store(p_ptr + buf_rows + slot[None, :], p.to(q_ptr.dtype.element_ty))
            tl.store(ds_ptr + buf_rows + slot[None, :], ds)
        for ci in tl.static_range(NCH):
            dd = ci * DC + offs_c
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & (dd < D)[None, :], other=0.0)
            if ci == 0:
                acc0 = tl.dot(ds, kc, acc0)
            elif ci == 1:
                acc1 = tl.dot(ds, kc, acc1)
            elif ci == 2:
                acc2 = tl.dot(ds, kc, acc2)
            else:
                acc3 = tl.dot(ds, kc, acc3)
    dq_row = dq_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    for ci in tl.static_range(NCH):
        dd = ci * DC + offs_c
        m = h_ok[:, None] & (dd < D)[None, :]
        if ci == 0:
            tl.store(dq_row + dd[None, :], (acc0 * scale).to(dq_ptr.dtype.element_ty), mask=m)
        elif ci == 1:
            tl.store(dq_row + dd[None, :], (acc1 * scale).to(dq_ptr.dtype.element_ty), mask=m)
        elif ci == 2:
            tl.store(dq_row + dd[None, :], (acc2 * scale).to(dq_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(dq_row + dd[None, :], (acc3 * scale).to(dq_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dkv_kernel(q_ptr, do_ptr, len_ptr, mult_ptr, prow_ptr, p_ptr, ds_ptr, plane_ptr,
                T, H, D, DV, K, K_PAD, row0, g0, rows_per_group, n_col, scale,
                stride_qt, stride_qh, stride_dot, stride_doh,
                HAS_LEN: tl.constexpr, HAS_MULT: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    g = g0 + pid // n_col
    col = pid % n_col
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    dd = col * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dd < D
    r0 = g * rows_per_group
    r1 = tl.minimum(r0 + rows_per_group, T)
    for t32 in range(r0, r1):
        t = tl.cast(t32, tl.int64)
        n_slots = _row_slots(len_ptr, t, K, HAS_LEN)
        qc = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + dd[None, :],
                     mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        oc = tl.load(do_ptr + t * stride_dot + offs_h[:, None] * stride_doh + dd[None, :],
                     mask=h_ok[:, None] & (dd < DV)[None, :], other=0.0)
        buf_rows = (t - row0) * (BLOCK_H * K_PAD) + offs_h[:, None] * K_PAD
        for j0 in range(0, n_slots, BLOCK_N):
            slot = j0 + offs_n
            in_len = slot < n_slots
            prow = tl.load(prow_ptr + t * K_PAD + slot, mask=in_len, other=-1).to(tl.int64)
            active = prow >= 0
            p = tl.load(p_ptr + buf_rows + slot[None, :], mask=in_len[None, :], other=0.0)
            ds = tl.load(ds_ptr + buf_rows + slot[None, :], mask=in_len[None, :], other=0.0)
            contrib = tl.dot(tl.trans(ds), qc) * scale + tl.dot(tl.trans(p), oc)
            if HAS_MULT:
                mult = tl.load(mult_ptr + t * K + slot, mask=in_len, other=0.0)
                contrib = contrib * mult[:, None]
            pptr = plane_ptr + tl.where(active, prow, 0)[:, None] * D + dd[None, :]
            pmask = active[:, None] & d_ok[None, :]
            old = tl.load(pptr, mask=pmask, other=0.0, cache_modifier=".cg")
            tl.store(pptr, old + contrib, mask=pmask)
        tl.debug_barrier()


def plane_rows(ids, active, table, rows_per_group: int, k_pad: int):
    """Per (row, slot): the plane row its contribution goes to (``table[group, id // 64] * 64
    + id % 64``), ``-1`` for inactive slots and the padding up to ``k_pad`` (int32
    ``[T, k_pad]``). Gathers only: deterministic."""
    T, K = ids.shape
    dev = ids.device
    grp = (torch.arange(T, device=dev) // rows_per_group).unsqueeze(1)
    sid = torch.where(active, ids.to(torch.int64), torch.zeros_like(ids, dtype=torch.int64))
    base = table[grp, sid // kt.TILE]
    prow = torch.where(active, base * kt.TILE + sid % kt.TILE, torch.full_like(base, -1))
    out = torch.full((T, k_pad), -1, dtype=torch.int32, device=dev)
    out[:, :K] = prow.to(torch.int32)
    return out


class _PhaseTimer:
    """Milliseconds per phase from CUDA events (a no-op when disabled); phases that repeat
    (row chunks) add up."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.marks: list = []
        if enabled:
            self._event("start")

    def _event(self, name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((name, ev))

    def mark(self, name: str):
        if self.enabled:
            self._event(name)

    def result(self) -> dict:
        if not self.enabled:
            return {}
        self.marks[-1][1].synchronize()
        ms: dict = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            ms[name] = round(ms.get(name, 0.0) + a.elapsed_time(b), 4)
        return {"ms": ms}


def _chunks(D: int, d_chunks: int):
    bd = _pow2(D)
    nch = max(1, min(int(d_chunks), bd // 16, 4))
    return bd // nch, nch


def row_pass(q, kv, ids, lengths, dout, full2, delta, scale, dv, *, dq=None, rows=None,
             pds=None, block_n=64, d_chunks=4, num_warps=8, num_stages=1):
    """``dq`` of rows ``rows = (r0, r1)`` (all rows by default; one program per row, written
    once into ``dq``), and, when ``pds = (p_buf, ds_buf)`` (operand dtype,
    ``[r1 - r0, H_pad, K_pad]``) is given, the rows' ``P`` and ``dS``. Returns ``dq``."""
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    r0, r1 = rows if rows is not None else (0, T)
    dq = torch.empty_like(q) if dq is None else dq
    if r1 <= r0:
        return dq
    dc, nch = _chunks(D, d_chunks)
    lens = lengths.contiguous() if lengths is not None else ids
    k_pad = pds[0].shape[2] if pds is not None else K
    p_buf, ds_buf = pds if pds is not None else (dq, dq)      # dummy pointers when not stored
    _row_kernel[(r1 - r0,)](q, kv, ids, lens, dout, full2, delta, dq, p_buf, ds_buf, r0,
                            H, D, dv, S, K, k_pad, float(scale), float(scale) * LOG2E,
                            q.stride(0), q.stride(1), kv.stride(0), ids.stride(0),
                            dout.stride(0), dout.stride(1), HAS_LEN=lengths is not None,
                            STORE_PDS=pds is not None, BLOCK_H=_pow2(H), BLOCK_N=block_n,
                            DC=dc, NCH=nch, num_warps=num_warps, num_stages=num_stages)
    return dq


def attention_backward(q, kv, ids, sink, out, lse, dout, scale, dv, lengths=None, *,
                       stats: dict | None = None, **overrides):
    """Deterministic section 6 backward (``dq``, ``dkv``, float32 ``dsink``), arguments already
    validated, with the conventions of :func:`gpu_impl.kernels_triton.attention_forward`:
    ``out``/``dout`` ``[T,H,Dv]``, ``lse`` float32 ``[T,H]`` (KV-only, +inf on empty rows),
    ``sink`` float32 ``[H]``. ``overrides`` replace :data:`SPLIT_CONFIG` entries; ``stats``, when
    given, receives the layout (groups, column slices, plane and buffer bytes, chunks); with
    ``stats["time"] = True`` also the milliseconds of each phase (CUDA events; this adds
    synchronisations, so time whole calls without it)."""
    cfg = dict(SPLIT_CONFIG)
    for k_, v_ in overrides.items():
        if k_ not in cfg:
            raise TypeError(f"unknown split-backward option {k_!r}")
        if v_ is not None:
            cfg[k_] = v_
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    dev = q.device
    f32 = torch.float32
    if T == 0 or K == 0 or S == 0:
        return (torch.zeros_like(q), torch.zeros((S, D), dtype=kv.dtype, device=dev),
                torch.zeros(H, dtype=f32, device=dev))
    q = q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    dout = dout.contiguous()
    ids = ids.contiguous()
    timer = _PhaseTimer(stats is not None and stats.get("time") is True and dev.type == "cuda")
    delta, full2, dsink = kt.row_statistics(out, lse, dout, sink)
    timer.mark("statistics")
    # Slot validity, duplicate merging and the plane layout (integer ops: deterministic).
    valid = (ids >= 0) & (ids < S)
    if lengths is not None:
        valid &= (torch.arange(K, device=dev).unsqueeze(0)
                  < lengths.to(torch.int64).clamp(0, K).unsqueeze(1))
    mult = kt.slot_multiplicity(ids, valid)
    active = valid if mult is None else (mult > 0)
    timer.mark("multiplicity")
    block_d = min(int(cfg["block_d"]), _pow2(D))
    n_col = -(-D // block_d)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    groups = cfg["groups"] or -(-sms * cfg["programs_per_sm"] // n_col)
    groups = max(1, min(int(groups), T))
    rows_per_group = -(-T // groups)
    groups = -(-T // rows_per_group)
    table, nt, total = kt.tile_table(ids, active, S, groups, rows_per_group)
    timer.mark("tile_table")
    planes = torch.zeros((max(total, 1) * kt.TILE, D), dtype=f32, device=dev)
    # P/dS buffer: whole groups per chunk, at most max_buffer_bytes.
    block_h = _pow2(H)
    block_n = int(cfg["block_n"])
    dkv_block_n = int(cfg["dkv_block_n"])
    k_pad = -(-K // math.lcm(block_n, dkv_block_n)) * math.lcm(block_n, dkv_block_n)
    row_bytes = 2 * block_h * k_pad * q.element_size()
    groups_per_chunk = max(1, int(cfg["max_buffer_bytes"]) // max(1, row_bytes * rows_per_group))
    chunk_rows = min(T, groups_per_chunk * rows_per_group)
    buf = torch.empty((2, chunk_rows, block_h, k_pad), dtype=q.dtype, device=dev)
    prow = plane_rows(ids, active, table, rows_per_group, k_pad)
    timer.mark("plane_rows")
    dq = torch.empty_like(q)
    lens = lengths.contiguous() if lengths is not None else ids
    mult_arg = mult if mult is not None else delta
    n_chunks = 0
    for g0 in range(0, groups, groups_per_chunk):
        g1 = min(groups, g0 + groups_per_chunk)
        r0, r1 = g0 * rows_per_group, min(T, g1 * rows_per_group)
        row_pass(q, kv, ids, lengths, dout, full2, delta, scale, dv, dq=dq, rows=(r0, r1),
                 pds=(buf[0], buf[1]), block_n=block_n, d_chunks=cfg["d_chunks"],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        timer.mark("row_pass")
        _dkv_kernel[((g1 - g0) * n_col,)](
            q, dout, lens, mult_arg, prow, buf[0], buf[1], planes,
            T, H, D, dv, K, k_pad, r0, g0, rows_per_group, n_col, float(scale),
            q.stride(0), q.stride(1), dout.stride(0), dout.stride(1),
            HAS_LEN=lengths is not None, HAS_MULT=mult is not None, BLOCK_H=block_h,
            BLOCK_N=dkv_block_n, BLOCK_D=block_d,
            num_warps=cfg["dkv_warps"], num_stages=cfg["dkv_stages"])
        timer.mark("dkv_pass")
        n_chunks += 1
    dkv = torch.empty((S, D), dtype=kv.dtype, device=dev)
    kt.fold_planes(planes, table, dkv, groups, nt)
    timer.mark("fold")
    if stats is not None:
        stats.update(route="split", groups=groups, rows_per_group=rows_per_group,
                     column_slices=n_col, plane_bytes=planes.numel() * 4,
                     buffer_bytes=buf.numel() * buf.element_size(), chunks=n_chunks,
                     **timer.result())
    return dq, dkv, dsink
