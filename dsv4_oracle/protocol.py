"""The op protocol: the op names, in pipeline order, and the exact call of each op.

This is the one list of ops. The adapter loader (:mod:`dsv4_oracle.adapters`), the stage
table (:data:`dsv4_oracle.conformance.STAGES`, one row per op in this order), the runner and
the packed layer's per-op backend map (:mod:`gpu_impl.layer`, :data:`gpu_impl.api.OPS`)
import it from here.

For adapter authors: an adapter provides any subset of these callables, named and called
exactly like the float64 oracle's functions in :mod:`reference`. The checker calls each op as
its :class:`typing.Protocol` below shows: positional arguments first, then the keywords (your
function may take more keywords, with defaults). An op returns a tuple (or NamedTuple) whose
*first* fields are the outputs listed; more fields are ignored, and a ``backend`` attribute on
the result is recorded in the report. Tensors arrive on the adapter's ``device`` in the case's
dtype; results may be any dtype on any device. Ids are in the logical key space of contract
section 2 (raw rows ``0 .. T-1``, then compressed groups ``T .. T+C-1``); ``-1`` marks an
unused slot. ``layout`` is a :class:`reference.PackedLayout`.

=============================  ========  ======================================================
op                             section   returns (first fields)
=============================  ========  ======================================================
``compressor_forward``         13, 15    ``kv_cmp [C, d]`` (a tensor, or a 1-tuple)
``indexer_compressor_forward`` 13-15     ``k_idx [C, D_I]`` (a tensor, or a 1-tuple)
``indexer_scores``             7         ``scores [T, C]`` (a tensor, or a 1-tuple)
``stable_topk``                4         ``ids [T, K]``, ``lengths [T]``
``build_csa_indices``          5         ``ids [T, width]``, ``lengths [T]``
``sparse_attention_forward``   6         ``out [T, H, Dv]``, ``lse [T, H]``
``sparse_attention_backward``  6         ``dq [T, H, D]``, ``dkv [S, D]``, ``dsink [H]``
``compressor_backward``        13, 15    ``dkv [T, c*d]``, ``dscore [T, c*d]``,
                                         ``dape [r, c*d]``, ``dnorm_weight [d]``
``sparse_indexer_loss``        8         ``loss []``, ``kl [T]``, ``target [T, K]``,
                                         ``predict [T, K]``
``sparse_indexer_loss_grad``   8         ``dq_idx [T, H_I, D_I]``, ``dw [T, H_I]``,
                                         ``dk_idx [C, D_I]``
``indexer_compressor_``        13-15     as ``compressor_backward``, for ``k_idx``
``backward``
``csa_layer``                  4 to 15   an object with the fields of :class:`LayerOutput`
=============================  ========  ======================================================

``PROTOCOLS[op]`` is the protocol class of each op (``isinstance`` works on any callable; it
does not check the signature, the checker's call does).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from dsv4_oracle.reference.layout import PackedLayout

__all__ = [
    "OPS", "LAYER_OP", "ALL_OPS", "SECTIONS", "PROTOCOLS", "fed_by_oracle", "ops_line",
    "IndexerScoresOp", "StableTopkOp", "BuildCsaIndicesOp", "SparseAttentionForwardOp",
    "SparseAttentionBackwardOp", "SparseIndexerLossOp", "SparseIndexerLossGradOp",
    "CsaLayerOp", "LayerOutput", "IndexerLossOutput", "CompressorForwardOp",
    "CompressorBackwardOp", "IndexerCompressorForwardOp", "IndexerCompressorBackwardOp",
]

Tensor = torch.Tensor

# the op-level protocol, in pipeline order (each op reads only what earlier ops produce)
OPS = ("compressor_forward", "indexer_compressor_forward", "indexer_scores", "stable_topk",
       "build_csa_indices", "sparse_attention_forward", "sparse_attention_backward",
       "compressor_backward", "sparse_indexer_loss", "sparse_indexer_loss_grad",
       "indexer_compressor_backward")
# the packed layer: the same pipeline in one call, with autograd
LAYER_OP = "csa_layer"
ALL_OPS = OPS + (LAYER_OP,)


def fed_by_oracle(ops) -> tuple[str, ...]:
    """The pipeline ops that ``ops`` (the ops an implementation provides) lack but read from:
    the ops before the last of ``ops`` in :data:`OPS` order, whose results the checker feeds
    from the oracle (rounded as a kernel stores them); the packed layer feeds nothing."""
    mine = [OPS.index(o) for o in ops if o in OPS]
    return tuple(o for o in OPS[:max(mine)] if o not in ops) if mine else ()


def ops_line(ops) -> str:
    """``ops judged: ...; fed by the oracle: ...`` for ``ops`` (the ops checked)."""
    fed = fed_by_oracle(ops)
    return (f"ops judged: {', '.join(o for o in ALL_OPS if o in ops) or 'none'}"
            + (f"; fed by the oracle (where a case has them): {', '.join(fed)}" if fed else ""))


# op -> the contract section it implements
SECTIONS = {"compressor_forward": "15", "indexer_compressor_forward": "15",
            "compressor_backward": "15", "indexer_compressor_backward": "15",
            "indexer_scores": "7", "stable_topk": "4", "build_csa_indices": "5",
            "sparse_attention_forward": "6", "sparse_attention_backward": "6",
            "sparse_indexer_loss": "8", "sparse_indexer_loss_grad": "8", LAYER_OP: "4-15"}


@runtime_checkable
class CompressorForwardOp(Protocol):
    def __call__(self, kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor,
                 layout: PackedLayout, ratio: int, *, rope) -> Tensor | tuple:
        """Contract section 15 (RoPE: section 13): ``kv``, ``score [T, c*d]`` (the token
        projections; ``c = 2`` with the overlap, which is on for ``ratio == 4``), ``ape [r, c*d]``
        and ``norm_weight [d]`` (float32), ``rope`` a :class:`reference.RopeSpec` (or a
        ``[P, d_r/2, 2]`` table of ``(cos, sin)``). Returns ``kv_cmp [C, d]`` in compressed-row
        order: per document, groups of ``r`` tokens over its padded length, softmax-pooled per
        channel (slots ``2r`` with the overlap, reset at every document start), RMSNorm, RoPE at
        the group's first-token position ``g*r``."""


