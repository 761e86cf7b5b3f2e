"""Per-rank context-parallel plans of the oracle and their expected results (contract section 10).

A *plan* says, for one rank of a CP group, which packed rows it owns, which key rows it needs
from other ranks (the halo), which compressed groups it owns and receives, and how its
**physical key buffer** is laid out::

    [ halo (H slots) | local rows (L) | gathered compressed keys, rank-major (cp * cap) ]

- ``halo``: for every maximal run of consecutive owned rows, ``D_win = max(W, D_comp)`` slots
  holding the global rows ``[run_start - D_win, run_start)`` (``D_comp = 2r`` for the overlapping
  ratio-4 compressor, ``r`` for other ratios, 0 for window-only layers). A slot whose row is
  before row 0, in another document than the run's first row (the halo never crosses a
  document), owned by the rank itself or already held by an earlier slot is unused (-1). The
  contiguous partition has exactly one run, so exactly ``D_win`` halo slots (rank 0's are all
  unused), as in DSv4 static CP.
- ``local rows``: the owned rows in the rank's order (ascending global rows in both modes).
- ``gathered compressed keys``: **rank-major**, the order an all-gather produces: rank ``o``'s
  owned groups occupy slots ``[o*cap, o*cap + n_o)`` in ascending global id, the rest of its
  ``cap`` slots are unused. A group belongs to the rank holding its last token. ``cap`` is
  ``ceil(L / r)`` for the contiguous partition (a static bound: ``k`` disjoint ``r``-row groups
  whose last tokens lie in ``L`` rows number at most ``ceil(L/r)``) and the largest owned count
  for the zigzag partition. Under the contiguous partition the owner is non-decreasing in the
  global id, so slot order preserves global-id order: a Top-K over slots breaks ties exactly as
  one over global ids.

Expected results. Per-row results (ids, lengths, out, lse, KL, dq, dq_idx, dw) are functions of
the global row only (section 10): :func:`cp_rank_expected` recomputes them *on the rank's own
physical buffers* (its rows' queries against ``[halo | local | gathered]``), which reproduces the
cp=1 rows bitwise. Reductions (dkv, dsink, dk_idx, the loss) are returned as **partials**: the
rank's per-(row, slot) contributions, unsummed; :func:`cp_reduce_partials` folds every rank's
contributions in global (row, slot) order into the logical key space, which is exactly the
cp=1 oracle's left fold (``_reduce``), so the result is bitwise the cp=1 gradient. (A sum of
per-rank *sums* would not be: floating-point addition is not associative.) The contributions
are materialised (``O(L*K*D)`` per rank): this is a verification tool for small shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import as_float64, as_index, as_int, choice
from ._pointwise import sigmoid
from ._reduce import fold_rows_into, ordered_sum
from .attention import sparse_attention_backward, sparse_attention_forward, valid_slots
from .cp import cp_partition, cp_size
from .indexer_loss import sparse_indexer_loss, sparse_indexer_loss_grad
from .layout import PackedLayout

__all__ = ["CPRankPlan", "CPRankExpected", "CPRankPartial", "CPReduced", "cp_plans", "cp_halo_width",
           "cp_rank_expected", "cp_reduce_partials"]

_I64 = torch.int64


def cp_halo_width(window: int, ratio: int) -> int:
    """Section 10: ``D_win = max(W, D_comp)``; ``D_comp`` is ``2r`` for the overlapping CSA
    compressor (``r == 4``), ``r`` for any other positive ratio, 0 for window-only layers."""
    window = as_int(window, "window", minimum=1)
    ratio = as_int(ratio, "ratio", minimum=0)
    comp = 2 * ratio if ratio == 4 else ratio
    return max(window, comp)



def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` where ``0 <= ids < len(table)``, else -1; an empty table (no keys, or no
    complete compressed group: ``C = 0``) maps every id to -1."""
    if table.numel() == 0:
        return torch.full(ids.shape, -1, dtype=table.dtype)
    inside = (ids >= 0) & (ids < table.numel())
    return torch.where(inside, table[torch.where(inside, ids, 0)], -1)

