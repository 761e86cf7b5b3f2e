"""The compressor: raw tokens to compressed keys, forward and closed-form backward
(contract section 15, with RoPE of section 13 and the Hadamard rotation of section 14).

Gather-based and chunked over compressed groups: each group reads only its own slots (at most
``2r`` rows of the inputs), never a ``T x C`` mask. Every per-group quantity comes from
elementwise operations and reductions over a group's own slots or channels, so a group's bits do
not depend on the chunk it is evaluated in; the sums over groups (``dape``, ``dnorm_weight``) are
left folds in compressed-row order (``_reduce.fold_rows_into``), so they do not depend on
chunking either (section 10). The gradients wrt ``kv`` and ``score`` are scatters of disjoint
elements: each input element is read by at most one slot of one group.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import as_float64, as_index, as_int, as_real, check_dim
from ._checks import chunk_rows as rows_per_chunk
from ._reduce import fold_rows_into
from .constants import CHUNK_BYTES, COMPRESSOR_EPS
from .hadamard import hadamard, is_power_of_two
from .layout import PackedLayout
from .qnorm import row_scale
from .rope import RopeSpec, rope_rotate

__all__ = ["CompressorInputs", "CompressorGrads", "CompressorGroups", "compressor_groups",
           "compressor_forward", "compressor_backward", "indexer_compressor_forward",
           "indexer_compressor_backward", "compressor_halo", "compressor_owned_groups"]

F64 = torch.float64
INF = math.inf


class CompressorInputs(NamedTuple):
    """The inputs of one compressor (section 15), as the packed layer takes them:
    ``kv [T, c*d]`` and ``score [T, c*d]`` (the token projections ``x W_kv^T`` and
    ``x W_gate^T``), ``ape [r, c*d]`` and the RMSNorm weight ``norm_weight [d]``."""

    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor


class CompressorGrads(NamedTuple):
    """Section 15 backward: gradients wrt ``kv``, ``score``, ``ape`` and ``norm_weight``."""

    dkv: torch.Tensor
    dscore: torch.Tensor
    dape: torch.Tensor
    dnorm_weight: torch.Tensor


class CompressorGroups(NamedTuple):
    """The slot sets of section 15 for every compressed group (int64, CPU or compute device).

    ``doc [C]``, ``index [C]`` (``g`` inside its document), ``position [C]`` (``g * r``, the
    RoPE position), ``element [C, S]`` (per slot, the row of the ``[T * c, d]`` view of the
    inputs it reads: ``token * c + half``; ``-1`` for an invalid slot), ``ape_row [S]`` (the
    row of the ``[r * c, d]`` view of ``ape``: ``(k mod r) * c + half``)."""

    doc: torch.Tensor
    index: torch.Tensor
    position: torch.Tensor
    element: torch.Tensor
    ape_row: torch.Tensor
    coff: int


def _overlap(ratio: int, overlap) -> bool:
    if overlap is None:
        return ratio == 4
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool or None, got {type(overlap).__name__}")
    return overlap


def compressor_groups(layout: PackedLayout, ratio: int, overlap=None) -> CompressorGroups:
    """Section 15: the groups ``(b, g)``, ``g < P_b // r``, in compressed-row order, and the
    slots each one reads. With ``overlap`` (default: ``r == 4``) a group has ``2r`` slots: slot
    ``k < r`` is token ``(g-1) r + k`` of its document, channels ``[0, d)`` (invalid for
    ``g = 0``: the document-start reset), slot ``r + k`` is token ``g r + k``, channels
    ``[d, 2d)``; without, ``r`` slots: token ``g r + k``, channels ``[0, d)``."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    ratio = as_int(ratio, "ratio", minimum=1)
    ov = _overlap(ratio, overlap)
    c = 2 if ov else 1
    cu_comp = layout.compressed_offsets(ratio)
    C = int(cu_comp[-1])
    gid = torch.arange(C, dtype=torch.int64)
    doc = torch.searchsorted(cu_comp, gid, right=True) - 1
    g = gid - cu_comp[doc]
    start = layout.cu_seqlens_padded[doc] + g * ratio                  # first token row
    k = torch.arange(ratio, dtype=torch.int64)
    own = (start.unsqueeze(1) + k.unsqueeze(0)) * c + (c - 1)          # own tokens, last half
    if ov:
        prev = (start.unsqueeze(1) - ratio + k.unsqueeze(0)) * c       # previous group, half 0
        prev = torch.where((g > 0).unsqueeze(1), prev, torch.full_like(prev, -1))
        element = torch.cat([prev, own], dim=1)
        ape_row = torch.cat([k * c, k * c + 1])
    else:
        element, ape_row = own, k * c
    return CompressorGroups(doc, g, g * ratio, element, ape_row, c)


