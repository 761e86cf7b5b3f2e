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
something the deterministic mode relies on; ``deterministic=False`` uses them (``reduce_scatter_tensor`` /
``all_reduce``). With the per-op backends deterministic too, a fixed CP size and process layout
gives bitwise identical results run to run. Results across CP sizes differ in the last bits
(different fold orders) and are judged against the oracle by the error model.

Precision: as the chosen backend's ops (see :mod:`gpu_impl.torch_backend`). The backend returns
each rank's partial ``dkv`` / ``dk_idx`` in the tensor's dtype, so for bf16 inputs the halo and
compressed-key gradients carry one extra bf16 rounding per partial before the CP sum (summed in
float32 in rank order, rounded once): the same as Megatron's bf16 reduce-scatter.

Invalid input fails fast on every rank. Each rank validates its arguments (types, shapes,
dtypes, devices, the geometry, finite values: a NaN or an infinity in any input tensor, a NaN
in ``sink``), then one fixed-size all-gather shares every rank's verdict and a fingerprint of
every argument the ranks must agree on (the layout; ``window``, ``ratio``, ``topk``,
``coeff``, ``scale``, ``index_scale``, ``v_dim``, ``cp`` and the policies; the values of
``sink``; the dtypes and shapes of every tensor). Any local failure or any disagreement raises
a ``ValueError`` / ``TypeError`` naming the argument and the ranks on *every* rank before any
data moves, and the group stays usable. Every collective of the layer (that exchange
included) is bounded by ``timeout`` seconds (default :data:`DEFAULT_TIMEOUT_S`, or the process
group's own timeout when that is shorter): a rank that fails later or never joins makes the
others raise ``TimeoutError`` within that time instead of blocking, and a rank whose process
exits makes them raise ``RuntimeError`` at once, whether the collective was waiting or could
not start; both messages are the layer's own, naming the collective and the rank. The group
is then broken, as after any failed collective. With NCCL,
set the CUDA device of each rank first, as usual; waiting with a timeout makes each of the
layer's collectives a host synchronisation point.
"""
from __future__ import annotations

import datetime
import hashlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from dsv4_oracle.reference.cp import cp_size
from dsv4_oracle.reference.layout import PackedLayout

from . import api
from .checks import as_bool, as_int, as_real, choice

__all__ = ["CPLayerResult", "DEFAULT_TIMEOUT_S", "cp_csa_layer", "cp_geometry",
           "owned_group_counts"]

F32 = torch.float32
INF = math.inf
DEFAULT_TIMEOUT_S = 60.0       # bound of each of the layer's collectives, seconds


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
    invalid CP configuration (``TypeError`` for arguments of the wrong type)."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a reference.PackedLayout, got {type(layout).__name__}")
    cp = cp_size(cp)
    rank = as_int(rank, "rank", minimum=0)
    if rank >= cp:
        raise ValueError(f"rank must be < cp={cp}, got {rank}")
    window = as_int(window, "window", minimum=1)
    ratio = as_int(ratio, "ratio", minimum=0)
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
    cp = cp_size(cp)
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
        as_int(topk, "topk", minimum=0)
        for name, t, nd in (("q_idx", q_idx, 3), ("weights", weights, 2), ("k_idx", k_idx, 2)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != nd or not t.is_floating_point():
                raise ValueError(f"{name} must be a {nd}-d float tensor, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if q_idx.shape[0] != geo.L:
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
    _check_values(rank, q=q, kv=kv, sink=sink, kv_cmp=kv_cmp, q_idx=q_idx, weights=weights,
                  k_idx=k_idx)
    return geo


def _check_values(rank, **named):
    """Every input tensor finite, except ``sink``: no NaN (``-inf`` is "no sink"). One
    reduction per tensor and a single host synchronisation."""
    named = {k: t for k, t in named.items() if t is not None and t.numel()}
    bad = [(torch.isnan(t) if k == "sink" else ~torch.isfinite(t)).any() for k, t in named.items()]
    if not bad or not bool(torch.stack(bad).any()):
        return
    for (name, t), b in zip(named.items(), torch.stack(bad).tolist()):
        if b:
            what = "NaN" if name == "sink" else "NaN or infinite value"
            mask = torch.isnan(t) if name == "sink" else ~torch.isfinite(t)
            where = tuple(torch.nonzero(mask)[0].tolist())
            raise ValueError(f"{name} holds a {what} on rank {rank} (element {where} = "
                             f"{t[where].item()}); the CP layer takes finite inputs"
                             + (" (a sink may be +-inf)" if name == "sink" else ""))


# What every rank must agree on, in a fixed order (the fields of the fingerprint).
_AGREED = ("layout", "window", "ratio", "topk", "coeff", "scale", "index_scale", "v_dim", "order",
           "align", "grad_mode", "backend", "deterministic", "reduce_sink", "cp", "sink", "q",
           "kv", "kv_cmp", "q_idx", "weights", "k_idx")
_OWNED = ("kv_cmp", "k_idx")     # rows differ per rank (owned groups): only the row shape agrees
_ERR_BYTES = 480                 # a failing rank's message, truncated
_TEXT_BYTES = 48                 # a field's printable summary, truncated
_DIGEST_BYTES = 8
_FIELD_BYTES = _DIGEST_BYTES + _TEXT_BYTES
_ERROR_KINDS = {0: None, 1: ValueError, 2: TypeError}


def _describe(name, x):
    """(summary text, bytes to digest) of one agreed argument; never raises."""
    try:
        if name == "layout" and isinstance(x, PackedLayout):
            cu, pad = x.cu_seqlens.tolist(), x.cu_seqlens_padded.tolist()
            return (f"T={x.num_rows} cu_seqlens={cu} padded={pad}",
                    repr((cu, pad, x.num_rows)).encode())
        if isinstance(x, torch.Tensor):
            shape = ("*",) + tuple(x.shape[1:]) if name in _OWNED else tuple(x.shape)
            meta = f"{str(x.dtype).replace('torch.', '')} {shape} on {x.device.type}"
            if name != "sink":
                return meta, meta.encode()
            vals = x.detach().to("cpu", copy=True).contiguous()
            return (f"{vals.tolist()} ({meta})",
                    meta.encode() + vals.view(torch.uint8).numpy().tobytes()
                    if vals.numel() else meta.encode())
        return repr(x), (type(x).__name__ + repr(x)).encode()
    except Exception as exc:  # an unreadable argument is reported by the local checks
        return f"<unreadable: {type(exc).__name__}>", b"<unreadable>"


def _payload(error, args):
    """This rank's verdict and fingerprint as a fixed-size uint8 tensor (CPU); an argument
    missing from ``args`` counts as ``None``."""
    buf = bytearray(1 + _ERR_BYTES + len(_AGREED) * _FIELD_BYTES)
    if error is not None:
        buf[0] = 2 if isinstance(error, TypeError) else 1
        msg = str(error).encode()[:_ERR_BYTES]
        buf[1:1 + len(msg)] = msg
    for i, name in enumerate(_AGREED):
        text, raw = _describe(name, args.get(name))
        o = 1 + _ERR_BYTES + i * _FIELD_BYTES
        buf[o:o + _DIGEST_BYTES] = hashlib.blake2b(raw, digest_size=_DIGEST_BYTES).digest()
        t = text.encode()[:_TEXT_BYTES]
        buf[o + _DIGEST_BYTES:o + _DIGEST_BYTES + len(t)] = t
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def _text(b: bytes) -> str:
    return b.rstrip(b"\0").decode("utf-8", "replace")


def _agree(comm, error, args):
    """Share every rank's verdict and fingerprint (one fixed-size all-gather, bounded by the
    timeout); raise the same kind of error on every rank if any rank failed or the ranks
    disagree on an argument."""
    mine = _payload(error, args)
    every = comm.all_gather(mine.to(comm.exchange_device), "the validation exchange")
    rows = [bytes(r) for r in every.view(comm.size, -1).cpu().tolist()]
    if error is not None:        # this rank's own error, full text, with the rank named
        raise type(error)(f"invalid CP input on rank {comm.rank} of the group: {error}") \
            from error
    for r, row in enumerate(rows):
        kind = _ERROR_KINDS.get(row[0], ValueError)
        if kind is not None:
            raise kind(f"invalid CP input on rank {r} of the group: {_text(row[1:1 + _ERR_BYTES])}")
    diffs = []
    for i, name in enumerate(_AGREED):
        o = 1 + _ERR_BYTES + i * _FIELD_BYTES
        by_value: dict = {}                       # digest -> (summary, ranks holding it)
        for r, row in enumerate(rows):
            text = row[o + _DIGEST_BYTES:o + _FIELD_BYTES]
            by_value.setdefault(row[o:o + _DIGEST_BYTES], (text, []))[1].append(r)
        if len(by_value) > 1:
            held = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                             f"{_text(text)}" for text, rs in by_value.values())
            diffs.append((name, held))
    if diffs:
        raise ValueError("CP ranks disagree on " + ", ".join(n for n, _ in diffs) + " ("
                         + "), (".join(f"{n} on {held}" for n, held in diffs) + "); every rank "
                         "must pass the same value")


# --------------------------------------------------------------------------------------------
# collectives, each bounded by the timeout
# --------------------------------------------------------------------------------------------
def _options(cls, timeout):
    from torch._C import _distributed_c10d as c10d
    opts = getattr(c10d, cls)()
    opts.timeout = timeout
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


class _Comm:
    """The layer's collectives on one CP group; every one waits at most ``timeout_s`` seconds
    (the collective's own timeout option and a bounded wait), then raises ``TimeoutError``; a
    collective that fails otherwise (a peer's connection closed) raises ``RuntimeError``. Both
    name the collective and the rank."""

    def __init__(self, group, timeout_s):
        self.group = group
        self.pg = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.set_timeout(timeout_s)
        nccl = dist.get_backend(group) == "nccl"
        self.exchange_device = (torch.device("cuda", torch.cuda.current_device()) if nccl
                                else torch.device("cpu"))

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def _run(self, what, start):
        """``start()`` (which starts a collective and returns its work objects) and the wait for
        them: every failure of either, whether the collective could not start (a peer already
        gone) or did not finish, raises this layer's own error naming ``what`` and the rank."""
        try:
            works = start()
            for w in works if isinstance(works, (list, tuple)) else [works]:
                if w is not None:
                    w.wait(self.timeout)
        except RuntimeError as exc:          # gloo and NCCL errors (DistBackendError, ...)
            msg = str(exc)
            if "imed out" in msg or "timeout" in msg.lower():
                raise TimeoutError(
                    f"cp_csa_layer: {what} did not complete within {self.timeout_s:g} s on rank "
                    f"{self.rank} of the CP group (another rank failed, never joined or is "
                    f"stuck; the group is no longer usable): {msg.splitlines()[0]}") from None
            raise RuntimeError(
                f"cp_csa_layer: {what} failed on rank {self.rank} of the CP group (another "
                f"rank failed or exited; the group is no longer usable): "
                f"{msg.splitlines()[0] if msg else type(exc).__name__}") from None

    def _call(self, names, *args):
        for n in names:
            fn = getattr(self.pg, n, None)
            if fn is not None:
                return fn(*args)
        raise RuntimeError(f"this torch.distributed has none of {names}")

    def all_gather(self, x, what):
        """Rank-major concatenation of every rank's ``x`` (same shape everywhere)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        self._run(what, lambda: self._call(("all_gather_single", "_allgather_base"), out, x,
                                           _options("AllgatherOptions", self.timeout)))
        return out

    def all_to_all(self, x, what):
        x = x.contiguous()
        out = torch.empty_like(x)
        self._run(what, lambda: self._call(("all_to_all_single", "alltoall_base"), out, x, [],
                                           [], _options("AllToAllOptions", self.timeout)))
        return out

    def reduce_scatter(self, x, what):
        """Sum over ranks of ``x [cp*n, ...]``, this rank's ``n`` rows."""
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size,) + tuple(x.shape[1:]))
        opts = _options("ReduceScatterOptions", self.timeout)
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(what, lambda: self._call(("reduce_scatter_single", "_reduce_scatter_base"),
                                           out, x, opts))
        return out

    def all_reduce(self, x, what):
        y = x.clone()
        opts = _options("AllreduceOptions", self.timeout)
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(what, lambda: self.pg.allreduce([y], opts))
        return y

    def shift(self, send, send_to, out, recv_from, what):
        """Point to point: ``send`` to group rank ``send_to`` and ``out`` from ``recv_from``
        (either may be ``None``)."""
        ops = []
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(),
                                  _global_rank(self.group, send_to), self.group))
        if recv_from is not None:
            ops.append(dist.P2POp(dist.irecv, out, _global_rank(self.group, recv_from),
                                  self.group))
        if ops:
            self._run(what, lambda: dist.batch_isend_irecv(ops))
        return out