class CPRankPlan:
    """The CP plan of one rank (section 10); built by :func:`cp_plans`. Read-only.

    Attributes (int64 CPU tensors, global ids unless stated):

    - ``rows [L]``: owned packed rows, in local order;
    - ``halo_rows [H]``: the global row of each halo slot, -1 for an unused slot;
    - ``owned_groups [n_own]``: compressed ids whose last token the rank holds, ascending;
    - ``needed_groups``: compressed ids visible to at least one owned real row, ascending;
    - ``received_groups``: ``needed_groups`` that another rank owns;
    - ``group_owner [C]``, ``group_slot [C]``: owner rank and gathered-buffer slot of every
      group (the same in every rank's plan);
    - ``key_ids [S]``: the logical key id (section 2: raw row ``t`` or ``T + c``) of every
      physical key slot, -1 for unused slots.

    Ints: ``rank``, ``cp``, ``window``, ``ratio``, ``halo_width`` (``D_win``), ``num_halo``
    (``H``), ``num_local`` (``L``), ``cmp_capacity`` (``cap``), ``cmp_offset`` (``H + L``, the
    first gathered slot), ``num_keys`` (``S``); ``mode``; ``layout``.
    """

    def __init__(self, *, layout, rank, cp, mode, window, ratio, rows, halo_rows, group_owner,
                 cmp_capacity, row_owner):
        T = layout.num_rows
        self.layout = layout
        self.rank, self.cp, self.mode = rank, cp, mode
        self.window, self.ratio = window, ratio
        self.halo_width = cp_halo_width(window, ratio)
        self.rows = rows
        self.halo_rows = halo_rows
        self.num_halo = int(halo_rows.numel())
        self.num_local = int(rows.numel())
        self.cmp_capacity = cmp_capacity
        self.cmp_offset = self.num_halo + self.num_local
        self.num_keys = self.cmp_offset + cp * cmp_capacity
        C = int(group_owner.numel())
        self.group_owner = group_owner
        slot = torch.full((C,), -1, dtype=_I64)
        for o in range(cp):
            mine = torch.nonzero(group_owner == o).flatten()
            slot[mine] = o * cmp_capacity + torch.arange(mine.numel(), dtype=_I64)
        self.group_slot = slot
        self.owned_groups = torch.nonzero(group_owner == rank).flatten()
        # Groups visible to the owned real rows: per document, the largest visible count.
        if ratio > 0 and C:
            vis = layout.visible_compressed(ratio)[rows]
            docs = layout.doc[rows]
            real = layout.is_real[rows]
            top = torch.zeros(max(layout.num_docs, 1), dtype=_I64)
            if bool(real.any()):
                top.scatter_reduce_(0, docs[real], vis[real], reduce="amax")
            cu_comp = layout.compressed_offsets(ratio)
            gid = torch.arange(C, dtype=_I64)
            gdoc = torch.searchsorted(cu_comp, gid, right=True) - 1
            self.needed_groups = gid[(gid - cu_comp[gdoc]) < top[gdoc]]
        else:
            self.needed_groups = torch.zeros(0, dtype=_I64)
        self.received_groups = self.needed_groups[group_owner[self.needed_groups] != rank]
        # Physical -> logical, and the logical -> physical table of this rank.
        key_ids = torch.full((self.num_keys,), -1, dtype=_I64)
        key_ids[:self.num_halo] = halo_rows
        key_ids[self.num_halo:self.cmp_offset] = rows
        key_ids[self.cmp_offset + slot] = T + torch.arange(C, dtype=_I64)
        self.key_ids = key_ids
        phys = torch.full((T + C,), -1, dtype=_I64)
        used = torch.nonzero(key_ids >= 0).flatten()
        phys[key_ids[used]] = used
        self._physical_of = phys
        self._row_owner = row_owner

    # -- id mappings -----------------------------------------------------------------------
    def to_physical(self, ids) -> torch.Tensor:
        """Logical key ids (any shape) -> this rank's physical key slots. Ids outside
        ``[0, T + C)`` are invalid and become -1; a valid id the rank does not hold (a raw row
        neither owned nor in its halo) raises ``ValueError``. The input is not modified."""
        ids = as_index(ids, "ids")
        n = int(self._physical_of.numel())
        inside = (ids >= 0) & (ids < n)
        out = torch.where(inside, self._physical_of[torch.where(inside, ids, 0)], -1)
        missing = inside & (out < 0)
        if bool(missing.any()):
            where = torch.nonzero(missing)[0].tolist()
            raise ValueError(
                f"ids{where} = {int(ids[tuple(where)])} is a key row that rank {self.rank} "
                f"neither owns nor receives in its halo (cp={self.cp}, mode={self.mode!r})")
        return out

    def to_logical(self, ids) -> torch.Tensor:
        """Physical key slots -> logical key ids; slots outside ``[0, S)`` or unused give -1."""
        return _lookup(self.key_ids, as_index(ids, "ids"))

    def compressed_to_slots(self, compressed_ids) -> torch.Tensor:
        """Global compressed ids (columns of the indexer) -> gathered-buffer slots; entries
        outside ``[0, C)`` give -1."""
        return _lookup(self.group_slot, as_index(compressed_ids, "compressed_ids"))

    # -- buffers ---------------------------------------------------------------------------
    def gathered(self, x_cmp, name: str = "x_cmp") -> torch.Tensor:
        """The rank-major gathered buffer ``[cp*cap, d]`` of a per-group tensor ``[C, d]``
        (float64; zeros in unused slots)."""
        x = as_float64(x_cmp, name, ndim=2)
        C = int(self.group_slot.numel())
        if x.shape[0] != C:
            raise ValueError(f"{name} must have {C} rows (compressed groups), got {tuple(x.shape)}")
        out = torch.zeros((self.cp * self.cmp_capacity, x.shape[1]), dtype=torch.float64)
        out[self.group_slot] = x
        return out

    def key_buffer(self, kv, kv_cmp=None) -> torch.Tensor:
        """The rank's physical key buffer ``[S, D]`` (float64; zeros in unused slots) from the
        global raw keys ``kv [T, D]`` and compressed keys ``kv_cmp [C, D]``."""
        kv = as_float64(kv, "kv", ndim=2)
        T = self.layout.num_rows
        if kv.shape[0] != T:
            raise ValueError(f"kv must have {T} rows (layout.num_rows), got {tuple(kv.shape)}")
        buf = torch.zeros((self.num_keys, kv.shape[1]), dtype=torch.float64)
        used = torch.nonzero(self.halo_rows >= 0).flatten()
        buf[used] = kv[self.halo_rows[used]]
        buf[self.num_halo:self.cmp_offset] = kv[self.rows]
        if self.cmp_capacity:
            if kv_cmp is None:
                kv_cmp = torch.zeros((0, kv.shape[1]), dtype=torch.float64)
            g = self.gathered(kv_cmp, "kv_cmp")
            if g.shape[1] != kv.shape[1]:
                raise ValueError(f"kv_cmp must have {kv.shape[1]} columns like kv, got {g.shape[1]}")
            buf[self.cmp_offset:] = g
        return buf

    def local_layout(self) -> PackedLayout:
        """A layout of the rank's ``L`` rows with the same real/padding pattern: one segment
        per maximal slice of one document (or of capacity rows) in local order. Positions are
        not preserved; use it only for masks (e.g. :func:`sparse_indexer_loss`)."""
        lay = self.layout
        rows = self.rows
        if rows.numel() == 0:
            return PackedLayout([0], [0], 0)
        docs = lay.doc[rows]
        new = torch.ones(rows.numel(), dtype=torch.bool)
        new[1:] = (docs[1:] != docs[:-1]) | (rows[1:] != rows[:-1] + 1)
        starts = torch.nonzero(new).flatten()
        ends = torch.cat([starts[1:], torch.tensor([rows.numel()])])
        real = lay.is_real[rows].to(_I64)
        real_counts = torch.stack([real[s:e].sum() for s, e in zip(starts.tolist(), ends.tolist())])
        cu_pad = torch.cat([torch.zeros(1, dtype=_I64), ends])
        cu = torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(real_counts, 0)])
        return PackedLayout(cu, cu_pad, int(rows.numel()))

    def __repr__(self) -> str:
        return (f"CPRankPlan(rank={self.rank}, cp={self.cp}, mode={self.mode!r}, "
                f"L={self.num_local}, halo={self.num_halo}, cap={self.cmp_capacity}, "
                f"owned_groups={int(self.owned_groups.numel())}, "
                f"received_groups={int(self.received_groups.numel())})")