def compressor_halo(ratio: int, overlap=None) -> int:
    """Section 15 (CP): the rows before its first owned row a rank needs to compute every group
    it owns: ``2r - 1`` with the overlap, ``r - 1`` without (a group belongs to the rank holding
    its last token; its first token and, with the overlap, the previous group's lie at most this
    far back)."""
    ratio = as_int(ratio, "ratio", minimum=1)
    return 2 * ratio - 1 if _overlap(ratio, overlap) else ratio - 1


def compressor_owned_groups(layout: PackedLayout, ratio: int, rows) -> torch.Tensor:
    """Section 15 (CP): the compressed ids whose last token is one of ``rows`` (a rank's owned
    packed rows), ascending."""
    ratio = as_int(ratio, "ratio", minimum=1)
    rows = as_index(rows, "rows", ndim=1).to("cpu")
    last = compressor_groups(layout, ratio, overlap=False).element[:, -1]   # c = 1: the row
    owned = torch.zeros(layout.num_rows, dtype=torch.bool)
    owned[rows] = True
    return torch.nonzero(owned[last]).flatten()


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
class _Args(NamedTuple):
    kv: torch.Tensor          # [T * c, d]
    score: torch.Tensor       # [T * c, d]
    ape: torch.Tensor         # [r * c, d]
    weight: torch.Tensor      # [d]
    grp: CompressorGroups
    groups: torch.Tensor      # the compressed ids computed, ascending
    rope: object
    rotate: bool
    eps: float
    d: int
    T: int


def _inputs(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate, eps, groups):
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    ratio = as_int(ratio, "ratio", minimum=1)
    kv = as_float64(kv, "kv", ndim=2)
    score = as_float64(score, "score", ndim=2)
    ape = as_float64(ape, "ape", ndim=2, allow_nan=False)
    weight = as_float64(norm_weight, "norm_weight", ndim=1, allow_nan=False)
    if not isinstance(rotate, bool):
        raise TypeError(f"rotate must be a bool, got {type(rotate).__name__}")
    eps = as_real(eps, "eps", positive=True)
    ov = _overlap(ratio, overlap)
    c = 2 if ov else 1
    T = layout.num_rows
    check_dim(kv, "kv", 0, T, "layout.num_rows")
    if kv.shape[1] % c or kv.shape[1] == 0:
        raise ValueError(f"kv must have c*d columns with c = {c} (overlap={ov}) and d >= 1, "
                         f"got shape {tuple(kv.shape)}")
    d = kv.shape[1] // c
    if tuple(score.shape) != tuple(kv.shape):
        raise ValueError(f"score must have the shape of kv {tuple(kv.shape)}, got "
                         f"{tuple(score.shape)}")
    if tuple(ape.shape) != (ratio, c * d):
        raise ValueError(f"ape must have shape (ratio, c*d) = ({ratio}, {c * d}), got "
                         f"{tuple(ape.shape)}")
    if not bool(torch.isfinite(ape).all()):
        raise ValueError("ape must be finite")
    check_dim(weight, "norm_weight", 0, d, "the compressed key width d")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("norm_weight must be finite")
    if isinstance(rope, RopeSpec):
        if rope.dim > d:
            raise ValueError(f"rope.dim={rope.dim} exceeds the compressed key width d={d}")
    elif not isinstance(rope, torch.Tensor):
        raise TypeError(f"rope must be a reference.RopeSpec or a (cos, sin) table tensor, got "
                        f"{type(rope).__name__}")
    if rotate and not is_power_of_two(d):
        raise ValueError(f"the Hadamard rotation (rotate=True) needs a power-of-two width d, "
                         f"got {d}")
    grp = compressor_groups(layout, ratio, ov)
    C = grp.doc.numel()
    if groups is None:
        groups = torch.arange(C, dtype=torch.int64)
    else:
        groups = as_index(groups, "groups", ndim=1).to("cpu")
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= C):
            raise ValueError(f"groups must be compressed ids in [0, {C})")
        if groups.numel() > 1 and bool((groups[1:] <= groups[:-1]).any()):
            raise ValueError("groups must be strictly ascending")
    # every element a computed group reads must be finite (the rest may hold anything)
    el = grp.element[groups]
    read = el[el >= 0]
    kv2, sc2 = kv.reshape(T * c, d), score.reshape(T * c, d)
    for name, t in (("kv", kv2), ("score", sc2)):
        bad = ~torch.isfinite(t.index_select(0, read)).all(dim=1)
        if bool(bad.any()):
            e = int(read[torch.nonzero(bad)[0, 0]])
            raise ValueError(f"{name} has a non-finite value in row {e // c}, channels "
                             f"[{(e % c) * d}, {(e % c + 1) * d}), which the compressor reads")
    return _Args(kv2, sc2, ape.reshape(ratio * c, d), weight, grp, groups, rope, rotate, eps,
                 d, T)