def _group_timeout_s(group, device) -> float | None:
    """The process group's own timeout in seconds for its backend on ``device`` (``None`` when
    this torch.distributed does not say)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        t = pg._get_backend(device).options._timeout
        return float(t.total_seconds())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _global_rank(group, r):
    return r if group is None else dist.get_global_rank(group, r)


def _shift_to_next(comm, geo, tail, out):
    """Point to point: rank r sends ``tail`` to r+1 and receives ``out`` from r-1 (rank 0
    keeps ``out`` as given)."""
    return comm.shift(tail, geo.rank + 1 if geo.rank + 1 < geo.cp else None, out,
                      geo.rank - 1 if geo.rank > 0 else None, "the halo exchange")


def _shift_to_previous(comm, geo, head, out):
    """Point to point: rank r sends ``head`` to r-1 and receives ``out`` from r+1."""
    return comm.shift(head, geo.rank - 1 if geo.rank > 0 else None, out,
                      geo.rank + 1 if geo.rank + 1 < geo.cp else None,
                      "the halo gradient exchange")


def _all_gather_rows(comm, geo, x, what):
    """Pad the rank's owned rows to ``cap`` and all-gather them rank-major: ``[cp*cap, d]``."""
    buf = x.new_zeros((geo.cap, x.shape[1]))
    buf[:x.shape[0]] = x
    return comm.all_gather(buf, what)