@runtime_checkable
class IndexerCompressorForwardOp(Protocol):
    def __call__(self, kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor,
                 layout: PackedLayout, ratio: int, *, rope) -> Tensor | tuple:
        """Contract section 15, the indexer's compressor: as :class:`CompressorForwardOp`,
        followed by the normalised Walsh-Hadamard rotation of section 14. Returns
        ``k_idx [C, D_I]``."""


@runtime_checkable
class CompressorBackwardOp(Protocol):
    def __call__(self, kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor,
                 layout: PackedLayout, ratio: int, dout: Tensor, *, rope) -> tuple:
        """Contract section 15 backward: the forward's arguments and ``dout [C, d]``, the
        gradient of ``kv_cmp``. Returns ``(dkv [T, c*d], dscore [T, c*d], dape [r, c*d],
        dnorm_weight [d])``; ``dkv`` and ``dscore`` are exact zeros on elements no group reads;
        in deterministic mode ``dape`` and ``dnorm_weight`` are summed in a fixed order."""


@runtime_checkable
class IndexerCompressorBackwardOp(Protocol):
    def __call__(self, kv: Tensor, score: Tensor, ape: Tensor, norm_weight: Tensor,
                 layout: PackedLayout, ratio: int, dout: Tensor, *, rope) -> tuple:
        """Contract section 15 backward of the indexer's compressor, for ``dout = dk_idx``:
        as :class:`CompressorBackwardOp`."""


@runtime_checkable
class IndexerScoresOp(Protocol):
    def __call__(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, layout: PackedLayout,
                 ratio: int) -> Tensor | tuple:
        """Contract section 7: ``q_idx [T, H_I, D_I]``, ``k_idx [C, D_I]`` (compressed indexer
        keys), ``weights [T, H_I]``, the compress ratio. Returns ``scores [T, C]``:
        ``D_I**-0.5 * sum_h w[t,h] * relu(<q_idx[t,h], k_idx[c]>)`` where group ``c`` is
        visible to row ``t`` (section 3), ``-inf`` elsewhere (padding and capacity rows: all
        ``-inf``)."""


