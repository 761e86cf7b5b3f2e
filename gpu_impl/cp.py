"""One packed DSv4 attention layer under static contiguous context parallelism (contract
section 10) on ``torch.distributed``: CPU (gloo) and GPU (NCCL) alike.

Rank ``r`` of a CP group of size ``cp`` owns the packed rows ``[r*L, (r+1)*L)`` (``L = T/cp``)
and the compressed groups whose last token it holds. It is called with its *local* tensors:

- ``q [L,H,D]``, ``kv [L,D]``, ``q_idx [L,H_I,D_I]``, ``weights [L,H_I]`` (its rows);
- ``kv_cmp [n_own,D]``, ``k_idx [n_own,D_I]`` (its owned groups, ascending global id; the
  counts are :func:`owned_group_counts`);
- ``sink [H]`` (replicated) and the *global* ``layout`` (replicated, as in Megatron's
  ``PackedSeqParams``).

Data flow (forward): validation agreed by every rank -> halo exchange (rank ``r`` sends its last
``D_win = max(W, D_comp)`` key rows to ``r+1``, point to point) -> all-gather of the compressed
keys and the indexer keys into rank-major buffers of ``cap = ceil(L/r)`` slots per rank -> local
indexer scores against the gathered keys with document-relative causal offsets -> stable Top-K
-> compressed-first key rows in the rank's physical key layout ``[halo | local | gathered]`` ->
sparse attention with the sink -> the sparse indexer loss normalised by the *global* real-token
count ``N``. Backward: local attention and indexer backward, then halo gradients go back to the
previous rank, gathered-buffer gradients go to their owners, the sink gradient is reduced.

Determinism (``deterministic=True``): no NCCL/gloo *reduction* is used at all. Gradients of
gathered buffers move with ``all_to_all`` (pure data movement) and each owner folds the ``cp``
partials in rank order; the sink gradient and the loss are all-gathered and folded in rank
order on every rank (identical bits everywhere); the halo gradient is one point-to-point
message added in a fixed order. NCCL documents no summation order for its reductions (ring or
tree, chunking, protocol and channel count depend on the message size, the topology, the NCCL
version and environment variables), so bits of ``all_reduce`` / ``reduce_scatter`` are not
something we rely on; ``deterministic=False`` uses them (``reduce_scatter_tensor`` /
``all_reduce``). With the per-op backends deterministic too, a fixed CP size and process layout
gives bitwise identical results run to run. Results across CP sizes differ in the last bits
(different fold orders) and are judged against the oracle by the error model.

Precision: as the chosen backend's ops (see :mod:`gpu_impl.torch_backend`). The backend returns
each rank's partial ``dkv`` / ``dk_idx`` in the tensor's dtype, so for bf16 inputs the halo and
compressed-key gradients carry one extra bf16 rounding per partial before the CP sum (summed in
float32 in rank order, rounded once): the same as Megatron's bf16 reduce-scatter.

Invalid input (rows not divisible by ``cp``, a rank slice shorter than its halo, a process group
of another size than ``cp``, wrong local shapes, ranks disagreeing on the layout or the
configuration) raises on *every* rank before any data moves: each rank validates locally, then
one small ``all_gather_object`` shares the verdicts and a fingerprint of the replicated
configuration (with NCCL, set the CUDA device of each rank first, as usual).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from reference.layout import PackedLayout

from . import api
from .checks import as_bool, as_int, as_real, choice

__all__ = ["CPLayerResult", "cp_csa_layer", "cp_geometry", "owned_group_counts"]

F32 = torch.float32
INF = math.inf


class CPLayerResult(NamedTuple):
    """What :func:`cp_csa_layer` returns on each rank (tensors on the inputs' device)."""

    out: torch.Tensor              # [L, H, Dv] q's dtype, differentiable (q, kv, kv_cmp, sink)
    loss: torch.Tensor             # 0-dim float32 CP-global indexer loss, identical on every
                                   # rank, differentiable wrt q_idx, weights, k_idx
    lse: torch.Tensor              # [L, H] float32, excludes the sink, +inf on sink-only rows
    ids: torch.Tensor              # [L, width] int32 ids in the physical key layout
    lengths: torch.Tensor          # [L] int32
    compressed_ids: torch.Tensor | None   # [L, Kc] gathered-buffer slots of the Top-K (CSA)
    kl: torch.Tensor | None        # [L] float32 per-row KL (CSA)
    target: torch.Tensor | None    # [L, Kc] float32 teacher on the selected slots (CSA)
    predict: torch.Tensor | None   # [L, Kc] float32 student on the selected slots (CSA)
    index_scores: torch.Tensor | None     # [L, cp*cap] float32 over gathered slots (CSA)
    key_ids: torch.Tensor          # [S] int64 CPU: logical key id of every physical slot, -1 unused
    backends: dict                 # op name -> backend that ran it (the backward's ops are
                                   # added to this same dict when the backward runs)


# --------------------------------------------------------------------------------------------
# geometry (host side, from the replicated layout)
# --------------------------------------------------------------------------------------------
class _Geometry(NamedTuple):
    cp: int
    rank: int
    L: int
    start: int
    d_win: int
    ratio: int
    cap: int
    C: int
    first_group: list        # per rank, first owned global compressed id (cp + 1 entries)
    group_slot: torch.Tensor  # [C] int64: gathered slot of every group
    key_ids: torch.Tensor    # [S] int64 CPU


def _halo_width(window: int, ratio: int) -> int:
    return max(window, 2 * ratio if ratio == 4 else ratio)


def _group_owners(layout, cp, ratio):
    """Owner rank of every compressed group (the rank holding its last token; non-decreasing
    in the global id under the contiguous partition) and each rank's first owned id."""
    L = layout.num_rows // cp
    cu_comp = layout.compressed_offsets(ratio)
    n = layout.compressed_counts(ratio)
    C = int(cu_comp[-1])
    gid = torch.arange(C)
    gdoc = torch.repeat_interleave(torch.arange(layout.num_docs), n)
    last = layout.cu_seqlens_padded[gdoc] + (gid - cu_comp[gdoc] + 1) * ratio - 1
    owner = last // L
    return owner, torch.searchsorted(owner, torch.arange(cp + 1)).tolist()


def cp_geometry(layout: PackedLayout, cp: int, rank: int, *, window: int, ratio: int) -> _Geometry:
    """The rank's rows, halo width, compressed capacity, group ownership and physical key
    layout ``[halo (D_win) | local (L) | gathered (cp*cap)]``; raises ``ValueError`` for an
    invalid CP configuration."""
    T = layout.num_rows
    if T % cp:
        raise ValueError(f"cp={cp} does not divide the {T} packed rows (contiguous partition)")
    L = T // cp
    d_win = _halo_width(window, ratio)
    if cp > 1 and L < d_win:
        raise ValueError(f"cp={cp}: each rank owns T/cp={L} rows, fewer than its halo "
                         f"D_win=max(W, D_comp)={d_win} (window={window}, ratio={ratio})")
    if ratio > 0:
        owner, first = _group_owners(layout, cp, ratio)
        C = int(owner.numel())
        cap = -(-L // ratio)
        gid = torch.arange(C)
        slot = owner * cap + (gid - torch.tensor(first)[owner]) if C else gid
    else:
        C, cap, first, slot = 0, 0, [0] * (cp + 1), torch.zeros(0, dtype=torch.int64)
    start = rank * L
    S = d_win + L + cp * cap
    key_ids = torch.full((S,), -1, dtype=torch.int64)
    halo = torch.arange(start - d_win, start)
    key_ids[:d_win] = torch.where(halo >= 0, halo, -1)
    key_ids[d_win:d_win + L] = torch.arange(start, start + L)
    if C:
        key_ids[d_win + L + slot] = T + torch.arange(C)
    return _Geometry(cp, rank, L, start, d_win, ratio, cap, C, first, slot, key_ids)


def owned_group_counts(layout: PackedLayout, cp: int, *, ratio: int) -> list:
    """Per rank, how many compressed groups it owns (the rows of its ``kv_cmp`` / ``k_idx``)
    under the contiguous partition: the groups whose last token lies in its rows."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a reference.PackedLayout, got {type(layout).__name__}")
    cp = as_int(cp, "cp", minimum=1)
    ratio = as_int(ratio, "ratio", minimum=0)
    if layout.num_rows % cp:
        raise ValueError(f"cp={cp} does not divide the {layout.num_rows} packed rows")
    if ratio == 0:
        return [0] * cp
    first = _group_owners(layout, cp, ratio)[1]
    return [first[o + 1] - first[o] for o in range(cp)]


# --------------------------------------------------------------------------------------------
# validation, agreed by every rank before any data moves
# --------------------------------------------------------------------------------------------
def _local_checks(q, kv, sink, layout, kv_cmp, q_idx, weights, k_idx, group, cp, window, ratio,
                  topk, coeff):
    """Validate this rank's arguments; returns the geometry (raises TypeError/ValueError)."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a reference.PackedLayout, got {type(layout).__name__}")
    window = as_int(window, "window", minimum=1)
    ratio = as_int(ratio, "ratio", minimum=0)
    as_real(coeff, "coeff")
    size = dist.get_world_size(group)
    if cp is not None and as_int(cp, "cp", minimum=1) != size:
        raise ValueError(f"cp={cp} but the process group has {size} ranks")
    rank = dist.get_rank(group)
    geo = cp_geometry(layout, size, rank, window=window, ratio=ratio)
    for name, t, nd in (("q", q, 3), ("kv", kv, 2), ("sink", sink, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd or not t.is_floating_point():
            raise ValueError(f"{name} must be a {nd}-d float tensor, got {t.dtype} {tuple(t.shape)}")
    L, H, D = q.shape
    if L != geo.L:
        raise ValueError(f"q has {L} rows on rank {rank}; a rank of a CP group of {size} owns "
                         f"T/cp = {layout.num_rows}/{size} = {geo.L} rows")
    if tuple(kv.shape) != (geo.L, D):
        raise ValueError(f"kv must have shape {(geo.L, D)} (local rows, head dim), got {tuple(kv.shape)}")
    if tuple(sink.shape) != (H,):
        raise ValueError(f"sink must have shape {(H,)}, got {tuple(sink.shape)}")
    if kv.dtype != q.dtype:
        raise TypeError(f"q ({q.dtype}) and kv ({kv.dtype}) must have the same dtype")
    n_own = geo.first_group[rank + 1] - geo.first_group[rank]
    indexer = [x is not None for x in (q_idx, weights, k_idx)]
    if any(indexer) and not all(indexer):
        raise ValueError("q_idx, k_idx and weights must be given together (a CSA layer) or not at all")
    if ratio == 0 and (kv_cmp is not None or any(indexer)):
        raise ValueError("a window-only layer (ratio 0) takes no kv_cmp and no indexer inputs")
    if ratio > 0:
        if not isinstance(kv_cmp, torch.Tensor):
            raise TypeError(f"kv_cmp must be a torch.Tensor for a compressed layer (ratio {ratio})")
        if tuple(kv_cmp.shape) != (n_own, D):
            raise ValueError(f"kv_cmp must have shape {(n_own, D)}: rank {rank} owns {n_own} "
                             f"compressed groups (ratio {ratio}), got {tuple(kv_cmp.shape)}")
        if kv_cmp.dtype != q.dtype:
            raise TypeError(f"kv_cmp ({kv_cmp.dtype}) must have q's dtype ({q.dtype})")
    if all(indexer):
        if ratio == 0:
            raise ValueError("indexer inputs need a compressed layer")
        as_int(topk, "topk", minimum=0)
        if q_idx.dim() != 3 or q_idx.shape[0] != geo.L:
            raise ValueError(f"q_idx must have shape ({geo.L}, H_I, D_I), got {tuple(q_idx.shape)}")
        HI, DI = q_idx.shape[1:]
        if tuple(weights.shape) != (geo.L, HI):
            raise ValueError(f"weights must have shape {(geo.L, HI)}, got {tuple(weights.shape)}")
        if tuple(k_idx.shape) != (n_own, DI):
            raise ValueError(f"k_idx must have shape {(n_own, DI)}: rank {rank} owns {n_own} "
                             f"compressed groups, got {tuple(k_idx.shape)}")
    elif topk is not None:
        raise ValueError("topk needs the indexer inputs (q_idx, k_idx, weights)")
    devs = {t.device for t in (q, kv, sink, kv_cmp, q_idx, weights, k_idx) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    backend_name = dist.get_backend(group)
    if backend_name == "nccl" and dev.type != "cuda":
        raise ValueError(f"an NCCL process group needs CUDA tensors, got {dev}")
    return geo


def _fingerprint(layout, q, q_idx, cfg):
    """What every rank must agree on: the replicated layout and configuration, and the
    per-row shapes and dtype of the inputs."""
    fp = {"layout": (tuple(layout.cu_seqlens.tolist()), tuple(layout.cu_seqlens_padded.tolist()),
                     layout.num_rows) if isinstance(layout, PackedLayout) else repr(layout)}
    if isinstance(q, torch.Tensor):
        fp.update(q_heads_dim=tuple(q.shape[1:]), dtype=str(q.dtype))
    if isinstance(q_idx, torch.Tensor):
        fp["q_idx_heads_dim"] = tuple(q_idx.shape[1:])
    fp.update((k, repr(v)) for k, v in cfg.items())
    return fp


def _agree(group, error, fingerprint):
    """Share every rank's verdict; raise the same kind of error on every rank if any failed."""
    mine = None if error is None else (type(error).__name__, str(error))
    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (mine, fingerprint), group=group)
    if error is not None:
        raise error
    for r, (err, _) in enumerate(verdicts):
        if err is not None:
            kind = TypeError if err[0] == "TypeError" else ValueError
            raise kind(f"invalid CP input on rank {r} of the group: {err[1]}")
    prints = [fp for _, fp in verdicts]
    for r, fp in enumerate(prints):
        diff = sorted(k for k in set(fp) | set(prints[0]) if fp.get(k) != prints[0].get(k))
        if diff:
            raise ValueError(f"CP ranks disagree on {', '.join(diff)}: rank 0 has "
                             f"{[prints[0].get(k) for k in diff]}, rank {r} has "
                             f"{[fp.get(k) for k in diff]}")


# --------------------------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------------------------
def _global_rank(group, r):
    return r if group is None else dist.get_global_rank(group, r)


def _shift_to_next(group, geo, tail, out):
    """Point to point: rank r sends ``tail`` to r+1 and receives ``out`` from r-1 (rank 0
    keeps ``out`` as given)."""
    ops = []
    if geo.rank + 1 < geo.cp:
        ops.append(dist.P2POp(dist.isend, tail.contiguous(), _global_rank(group, geo.rank + 1), group))
    if geo.rank > 0:
        ops.append(dist.P2POp(dist.irecv, out, _global_rank(group, geo.rank - 1), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


def _shift_to_previous(group, geo, head, out):
    """Point to point: rank r sends ``head`` to r-1 and receives ``out`` from r+1."""
    ops = []
    if geo.rank > 0:
        ops.append(dist.P2POp(dist.isend, head.contiguous(), _global_rank(group, geo.rank - 1), group))
    if geo.rank + 1 < geo.cp:
        ops.append(dist.P2POp(dist.irecv, out, _global_rank(group, geo.rank + 1), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


def _all_gather_rows(group, geo, x):
    """Pad the rank's owned rows to ``cap`` and all-gather them rank-major: ``[cp*cap, d]``."""
    buf = x.new_zeros((geo.cap, x.shape[1]))
    buf[:x.shape[0]] = x
    out = x.new_empty((geo.cp * geo.cap, x.shape[1]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, buf, group=group)
    return out


def _return_to_owners(group, geo, partial, n_own, deterministic):
    """Gradients of a gathered buffer ``[cp*cap, d]`` back to their owners: the sum over ranks
    of each owner's slice, as ``[n_own, d]`` float32 (deterministic: all_to_all + fold in rank
    order; otherwise reduce-scatter)."""
    d = partial.shape[1]
    if deterministic:
        recv = torch.empty_like(partial)
        dist.all_to_all_single(recv, partial.contiguous(), group=group)
        parts = recv.view(geo.cp, geo.cap, d).to(F32)
        acc = parts[0].clone()
        for r in range(1, geo.cp):
            acc += parts[r]
        return acc[:n_own]
    out = partial.new_empty((geo.cap, d))
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rs(out, partial.contiguous(), group=group)
    return out[:n_own].to(F32)


def _sum_over_ranks(group, geo, x, deterministic):
    """``sum_r x_r`` (float32), identical on every rank: all-gather + fold in rank order, or
    all-reduce."""
    x = x.to(F32).contiguous()
    if deterministic:
        out = x.new_empty((geo.cp,) + tuple(x.shape))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), x.view(-1), group=group)
        acc = out[0].clone()
        for r in range(1, geo.cp):
            acc += out[r]
        return acc
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


# --------------------------------------------------------------------------------------------
# local pieces
# --------------------------------------------------------------------------------------------
def _mm32(a, b):
    """Batched ``a @ b`` with float32 accumulation (exact products for bf16/fp16 operands)."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=F32)
    return torch.bmm(a.to(F32), b.to(F32))


def _local_rows(layout, geo, dev):
    sl = slice(geo.start, geo.start + geo.L)
    return layout.pos[sl].to(dev), layout.is_real[sl].to(dev), layout.doc[sl].to(dev)


def _doc_spans(layout, geo):
    """(doc, first local real row, end local real row) for every document with real rows here."""
    spans = []
    cu_pad = layout.cu_seqlens_padded.tolist()
    real = layout.doc_lengths.tolist()
    lo, hi = geo.start, geo.start + geo.L
    for b in range(layout.num_docs):
        r0, r1 = cu_pad[b], cu_pad[b] + real[b]
        a, e = max(r0, lo), min(r1, hi)
        if a < e:
            spans.append((b, a - lo, e - lo))
    return spans


def _indexer_scores_local(layout, geo, q_idx, weights, k_gathered, scale, chunk):
    """Section 7 over the rank's rows and the gathered indexer keys: float32 ``[L, cp*cap]``,
    ``-inf`` where a slot is not visible (document-relative: the row's global position)."""
    dev = q_idx.device
    L, HI, DI = q_idx.shape
    scale = DI ** -0.5 if scale is None else scale
    out = torch.full((L, geo.cp * geo.cap), -INF, dtype=F32, device=dev)
    vis = layout.visible_compressed(geo.ratio)[geo.start:geo.start + geo.L]
    cu_comp = layout.compressed_offsets(geo.ratio).tolist()
    wf = weights.to(F32) * scale
    for b, i0, i1 in _doc_spans(layout, geo):
        gmax = int(vis[i1 - 1])                  # visibility grows with the position
        if gmax == 0:
            continue
        slots = geo.group_slot[cu_comp[b]:cu_comp[b] + gmax].to(dev)
        kbt = k_gathered.index_select(0, slots).t().unsqueeze(0)          # [1, D_I, g]
        step = max(1, chunk // max(1, HI * gmax))
        v = vis[i0:i1].to(dev)
        cols = torch.arange(gmax, device=dev).unsqueeze(0)
        for s0 in range(i0, i1, step):
            s1 = min(s0 + step, i1)
            z = _mm32(q_idx[s0:s1], kbt.expand(s1 - s0, DI, gmax))       # [n, H_I, g]
            sc = (torch.relu(z) * wf[s0:s1].unsqueeze(-1)).sum(dim=1)
            sc = torch.where(cols < v[s0 - i0:s1 - i0].unsqueeze(1), sc, torch.full_like(sc, -INF))
            out[s0:s1, slots] = sc
    return out


def _compact(ids):
    """Section 5 stable compaction (valid entries first, in order; -1 after)."""
    T, K = ids.shape
    valid = ids >= 0
    lengths = valid.sum(dim=1)
    pos = torch.where(valid, torch.cumsum(valid.to(torch.int64), dim=1) - 1,
                      torch.full_like(ids, K, dtype=torch.int64))
    out = torch.full((T, K + 1), -1, dtype=ids.dtype, device=ids.device)
    out.scatter_(1, pos, torch.where(valid, ids, torch.full_like(ids, -1)))
    return out[:, :K].contiguous(), lengths


def _key_rows(layout, geo, window, cmp_slots, dev):
    """Compressed-first rows in the physical layout: ``[cmp_offset + slot | window rows]``."""
    pos, real, doc = _local_rows(layout, geo, dev)
    L = geo.L
    local = torch.arange(L, device=dev)
    offs = torch.arange(window, device=dev).unsqueeze(0)
    wpos = torch.clamp(pos - window + 1, min=0).unsqueeze(1) + offs
    ok = (wpos <= pos.unsqueeze(1)) & real.unsqueeze(1)
    phys = (local - pos).unsqueeze(1) + wpos + geo.d_win          # global - start + D_win
    win = torch.where(ok, phys, torch.full_like(phys, -1))
    if cmp_slots is None:
        cmp = torch.empty((L, 0), dtype=torch.int64, device=dev)
    else:
        cs = cmp_slots.to(torch.int64)
        cmp = torch.where((cs >= 0) & real.unsqueeze(1), cs + geo.d_win + geo.L,
                          torch.full_like(cs, -1))
    ids, lengths = _compact(torch.cat([cmp, win], dim=1))
    return ids.to(torch.int32), lengths.to(torch.int32)


def _hca_slots(layout, geo, dev):
    """Every visible group of each local row (HCA), as gathered slots; width ``max_b n_b``."""
    width = int(layout.compressed_counts(geo.ratio).max()) if layout.num_docs else 0
    pos, real, doc = _local_rows(layout, geo, dev)
    vis = layout.visible_compressed(geo.ratio)[geo.start:geo.start + geo.L].to(dev)
    base = layout.compressed_offsets(geo.ratio).to(dev)[doc.clamp_min(0)]
    g = torch.arange(width, device=dev).unsqueeze(0)
    ok = (g < vis.unsqueeze(1)) & real.unsqueeze(1)
    gid = torch.where(ok, base.unsqueeze(1) + g, torch.zeros_like(g))
    slot = geo.group_slot.to(dev)
    return torch.where(ok, slot[gid] if geo.C else gid, torch.full_like(gid, -1))


def _local_layout(layout, geo):
    """A layout of the rank's rows with the same real/padding pattern (for the loss's masks)."""
    lo, hi = geo.start, geo.start + geo.L
    bounds = sorted({lo, hi} | {int(x) for x in layout.cu_seqlens_padded.tolist() if lo < x < hi})
    real = layout.is_real[lo:hi].to(torch.int64)
    cu_pad = [b - lo for b in bounds]
    counts = [int(real[a:e].sum()) for a, e in zip(cu_pad[:-1], cu_pad[1:])]
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    return PackedLayout(cu, cu_pad, geo.L)


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------
class _CPLayerFn(torch.autograd.Function):
    """Forward and backward of the CP layer; one Function so that every rank runs the backward
    collectives in one fixed order."""

    @staticmethod
    def forward(ctx, q, kv, sink, kv_cmp, q_idx, weights, k_idx, st):
        geo, group, cfg = st["geo"], st["group"], st["cfg"]
        layout, dev = st["layout"], q.device
        det, be = cfg["deterministic"], cfg["backend"]
        ran = st["ran"]
        # Halo exchange and all-gathers (data movement only).
        halo = _shift_to_next(group, geo, kv[geo.L - geo.d_win:] if geo.cp > 1 else kv[:0],
                              kv.new_zeros((geo.d_win, kv.shape[1])))
        parts = [halo, kv]
        g_kv = g_k = None
        if geo.ratio > 0:
            g_kv = _all_gather_rows(group, geo, kv_cmp)
            parts.append(g_kv)
        keys = torch.cat(parts, dim=0)
        scores = slots = None
        if k_idx is not None:
            g_k = _all_gather_rows(group, geo, k_idx)
            scores = _indexer_scores_local(layout, geo, q_idx, weights, g_k, cfg["index_scale"],
                                           cfg["chunk"])
            top = api.stable_topk(scores, cfg["topk"], order=cfg["order"], align=cfg["align"],
                                  backend=be, deterministic=det)
            slots, ran["stable_topk"] = top.ids, top.backend
        elif geo.ratio > 0:
            slots = _hca_slots(layout, geo, dev)
        ids, lengths = _key_rows(layout, geo, cfg["window"], slots, dev)
        fwd = api.sparse_attention_forward(q, keys, ids, sink, scale=cfg["scale"],
                                           v_dim=cfg["v_dim"], lengths=lengths, backend=be,
                                           deterministic=det)
        ran["sparse_attention_forward"] = fwd.backend
        out, lse = fwd.out, fwd.lse
        kl = None
        loss = torch.zeros((), dtype=F32, device=dev)
        target = predict = None
        if k_idx is not None:
            res = api.sparse_indexer_loss(q, g_kv, sink, lse, slots, scores, st["local_layout"],
                                          coeff=cfg["coeff"], scale=cfg["scale"],
                                          num_real=cfg["num_real"], backend=be,
                                          deterministic=det)
            ran["sparse_indexer_loss"] = res.backend
            kl, target, predict = res.kl, res.target, res.predict
            loss = _sum_over_ranks(group, geo, res.loss.reshape(1), det).reshape(())
        ctx.save_for_backward(q, keys, sink, ids, lengths, out, lse, q_idx, weights, g_k, slots,
                              target, predict)
        ctx.st = st
        ctx.kv_dtype, ctx.cmp_dtype = kv.dtype, None if kv_cmp is None else kv_cmp.dtype
        ctx.k_dtype = None if k_idx is None else k_idx.dtype
        ctx.mark_non_differentiable(lse)
        st["aux"] = dict(ids=ids, lengths=lengths, slots=slots, kl=kl, scores=scores,
                         target=target, predict=predict)
        return out, lse, loss

    @staticmethod
    def backward(ctx, dout, _dlse, dloss):
        (q, keys, sink, ids, lengths, out, lse, q_idx, weights, g_k, slots, target,
         predict) = ctx.saved_tensors
        st = ctx.st
        geo, group, cfg = st["geo"], st["group"], st["cfg"]
        det, be = cfg["deterministic"], cfg["backend"]
        rank = geo.rank
        n_own = geo.first_group[rank + 1] - geo.first_group[rank]
        if dout is None:
            dout = torch.zeros_like(out)
        bwd = api.sparse_attention_backward(q, keys, ids, sink, out, lse,
                                            dout.to(q.dtype).contiguous(), scale=cfg["scale"],
                                            v_dim=cfg["v_dim"], lengths=lengths, backend=be,
                                            deterministic=det)
        st["ran"]["sparse_attention_backward"] = bwd.backend
        dkeys = bwd.dkv
        c0 = geo.d_win + geo.L
        # Halo rows: back to the previous rank, added after the owner's own contribution.
        recv = _shift_to_previous(group, geo, dkeys[:geo.d_win],
                                  dkeys.new_zeros((geo.d_win, dkeys.shape[1])))
        dkv = dkeys[geo.d_win:c0].to(F32)
        if geo.cp > 1:
            dkv[geo.L - geo.d_win:] += recv.to(F32)
        dkv = dkv.to(ctx.kv_dtype)
        dkv_cmp = None
        if geo.ratio > 0:
            dkv_cmp = _return_to_owners(group, geo, dkeys[c0:], n_own, det).to(ctx.cmp_dtype)
        dsink = bwd.dsink
        if cfg["reduce_sink"]:
            dsink = _sum_over_ranks(group, geo, dsink, det)
        dsink = dsink.to(sink.dtype)
        dq_idx = dw = dk_idx = None
        if g_k is not None:
            g = api.sparse_indexer_loss_grad(
                q_idx, g_k, weights, slots, target, predict, coeff=cfg["coeff"],
                num_real=cfg["num_real"], grad_loss=float(dloss) if dloss is not None else 0.0,
                scale=cfg["index_scale"], mode=cfg["grad_mode"], backend=be, deterministic=det)
            dq_idx, dw = g.dq_idx, g.dw
            st["ran"]["sparse_indexer_loss_grad"] = g.backend
            dk_idx = _return_to_owners(group, geo, g.dk_idx, n_own, det).to(ctx.k_dtype)
        return bwd.dq, dkv, dsink, dkv_cmp, dq_idx, dw, dk_idx, None


def cp_csa_layer(q, kv, sink, layout, *, window, ratio, group=None, cp=None, kv_cmp=None,
                 q_idx=None, k_idx=None, weights=None, topk=None, coeff=0.0, scale=None,
                 index_scale=None, v_dim=None, order="id", align=None, grad_mode="clipped",
                 backend="auto", deterministic=True, reduce_sink=True,
                 chunk_elements=1 << 24) -> CPLayerResult:
    """One packed DSv4 attention layer on this rank of the CP ``group`` (default: the world).

    Local inputs as in the module docstring; ``layout`` is the global
    :class:`reference.PackedLayout`. ``cp`` (optional) is the CP size the caller expects; a
    group of another size raises. ``topk``, ``order``, ``align``, ``coeff``, ``scale``,
    ``index_scale``, ``v_dim``, ``grad_mode`` as in :func:`gpu_impl.layer.csa_layer`; the loss
    is normalised by the global ``N = layout.num_real``. ``backend`` names the per-op backend
    (``"auto"``, ``"torch"``, ``"cudnn"``). ``reduce_sink=False`` returns each rank's partial
    sink gradient instead of the CP sum (for a trainer that reduces parameter gradients over
    the data x context parallel group itself, as Megatron's DDP does: then do not also reduce
    here). Every rank of the group must call this with the same layout and configuration, and
    must run the backward if any rank does.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_csa_layer needs an initialised torch.distributed process group")
    cfg = dict(window=window, ratio=ratio, topk=topk, coeff=coeff, scale=scale,
               index_scale=index_scale, v_dim=v_dim, order=order, align=align,
               grad_mode=grad_mode, backend=backend, deterministic=deterministic,
               reduce_sink=reduce_sink)
    error, geo = None, None
    try:
        choice(order, "order", ("id", "score"))
        choice(grad_mode, "grad_mode", ("clipped", "autograd"))
        choice(backend, "backend", api.BACKENDS)
        as_bool(deterministic, "deterministic")
        as_bool(reduce_sink, "reduce_sink")
        geo = _local_checks(q, kv, sink, layout, kv_cmp, q_idx, weights, k_idx, group, cp,
                            window, ratio, topk, coeff)
    except (TypeError, ValueError) as exc:
        error = exc
    _agree(group, error, _fingerprint(layout, q, q_idx, cfg))

    cfg.update(num_real=max(1, layout.num_real), chunk=as_int(chunk_elements, "chunk_elements",
                                                               minimum=1))
    ran: dict = {}
    st = dict(geo=geo, group=group, cfg=cfg, layout=layout, ran=ran,
              local_layout=_local_layout(layout, geo) if q_idx is not None else None)
    out, lse, loss = _CPLayerFn.apply(q, kv, sink, kv_cmp, q_idx, weights, k_idx, st)
    aux = st.pop("aux")
    return CPLayerResult(out, loss, lse, aux["ids"], aux["lengths"], aux["slots"], aux["kl"],
                         aux["target"], aux["predict"], aux["scores"], geo.key_ids, ran)
