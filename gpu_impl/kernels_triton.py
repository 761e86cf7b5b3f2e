"""Triton kernels of the H200 lane: sparse MQA attention with a sink (contract section 6).

Why these exist: cuDNN 1.32 has no sparse-attention forward on SM90, and its SM90 backward
accumulates ``dkv`` and ``d_sink`` with float atomics (not repeatable). These kernels give

- :func:`attention_forward`: one program per (query row, block of value columns); the row's
  selected keys are gathered block by block straight from ``kv`` (no gathered copy in memory),
  online softmax in float32 over the valid slots only, the sink added to the normaliser at the
  end (``out = acc * exp(m - logaddexp(lse, sink))``); ``lse`` excludes the sink and is
  ``+inf`` on rows with no valid slot (whose ``out`` is exactly 0). Invalid slots are never
  read (masked loads), so NaN in unselected key rows cannot leak. One program owns each output
  element and reduces in a fixed order: bitwise repeatable.
- the building blocks of the deterministic backward (:mod:`gpu_impl.kernels_triton_split`):
  :func:`row_statistics` (``Delta``, the full normaliser, ``dsink``), :func:`slot_multiplicity`
  (duplicate valid ids of a row merged onto their first slot), :func:`tile_table` (the layout
  of program-private float32 planes: only the 64-row key tiles a program touches) and
  :func:`fold_planes` (each key tile summed over the planes in program order, so every
  ``dkv`` element is a fixed-order sum); the slot-validity helpers ``_row_slots`` and
  ``_slot_block`` that every kernel walking a row's slots shares.

Precision (working precision): q/kv/dO operands in their dtype (bf16), every product
accumulated in float32; ``P`` and ``dS`` rounded once to the operand dtype before the GEMM that
consumes them (as flash-attention kernels and cuDNN do); ``lse``, ``dsink`` float32; ``out``,
``dq``, ``dkv`` in the operand dtype, rounded once from float32.

Importing this module needs triton; nothing here runs at import time.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["attention_forward", "fold_planes", "tile_table", "slot_multiplicity",
           "row_statistics", "FORWARD_CONFIG"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
TILE = 64            # key rows per plane tile (tile table granularity)

# Default launch parameters (chosen by bench/bench_gpu.py on the H200; see docs/CUDNN.md).
FORWARD_CONFIG = dict(block_n=64, block_d=64, block_dv=512, num_warps=8, num_stages=3)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (int(n) - 1).bit_length()))


# --------------------------------------------------------------------------------------------
# slot validity (shared by every kernel that walks a row's slots)
# --------------------------------------------------------------------------------------------
@triton.jit
def _row_slots(len_ptr, t, K, HAS_LEN: tl.constexpr):
    """Section 6: the number of slots of row ``t`` that may be valid, ``clamp(len_t, 0, K)``
    (``K`` without lengths)."""
    n_slots = K
    if HAS_LEN:
        n_slots = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), K)
    return n_slots


@triton.jit
def _slot_block(ids_row_ptr, j0, n_slots, S, offs_n):
    """Section 6 slot validity for slots ``j0 + offs_n`` of one row: ``(slot, in_len, valid,
    sid)`` with ``valid = slot < n_slots and 0 <= id < S`` and ``sid`` the id where valid, else
    0 (a safe address; invalid ids are never read)."""
    slot = j0 + offs_n
    in_len = slot < n_slots
    idv = tl.load(ids_row_ptr + slot, mask=in_len, other=-1).to(tl.int64)
    valid = in_len & (idv >= 0) & (idv < S)
    return slot, in_len, valid, tl.where(valid, idv, 0)


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(q_ptr, kv_ptr, ids_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
                H, D, DV, S, K, scale_log2,
                stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh,
                HAS_LEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    n_slots = _row_slots(len_ptr, t, K, HAS_LEN)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    for j0 in range(0, n_slots, BLOCK_N):
        slot, in_len, valid, sid = _slot_block(ids_ptr + t * stride_it, j0, n_slots, S, offs_n)
        kv_rows = kv_ptr + sid[:, None] * stride_kv
        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            d_ok = dd < D
            qc = tl.load(q_row + dd[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
            s += tl.dot(qc, tl.trans(kc))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vc = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc)
        m_i = m_new
    empty = l_i == 0.0
    lse2 = tl.where(empty, 0.0, m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    sink2 = tl.load(sink_ptr + offs_h, mask=h_ok, other=float("-inf")) * 1.4426950408889634
    hi = tl.maximum(lse2, sink2)
    lo = tl.minimum(lse2, sink2)
    full2 = hi + tl.log2(1.0 + tl.exp2(lo - hi))          # logaddexp2(lse2, sink2)
    full2 = tl.where(hi == float("inf"), float("inf"), full2)
    factor = tl.where(empty, 0.0, tl.exp2(tl.where(empty, 0.0, m_i) - full2))
    o = acc * factor[:, None]
    out_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & v_ok[None, :])
    if pid_v == 0:
        lse = tl.where(empty, float("inf"), lse2 * 0.6931471805599453)
        tl.store(lse_ptr + t * H + offs_h, lse, mask=h_ok)


def attention_forward(q, kv, ids, sink, scale, dv, lengths=None, *, block_n=None, block_d=None,
                      block_dv=None, num_warps=None, num_stages=None):
    """Section 6 forward on CUDA (or the Triton interpreter): ``out [T,H,Dv]`` in q's dtype and
    float32 ``lse [T,H]``. Arguments are assumed validated: q ``[T,H,D]``, kv ``[S,D]`` (unit
    last stride), ids ``[T,K]`` int32/int64, sink ``[H]`` float32, lengths ``[T]`` or None."""
    cfg = dict(FORWARD_CONFIG)
    for k_, v_ in (("block_n", block_n), ("block_d", block_d), ("block_dv", block_dv),
                   ("num_warps", num_warps), ("num_stages", num_stages)):
        if v_ is not None:
            cfg[k_] = v_
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    ids = ids.contiguous()
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    block_h = _pow2(H)
    block_d = min(cfg["block_d"], _pow2(D))
    block_dv = min(cfg["block_dv"], _pow2(dv))
    block_n = cfg["block_n"]
    lens = lengths.contiguous() if lengths is not None else ids   # dummy pointer when absent
    grid = (T, triton.cdiv(dv, block_dv))
    _fwd_kernel[grid](q, kv, ids, lens, sink, out, lse,
                      H, D, dv, S, K, float(scale) * LOG2E,
                      q.stride(0), q.stride(1), kv.stride(0), ids.stride(0),
                      out.stride(0), out.stride(1),
                      HAS_LEN=lengths is not None, BLOCK_H=block_h, BLOCK_N=block_n,
                      BLOCK_D=block_d, BLOCK_DV=block_dv,
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


# --------------------------------------------------------------------------------------------
# building blocks of the deterministic backward
# --------------------------------------------------------------------------------------------
@triton.jit
def _fold_kernel(plane_ptr, table_ptr, dkv_ptr, S, D, NT, G, stride_dkv,
                 TILE_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    tile = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = tl.arange(0, TILE_ROWS)
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dd < D
    acc = tl.zeros([TILE_ROWS, BLOCK_D], dtype=tl.float32)
    for g in range(0, G):
        base = tl.load(table_ptr + tl.cast(g, tl.int64) * NT + tile)
        if base >= 0:
            ptrs = plane_ptr + (base * TILE_ROWS + rows)[:, None] * D + dd[None, :]
            acc += tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    key = tile.to(tl.int64) * TILE_ROWS + rows
    tl.store(dkv_ptr + key[:, None] * stride_dkv + dd[None, :], acc.to(dkv_ptr.dtype.element_ty),
             mask=(key < S)[:, None] & d_ok[None, :])


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, H, DV, stride_ot, stride_oh, stride_dt, stride_dh,
                  BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_v = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for v0 in range(0, DV, BLOCK_V):
        vv = v0 + offs_v
        m = h_ok[:, None] & (vv < DV)[None, :]
        o = tl.load(o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + vv[None, :], mask=m,
                    other=0.0).to(tl.float32)
        d = tl.load(do_ptr + t * stride_dt + offs_h[:, None] * stride_dh + vv[None, :], mask=m,
                    other=0.0).to(tl.float32)
        acc += tl.sum(o * d, 1)
    tl.store(delta_ptr + t * H + offs_h, acc, mask=h_ok)


def row_statistics(out, lse, dout, sink):
    """Per row: ``Delta = rowsum(dO * out)`` (float32 products and sums in one Triton program
    per row: a fixed order, no float32 copies of ``out``/``dO``), the full normaliser
    ``logaddexp(lse, sink)`` in log2 units (+inf on empty rows) and ``dsink`` (fixed-shape float32
    torch reductions of per-row terms). Empty rows (``lse = +inf``) contribute nothing."""
    f32 = torch.float32
    T, H, DV = out.shape
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = torch.empty((T, H), dtype=f32, device=out.device)
    if T:
        _delta_kernel[(T,)](out, dout, delta, H, DV, out.stride(0), out.stride(1),
                            dout.stride(0), dout.stride(1), BLOCK_H=_pow2(H),
                            BLOCK_V=min(128, _pow2(DV)), num_warps=4)
    lse32 = lse.to(f32)
    sink32 = sink.to(f32)
    empty = torch.isinf(lse32) & (lse32 > 0)
    lse0 = torch.where(empty, torch.zeros_like(lse32), lse32)
    delta = torch.where(empty, torch.zeros_like(delta), delta)
    full = torch.logaddexp(lse0, sink32.unsqueeze(0))
    full = torch.where(empty, torch.full_like(full, math.inf), full)
    p_sink = torch.sigmoid(sink32.unsqueeze(0) - lse0)
    p_sink = torch.where(empty, torch.zeros_like(p_sink), p_sink)
    dsink = -(p_sink * delta).sum(dim=0)
    return delta.contiguous(), (full * LOG2E).contiguous(), dsink


def slot_multiplicity(ids: torch.Tensor, valid: torch.Tensor):
    """Per slot, how many valid slots of its row hold the same id, on the first of them, and 0
    on the later duplicates and invalid slots (float32 ``[T, K]``); ``None`` when no row holds a
    duplicate valid id. Integer sorts and counts only: deterministic."""
    T, K = ids.shape
    if K < 2 or T == 0:
        return None
    # valid ids are < S <= 2^31 - 1, so int32 keys hold them (a faster sort than int64)
    big = torch.iinfo(torch.int32).max
    key = torch.where(valid, ids.to(torch.int32), torch.full_like(ids, big, dtype=torch.int32))
    srt, perm = torch.sort(key, dim=1, stable=True)
    same = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != big)
    if not bool(same.any()):
        return None
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = ~same
    run = torch.cumsum(first.to(torch.int64), dim=1) - 1
    counts = torch.zeros_like(run).scatter_add_(1, run, torch.ones_like(run))
    mult_sorted = torch.where(first & (srt != big), counts.gather(1, run), torch.zeros_like(run))
    mult = torch.empty_like(mult_sorted).scatter_(1, perm, mult_sorted)
    return mult.to(torch.float32).contiguous()


def tile_table(ids: torch.Tensor, active: torch.Tensor, num_keys: int, programs: int,
               rows_per_prog: int):
    """The plane layout: ``table [G, NT]`` int64 (the first plane row of each key tile a program
    touches, -1 for the others) and the total number of plane tiles. Boolean scatters (every
    write stores True) and cumulative sums only: deterministic."""
    T, K = ids.shape
    nt = max(1, -(-num_keys // TILE))
    dev = ids.device
    prog = (torch.arange(T, device=dev) // rows_per_prog).unsqueeze(1).expand(T, K)
    tile = torch.where(active, ids.to(torch.int64) // TILE, torch.full_like(ids, nt, dtype=torch.int64))
    touched = torch.zeros((programs, nt + 1), dtype=torch.bool, device=dev)
    touched[prog.reshape(-1), tile.reshape(-1)] = True
    touched = touched[:, :nt]
    count = touched.sum(dim=1)
    start = torch.cumsum(count, 0) - count
    local = torch.cumsum(touched.to(torch.int64), dim=1) - 1
    table = torch.where(touched, start.unsqueeze(1) + local, torch.full_like(local, -1))
    total = int(count.sum())
    return table.contiguous(), nt, total


def fold_planes(planes, table, dkv, programs: int, num_tiles: int, block_d: int = 128):
    """``dkv[key] = sum over programs g = 0, 1, ... of plane_g[key]`` in that order."""
    S, D = dkv.shape
    bd = min(block_d, _pow2(D))
    grid = (num_tiles, triton.cdiv(D, bd))
    _fold_kernel[grid](planes, table, dkv, S, D, num_tiles, programs, dkv.stride(0),
                       TILE_ROWS=TILE, BLOCK_D=bd, num_warps=4)
    return dkv