@runtime_checkable
class StableTopkOp(Protocol):
    def __call__(self, scores: Tensor, k: int, *, order: str) -> tuple:
        """Contract section 4: per row the ``min(k, #finite scores)`` best columns (score
        descending as exact values, ties to the smaller id, ``-0.0 == +0.0``, ``-inf`` never
        selected), emitted ascending (``order="id"``) or in selection order (``"score"``).
        Returns ``(ids [T, k], lengths [T])``, unused slots ``-1``."""


@runtime_checkable
class BuildCsaIndicesOp(Protocol):
    def __call__(self, layout: PackedLayout, *, window: int, ratio: int,
                 compressed_ids: Optional[Tensor]) -> tuple:
        """Contract section 5: each real row's key ids, compressed part first (the given
        ``compressed_ids [T, K]`` for a CSA layer; every visible group for HCA, ``ratio > 0``
        and ``compressed_ids=None``; none for a window-only layer, ``ratio == 0``), then the
        window's raw ids, stably compacted. Returns ``(ids [T, width], lengths [T])``;
        padding and capacity rows are all ``-1`` with length 0."""


@runtime_checkable
class SparseAttentionForwardOp(Protocol):
    def __call__(self, q: Tensor, kv: Tensor, ids: Tensor, sink: Tensor, *,
                 v_dim: Optional[int], lengths: Optional[Tensor]) -> tuple:
        """Contract section 6: ``q [T, H, D]``, ``kv [S, D]`` (keys and values share rows;
        values are the first ``v_dim`` columns, all ``D`` when ``None``), ``ids [T, K]``,
        ``sink [H]``, optional ``lengths [T]`` (slots at or past a row's length are invalid,
        as is any id outside ``[0, S)``). Returns ``(out [T, H, Dv], lse [T, H])``; ``lse``
        excludes the sink; a row with no valid slot has ``out = 0``, ``lse = +inf``."""


@runtime_checkable
class SparseAttentionBackwardOp(Protocol):
    def __call__(self, q: Tensor, kv: Tensor, ids: Tensor, sink: Tensor, out: Tensor,
                 lse: Tensor, dout: Tensor, *, v_dim: Optional[int],
                 lengths: Optional[Tensor]) -> tuple:
        """Contract section 6, backward: the forward's arguments plus its ``out``, ``lse`` and
        the upstream ``dout [T, H, Dv]``. Returns ``(dq [T, H, D], dkv [S, D], dsink [H])``.
        ``Delta = <dout, out>`` may use the ``out`` given or the op's own recomputed forward
        (both conventions are accepted; an adapter may pin one with its
        ``backward_convention`` attribute)."""


@runtime_checkable
class SparseIndexerLossOp(Protocol):
    def __call__(self, q: Tensor, kv_cmp: Tensor, sink: Tensor, lse: Tensor,
                 compressed_ids: Tensor, index_scores: Tensor, layout: PackedLayout, *,
                 coeff: float) -> tuple:
        """Contract section 8: ``q [T, H, D]``, the compressed keys ``kv_cmp [C, D]``,
        ``sink [H]``, the attention's ``lse [T, H]`` (over all of a row's keys), the Top-K
        ``compressed_ids [T, K]`` (ids ``0 .. C-1``), the indexer scores ``[T, C]``. Returns
        ``(loss [], kl [T], target [T, K], predict [T, K])``: the teacher (detached) and the
        student on the selected slots (0 elsewhere), ``loss = coeff * sum_t KL[t] / N`` with
        ``N = layout.num_real`` and the loss floor of section 8."""