def _runs(rows: torch.Tensor):
    """Maximal runs of consecutive rows: list of (first_row, length)."""
    if rows.numel() == 0:
        return []
    brk = torch.nonzero(rows[1:] != rows[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=_I64), brk])
    ends = torch.cat([brk, torch.tensor([rows.numel()])])
    return [(int(rows[s]), int(e - s)) for s, e in zip(starts, ends)]


def cp_plans(layout, cp, *, window, ratio, mode="contiguous"):
    """Section 10: the plan of every rank of a CP group of size ``cp``; a list of
    :class:`CPRankPlan`, rank order.

    ``window`` ``W >= 1``, ``ratio`` ``r >= 0`` (0: window-only layer). ``mode`` is
    ``"contiguous"`` (DSv4 static CP) or ``"zigzag"`` (see :func:`cp_partition`). Raises
    ``ValueError`` where the partition raises (``T % cp``, zigzag segments not divisible by
    ``2*cp``) and, for the contiguous partition with ``cp > 1``, when a rank's slice
    ``L = T/cp`` is shorter than its halo ``D_win`` (the halo must come from one neighbour).
    """
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    cp = cp_size(cp)
    window = as_int(window, "window", minimum=1)
    ratio = as_int(ratio, "ratio", minimum=0)
    mode = choice(mode, "mode", ("contiguous", "zigzag"))
    parts = cp_partition(layout, cp, mode=mode)
    T = layout.num_rows
    d_win = cp_halo_width(window, ratio)
    if mode == "contiguous" and cp > 1 and T // cp < d_win:
        raise ValueError(
            f"cp={cp}: each rank owns T/cp={T // cp} rows, fewer than its halo "
            f"D_win=max(W, D_comp)={d_win} (window={window}, ratio={ratio})")
    row_owner = torch.full((T,), -1, dtype=_I64)
    for r, rows in enumerate(parts):
        row_owner[rows] = r
    if ratio > 0:
        cu_comp = layout.compressed_offsets(ratio)
        n = layout.compressed_counts(ratio)
        C = int(cu_comp[-1])
        gid = torch.arange(C, dtype=_I64)
        gdoc = torch.repeat_interleave(torch.arange(layout.num_docs, dtype=_I64), n)
        last = layout.cu_seqlens_padded[gdoc] + (gid - cu_comp[gdoc] + 1) * ratio - 1
        group_owner = row_owner[last]
        if mode == "contiguous":
            cap = -(-(T // cp) // ratio)
        else:
            counts = torch.bincount(group_owner, minlength=cp) if C else torch.zeros(cp, dtype=_I64)
            cap = int(counts.max()) if cp else 0
    else:
        group_owner = torch.zeros(0, dtype=_I64)
        cap = 0
    plans = []
    for r, rows in enumerate(parts):
        rows = rows.to(_I64)
        blocks = []
        seen = torch.zeros(T, dtype=torch.bool)
        seen[rows] = True                              # owned rows are never halo rows
        for first, _ in _runs(rows):
            h = torch.arange(first - d_win, first, dtype=_I64)
            ok = h >= 0
            hs = torch.where(ok, h, 0)
            first_doc = int(layout.doc[first])
            ok &= (layout.doc[hs] == first_doc) & (first_doc >= 0)
            ok &= ~seen[hs]
            h = torch.where(ok, h, -1)
            seen[h[ok]] = True
            blocks.append(h)
        if not blocks:
            blocks.append(torch.full((d_win,), -1, dtype=_I64))
        plans.append(CPRankPlan(layout=layout, rank=r, cp=cp, mode=mode, window=window,
                                ratio=ratio, rows=rows, halo_rows=torch.cat(blocks),
                                group_owner=group_owner, cmp_capacity=cap, row_owner=row_owner))
    return plans


class CPRankPartial(NamedTuple):
    """A rank's unsummed contributions to the reduced quantities (float64, logical ids)."""

    num_rows: int                 # T of the layout (the ranks together cover 0..T-1)
    rows: torch.Tensor            # [L] global row of each local row
    dkv_dest: torch.Tensor        # [L, K] logical key id receiving each slot's contribution, -1 none
    dkv_contrib: torch.Tensor     # [L, K, D]
    dsink_contrib: torch.Tensor   # [L, H]
    kl: torch.Tensor | None       # [L] per-row KL (the loss is a fold of these)
    dk_idx_dest: torch.Tensor | None     # [L, Kc] global compressed id, -1 none
    dk_idx_contrib: torch.Tensor | None  # [L, Kc, D_I]


class CPRankExpected(NamedTuple):
    """What rank ``plan.rank`` must produce (section 10); float64 / int64 CPU tensors."""

    rows: torch.Tensor            # [L] global rows
    ids: torch.Tensor             # [L, K] key ids in the rank's physical layout
    logical_ids: torch.Tensor     # [L, K] the same ids mapped back (== cp=1 rows)
    lengths: torch.Tensor         # [L]
    compressed_slots: torch.Tensor | None  # [L, Kc] gathered-buffer slots of the selection
    out: torch.Tensor             # [L, H, Dv]
    lse: torch.Tensor             # [L, H]
    kl: torch.Tensor | None       # [L]
    dq: torch.Tensor | None       # [L, H, D]
    dq_idx: torch.Tensor | None   # [L, H_I, D_I]
    dw: torch.Tensor | None       # [L, H_I]
    partial: CPRankPartial | None


def cp_rank_expected(plan, *, q, kv, sink, ids, lengths=None, kv_cmp=None, dout=None,
                     compressed_ids=None, index_scores=None, q_idx=None, k_idx=None,
                     weights=None, coeff=0.0, num_real=None, grad_loss=1.0, scale=None,
                     index_scale=None, v_dim=None, grad_mode="clipped"):
    """Section 10: rank ``plan.rank``'s expected results, computed on its own buffers.

    Global inputs: ``q [T,H,D]``, raw keys ``kv [T,D]``, ``kv_cmp [C,D]``, ``sink [H]``, the
    cp=1 key rows ``ids [T,K]`` (logical ids, e.g. :func:`build_csa_indices`) and ``lengths``;
    for the indexer loss the cp=1 selection ``compressed_ids [T,Kc]`` (global compressed ids)
    and ``index_scores [T,C]``; for the backward ``dout [T,H,Dv]`` and, with the loss,
    ``q_idx``, ``k_idx``, ``weights``. The rank evaluates its rows' queries against its
    physical key buffer (``plan.key_buffer``) with ids mapped by ``plan.to_physical``: the
    results equal the cp=1 rows bitwise (section 10) and ``partial`` holds the contributions
    that :func:`cp_reduce_partials` folds into the cp=1 reductions. ``num_real`` defaults to
    the global ``layout.num_real``.
    """
    if not isinstance(plan, CPRankPlan):
        raise TypeError(f"plan must be a CPRankPlan, got {type(plan).__name__}")
    lay = plan.layout
    rows = plan.rows
    T = lay.num_rows
    grad_mode = choice(grad_mode, "grad_mode", ("clipped", "autograd"))
    # Every global per-row input has T rows: checked here, before any row is taken.
    ids = _global_rows(as_index(ids, "ids", ndim=2), "ids", T)
    q = _global_rows(as_float64(q, "q", ndim=3), "q", T)
    sink = as_float64(sink, "sink", ndim=1, allow_nan=False)
    if lengths is not None:
        lengths = _global_rows(as_index(lengths, "lengths", ndim=1), "lengths", T)[rows]
    if compressed_ids is not None:
        compressed_ids = _global_rows(as_index(compressed_ids, "compressed_ids", ndim=2),
                                      "compressed_ids", T)
    if index_scores is not None:
        index_scores = _global_rows(as_float64(index_scores, "index_scores", ndim=2),
                                    "index_scores", T)
        C = int(plan.group_slot.numel())
        if index_scores.shape[1] != C:
            raise ValueError(f"index_scores must have {C} columns (compressed groups), got "
                             f"{tuple(index_scores.shape)}")
    if dout is not None:
        dout = _global_rows(as_float64(dout, "dout", ndim=3), "dout", T)
    if q_idx is not None:
        q_idx = _global_rows(as_float64(q_idx, "q_idx", ndim=3), "q_idx", T)
    if weights is not None:
        weights = _global_rows(as_float64(weights, "weights", ndim=2), "weights", T)
    keys = plan.key_buffer(kv, kv_cmp)
    ids_phys = plan.to_physical(ids[rows])
    q_loc = q[rows]
    out, lse = sparse_attention_forward(q_loc, keys, ids_phys, sink, scale=scale, v_dim=v_dim,
                                        lengths=lengths)
    lengths_out = valid_slots(ids_phys, plan.num_keys, lengths).sum(dim=1).to(_I64)
    n_real = lay.num_real if num_real is None else as_int(num_real, "num_real", minimum=1)

    slots = kl = loss_res = g_cmp = None
    if compressed_ids is not None:
        cids = compressed_ids[rows]
        slots = plan.compressed_to_slots(cids)
        if index_scores is not None and kv_cmp is not None:
            scores = index_scores
            phys_scores = torch.full((plan.num_local, plan.cp * plan.cmp_capacity),
                                     float("-inf"), dtype=torch.float64)
            phys_scores[:, plan.group_slot] = scores[rows]
            g_cmp = plan.gathered(kv_cmp, "kv_cmp")
            loss_res = sparse_indexer_loss(q_loc, g_cmp, sink, lse, slots, phys_scores,
                                           plan.local_layout(), coeff=coeff, scale=scale,
                                           num_real=n_real)
            kl = loss_res.kl

    dq = dq_idx = dw = partial = None
    if dout is not None:
        dout = dout[rows]
        L, K = ids_phys.shape
        D = keys.shape[1]
        # Expand every (row, slot) into its own key row: each expanded row is referenced once,
        # so the backward's fold into it is exactly that slot's contribution.
        valid = valid_slots(ids_phys, plan.num_keys, lengths)
        safe = torch.where(valid, ids_phys, 0)
        expanded = keys.index_select(0, safe.reshape(-1))
        slot_ids = torch.where(valid, torch.arange(L * K, dtype=_I64).view(L, K), -1)
        dq, dkv_exp, _ = sparse_attention_backward(q_loc, expanded, slot_ids, sink, out, lse,
                                                   dout, scale=scale, v_dim=v_dim,
                                                   lengths=lengths)
        dkv_contrib = dkv_exp.view(L, K, D)
        dest = torch.where(valid, plan.to_logical(ids_phys), -1)
        dsink_contrib = _dsink_rows(sink, out, lse, dout)
        dki_dest = dki_contrib = None
        if loss_res is not None and q_idx is not None:
            if weights is None or k_idx is None:
                raise ValueError("q_idx, k_idx and weights must be given together")
            qi = q_idx[rows]
            w = weights[rows]
            kg = plan.gathered(k_idx, "k_idx")
            Kc = slots.shape[1]
            ok = (slots >= 0) & (slots < kg.shape[0])
            k_exp = kg.index_select(0, torch.where(ok, slots, 0).reshape(-1))
            exp_ids = torch.where(ok, torch.arange(L * Kc, dtype=_I64).view(L, Kc), -1)
            dq_idx, dw, dk_exp = sparse_indexer_loss_grad(
                qi, k_exp, w, exp_ids, loss_res.target, loss_res.predict, coeff=coeff,
                num_real=n_real, grad_loss=grad_loss, scale=index_scale, mode=grad_mode)
            dki_contrib = dk_exp.view(L, Kc, -1)
            cid_of_slot = torch.full((plan.cp * plan.cmp_capacity,), -1, dtype=_I64)
            cid_of_slot[plan.group_slot] = torch.arange(plan.group_slot.numel(), dtype=_I64)
            dki_dest = torch.where(ok, cid_of_slot[torch.where(ok, slots, 0)], -1)
        partial = CPRankPartial(lay.num_rows, rows, dest, dkv_contrib, dsink_contrib, kl, dki_dest, dki_contrib)
    return CPRankExpected(rows, ids_phys, plan.to_logical(ids_phys), lengths_out, slots, out,
                          lse, kl, dq, dq_idx, dw, partial)


def _global_rows(x, name, T):
    if x.shape[0] != T:
        raise ValueError(f"{name} must have {T} rows (layout.num_rows), got {tuple(x.shape)}")
    return x


def _dsink_rows(sink, out, lse, dout):
    """Per-row sink gradient contributions ``-sigmoid(sink - lse) * <dO, out>`` (section 6),
    0 on rows with no valid slot (``lse = +inf``)."""
    delta = (dout * out).sum(dim=-1)
    empty = torch.isinf(lse) & (lse > 0)
    p_sink = sigmoid(sink.unsqueeze(0) - lse).masked_fill(empty, 0.0)
    return -(p_sink * delta)


class CPReduced(NamedTuple):
    """The canonical reductions of every rank's partials (equal to the cp=1 oracle bitwise)."""

    dkv: torch.Tensor             # [T + C, D] logical key buffer gradient
    dsink: torch.Tensor           # [H]
    loss: torch.Tensor | None     # 0-dim
    dk_idx: torch.Tensor | None   # [C, D_I]


def cp_reduce_partials(partials, *, num_keys, num_compressed=None, coeff=0.0, num_real=None):
    """Section 10: fold the ranks' contributions in global (row, slot) order.

    ``partials``: a list or tuple of one :class:`CPRankPartial` per rank (any rank order;
    together they must cover every global row exactly once). ``num_keys`` is ``T + C`` (the logical key buffer),
    ``num_compressed`` ``C`` (needed for ``dk_idx``), ``coeff`` and ``num_real`` ``N`` for the
    loss. The folds are the oracle's (``_reduce``), so every result equals the cp=1 oracle's
    bitwise.
    """
    if isinstance(partials, CPRankPartial) or not isinstance(partials, (list, tuple)):
        raise TypeError(f"partials must be a list or tuple of CPRankPartial (one per rank), "
                        f"got {type(partials).__name__}")
    parts = list(partials)
    if not parts:
        raise ValueError("partials must hold at least one CPRankPartial")
    for i, p in enumerate(parts):
        if not isinstance(p, CPRankPartial):
            raise TypeError(f"partials[{i}] must be a CPRankPartial, got {type(p).__name__}")
    num_keys = as_int(num_keys, "num_keys", minimum=0)
    rows = torch.cat([p.rows for p in parts])
    order = torch.argsort(rows, stable=True)
    T = parts[0].num_rows
    if any(p.num_rows != T for p in parts) or not torch.equal(rows[order],
                                                              torch.arange(T, dtype=_I64)):
        raise ValueError("partials must cover the global rows 0..T-1 exactly once")
    D = parts[0].dkv_contrib.shape[-1]
    dest = torch.cat([p.dkv_dest for p in parts])[order]
    contrib = torch.cat([p.dkv_contrib for p in parts])[order]
    flat = dest.reshape(-1) >= 0
    dkv = torch.zeros((num_keys, D), dtype=torch.float64)
    fold_rows_into(dkv, dest.reshape(-1)[flat], contrib.reshape(-1, D)[flat])
    dsink = ordered_sum(torch.cat([p.dsink_contrib for p in parts])[order])
    loss = dk_idx = None
    if all(p.kl is not None for p in parts):
        n_real = as_int(num_real, "num_real", minimum=1)
        loss = float(coeff) * ordered_sum(torch.cat([p.kl for p in parts])[order]) / n_real
    if all(p.dk_idx_dest is not None for p in parts):
        C = as_int(num_compressed, "num_compressed", minimum=0)
        kd = torch.cat([p.dk_idx_dest for p in parts])[order]
        kc = torch.cat([p.dk_idx_contrib for p in parts])[order]
        DI = kc.shape[-1]
        ok = kd.reshape(-1) >= 0
        dk_idx = torch.zeros((C, DI), dtype=torch.float64)
        fold_rows_into(dk_idx, kd.reshape(-1)[ok], kc.reshape(-1, DI)[ok])
    return CPReduced(dkv, dsink, loss, dk_idx)
