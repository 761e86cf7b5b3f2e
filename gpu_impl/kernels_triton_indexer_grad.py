"""Triton kernels of the deterministic clipped indexer-loss gradient (contract section 8).

For each row ``t`` and valid slot ``c`` (id ``i = ids[t, c]`` in ``[0, C)``):

- ``gI[t, c] = gs * (p * sum_c' tm - tm)`` with ``tm = max(tau, e)`` where ``p >= e`` (else 0),
  ``gs = coeff / N * grad_loss``;
- ``z[t, h, c] = <q_idx[t, h], k_idx[i]>`` (bf16 products, float32 accumulation);
- ``dw[t, h] = scale * sum_c gI relu(z)``;
- ``gate[t, h, c] = 1[z > 0] * scale * w[t, h] * gI[t, c]``, rounded once to the operand dtype;
- ``dq_idx[t] = gate[t] @ k_idx[ids[t]]``; ``dk_idx[i] += gate[t, :, c]^T q_idx[t]``.

Two kernels, no atomics:

- :func:`_rows_kernel`: one program per row. It sums ``tm`` over the row's slots (pass 1), then
  walks the slots in blocks: gathers the selected ``k_idx`` rows, ``z`` by one GEMM, ``dw`` and
  ``dq_idx`` accumulated in registers in slot order (each written once), and the ``dk_idx``
  contribution of every valid slot (``gate^T q``, float32) stored to its own row of a buffer
  ``[rows * Kc, D_I]``.
- :func:`_fold_kernel`: one program per key. The valid (row, slot) pairs are sorted by key
  (``torch.sort(stable=True)`` of the flat ids: within a key, row-major order); the program sums
  its key's contributions block by block (``tl.sum`` over a fixed block shape, blocks in order)
  and adds the sum to a float32 ``dk`` accumulator.

Rows are processed in chunks (the buffer is capped at :data:`BUFFER_BYTES`), chunks in row
order. Every output element is therefore a fixed-order sum that depends only on the inputs, the
shape and the configuration: bitwise repeatable, whatever the thread timing. Duplicate valid ids
in a row are summed like distinct ones (each slot contributes, as in the contract).

Importing this module needs triton; nothing here runs at import time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["indexer_loss_grad", "GRAD_CONFIG", "BUFFER_BYTES"]

F32 = torch.float32
# Default launch parameters (bench/bench_gpu.py on the H200; docs/CUDNN.md).
GRAD_CONFIG = dict(block_n=64, num_warps=4, num_stages=2, fold_block=32, fold_warps=4)
BUFFER_BYTES = 1 << 31          # contribution buffer cap (float32 rows of D_I), per chunk


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (int(n) - 1).bit_length()))


@triton.jit
def _slot_gradient(ids_row, tau_row, p_row, slot, Kc, C, e, gs, sum_tm):
    """Section 8 slot validity and clipped gradient of slots ``slot`` of one row: ``(valid,
    safe id, gI, tm)``; ``sum_tm`` is the row's ``sum_c tm`` (pass 1 passes 0 and keeps only
    ``tm``). Invalid slots are never read past the id."""
    in_k = slot < Kc
    idv = tl.load(ids_row + slot, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (idv >= 0) & (idv < C)
    tau = tl.load(tau_row + slot, mask=valid, other=0.0).to(tl.float32)
    p = tl.load(p_row + slot, mask=valid, other=0.0).to(tl.float32)
    tm = tl.where(valid & (p >= e), tl.maximum(tau, e), 0.0)
    g = tl.where(valid, gs * (p * sum_tm - tm), 0.0)
    return valid, tl.where(valid, idv, 0), g, tm


@triton.jit
def _rows_kernel(q_ptr, k_ptr, w_ptr, ids_ptr, tau_ptr, p_ptr, dq_ptr, dw_ptr, buf_ptr,
                 r0, HI, DI, C, Kc, gs, scale, e,
                 stride_qt, stride_qh, stride_kc, stride_wt, stride_it, stride_tt, stride_pt,
                 stride_dqt, stride_dqh, stride_dwt,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    local = tl.program_id(0).to(tl.int64)
    t = r0 + local
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < HI
    d_ok = offs_d < DI
    ids_row = ids_ptr + t * stride_it
    tau_row = tau_ptr + t * stride_tt
    p_row = p_ptr + t * stride_pt
    # pass 1: sum_c tm (a fixed-shape reduction)
    tm_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j0 in range(0, Kc, BLOCK_N):
        _, _, _, tm = _slot_gradient(ids_row, tau_row, p_row, j0 + offs_n, Kc, C, e, gs, 0.0)
        tm_acc += tm
    sum_tm = tl.sum(tm_acc, 0)
    # pass 2: z, dw, dq, the dk contributions
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hd_ok, other=0.0)
    wf = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32) * scale
    dq_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j0 in range(0, Kc, BLOCK_N):
        slot = j0 + offs_n
        valid, sid, g, _ = _slot_gradient(ids_row, tau_row, p_row, slot, Kc, C, e, gs, sum_tm)
        kg = tl.load(k_ptr + sid[:, None] * stride_kc + offs_d[None, :],
                     mask=valid[:, None] & d_ok[None, :], other=0.0)
        z = tl.dot(q, tl.trans(kg))                                   # [H, N] float32
        dw_acc += tl.sum(tl.maximum(z, 0.0) * g[None, :], 1)
        gate = tl.where(z > 0, wf[:, None] * g[None, :], 0.0).to(kg.dtype)
        dq_acc += tl.dot(gate, kg)
        contrib = tl.dot(tl.trans(gate), q)                           # [N, D] float32
        rows = local * Kc + slot
        tl.store(buf_ptr + rows[:, None] * DI + offs_d[None, :], contrib,
                 mask=valid[:, None] & d_ok[None, :])
    tl.store(dq_ptr + t * stride_dqt + offs_h[:, None] * stride_dqh + offs_d[None, :],
             dq_acc.to(dq_ptr.dtype.element_ty), mask=hd_ok)
    tl.store(dw_ptr + t * stride_dwt + offs_h, (dw_acc * scale).to(dw_ptr.dtype.element_ty),
             mask=h_ok)


@triton.jit
def _fold_kernel(buf_ptr, order_ptr, off_ptr, dk_ptr, DI,
                 BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DI
    start = tl.load(off_ptr + c)
    end = tl.load(off_ptr + c + 1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for e0 in range(start, end, BLOCK_E):
        ee = e0 + offs_e
        ok = ee < end
        src = tl.load(order_ptr + ee, mask=ok, other=0)
        x = tl.load(buf_ptr + src[:, None] * DI + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.sum(x, 0)
    dst = dk_ptr + c * DI + offs_d
    tl.store(dst, tl.load(dst, mask=d_ok, other=0.0) + acc, mask=d_ok)


def indexer_loss_grad(q, k, w, ids, tau, p, gs: float, scale: float, e: float, *,
                      block_n=None, num_warps=None, num_stages=None, fold_block=None,
                      fold_warps=None, buffer_bytes=None, stats=None):
    """Section 8 clipped gradients ``(dq_idx, dw, dk_idx)`` in the operands' dtypes.

    ``q`` ``[T, H_I, D_I]``, ``k`` ``[C, D_I]``, ``w`` ``[T, H_I]`` (half precision), ``ids``
    ``[T, Kc]`` (any integer dtype; entries outside ``[0, C)`` are invalid slots), ``tau``/``p``
    ``[T, Kc]`` float; ``gs = coeff / N * grad_loss``, ``e`` the gradient floor. Inputs are
    only read. ``stats`` (a dict) receives the chunk count, and with ``stats["time"]`` true the
    CUDA-event milliseconds of the row pass, the sort and the fold."""
    cfg = dict(GRAD_CONFIG)
    for name, val in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages),
                      ("fold_block", fold_block), ("fold_warps", fold_warps)):
        if val is not None:
            cfg[name] = val
    cap = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
    T, HI, DI = q.shape
    C, Kc = k.shape[0], ids.shape[1]
    dev = q.device
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    tau = tau if tau.stride(1) == 1 else tau.contiguous()
    p = p if p.stride(1) == 1 else p.contiguous()
    dq = torch.empty((T, HI, DI), dtype=q.dtype, device=dev)
    dw = torch.empty((T, HI), dtype=w.dtype, device=dev)
    dk32 = torch.zeros((C, DI), dtype=F32, device=dev)
    step = max(1, min(T, cap // max(1, Kc * DI * 4)))
    if T == 0 or Kc == 0:
        dq.zero_()
        dw.zero_()
        return dq, dw, dk32.to(k.dtype)
    buf = torch.empty((step * Kc, DI), dtype=F32, device=dev)
    BH, BD = _pow2(HI), _pow2(DI)
    chunks = 0
    timed = stats is not None and stats.get("time")
    marks = []

    def mark():
        if timed:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        chunks += 1
        mark()
        _rows_kernel[(n,)](
            q, k, w, ids, tau, p, dq, dw, buf, r0, HI, DI, C, Kc, float(gs), float(scale),
            float(e), q.stride(0), q.stride(1), k.stride(0), w.stride(0), ids.stride(0),
            tau.stride(0), p.stride(0), dq.stride(0), dq.stride(1), dw.stride(0),
            BLOCK_H=BH, BLOCK_D=BD, BLOCK_N=cfg["block_n"], num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        mark()
        if C == 0:
            continue
        flat = ids[r0:r1].reshape(-1)
        key = torch.where((flat >= 0) & (flat < C), flat.to(torch.int32),
                          torch.full((), C, dtype=torch.int32, device=dev))
        key, order = torch.sort(key, stable=True)
        offsets = torch.searchsorted(key, torch.arange(C + 1, dtype=torch.int32, device=dev))
        mark()
        _fold_kernel[(C,)](buf, order, offsets, dk32, DI, BLOCK_E=cfg["fold_block"],
                           BLOCK_D=BD, num_warps=cfg["fold_warps"])
        mark()
    if stats is not None:
        stats.update(chunks=chunks, rows_per_chunk=step)
        if timed and len(marks) == 4 * chunks:
            torch.cuda.synchronize(dev)
            ms = [a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:])]
            stats.update(rows_ms=sum(ms[0::4]), sort_ms=sum(ms[1::4]), fold_ms=sum(ms[2::4]))
    return dq, dw, dk32.to(k.dtype)