@runtime_checkable
class SparseIndexerLossGradOp(Protocol):
    def __call__(self, q_idx: Tensor, k_idx: Tensor, weights: Tensor, compressed_ids: Tensor,
                 target: Tensor, predict: Tensor, *, coeff: float, num_real: int) -> tuple:
        """Contract section 8, the clipped gradient (gradient floor ``exp(-100)``) of the loss
        with upstream 1 through the indexer: returns ``(dq_idx [T, H_I, D_I], dw [T, H_I],
        dk_idx [C, D_I])``. No gradient reaches ``q``, ``kv`` or the sink. ``num_real`` is
        ``N`` (an int); under a declared policy whose normaliser is per row (section 5.2:
        padding rows that attend under ``loss_norm="real"``, ``loss_norm="rank_mean"``) it is
        the per-row divisors, float64 ``[T]`` (``+inf``: the row does not count)."""


class IndexerLossOutput(Protocol):
    """The ``indexer_loss`` field of a CSA layer's result (contract section 8)."""

    kl: Tensor
    target: Tensor
    predict: Tensor


class LayerOutput(Protocol):
    """What ``csa_layer`` returns (attribute access; :class:`gpu_impl.layer.LayerResult` is
    one). ``out`` must be differentiable into ``q``, ``kv`` (``kv_raw``), ``kv_cmp`` and
    ``sink``; ``loss`` into ``q_idx``, ``k_idx`` and ``weights`` only (the checker runs the
    backward itself, through autograd). The CSA fields are read for ``layer="csa"``. A layer
    run from raw compressor inputs returns ``kv_cmp`` and ``k_idx``: the very tensors the
    attention and the indexer read (the checker retains their gradients)."""

    out: Tensor                          # [T, H, Dv]
    loss: Tensor                         # [] indexer loss (0 without an indexer)
    lse: Tensor                          # [T, H]
    ids: Tensor                          # [T, width]
    lengths: Tensor                      # [T]
    compressed_ids: Optional[Tensor]     # [T, K] (CSA)
    compressed_lengths: Optional[Tensor]  # [T] (CSA)
    index_scores: Optional[Tensor]       # [T, C] (CSA)
    indexer_loss: Optional[IndexerLossOutput]  # (CSA)
    kv_cmp: Optional[Tensor]             # [C, D] the compressor's output (raw inputs)
    k_idx: Optional[Tensor]              # [C, D_I] the indexer compressor's output (raw inputs)


@runtime_checkable
class CsaLayerOp(Protocol):
    def __call__(self, q: Tensor, kv: Tensor, sink: Tensor, layout: PackedLayout, *,
                 window: int, ratio: int, v_dim: Optional[int], coeff: float, order: str,
                 kv_cmp: Optional[Tensor] = None, q_idx: Optional[Tensor] = None,
                 k_idx: Optional[Tensor] = None, weights: Optional[Tensor] = None,
                 topk: Optional[int] = None, compressor=None, index_compressor=None,
                 rope=None, scale: Optional[float] = None) -> LayerOutput:
        """Contract sections 4 to 8 in one call: the packed layer (the signature of
        :func:`gpu_impl.layer.csa_layer`). ``kv`` holds the raw rows ``[T, D]``; ``kv_cmp``
        (``ratio > 0``) the compressed ones; ``q_idx``, ``k_idx``, ``weights`` and ``topk``
        are given for a CSA layer only; ``scale`` (the attention scale of sections 6 and 8)
        only for a case that carries its own. From raw tokens (sections 13-15): ``compressor``
        (a :class:`reference.CompressorInputs`) and ``rope`` instead of ``kv_cmp``, and for a
        CSA layer ``index_compressor`` instead of ``k_idx``; the checker passes them only to a
        ``csa_layer`` that names the keyword ``compressor``."""


PROTOCOLS = {
    "compressor_forward": CompressorForwardOp,
    "indexer_compressor_forward": IndexerCompressorForwardOp,
    "compressor_backward": CompressorBackwardOp,
    "indexer_compressor_backward": IndexerCompressorBackwardOp,
    "indexer_scores": IndexerScoresOp,
    "stable_topk": StableTopkOp,
    "build_csa_indices": BuildCsaIndicesOp,
    "sparse_attention_forward": SparseAttentionForwardOp,
    "sparse_attention_backward": SparseAttentionBackwardOp,
    "sparse_indexer_loss": SparseIndexerLossOp,
    "sparse_indexer_loss_grad": SparseIndexerLossGradOp,
    LAYER_OP: CsaLayerOp,
}
