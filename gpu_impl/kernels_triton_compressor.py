"""Triton kernels of the compressor's pooling (contract section 15), deterministic by design.

The pooling is the only part of the compressor that gathers: per group ``g`` and channel
``j``, ``ctil[g, j] = sum_k softmax_k(score + ape) * kv`` over the group's ``S`` slots. These
kernels fuse the gather, the softmax and the weighted sum; RMSNorm, RoPE and the Hadamard
rotation stay in torch (:func:`gpu_impl.torch_backend.compressor_stages`).

- :func:`pool_forward`: one program per (group, channel block); float32 arithmetic; writes
  ``ctil [C, d]`` in float32.
- :func:`pool_backward`: one program per (run of ``GROUPS`` consecutive groups, channel block).
  It recomputes the weights, writes ``dkv`` and ``dscore`` of its groups' slots (each input
  element is read by at most one slot of one group, so every element is written by exactly one
  program: no atomics) and folds ``dape``'s terms over its groups in group order into its own
  row of a partial buffer; the partial rows are then summed by one torch reduction of fixed
  shape. The bits depend only on the inputs and the launch shape, never on timing.

Inputs are the ``[T * c, d]`` views of ``kv`` and ``score`` (``c = 2`` with the overlap), the
``[r * c, d]`` view of ``ape`` (float32), the slot table ``element [C, S]`` (int64: the row of
the views a slot reads, ``-1`` for an invalid slot) and ``slot_ape [S]`` (the ``ape`` row of each
slot). ``S`` must be a power of two (8 for ``r = 4`` with the overlap, 128 for ``r = 128``).
Imported only on a CUDA machine with Triton (``gpu_impl.cudnn_backend`` imports it lazily).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pool_forward", "pool_backward", "BLOCK_D", "GROUPS"]

BLOCK_D = 64           # channels per program
GROUPS = 16            # consecutive groups per backward program (d_ape folded in their order)


@triton.jit
def _pool_fwd_kernel(kv, score, ape, element, slot_ape, out, D,
                     S: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, S)
    el = tl.load(element + g * S + k)
    valid = el >= 0
    jm = j < D
    m2 = valid[:, None] & jm[None, :]
    off = tl.where(valid, el, 0).to(tl.int64)[:, None] * D + j[None, :]
    v = tl.load(kv + off, mask=m2, other=0.0).to(tl.float32)
    ar = tl.load(slot_ape + k).to(tl.int64)
    z = tl.load(score + off, mask=m2, other=0.0).to(tl.float32) + \
        tl.load(ape + ar[:, None] * D + j[None, :], mask=m2, other=0.0)
    z = tl.where(m2, z, float("-inf"))
    mx = tl.max(z, axis=0)
    mx = tl.where(jm, mx, 0.0)
    e = tl.where(m2, tl.exp(z - mx[None, :]), 0.0)
    den = tl.sum(e, axis=0)
    den = tl.where(jm, den, 1.0)
    ctil = tl.sum((e / den[None, :]) * v, axis=0)
    tl.store(out + g.to(tl.int64) * D + j, ctil, mask=jm)


@triton.jit
def _pool_bwd_kernel(kv, score, ape, element, slot_ape, dctil, dkv, dscore, dape_part, C, D,
                     S: tl.constexpr, BLOCK: tl.constexpr, GROUPS_PER: tl.constexpr):
    pid = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, S)
    jm = j < D
    ar = tl.load(slot_ape + k).to(tl.int64)
    acc = tl.zeros((S, BLOCK), dtype=tl.float32)
    for i in range(GROUPS_PER):                       # groups in order: a fixed fold of d_ape
        g = pid * GROUPS_PER + i
        live = g < C
        el = tl.load(element + g * S + k, mask=(k < S) & live, other=-1)
        valid = el >= 0
        m2 = valid[:, None] & jm[None, :]
        off = tl.where(valid, el, 0).to(tl.int64)[:, None] * D + j[None, :]
        v = tl.load(kv + off, mask=m2, other=0.0).to(tl.float32)
        z = tl.load(score + off, mask=m2, other=0.0).to(tl.float32) + \
            tl.load(ape + ar[:, None] * D + j[None, :], mask=m2, other=0.0)
        z = tl.where(m2, z, float("-inf"))
        mx = tl.where(jm, tl.max(z, axis=0), 0.0)
        e = tl.where(m2, tl.exp(z - mx[None, :]), 0.0)
        den = tl.where(jm, tl.sum(e, axis=0), 1.0)
        alpha = e / den[None, :]
        ctil = tl.sum(alpha * v, axis=0)
        dc = tl.load(dctil + g.to(tl.int64) * D + j, mask=jm & live, other=0.0).to(tl.float32)
        dv = alpha * dc[None, :]
        dz = tl.where(m2, alpha * (v - ctil[None, :]) * dc[None, :], 0.0)
        tl.store(dkv + off, dv.to(dkv.dtype.element_ty), mask=m2)
        tl.store(dscore + off, dz.to(dscore.dtype.element_ty), mask=m2)
        acc += dz
    part = dape_part + pid.to(tl.int64) * S * D + k[:, None] * D + j[None, :]
    tl.store(part, acc, mask=(k[:, None] < S) & jm[None, :])


def pool_forward(kv2: torch.Tensor, score2: torch.Tensor, ape2: torch.Tensor,
                 element: torch.Tensor, slot_ape: torch.Tensor) -> torch.Tensor:
    """float32 pooled rows ``ctil [C, d]`` (section 15) of the ``[T * c, d]`` views."""
    C, S = element.shape
    D = kv2.shape[1]
    out = torch.empty((C, D), dtype=torch.float32, device=kv2.device)
    if C:
        grid = (C, triton.cdiv(D, BLOCK_D))
        _pool_fwd_kernel[grid](kv2, score2, ape2, element, slot_ape, out, D, S=S, BLOCK=BLOCK_D)
    return out


def pool_backward(kv2, score2, ape2, element, slot_ape, dctil):
    """``(dkv2, dscore2 [T * c, d]`` in ``kv2``'s dtype, ``dape_slots [S, d]`` float32) for the
    upstream ``dctil [C, d]``: exact zeros on unread elements; ``dape_slots`` folded per run of
    ``GROUPS`` groups in order, then the runs summed by one reduction of fixed shape."""
    C, S = element.shape
    D = kv2.shape[1]
    dkv = torch.zeros_like(kv2)
    dscore = torch.zeros_like(score2)
    runs = triton.cdiv(max(C, 1), GROUPS)
    part = torch.zeros((runs, S, D), dtype=torch.float32, device=kv2.device)
    if C:
        grid = (runs, triton.cdiv(D, BLOCK_D))
        _pool_bwd_kernel[grid](kv2, score2, ape2, element, slot_ape, dctil.contiguous(), dkv,
                               dscore, part, C, D, S=S, BLOCK=BLOCK_D, GROUPS_PER=GROUPS)
    return dkv, dscore, part.sum(dim=0)
