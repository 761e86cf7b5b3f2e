"""Key-major ("owner computes") deterministic attention backward (contract section 6).

Why: the row-major planes backward (:mod:`gpu_impl.kernels_triton`) scatters every ``dkv``
contribution into program-private float32 planes that do not fit in L2 (docs/CUDNN.md,
"Performance miss"). Here nothing is scattered:

- ``dq``: :func:`gpu_impl.kernels_triton_split.row_pass`, one program per query row (all
  heads), like the forward: gather the row's selected keys block by block, recompute ``P``
  and ``dS``, accumulate ``dq`` in registers, write it once.
- ``dkv``: FlashAttention-2's dK/dV loop made sparse. Key block ``b`` (``BLOCK_S`` keys) is
  referenced by a set of query-row blocks (``R`` rows x all heads = an ``(R H) x D`` tile). A
  program owns a contiguous chunk of the (key block, row block) pairs of ONE key block, in
  ascending row-block order, recomputes the dense ``(R H) x BLOCK_S`` tiles ``S`` and ``dP``,
  masks them by the slot multiplicity ``count[t, s]`` (how many valid slots of row ``t`` hold
  key ``s``; 0 = not selected, so unselected keys of the block are never used) and accumulates
  ``dkv_b += (scale count dS)^T Q + (count P)^T dO`` in registers. Chunks of one key block are
  summed in chunk order by :func:`_fold_kernel`. Every ``dkv`` element is a fixed-order sum:
  bitwise repeatable by construction, no atomics.

The pair list and the count tiles are derived from the caller's ``ids``/``lengths`` on the
device with deterministic integer ops (boolean scatter, ``nonzero``, ``bincount``). The dense
work is ``pairs * R * BLOCK_S`` (row, key) products against ``n`` valid slots; when that ratio
exceeds ``max_dense_ratio`` (arbitrary ids spread over many key blocks), when ``q``/``dout``
hold non-finite values (a dense tile would multiply a zero ``dS`` by them), or when the head
dim does not fit (``D > 512``), :func:`attention_backward` falls back to the planes kernel, so
any ids keep the exact section 6 semantics (a slot is valid iff ``0 <= id < S`` and
``slot < length``; duplicates count once per slot).

Precision: operands in their dtype (bf16), products accumulated in float32; ``count P`` and
``scale count dS`` rounded once to the operand dtype before the ``dkv`` GEMM (``dS`` once for
``dq``); ``dq``/``dkv`` rounded once from float32; ``dsink`` a fixed-shape float32 torch
reduction of per-row terms.

Importing this module needs triton; nothing here runs at import time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import kernels_triton as kt
from .kernels_triton import _pow2
from .kernels_triton_split import _chunks, row_pass

__all__ = ["attention_backward", "keymajor_plan", "KEYMAJOR_CONFIG"]

LOG2E = 1.4426950408889634

# Launch parameters (see docs/CUDNN.md, "key-major backward"); max_dense_ratio bounds the dense
# (row, key) products per valid slot before falling back to the planes kernel.
KEYMAJOR_CONFIG = dict(block_s=64, block_m=64, d_chunks=4, block_n=64, num_warps=8,
                       num_stages=1, programs_per_sm=2, max_dense_ratio=4.0)


@triton.jit
def _dkv_kernel(q_ptr, kv_ptr, do_ptr, full_ptr, delta_ptr, cnt_ptr, pair_rb_ptr,
                chunk_kb_ptr, chunk_lo_ptr, chunk_hi_ptr, part_ptr,
                T, H, D, DV, S, scale, scale_log2,
                stride_qt, stride_qh, stride_kv, stride_dot, stride_doh,
                R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                DC: tl.constexpr, NCH: tl.constexpr):
    c = tl.program_id(0)
    kb = tl.load(chunk_kb_ptr + c).to(tl.int64)
    lo = tl.load(chunk_lo_ptr + c)
    hi = tl.load(chunk_hi_ptr + c)
    BLOCK_M: tl.constexpr = R * BLOCK_H
    offs_m = tl.arange(0, BLOCK_M)
    r_of_m = offs_m // BLOCK_H
    h_of_m = offs_m % BLOCK_H
    offs_n = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, DC)
    key = kb * BLOCK_S + offs_n
    key_ok = key < S
    kv_rows = kv_ptr + tl.where(key_ok, key, 0)[:, None] * stride_kv
    acc0 = tl.zeros([BLOCK_S, DC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_S, DC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_S, DC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_S, DC], dtype=tl.float32)
    for p in range(lo, hi):
        rb = tl.load(pair_rb_ptr + p).to(tl.int64)
        t = rb * R + r_of_m
        m_ok = (t < T) & (h_of_m < H)
        tt = tl.where(m_ok, t, 0)
        q_rows = q_ptr + tt[:, None] * stride_qt + h_of_m[:, None] * stride_qh
        do_rows = do_ptr + tt[:, None] * stride_dot + h_of_m[:, None] * stride_doh
        s = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
        dp = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
        for ci in tl.static_range(NCH):
            dd = ci * DC + offs_c
            kc = tl.load(kv_rows + dd[None, :], mask=key_ok[:, None] & (dd < D)[None, :], other=0.0)
            qc = tl.load(q_rows + dd[None, :], mask=m_ok[:, None] & (dd < D)[None, :], other=0.0)
            oc = tl.load(do_rows + dd[None, :], mask=m_ok[:, None] & (dd < DV)[None, :], other=0.0)
            s = tl.dot(qc, tl.trans(kc), s)
            dp = tl.dot(oc, tl.trans(kc), dp)
        cnt = tl.load(cnt_ptr + tl.cast(p, tl.int64) * (R * BLOCK_S) + r_of_m[:, None] * BLOCK_S
                      + offs_n[None, :]).to(tl.float32)
        full2 = tl.load(full_ptr + tt * H + h_of_m, mask=m_ok, other=float("inf"))
        delta = tl.load(delta_ptr + tt * H + h_of_m, mask=m_ok, other=0.0)
        keep = (cnt > 0.0) & m_ok[:, None]
        pm = tl.where(keep, tl.exp2(s * scale_log2 - full2[:, None]), 0.0)
        ds = tl.where(keep, pm * (dp - delta[:, None]), 0.0)
        pt = tl.trans((pm * cnt).to(q_ptr.dtype.element_ty))
        dst = tl.trans((ds * (cnt * scale)).to(q_ptr.dtype.element_ty))
        for ci in tl.static_range(NCH):
            dd = ci * DC + offs_c
            qc = tl.load(q_rows + dd[None, :], mask=m_ok[:, None] & (dd < D)[None, :], other=0.0)
            oc = tl.load(do_rows + dd[None, :], mask=m_ok[:, None] & (dd < DV)[None, :], other=0.0)
            if ci == 0:
                acc0 = tl.dot(pt, oc, tl.dot(dst, qc, acc0))
            elif ci == 1:
                acc1 = tl.dot(pt, oc, tl.dot(dst, qc, acc1))
            elif ci == 2:
                acc2 = tl.dot(pt, oc, tl.dot(dst, qc, acc2))
            else:
                acc3 = tl.dot(pt, oc, tl.dot(dst, qc, acc3))
    base = part_ptr + c.to(tl.int64) * (BLOCK_S * NCH * DC) + offs_n[:, None] * (NCH * DC)
    for ci in tl.static_range(NCH):
        dd = ci * DC + offs_c
        if ci == 0:
            tl.store(base + dd[None, :], acc0)
        elif ci == 1:
            tl.store(base + dd[None, :], acc1)
        elif ci == 2:
            tl.store(base + dd[None, :], acc2)
        else:
            tl.store(base + dd[None, :], acc3)


@triton.jit
def _fold_kernel(part_ptr, cptr_ptr, dkv_ptr, S, D, stride_dkv,
                 BLOCK_S: tl.constexpr, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):
    kb = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = tl.arange(0, BLOCK_S)
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    c0 = tl.load(cptr_ptr + kb)
    c1 = tl.load(cptr_ptr + kb + 1)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for c in range(c0, c1):                                   # chunk order: fixed
        ptrs = part_ptr + tl.cast(c, tl.int64) * (BLOCK_S * WIDTH) + rows[:, None] * WIDTH + dd[None, :]
        acc += tl.load(ptrs)
    key = kb.to(tl.int64) * BLOCK_S + rows
    tl.store(dkv_ptr + key[:, None] * stride_dkv + dd[None, :], acc.to(dkv_ptr.dtype.element_ty),
             mask=(key < S)[:, None] & (dd < D)[None, :])


def _valid_slots(ids, S, lengths):
    K = ids.shape[1]
    valid = (ids >= 0) & (ids < S)
    if lengths is not None:
        valid &= (torch.arange(K, device=ids.device).unsqueeze(0)
                  < lengths.to(torch.int64).clamp(0, K).unsqueeze(1))
    return valid


def keymajor_plan(ids, valid, num_keys: int, *, rows_per_block: int, block_s: int,
                  programs: int, max_dense_ratio: float):
    """The dkv work list, or ``None`` when the dense work exceeds ``max_dense_ratio`` times the
    valid slots. Returns a dict: ``pair_rb`` int32 ``[P]`` (the row block of each (key block,
    row block) pair, sorted by key block then row block), ``count`` int32 ``[P, R, BLOCK_S]``
    (slot multiplicity of each key in each row of the pair), per-program chunks ``chunk_kb``,
    ``chunk_lo``, ``chunk_hi`` int32 (a contiguous pair range of one key block), ``cptr``
    int32 ``[KB+1]`` (each key block's chunk range). Integer ops only: deterministic."""
    T, K = ids.shape
    dev = ids.device
    R, BS = rows_per_block, block_s
    rbs, kbs = -(-T // R), -(-num_keys // BS)
    i64 = torch.int64
    n_valid = int(valid.sum())
    t_idx = torch.arange(T, device=dev).unsqueeze(1).expand(T, K)[valid]
    s_idx = ids.to(i64)[valid]
    rb, kb = t_idx // R, s_idx // BS
    if rbs * kbs > 2 ** 28:
        return None
    touched = torch.zeros((kbs, rbs), dtype=torch.bool, device=dev)
    touched[kb, rb] = True
    pairs = touched.nonzero()                                  # row-major: by kb, then rb
    P = pairs.shape[0]
    if P * R * BS > max_dense_ratio * max(n_valid, 1):
        return None
    pid = torch.full((kbs, rbs), -1, dtype=i64, device=dev)
    pid[pairs[:, 0], pairs[:, 1]] = torch.arange(P, device=dev)
    lin = pid[kb, rb] * (R * BS) + (t_idx % R) * BS + s_idx % BS
    count = torch.bincount(lin, minlength=P * R * BS).to(torch.int32).reshape(max(P, 0), R, BS)
    n_kb = torch.bincount(pairs[:, 0], minlength=kbs)
    start = torch.cumsum(n_kb, 0) - n_kb
    chunk = max(1, -(-P // max(1, programs)))
    nch = -(-n_kb // chunk)
    cptr = torch.zeros(kbs + 1, dtype=i64, device=dev)
    cptr[1:] = torch.cumsum(nch, 0)
    NC = int(cptr[-1])
    chunk_kb = torch.repeat_interleave(torch.arange(kbs, device=dev), nch)
    j = torch.arange(NC, device=dev) - cptr[chunk_kb]
    lo = start[chunk_kb] + j * chunk
    hi = torch.minimum(lo + chunk, start[chunk_kb] + n_kb[chunk_kb])
    i32 = torch.int32
    return dict(pair_rb=pairs[:, 1].to(i32).contiguous(), count=count.contiguous(),
                chunk_kb=chunk_kb.to(i32), chunk_lo=lo.to(i32), chunk_hi=hi.to(i32),
                cptr=cptr.to(i32), num_chunks=NC, num_pairs=P, num_key_blocks=kbs,
                dense_ratio=P * R * BS / max(n_valid, 1))


def attention_backward(q, kv, ids, sink, out, lse, dout, scale, dv, lengths=None, *,
                       fallback: bool = True, stats: dict | None = None, **overrides):
    """Deterministic section 6 backward (``dq``, ``dkv``, float32 ``dsink``), same argument
    conventions as :func:`gpu_impl.kernels_triton.attention_backward`. Uses the key-major dkv
    kernel when the ids' structure fits (see the module docstring), else the planes kernel
    (``fallback=False`` raises instead). ``stats``, when given, receives the route and plan
    sizes."""
    cfg = dict(KEYMAJOR_CONFIG)
    for k_, v_ in overrides.items():
        if k_ not in cfg:
            raise TypeError(f"unknown key-major option {k_!r}")
        if v_ is not None:
            cfg[k_] = v_
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    dev = q.device
    stats = stats if stats is not None else {}

    def planes(why):
        if not fallback:
            raise ValueError(f"key-major backward does not apply: {why}")
        stats.update(route="planes", why=why)
        return kt.attention_backward(q, kv, ids, sink, out, lse, dout, scale, dv, lengths)

    if T == 0 or K == 0 or S == 0:
        return planes("empty problem")
    if D > 512 or dv > D:
        return planes(f"head dim {D} (v {dv}) does not fit the key-major tiles (D <= 512)")
    if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(dout).all())):
        return planes("q or dout holds non-finite values")
    q = q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    dout = dout.contiguous()
    ids = ids.contiguous()
    block_h = _pow2(H)
    R = max(1, cfg["block_m"] // block_h)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    valid = _valid_slots(ids, S, lengths)
    plan = keymajor_plan(ids, valid, S, rows_per_block=R, block_s=cfg["block_s"],
                         programs=sms * cfg["programs_per_sm"],
                         max_dense_ratio=cfg["max_dense_ratio"])
    if plan is None:
        return planes("ids too spread for dense key-major tiles")
    stats.update(route="keymajor", pairs=plan["num_pairs"], chunks=plan["num_chunks"],
                 dense_ratio=round(plan["dense_ratio"], 3), rows_per_block=R)
    delta, full2, dsink = kt.row_statistics(out, lse, dout, sink)
    dq = row_pass(q, kv, ids, lengths, dout, full2, delta, scale, dv, block_n=cfg["block_n"],
                  d_chunks=cfg["d_chunks"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    dc, nch = _chunks(D, cfg["d_chunks"])
    bs = cfg["block_s"]
    nc = plan["num_chunks"]
    part = torch.empty((max(nc, 1), bs, dc * nch), dtype=torch.float32, device=dev)
    if nc:
        _dkv_kernel[(nc,)](q, kv, dout, full2, delta, plan["count"], plan["pair_rb"],
                           plan["chunk_kb"], plan["chunk_lo"], plan["chunk_hi"], part,
                           T, H, D, dv, S, float(scale), float(scale) * LOG2E,
                           q.stride(0), q.stride(1), kv.stride(0), dout.stride(0), dout.stride(1),
                           R=R, BLOCK_H=block_h, BLOCK_S=bs, DC=dc, NCH=nch,
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    dkv = torch.empty((S, D), dtype=kv.dtype, device=dev)
    fold_bd = min(128, dc * nch)
    _fold_kernel[(plan["num_key_blocks"], triton.cdiv(dc * nch, fold_bd))](
        part, plan["cptr"], dkv, S, D, dkv.stride(0), BLOCK_S=bs, WIDTH=dc * nch,
        BLOCK_D=fold_bd, num_warps=4)
    return dq, dkv, dsink