def _step(chunk_rows, a: _Args) -> int:
    S = a.grp.element.shape[1]
    return rows_per_chunk(chunk_rows, 8 * S * a.d * 6, CHUNK_BYTES)


def _pool(a: _Args, gids: torch.Tensor):
    """Per group of ``gids``: gathered values ``v [G, S, d]``, softmax weights ``alpha``
    (0 on invalid slots), pooled ``ctil [G, d]`` and the slot validity ``[G, S]``."""
    el = a.grp.element.index_select(0, gids)                               # [G, S]
    valid = el >= 0
    safe = torch.where(valid, el, torch.zeros_like(el)).reshape(-1)
    G, S = el.shape
    v = a.kv.index_select(0, safe).view(G, S, a.d).masked_fill(~valid.unsqueeze(-1), 0.0)
    z = a.score.index_select(0, safe).view(G, S, a.d) + a.ape.index_select(0, a.grp.ape_row)
    z = z.masked_fill(~valid.unsqueeze(-1), -INF)
    m = z.amax(dim=1, keepdim=True)                                        # finite: slot r+k valid
    e = torch.exp(z - m)
    alpha = e / e.sum(dim=1, keepdim=True)
    ctil = (alpha * v).sum(dim=1)
    return v, alpha, ctil, valid


def _norm_parts(ctil, eps):
    """``y = ctil / sigma`` (sigma: the row's power-of-two scale) and ``s_hat =
    rsqrt(mean(y^2) + eps / sigma^2)``, so that ``ctil * rsqrt(mean(ctil^2) + eps) = y * s_hat``
    without overflow."""
    sigma = row_scale(ctil.detach())
    y = ctil / sigma
    s_hat = torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps / sigma.square())
    return y, s_hat, sigma


def _positions(a: _Args, gids):
    return a.grp.position.index_select(0, gids)


# ---------------------------------------------------------------------------------------------
# forward and backward
# ---------------------------------------------------------------------------------------------
def compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                       rotate=False, eps=COMPRESSOR_EPS, groups=None, chunk_rows=None):
    """Section 15 forward (RoPE of section 13; with ``rotate``, the Hadamard rotation of
    section 14): float64 ``kv_cmp [C, d]`` in compressed-row order (row ``cu_comp[b] + g``).

    ``kv``, ``score [T, c*d]``; ``ape [r, c*d]``; ``norm_weight [d]``; ``rope`` a
    :class:`RopeSpec` or a ``[P, dim/2, 2]`` table of ``(cos, sin)``; ``overlap`` (default
    ``ratio == 4``) selects ``c = 2`` and the ``2r``-slot windows. ``groups`` (ascending
    compressed ids) computes those rows only (``[len(groups), d]``): what a CP rank computes
    for the groups it owns. Elements no computed group reads (tail tokens, capacity rows, the
    first half of a document's last group with the overlap) may hold anything, NaN included.
    Differentiable wrt ``kv``, ``score``, ``ape``, ``norm_weight`` (used by the gradchecks);
    the closed-form backward is :func:`compressor_backward`.
    """
    a = _inputs(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate, eps, groups)
    outs = []
    step = _step(chunk_rows, a)
    for i in range(0, a.groups.numel(), step):
        gids = a.groups[i:i + step]
        _, _, ctil, _ = _pool(a, gids)
        y, s_hat, _ = _norm_parts(ctil, a.eps)
        n = a.weight * y * s_hat
        r = rope_rotate(n, _positions(a, gids), a.rope)
        outs.append(hadamard(r) if a.rotate else r)
    if not outs:
        return torch.zeros((0, a.d), dtype=F64)
    return torch.cat(outs)


def compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope, overlap=None,
                        rotate=False, eps=COMPRESSOR_EPS, groups=None, chunk_rows=None):
    """Section 15 backward in closed form, for the upstream gradient ``dout [C, d]`` of
    ``kv_cmp`` (``[len(groups), d]`` with ``groups``). Returns float64
    :class:`CompressorGrads` ``(dkv [T, c*d], dscore [T, c*d], dape [r, c*d],
    dnorm_weight [d])``: ``dkv`` and ``dscore`` are exact zeros on elements no computed group
    reads; ``dape`` and ``dnorm_weight`` are left folds over groups in compressed-row order."""
    a = _inputs(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate, eps, groups)
    dout = as_float64(dout, "dout", ndim=2)
    want = (a.groups.numel(), a.d)
    if tuple(dout.shape) != want:
        raise ValueError(f"dout must have shape {want}, got {tuple(dout.shape)}")
    if not bool(torch.isfinite(dout).all()):
        raise ValueError("dout must be finite")
    c, d, T = a.grp.coff, a.d, a.T
    S = a.grp.element.shape[1]
    dkv = torch.zeros((T * c, d), dtype=F64)
    dscore = torch.zeros((T * c, d), dtype=F64)
    dape_slots = torch.zeros((1, S * d), dtype=F64)
    dweight = torch.zeros((1, d), dtype=F64)
    step = _step(chunk_rows, a)
    for i in range(0, a.groups.numel(), step):
        gids = a.groups[i:i + step]
        G = gids.numel()
        v, alpha, ctil, valid = _pool(a, gids)
        y, s_hat, sigma = _norm_parts(ctil, a.eps)
        g = dout[i:i + step]
        if a.rotate:
            g = hadamard(g)                                   # H is symmetric and orthogonal
        dn = rope_rotate(g, _positions(a, gids), a.rope, inverse=True)
        wdn = a.weight * dn
        fold_rows_into(dweight, torch.zeros(G, dtype=torch.int64), dn * y * s_hat)
        mean = (wdn * y).mean(dim=-1, keepdim=True)
        dctil = (s_hat / sigma) * (wdn - y * s_hat.square() * mean)           # [G, d]
        dv = alpha * dctil.unsqueeze(1)                                       # [G, S, d]
        dz = alpha * (v - ctil.unsqueeze(1)) * dctil.unsqueeze(1)
        el = a.grp.element.index_select(0, gids)
        rows = el[valid]
        dkv.index_copy_(0, rows, dv[valid])
        dscore.index_copy_(0, rows, dz[valid])
        fold_rows_into(dape_slots, torch.zeros(G, dtype=torch.int64), dz.reshape(G, S * d))
    dape = torch.zeros((a.ape.shape[0], d), dtype=F64)
    dape.index_copy_(0, a.grp.ape_row, dape_slots.view(S, d))
    return CompressorGrads(dkv.view(T, c * d), dscore.view(T, c * d),
                           dape.view(a.ape.shape[0] // c, c * d), dweight.view(d))


def indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                               eps=COMPRESSOR_EPS, groups=None, chunk_rows=None):
    """Section 15, the indexer's compressor: :func:`compressor_forward` with the Hadamard
    rotation of section 14 (``rotate=True``): ``k_idx [C, D_I]``."""
    return compressor_forward(kv, score, ape, norm_weight, layout, ratio, rope=rope,
                              overlap=overlap, rotate=True, eps=eps, groups=groups,
                              chunk_rows=chunk_rows)


def indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope,
                                overlap=None, eps=COMPRESSOR_EPS, groups=None, chunk_rows=None):
    """Section 15 backward of the indexer's compressor (``rotate=True``) for the upstream
    ``dout = dk_idx [C, D_I]``: :func:`compressor_backward`."""
    return compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, rope=rope,
                               overlap=overlap, rotate=True, eps=eps, groups=groups,
                               chunk_rows=chunk_rows)

