"""One packed DSv4 attention layer (CSA, HCA or window-only) with autograd, composed of the ops.

Data flow of :func:`csa_layer` (contract sections 4 to 8), for a CSA layer (``ratio > 0`` and
indexer inputs given):

    indexer scores (section 7, on detached indexer inputs)
      -> stable Top-K (section 4)
      -> compressed-first key rows and lengths (section 5)
      -> sparse attention with the sink over ``concat(kv, kv_cmp)`` (section 6)
      -> sparse indexer KL loss with the global real-token normalisation (section 8)

An HCA layer (``ratio > 0``, no indexer inputs) attends to every visible compressed group; a
window-only layer (``ratio == 0``) to its window. Gradients (``torch.autograd``):

- ``out`` -> ``q``, ``kv``, ``kv_cmp``, ``sink`` through the closed-form attention backward;
- ``loss`` -> ``q_idx``, ``k_idx``, ``weights`` only, through the section 8 gradient (clipped
  form by default): the teacher is detached, so no gradient of the loss reaches ``q``, ``kv``
  or the sink, and the indexer gets none from ``out`` (DSv4 detaches the indexer inputs).

Every op runs in the backend chosen for it (``backend``: one name for all ops, or a mapping
from op name to backend, missing ops meaning ``"auto"``); the result records which backend
ran each op. The same inputs give the same ids, lengths, ``out`` and ``lse`` bits in
``torch.no_grad()``, ``torch.inference_mode()`` and training (contract section 11): the ops
never depend on the grad mode, and the row composition is the same in every mode.
There is no module state: this is a functional API usable inside any ``nn.Module``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from dsv4_oracle.protocol import OPS
from dsv4_oracle.reference.compressor import CompressorInputs
from dsv4_oracle.reference.layout import PackedLayout

from . import api
from .checks import as_bool, as_int, as_real, choice, float_tensor

__all__ = ["LayerResult", "csa_layer"]

class LayerResult(NamedTuple):
    """What :func:`csa_layer` returns (all tensors on the inputs' device)."""

    out: torch.Tensor                 # [T, H, Dv], q's dtype, differentiable
    loss: torch.Tensor                # 0-dim float32 indexer loss (0 without an indexer)
    lse: torch.Tensor                 # [T, H] float32, excludes the sink, +inf on sink-only rows
    ids: torch.Tensor                 # [T, width] int key ids in the logical buffer (section 2)
    lengths: torch.Tensor             # [T] valid entries per row
    compressed_ids: torch.Tensor | None      # [T, K] Top-K compressed ids (CSA), else None
    compressed_lengths: torch.Tensor | None  # [T] (CSA), else None
    index_scores: torch.Tensor | None        # [T, C] float32 (CSA), else None
    indexer_loss: "api.IndexerLossResult | None"  # loss, kl, target, predict, N (CSA)
    backends: dict                    # op name -> backend that ran it (forward ops)
    kv_cmp: torch.Tensor | None = None      # [C, D] the compressor's keys (raw inputs given)
    k_idx: torch.Tensor | None = None       # [C, D_I] the indexer compressor's (raw inputs)


def _backend_map(backend) -> dict:
    if isinstance(backend, str):
        choice(backend, "backend", api.BACKENDS)
        return {op: backend for op in OPS}
    if isinstance(backend, Mapping):
        unknown = set(backend) - set(OPS)
        if unknown:
            raise ValueError(f"backend: unknown op names {sorted(unknown)}; ops are {OPS}")
        out = {op: "auto" for op in OPS}
        for op, name in backend.items():
            out[op] = choice(name, f"backend[{op!r}]", api.BACKENDS)
        return out
    raise TypeError(f"backend must be a str or a mapping of op name to backend, "
                    f"got {type(backend).__name__}")


class _SparseAttention(torch.autograd.Function):
    """``out = attention(q, kv_all, sink)`` on fixed ids; ``lse`` is a non-differentiable output."""

    @staticmethod
    def forward(ctx, q, kv_all, sink, ids, lengths, cfg):
        fwd = api.sparse_attention_forward(q, kv_all, ids, sink, scale=cfg["scale"],
                                           v_dim=cfg["v_dim"], lengths=lengths,
                                           backend=cfg["backends"]["sparse_attention_forward"],
                                           deterministic=cfg["deterministic"])
        ctx.save_for_backward(q, kv_all, sink, ids, lengths, fwd.out, fwd.lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(fwd.lse)
        cfg["ran"]["sparse_attention_forward"] = fwd.backend
        return fwd.out, fwd.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv_all, sink, ids, lengths, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        if dout is None:
            return None, None, None, None, None, None
        bwd = api.sparse_attention_backward(q, kv_all, ids, sink, out, lse,
                                            dout.to(q.dtype).contiguous(),
                                            scale=cfg["scale"], v_dim=cfg["v_dim"],
                                            lengths=lengths,
                                            backend=cfg["backends"]["sparse_attention_backward"],
                                            deterministic=cfg["deterministic"])
        return (bwd.dq, bwd.dkv.to(kv_all.dtype), bwd.dsink.to(sink.dtype), None, None, None)


class _Compress(torch.autograd.Function):
    """``kv_cmp = compressor(kv, score, ape, norm_weight)`` (section 15; ``cfg["rotate"]``: the
    indexer's compressor), differentiable into its four inputs."""

    @staticmethod
    def forward(ctx, kv, score, ape, norm_weight, cfg):
        op = "indexer_compressor" if cfg["rotate"] else "compressor"
        res = getattr(api, f"{op}_forward")(
            kv, score, ape, norm_weight, cfg["layout"], cfg["ratio"], rope=cfg["rope"],
            backend=cfg["backends"][f"{op}_forward"], deterministic=cfg["deterministic"])
        cfg["ran"][f"{op}_forward"] = res.backend
        ctx.save_for_backward(kv, score, ape, norm_weight)
        ctx.cfg = cfg
        return res.kv_cmp

    @staticmethod
    def backward(ctx, dout):
        kv, score, ape, norm_weight = ctx.saved_tensors
        cfg = ctx.cfg
        op = "indexer_compressor" if cfg["rotate"] else "compressor"
        g = getattr(api, f"{op}_backward")(
            kv, score, ape, norm_weight, cfg["layout"], cfg["ratio"],
            dout.to(kv.dtype).contiguous(), rope=cfg["rope"],
            backend=cfg["backends"][f"{op}_backward"], deterministic=cfg["deterministic"])
        return (g.dkv, g.dscore, g.dape.to(ape.dtype), g.dnorm_weight.to(norm_weight.dtype),
                None)


def _compressed(inputs, name, layout, ratio, rope, rotate, backends, deterministic, ran):
    """The compressor's output (section 15) from ``inputs`` (a ``CompressorInputs``)."""
    if not isinstance(inputs, CompressorInputs):
        raise TypeError(f"{name} must be a reference.CompressorInputs, got "
                        f"{type(inputs).__name__}")
    if rope is None:
        raise ValueError(f"rope is required with {name} (contract section 13)")
    cfg = dict(layout=layout, ratio=ratio, rope=rope, rotate=rotate, backends=backends,
               deterministic=deterministic, ran=ran)
    return _Compress.apply(*inputs, cfg)


class _IndexerLoss(torch.autograd.Function):
    """``loss`` as a function of the indexer inputs only (the teacher is detached)."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, loss_value, target, predict, cmp_ids, cfg):
        ctx.save_for_backward(q_idx, k_idx, weights, cmp_ids, target, predict)
        ctx.cfg = cfg
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        q_idx, k_idx, weights, cmp_ids, target, predict = ctx.saved_tensors
        cfg = ctx.cfg
        g = api.sparse_indexer_loss_grad(q_idx, k_idx, weights, cmp_ids, target, predict,
                                         coeff=cfg["coeff"], num_real=cfg["num_real"],
                                         grad_loss=float(grad_loss), scale=cfg["index_scale"],
                                         mode=cfg["grad_mode"],
                                         backend=cfg["backends"]["sparse_indexer_loss_grad"],
                                         deterministic=cfg["deterministic"])
        return g.dq_idx, g.dk_idx, g.dw, None, None, None, None, None


def csa_layer(q, kv, sink, layout, *, window, ratio, kv_cmp=None, q_idx=None, k_idx=None,
              weights=None, topk=None, coeff=0.0, scale=None, index_scale=None, v_dim=None,
              order="id", align=None, num_real=None, grad_mode="clipped", backend="auto",
              deterministic=True, compressor=None, index_compressor=None,
              rope=None) -> LayerResult:
    """One packed DSv4 attention layer; see the module docstring for the data flow.

    ``q [T,H,D]``, ``kv [T,D]`` (raw keys/values), ``sink [H]`` (float32), ``layout``
    (:class:`reference.PackedLayout`), ``window``, ``ratio`` (0: window-only). Compressed
    layers take ``kv_cmp [C,D]``; a CSA layer also ``q_idx [T,H_I,D_I]``, ``k_idx [C,D_I]``,
    ``weights [T,H_I]``, ``topk`` and the loss ``coeff`` (``num_real``: the global ``N`` of
    section 8, default ``layout.num_real``; pass the CP-global count under CP). ``order`` and
    ``align`` are the Top-K policies of section 4; ``grad_mode`` the section 8 gradient form.

    From raw tokens (sections 13-15): ``compressor`` (a :class:`reference.CompressorInputs`:
    ``kv``, ``score [T, c*D]``, ``ape [r, c*D]``, ``norm_weight [D]``) and ``rope`` (a
    :class:`reference.RopeSpec` or a ``(cos, sin)`` table) instead of ``kv_cmp``, and for a
    CSA layer ``index_compressor`` instead of ``k_idx``; the result's ``kv_cmp`` and ``k_idx``
    are the compressors' outputs that the attention and the indexer read.
    """
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a reference.PackedLayout, got {type(layout).__name__}")
    q = float_tensor(q, "q", ndim=3)
    kv = float_tensor(kv, "kv", ndim=2)
    sink = float_tensor(sink, "sink", ndim=1)
    window = as_int(window, "window", minimum=0)
    ratio = as_int(ratio, "ratio", minimum=0)
    if window == 0 and ratio == 0:
        raise ValueError("window=0 needs compressed keys (ratio > 0): a window-only layer "
                         "(ratio 0) needs window >= 1")
    backends = _backend_map(backend)
    deterministic = as_bool(deterministic, "deterministic")
    ran: dict = {}
    for given, raw, name in ((kv_cmp, compressor, "kv_cmp"), (k_idx, index_compressor, "k_idx")):
        if given is not None and raw is not None:
            raise ValueError(f"give {name} or its compressor inputs, not both")
    if (compressor is not None or index_compressor is not None) and ratio == 0:
        raise ValueError("a window-only layer (ratio 0) has no compressor")
    if compressor is not None:
        kv_cmp = _compressed(compressor, "compressor", layout, ratio, rope, False, backends,
                             deterministic, ran)
    if index_compressor is not None:
        k_idx = _compressed(index_compressor, "index_compressor", layout, ratio, rope, True,
                            backends, deterministic, ran)
    grad_mode = choice(grad_mode, "grad_mode", ("clipped", "autograd"))
    indexer = [x is not None for x in (q_idx, k_idx, weights)]
    if any(indexer) and not all(indexer):
        raise ValueError("q_idx, k_idx and weights must be given together (a CSA layer) "
                         "or not at all")
    is_csa = all(indexer)
    if ratio == 0 and (kv_cmp is not None or is_csa):
        raise ValueError("a window-only layer (ratio 0) takes no kv_cmp and no indexer inputs")
    if ratio > 0 and kv_cmp is None:
        raise ValueError(f"kv_cmp is required for a compressed layer (ratio {ratio})")
    if kv_cmp is not None:
        kv_cmp = float_tensor(kv_cmp, "kv_cmp", ndim=2)
        if kv_cmp.shape[0] != layout.num_compressed(ratio):
            raise ValueError(f"kv_cmp has {kv_cmp.shape[0]} rows, the layout has "
                             f"{layout.num_compressed(ratio)} compressed groups at ratio {ratio}")
    if is_csa:
        topk = as_int(topk, "topk", minimum=0)
    elif topk is not None:
        raise ValueError("topk needs the indexer inputs (q_idx, k_idx, weights)")
    coeff = as_real(coeff, "coeff")
    if q.shape[0] != layout.num_rows:
        raise ValueError(f"q has {q.shape[0]} rows, layout.num_rows is {layout.num_rows}")
    if kv.shape[0] != layout.num_rows:
        # raw row t has key id t (section 2): any other count shifts every compressed id
        raise ValueError(f"kv has {kv.shape[0]} rows, layout.num_rows is {layout.num_rows} "
                         "(one raw key row per packed row, contract section 2)")
    n_real = layout.num_real if num_real is None else as_int(num_real, "num_real", minimum=1)
    dev = q.device

    scores = cmp_ids = cmp_len = res = None
    if is_csa:
        sc = api.indexer_scores(q_idx.detach(), k_idx.detach(), weights.detach(), layout, ratio,
                                scale=index_scale, backend=backends["indexer_scores"],
                                deterministic=deterministic)
        top = api.stable_topk(sc.scores, topk, order=order, align=align,
                              backend=backends["stable_topk"], deterministic=deterministic)
        scores, cmp_ids, cmp_len = sc.scores, top.ids, top.lengths
        ran["indexer_scores"], ran["stable_topk"] = sc.backend, top.backend
    rows = api.build_csa_indices(layout, window=window, ratio=ratio, compressed_ids=cmp_ids,
                                 device=dev, backend=backends["build_csa_indices"],
                                 deterministic=deterministic)
    ran["build_csa_indices"] = rows.backend
    kv_all = kv if ratio == 0 else torch.cat([kv, kv_cmp], dim=0)
    cfg = dict(scale=scale, v_dim=v_dim, backends=backends, deterministic=deterministic, ran=ran)
    out, lse = _SparseAttention.apply(q, kv_all, sink, rows.ids, rows.lengths, cfg)

    if is_csa and n_real >= 1:
        res = api.sparse_indexer_loss(q.detach(), kv_cmp.detach(), sink.detach(), lse, cmp_ids,
                                      scores, layout, coeff=coeff, scale=scale, num_real=n_real,
                                      backend=backends["sparse_indexer_loss"],
                                      deterministic=deterministic)
        ran["sparse_indexer_loss"] = res.backend
        lcfg = dict(coeff=coeff, num_real=n_real, index_scale=index_scale, grad_mode=grad_mode,
                    backends=backends, deterministic=deterministic)
        loss = _IndexerLoss.apply(q_idx, k_idx, weights, res.loss, res.target, res.predict,
                                  cmp_ids, lcfg)
    else:
        loss = torch.zeros((), dtype=torch.float32, device=dev)
    return LayerResult(out, loss, lse, rows.ids, rows.lengths, cmp_ids, cmp_len, scores, res,
                       dict(ran), kv_cmp if compressor is not None else None,
                       k_idx if index_compressor is not None else None)