def _return_to_owners(comm, geo, partial, n_own, deterministic, what):
    """Gradients of a gathered buffer ``[cp*cap, d]`` back to their owners: the sum over ranks
    of each owner's slice, as ``[n_own, d]`` float32 (deterministic: all_to_all + fold in rank
    order; otherwise reduce-scatter)."""
    d = partial.shape[1]
    if deterministic:
        recv = comm.all_to_all(partial, what)
        parts = recv.view(geo.cp, geo.cap, d).to(F32)
        acc = parts[0].clone()
        for r in range(1, geo.cp):
            acc += parts[r]
        return acc[:n_own]
    return comm.reduce_scatter(partial, what)[:n_own].to(F32)


def _sum_over_ranks(comm, geo, x, deterministic, what):
    """``sum_r x_r`` (float32), identical on every rank: all-gather + fold in rank order, or
    all-reduce."""
    x = x.to(F32).contiguous()
    if deterministic:
        out = comm.all_gather(x.reshape(1, -1), what).view((geo.cp,) + tuple(x.shape))
        acc = out[0].clone()
        for r in range(1, geo.cp):
            acc += out[r]
        return acc
    return comm.all_reduce(x, what)


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
        geo, comm, cfg = st["geo"], st["comm"], st["cfg"]
        layout, dev = st["layout"], q.device
        det, be = cfg["deterministic"], cfg["backend"]
        ran = st["ran"]
        # Halo exchange and all-gathers (data movement only).
        halo = _shift_to_next(comm, geo, kv[geo.L - geo.d_win:] if geo.cp > 1 else kv[:0],
                              kv.new_zeros((geo.d_win, kv.shape[1])))
        parts = [halo, kv]
        g_kv = g_k = None
        if geo.ratio > 0:
            g_kv = _all_gather_rows(comm, geo, kv_cmp, "the all-gather of kv_cmp")
            parts.append(g_kv)
        keys = torch.cat(parts, dim=0)
        scores = slots = None
        if k_idx is not None:
            g_k = _all_gather_rows(comm, geo, k_idx, "the all-gather of k_idx")
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
            loss = _sum_over_ranks(comm, geo, res.loss.reshape(1), det,
                                   "the loss reduction").reshape(())
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
        geo, comm, cfg = st["geo"], st["comm"], st["cfg"]
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
        recv = _shift_to_previous(comm, geo, dkeys[:geo.d_win],
                                  dkeys.new_zeros((geo.d_win, dkeys.shape[1])))
        dkv = dkeys[geo.d_win:c0].to(F32)
        if geo.cp > 1:
            dkv[geo.L - geo.d_win:] += recv.to(F32)
        dkv = dkv.to(ctx.kv_dtype)
        dkv_cmp = None
        if geo.ratio > 0:
            dkv_cmp = _return_to_owners(comm, geo, dkeys[c0:], n_own, det,
                                        "the kv_cmp gradient exchange").to(ctx.cmp_dtype)
        dsink = bwd.dsink
        if cfg["reduce_sink"]:
            dsink = _sum_over_ranks(comm, geo, dsink, det, "the sink gradient reduction")
        dsink = dsink.to(sink.dtype)
        dq_idx = dw = dk_idx = None
        if g_k is not None:
            g = api.sparse_indexer_loss_grad(
                q_idx, g_k, weights, slots, target, predict, coeff=cfg["coeff"],
                num_real=cfg["num_real"], grad_loss=float(dloss) if dloss is not None else 0.0,
                scale=cfg["index_scale"], mode=cfg["grad_mode"], backend=be, deterministic=det)
            dq_idx, dw = g.dq_idx, g.dw
            st["ran"]["sparse_indexer_loss_grad"] = g.backend
            dk_idx = _return_to_owners(comm, geo, g.dk_idx, n_own, det,
                                       "the k_idx gradient exchange").to(ctx.k_dtype)
        return bwd.dq, dkv, dsink, dkv_cmp, dq_idx, dw, dk_idx, None


