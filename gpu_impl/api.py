"""The dispatching API: the contract's op-level functions with a ``backend`` choice.

Each function takes the oracle's arguments, plus ``backend="auto" | "torch" | "cudnn"`` and
``deterministic: bool = True``, and returns a NamedTuple whose fields are the op's outputs
followed by ``backend``: the name of the backend module that actually ran (``"torch"`` or
``"cudnn"``). There is no global state (no "last backend" variable): which backend ran is part
of every result, and :func:`resolve_backend` answers the same question beforehand.

Backend selection (:func:`resolve_backend`):

- ``"torch"``: :mod:`gpu_impl.torch_backend`, any device, every op, both modes.
- ``"cudnn"``: :mod:`gpu_impl.cudnn_backend`, imported lazily. It must be importable, the
  tensors must be on a CUDA device, and the module must support the op on that device in the
  requested mode; otherwise :class:`BackendUnavailable` (a ``RuntimeError``) says which piece is
  missing. The module declares support through
  ``why_unsupported(op, device, deterministic, args, kwargs)`` (``None`` when supported, else a
  one-line reason; ``args``/``kwargs`` are the op's own arguments, so that shape or dtype
  limits of a kernel can be checked); a module without that function is taken to support every
  op it defines on every CUDA device.
- ``"auto"``: ``"cudnn"`` where the above holds, else ``"torch"``.

Arguments are validated by the backend before it launches any computation; ``ValueError`` and
``TypeError`` name the offending argument.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from dsv4_oracle.protocol import OPS as PROTOCOL_OPS
from dsv4_oracle.reference.constants import COMPRESSOR_EPS, GRAD_FLOOR, LOSS_FLOOR, QNORM_EPS

from . import torch_backend
from .checks import as_bool, as_device, as_int, choice

__all__ = [
    "AttentionBackward", "AttentionForward", "BACKENDS", "BackendUnavailable", "CsaIndices",
    "CompressedKeys", "CompressorGradients", "compressor_backward", "compressor_forward",
    "indexer_compressor_backward", "indexer_compressor_forward",
    "IndexerGrads", "IndexerLossResult", "IndexerScores", "NormedQuery", "OPS", "TopK",
    "build_csa_indices", "indexer_scores", "q_rms_norm", "resolve_backend",
    "sparse_attention_backward", "sparse_attention_forward", "sparse_indexer_loss",
    "sparse_indexer_loss_grad", "stable_topk",
]

BACKENDS = ("auto", "torch", "cudnn")
# the protocol's ops (dsv4_oracle.protocol, pipeline order) plus the query norm (section 9)
OPS = PROTOCOL_OPS + ("q_rms_norm",)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this op here (the message names the missing piece)."""


class TopK(NamedTuple):
    ids: torch.Tensor
    lengths: torch.Tensor
    backend: str


class IndexerScores(NamedTuple):
    scores: torch.Tensor
    backend: str


class CsaIndices(NamedTuple):
    ids: torch.Tensor
    lengths: torch.Tensor
    backend: str


class AttentionForward(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    backend: str


class AttentionBackward(NamedTuple):
    dq: torch.Tensor
    dkv: torch.Tensor
    dsink: torch.Tensor
    backend: str


class IndexerLossResult(NamedTuple):
    loss: torch.Tensor
    kl: torch.Tensor
    target: torch.Tensor
    predict: torch.Tensor
    num_real: int
    backend: str


class IndexerGrads(NamedTuple):
    dq_idx: torch.Tensor
    dw: torch.Tensor
    dk_idx: torch.Tensor
    backend: str


class NormedQuery(NamedTuple):
    q: torch.Tensor
    backend: str


def _cudnn_module():
    """The cuDNN backend module, or a reason why it cannot be imported."""
    try:
        return importlib.import_module("dsv4_oracle.gpu_impl.cudnn_backend"), None
    except Exception as exc:          # a missing wheel, a missing CUDA library, ...
        return None, f"dsv4_oracle.gpu_impl.cudnn_backend cannot be imported ({type(exc).__name__}: {exc})"


def _cudnn_reason(op: str, device: torch.device, deterministic: bool, args=(), kwargs=None):
    """``None`` if the cuDNN backend can run ``op`` on ``device`` in this mode, else why not."""
    if device.type != "cuda":
        return f"the tensors are on {device}, and the cuDNN backend needs a CUDA device"
    if not torch.cuda.is_available():
        return "torch reports no usable CUDA device"
    module, reason = _cudnn_module()
    if module is None:
        return reason
    if not callable(getattr(module, op, None)):
        return f"dsv4_oracle.gpu_impl.cudnn_backend does not implement {op}"
    why = getattr(module, "why_unsupported", None)
    if not callable(why):
        return None
    try:
        return why(op, device, deterministic, tuple(args), dict(kwargs or {}))
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        # malformed arguments: the backend that runs validates them and names the bad one
        return f"its support check rejected the arguments ({type(exc).__name__}: {exc})"


def resolve_backend(op: str, device, backend: str = "auto", deterministic: bool = True,
                    args=(), kwargs=None) -> str:
    """The backend that runs ``op`` on ``device``: ``"torch"`` or ``"cudnn"``.

    ``args``/``kwargs``: the op's arguments, when known (kernels have shape limits).
    Raises :class:`BackendUnavailable` when ``backend="cudnn"`` is asked for and cannot run.
    A pure function of its arguments and of what is installed.
    """
    op = choice(op, "op", OPS)
    backend = choice(backend, "backend", BACKENDS)
    deterministic = as_bool(deterministic, "deterministic")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    reason = _cudnn_reason(op, device, deterministic, args, kwargs)
    if backend == "cudnn" and reason is not None:
        raise BackendUnavailable(f"backend='cudnn' cannot run {op}: {reason}")
    return "cudnn" if reason is None else "torch"


def _module(name: str):
    return torch_backend if name == "torch" else importlib.import_module("dsv4_oracle.gpu_impl.cudnn_backend")


def _device_of(*tensors) -> torch.device:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _run(op: str, device_tensor, backend: str, deterministic: bool, args, kwargs):
    if kwargs.get("chunk_rows") is not None:     # checked whichever backend runs (and reads it)
        as_int(kwargs["chunk_rows"], "chunk_rows", minimum=1)
    device = device_tensor if isinstance(device_tensor, torch.device) else _device_of(device_tensor)
    name = resolve_backend(op, device, backend, deterministic, args, kwargs)
    fn = getattr(_module(name), op)
    return fn(*args, deterministic=deterministic, **kwargs), name


# --------------------------------------------------------------------------------------------
# the ops (arguments as in the oracle; see gpu_impl.torch_backend for precision and dtypes)
# --------------------------------------------------------------------------------------------
def stable_topk(scores, k, *, order="id", align=None, backend="auto", deterministic=True):
    """Section 4. Returns :class:`TopK` ``(ids, lengths, backend)``."""
    (ids, lengths), name = _run("stable_topk", scores, backend, deterministic, (scores, k),
                                dict(order=order, align=align))
    return TopK(ids, lengths, name)


def indexer_scores(q_idx, k_idx, weights, layout, ratio, *, scale=None, chunk_rows=None,
                   backend="auto", deterministic=True):
    """Section 7. Returns :class:`IndexerScores` ``(scores, backend)``."""
    scores, name = _run("indexer_scores", q_idx, backend, deterministic,
                        (q_idx, k_idx, weights, layout, ratio),
                        dict(scale=scale, chunk_rows=chunk_rows))
    return IndexerScores(scores, name)


def build_csa_indices(layout, *, window, ratio, compressed_ids=None, device=None,
                      backend="auto", deterministic=True):
    """Section 5. ``device`` places the rows when no ``compressed_ids`` is given. Returns
    :class:`CsaIndices` ``(ids, lengths, backend)``."""
    device = as_device(device, "device")
    where = compressed_ids if isinstance(compressed_ids, torch.Tensor) else (
        torch.device("cpu") if device is None else device)
    (ids, lengths), name = _run("build_csa_indices", where, backend, deterministic, (layout,),
                                dict(window=window, ratio=ratio, compressed_ids=compressed_ids,
                                     device=device))
    return CsaIndices(ids, lengths, name)


def sparse_attention_forward(q, kv, ids, sink, *, scale=None, v_dim=None, lengths=None,
                             chunk_rows=None, backend="auto", deterministic=True):
    """Section 6 forward. Returns :class:`AttentionForward` ``(out, lse, backend)``."""
    (out, lse), name = _run("sparse_attention_forward", q, backend, deterministic,
                            (q, kv, ids, sink),
                            dict(scale=scale, v_dim=v_dim, lengths=lengths,
                                 chunk_rows=chunk_rows))
    return AttentionForward(out, lse, name)


def sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, scale=None, v_dim=None,
                              lengths=None, chunk_rows=None, backend="auto", deterministic=True):
    """Section 6 backward. Returns :class:`AttentionBackward` ``(dq, dkv, dsink, backend)``."""
    (dq, dkv, dsink), name = _run("sparse_attention_backward", q, backend, deterministic,
                                  (q, kv, ids, sink, out, lse, dout),
                                  dict(scale=scale, v_dim=v_dim, lengths=lengths,
                                       chunk_rows=chunk_rows))
    return AttentionBackward(dq, dkv, dsink, name)


def sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *, coeff,
                        scale=None, num_real=None, loss_floor=LOSS_FLOOR, chunk_rows=None,
                        backend="auto", deterministic=True):
    """Section 8 loss. Returns :class:`IndexerLossResult`
    ``(loss, kl, target, predict, num_real, backend)``."""
    res, name = _run("sparse_indexer_loss", q, backend, deterministic,
                     (q, kv_cmp, sink, lse, compressed_ids, index_scores, layout),
                     dict(coeff=coeff, scale=scale, num_real=num_real, loss_floor=loss_floor,
                          chunk_rows=chunk_rows))
    return IndexerLossResult(*tuple(res), name)


def sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target, predict, *, coeff,
                             num_real, grad_loss=1.0, scale=None, grad_floor=GRAD_FLOOR,
                             mode="clipped", loss_floor=LOSS_FLOOR, chunk_rows=None,
                             backend="auto", deterministic=True):
    """Section 8 gradients. Returns :class:`IndexerGrads` ``(dq_idx, dw, dk_idx, backend)``."""
    (dq, dw, dk), name = _run("sparse_indexer_loss_grad", q_idx, backend, deterministic,
                              (q_idx, k_idx, weights, compressed_ids, target, predict),
                              dict(coeff=coeff, num_real=num_real, grad_loss=grad_loss,
                                   scale=scale, grad_floor=grad_floor, mode=mode,
                                   loss_floor=loss_floor, chunk_rows=chunk_rows))
    return IndexerGrads(dq, dw, dk, name)


def q_rms_norm(q, eps=QNORM_EPS, *, backend="auto", deterministic=True):
    """Section 9. Returns :class:`NormedQuery` ``(q, backend)``."""
    out, name = _run("q_rms_norm", q, backend, deterministic, (q, eps), {})
    return NormedQuery(out, name)


class CompressedKeys(NamedTuple):
    kv_cmp: torch.Tensor
    backend: str


class CompressorGradients(NamedTuple):
    dkv: torch.Tensor
    dscore: torch.Tensor
    dape: torch.Tensor
    dnorm_weight: torch.Tensor
    backend: str


def compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                       rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None, backend="auto",
                       deterministic=True):
    """Section 15 forward (``rotate``: the indexer's compressor). Returns
    :class:`CompressedKeys` ``(kv_cmp, backend)``."""
    out, name = _run("compressor_forward", kv, backend, deterministic,
                     (kv, score, ape, norm_weight, layout, ratio),
                     dict(rope=rope, overlap=overlap, rotate=rotate, eps=eps,
                          chunk_rows=chunk_rows))
    return CompressedKeys(out, name)


def compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope, overlap=None,
                        rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None, backend="auto",
                        deterministic=True):
    """Section 15 backward. Returns :class:`CompressorGradients`
    ``(dkv, dscore, dape, dnorm_weight, backend)``."""
    res, name = _run("compressor_backward", kv, backend, deterministic,
                     (kv, score, ape, norm_weight, layout, ratio, dout),
                     dict(rope=rope, overlap=overlap, rotate=rotate, eps=eps,
                          chunk_rows=chunk_rows))
    return CompressorGradients(*tuple(res), name)


def indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                               eps=COMPRESSOR_EPS, chunk_rows=None, backend="auto",
                               deterministic=True):
    """Section 15, the indexer's compressor (with the Hadamard rotation of section 14)."""
    out, name = _run("indexer_compressor_forward", kv, backend, deterministic,
                     (kv, score, ape, norm_weight, layout, ratio),
                     dict(rope=rope, overlap=overlap, eps=eps, chunk_rows=chunk_rows))
    return CompressedKeys(out, name)


def indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope,
                                overlap=None, eps=COMPRESSOR_EPS, chunk_rows=None,
                                backend="auto", deterministic=True):
    """Section 15 backward of the indexer's compressor."""
    res, name = _run("indexer_compressor_backward", kv, backend, deterministic,
                     (kv, score, ape, norm_weight, layout, ratio, dout),
                     dict(rope=rope, overlap=overlap, eps=eps, chunk_rows=chunk_rows))
    return CompressorGradients(*tuple(res), name)