def cp_csa_layer(q, kv, sink, layout, *, window, ratio, group=None, cp=None, kv_cmp=None,
                 q_idx=None, k_idx=None, weights=None, topk=None, coeff=0.0, scale=None,
                 index_scale=None, v_dim=None, order="id", align=None, grad_mode="clipped",
                 backend="auto", deterministic=True, reduce_sink=True,
                 chunk_elements=1 << 24, timeout=None) -> CPLayerResult:
    """One packed DSv4 attention layer on this rank of the CP ``group`` (default: the world).

    Local inputs as in the module docstring; ``layout`` is the global
    :class:`reference.PackedLayout`. ``cp`` (optional) is the CP size the caller expects; a
    group of another size raises. ``topk``, ``order``, ``align``, ``coeff``, ``scale``,
    ``index_scale``, ``v_dim``, ``grad_mode`` as in :func:`gpu_impl.layer.csa_layer`; the loss
    is normalised by the global ``N = layout.num_real``. ``backend`` names the per-op backend
    (``"auto"``, ``"torch"``, ``"cudnn"``). ``reduce_sink=False`` returns each rank's partial
    sink gradient instead of the CP sum (for a trainer that reduces parameter gradients over
    the data x context parallel group itself, as Megatron's DDP does: then do not also reduce
    here). ``timeout`` (seconds, > 0) bounds each of the layer's collectives, forward and
    backward (default: :data:`DEFAULT_TIMEOUT_S`, or the process group's own timeout when that
    is shorter). Every rank of the group must call this with the same layout and configuration
    (checked: a difference raises on every rank), and must run the backward if any rank does.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_csa_layer needs an initialised torch.distributed process group")
    cfg = dict(window=window, ratio=ratio, topk=topk, coeff=coeff, scale=scale,
               index_scale=index_scale, v_dim=v_dim, order=order, align=align,
               grad_mode=grad_mode, backend=backend, deterministic=deterministic,
               reduce_sink=reduce_sink)
    error, geo = None, None
    comm = _Comm(group, DEFAULT_TIMEOUT_S)
    # The exchange below must be bounded even when this rank's timeout is unusable: the
    # default is the layer's limit or, when shorter, the process group's own timeout.
    own = _group_timeout_s(group, comm.exchange_device)
    comm.set_timeout(DEFAULT_TIMEOUT_S if own is None or own <= 0
                     else min(DEFAULT_TIMEOUT_S, own))
    try:
        if timeout is not None:
            comm.set_timeout(as_real(timeout, "timeout", positive=True))
    except (TypeError, ValueError) as exc:
        error = exc
    try:
        if error is not None:
            raise error
        choice(order, "order", ("id", "score"))
        choice(grad_mode, "grad_mode", ("clipped", "autograd"))
        choice(backend, "backend", api.BACKENDS)
        as_bool(deterministic, "deterministic")
        as_bool(reduce_sink, "reduce_sink")
        chunk = as_int(chunk_elements, "chunk_elements", minimum=1)
        for name, x in (("scale", scale), ("index_scale", index_scale)):
            if x is not None:
                as_real(x, name, positive=True)
        if v_dim is not None:
            as_int(v_dim, "v_dim", minimum=1)
        if align is not None:
            as_int(align, "align", minimum=1)
        geo = _local_checks(q, kv, sink, layout, kv_cmp, q_idx, weights, k_idx, group, cp,
                            window, ratio, topk, coeff)
    except (TypeError, ValueError) as exc:
        error = exc
    _agree(comm, error, dict(cfg, layout=layout, cp=cp, sink=sink, q=q, kv=kv, kv_cmp=kv_cmp,
                             q_idx=q_idx, weights=weights, k_idx=k_idx))

    cfg.update(num_real=max(1, layout.num_real), chunk=chunk)
    ran: dict = {}
    st = dict(geo=geo, comm=comm, cfg=cfg, layout=layout, ran=ran,
              local_layout=_local_layout(layout, geo) if q_idx is not None else None)
    out, lse, loss = _CPLayerFn.apply(q, kv, sink, kv_cmp, q_idx, weights, k_idx, st)
    aux = st.pop("aux")
    return CPLayerResult(out, loss, lse, aux["ids"], aux["lengths"], aux["slots"], aux["kl"],
                         aux["target"], aux["predict"], aux["scores"], geo.key_ids, ran)
