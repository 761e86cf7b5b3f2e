"""The H200 lane backend: cuDNN frontend 1.32 kernels, with Triton kernels where cuDNN has none.

Same op-level functions as the oracle (:mod:`reference`) and :mod:`gpu_impl.torch_backend`, with
the oracle's argument names plus ``deterministic: bool = True``. Inputs stay on their CUDA
device; ids and lengths produced here are **int32**; ids and lengths given may be int32 or int64
and are never modified (every sanitisation runs on a copy). Precision as in the torch backend:
bf16 operands, float32 accumulation and statistics, outputs in the operand dtype.

What runs where (``describe(op, ...)`` answers it for concrete arguments, without running):

================================  ==========================================================
op                                kernels (SM90 = H100/H200, SM100 = B200/GB200)
================================  ==========================================================
stable_topk                       cuDNN ``indexer_top_k_wrapper`` (``deterministic=True,
                                  tie_break=1``; ``-0.0`` canonicalised to ``+0.0`` first,
                                  selected ``-inf`` dropped); default mode: the
                                  non-deterministic kernel, ids then sorted
indexer_scores                    cuDNN ``indexer_forward_wrapper`` (THD, real rows only),
                                  scattered into the global ``[T, C]`` column space
sparse_attention_forward          SM90: Triton (:mod:`gpu_impl.kernels_triton`; cuDNN has no
                                  SM90 forward); SM100: cuDNN ``sparse_attention_forward_
                                  wrapper``
sparse_attention_backward         default mode, SM90: cuDNN ``sparse_attention_backward_
                                  wrapper`` (float atomics: dkv, dsink not repeatable);
                                  deterministic, SM90: Triton, row pass + fixed-order
                                  planes (:mod:`gpu_impl.kernels_triton_split`);
                                  SM100: cuDNN ``deterministic=True``
sparse_indexer_loss               teacher from cuDNN ``sparse_attn_score_recompute_wrapper``
                                  (with ``lse :=`` the per-head normalisers
                                  ``logaddexp(lse, sink)`` up to a per-row constant,
                                  renormalised to undo the kernel's ``+1e-10``); student and
                                  KL in torch (float32)
sparse_indexer_loss_grad          default mode: cuDNN ``indexer_backward_wrapper`` (float
                                  atomics: ``dw``, ``dk_idx`` not repeatable on SM90);
                                  deterministic, SM90: Triton fixed-order kernels
                                  (:mod:`gpu_impl.kernels_triton_indexer_grad`); SM100: cuDNN
                                  ``deterministic=True``
build_csa_indices, q_rms_norm     no cuDNN kernel: :func:`why_unsupported` says so, and the
                                  dispatcher runs the torch backend
================================  ==========================================================

Shapes a cuDNN kernel does not take (other head counts or dims, fp32 inputs, ...) go to the
Triton kernels or the torch backend; ``describe`` names which. Nothing is imported from cuDNN
or Triton before an op needs it; on a machine without them, the ops raise
:class:`CudnnBackendUnavailable` naming the missing piece.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math

import torch

from dsv4_oracle.reference.constants import COMPRESSOR_EPS, GRAD_FLOOR, LOSS_FLOOR, QNORM_EPS
from dsv4_oracle.reference.indexer_loss import IndexerLoss

from . import torch_backend
from .api import OPS
from .checks import (allocated, choice, reject_loss_values, reject_nan, reject_negative,
                     validate_attention_backward, validate_compressor,
                     validate_attention_forward, validate_indexer_scores,
                     validate_sparse_indexer_loss, validate_sparse_indexer_loss_grad,
                     validate_stable_topk)

__all__ = [
    "BACKEND_NAME", "CudnnBackendUnavailable", "build_csa_indices", "describe",
    "compressor_backward", "compressor_forward", "compressor_route", "compressor_slot_ape",
    "indexer_compressor_backward", "indexer_compressor_forward",
    "indexer_scores", "q_rms_norm", "sparse_attention_backward", "sparse_attention_forward",
    "sparse_indexer_loss", "sparse_indexer_loss_grad", "stable_topk", "why_unsupported",
]

BACKEND_NAME = "cudnn"
INDEX_DTYPE = torch.int32
F32 = torch.float32
INF = math.inf
CUDNN_GRAD_FLOOR = GRAD_FLOOR          # the indexer backward's CLIP_LOG_MIN = -100
HALF = (torch.bfloat16, torch.float16)
NO_KERNEL_OPS = ("build_csa_indices", "q_rms_norm")
COMPRESSOR_OPS = ("compressor_forward", "compressor_backward", "indexer_compressor_forward",
                  "indexer_compressor_backward")


class CudnnBackendUnavailable(RuntimeError):
    """cuDNN, Triton or a suitable GPU is missing (the message names the piece)."""


# --------------------------------------------------------------------------------------------
# plumbing: lazy imports, device facts, the no-grad wrapper
# --------------------------------------------------------------------------------------------
def _dsa():
    try:
        return importlib.import_module("cudnn.deepseek_sparse_attention")
    except Exception as exc:        # missing wheel, missing CuTe DSL, missing CUDA libraries
        raise CudnnBackendUnavailable(
            "the cuDNN frontend DSA kernels cannot be imported (pip install "
            f"nvidia-cudnn-frontend==1.32.0 with nvidia-cutlass-dsl): {type(exc).__name__}: {exc}"
        ) from exc


def _triton_kernels():
    try:
        return importlib.import_module("dsv4_oracle.gpu_impl.kernels_triton")
    except Exception as exc:
        raise CudnnBackendUnavailable(
            f"the Triton kernels cannot be imported (triton missing?): {type(exc).__name__}: {exc}"
        ) from exc


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def why_unsupported(op: str, device, deterministic: bool = True, args=(), kwargs=None):
    """``None`` if this backend runs ``op`` on ``device`` for these arguments, else the reason
    (used by :func:`gpu_impl.api.resolve_backend`, which then runs the torch backend). Cheap:
    finds packages and reads tensor metadata, imports nothing heavy, launches nothing."""
    device = torch.device(device)
    if op in NO_KERNEL_OPS:
        return f"cuDNN has no kernel for {op}; the torch backend runs it"
    if device.type != "cuda":
        return f"the tensors are on {device}; the cuDNN backend needs a CUDA device"
    if not torch.cuda.is_available():
        return "torch reports no usable CUDA device"
    major, minor = _capability(device)
    if major not in (9, 10):
        return (f"the cuDNN DSA kernels need SM90 or SM100; {device} is SM{major}{minor}")
    if importlib.util.find_spec("cudnn") is None:
        return "the cuDNN frontend (nvidia-cudnn-frontend 1.32) is not installed"
    if op.startswith("sparse_attention") and major == 9 and importlib.util.find_spec("triton") is None:
        return ("triton is not installed (the SM90 attention forward and deterministic backward "
                "are Triton kernels)")
    if args or kwargs:
        route, what = _route(op, tuple(args), dict(kwargs or {}), deterministic)
        if route == "torch":
            return what
    return None


def _route(op: str, args: tuple, kwargs: dict, deterministic: bool):
    """``(route, description)`` for the op's arguments (metadata only)."""
    def arg(i, name, default=None):
        return args[i] if len(args) > i else kwargs.get(name, default)
    if op == "stable_topk":
        return _topk_route(arg(0, "scores"), arg(1, "k"), deterministic)
    if op == "indexer_scores":
        return _indexer_route(arg(0, "q_idx"), arg(1, "k_idx"), arg(2, "weights"))
    if op == "sparse_attention_forward":
        q = arg(0, "q")
        return _forward_route(q, kwargs.get("v_dim") or q.shape[2], kwargs.get("kernel", "auto"))
    if op == "sparse_attention_backward":
        q = arg(0, "q")
        return _backward_route(q, kwargs.get("v_dim") or q.shape[2], deterministic)
    if op == "sparse_indexer_loss":
        return _loss_route(arg(0, "q"))
    if op == "sparse_indexer_loss_grad":
        return _grad_route(arg(0, "q_idx"), arg(2, "weights"), kwargs.get("mode", "clipped"),
                           kwargs.get("grad_floor", GRAD_FLOOR), deterministic)
    if op in COMPRESSOR_OPS:
        return compressor_route(arg(0, "kv"), arg(5, "ratio"), kwargs.get("overlap"),
                                deterministic, op.endswith("backward"))
    return "torch", f"no cuDNN kernel for {op}"


def _no_grad(fn):
    """Run ``fn`` without autograd and autocast (local, restored on exit), so the caller's grad
    mode cannot change a bit of the result (contract section 11)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast("cuda", enabled=False))
            return fn(*args, **kwargs)
    return wrapper


def _require_cuda(name: str, t: torch.Tensor) -> torch.device:
    if t.device.type != "cuda":
        raise CudnnBackendUnavailable(
            f"{name} is on {t.device}; the cuDNN backend runs on CUDA tensors only "
            "(use backend='torch' for other devices)")
    return t.device


def _compact(ids: torch.Tensor, valid: torch.Tensor):
    """Valid entries to the front in order, -1 after; int32 ids and lengths (copies)."""
    T, K = ids.shape
    lengths = valid.sum(dim=1)
    pos = torch.cumsum(valid.to(torch.int64), dim=1) - 1
    pos = torch.where(valid, pos, torch.full_like(pos, K))
    out = torch.full((T, K + 1), -1, dtype=torch.int32, device=ids.device)
    out.scatter_(1, pos, torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32))
    return out[:, :K].contiguous(), lengths.to(torch.int32)


def _pad_cols(x: torch.Tensor, multiple: int, value) -> torch.Tensor:
    K = x.shape[1]
    kp = max(multiple, -(-K // multiple) * multiple)
    if kp == K:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, kp - K), value=value).contiguous()


# --------------------------------------------------------------------------------------------
# section 4: stable Top-K
# --------------------------------------------------------------------------------------------
def _topk_route(s: torch.Tensor, k: int, deterministic: bool):
    if s.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch", f"{s.dtype} scores (the cuDNN Top-K takes fp32/fp16/bf16)"
    if k > 2048:
        return "torch", f"k={k} > 2048 (the cuDNN Top-K limit)"
    if k == 0 or s.shape[0] == 0 or s.shape[1] == 0:
        return "trivial", "empty problem"
    return "cudnn", (f"cudnn.indexer_top_k_wrapper(deterministic={deterministic}, tie_break=1)"
                     + ("" if deterministic else " + torch.sort of the ids"))


@_no_grad
def stable_topk(scores, k, *, order: str = "id", align: int | None = None,
                deterministic: bool = True):
    """Contract section 4 with the cuDNN Top-K. Returns int32 ``(ids [T, width], lengths [T])``.

    ``-0.0`` is turned into ``+0.0`` on a copy first (the kernel's radix order ranks ``+0``
    above ``-0``; the contract ties them). The kernel sees every column as a candidate, ``-inf``
    included; since ``-inf`` ranks last, a selected ``-inf`` means every finite column of the
    row was selected, so dropping the selected ``-inf`` entries gives exactly the contract's
    set. Deterministic mode: ``deterministic=True, tie_break=1`` (ties to the smaller column,
    ids ascending). Default mode: the non-deterministic kernel, whose output order is then
    sorted (the set at an exact tie is not guaranteed to be the smallest ids there).
    """
    s, k, order, align, width, deterministic = validate_stable_topk(scores, k, order, align,
                                                                    deterministic)
    _require_cuda("scores", s)
    route, _ = _topk_route(s, k, deterministic)
    if route == "torch":
        return torch_backend.stable_topk(s, k, order=order, align=align,
                                         deterministic=deterministic)
    rows, cols = s.shape
    dev = s.device
    ids = allocated(lambda: torch.full((rows, width), -1, dtype=INDEX_DTYPE, device=dev), "k",
                    f"the ids [T, width] = [{rows}, {width}] (k={k})")
    if route == "trivial":
        lengths = torch.zeros(rows, dtype=INDEX_DTYPE, device=dev)
        return ids, lengths
    take = min(k, cols)
    canon = (s + 0.0).contiguous()                    # a copy; -0.0 + 0.0 == +0.0
    seq_lens = torch.full((rows,), cols, dtype=torch.int32, device=dev)
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.indexer_top_k_wrapper(canon, seq_lens, take, next_n=1, return_val=False,
                                        tie_break=1, deterministic=deterministic)
    sel = res["indices"].to(torch.int64)              # [rows, take] local ids, -1 padded
    picked = canon.gather(1, sel.clamp_min(0))
    keep = (sel >= 0) & (picked > -INF)
    big = cols
    sel = torch.where(keep, sel, torch.full_like(sel, big))
    # Ascending ids, dropped slots last (the deterministic kernel already emits ascending ids;
    # the default kernel's order is unspecified).
    sel, _ = torch.sort(sel, dim=1)
    lengths = keep.sum(dim=1)
    used = torch.arange(take, device=dev).unsqueeze(0) < lengths.unsqueeze(1)
    if order == "score":
        val = canon.gather(1, sel.clamp(max=cols - 1)).to(F32)
        val = torch.where(used, -val, torch.full_like(val, INF))
        perm = torch.sort(val, dim=1, stable=True)[1]
        sel = sel.gather(1, perm)
    sel = torch.where(used, sel, torch.full_like(sel, -1))
    ids[:, :take] = sel.to(INDEX_DTYPE)
    return ids, lengths.to(INDEX_DTYPE)


# --------------------------------------------------------------------------------------------
# section 7: lightning indexer scores
# --------------------------------------------------------------------------------------------
def _indexer_route(q, k, w):
    HI, DI = q.shape[1], q.shape[2]
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return "torch", f"{q.dtype} q_idx/k_idx (the cuDNN indexer forward takes bf16)"
    if w.dtype != torch.bfloat16:
        return "torch", f"{w.dtype} weights (routed to cuDNN only as bf16)"
    if DI != 128:
        return "torch", f"D_I={DI} (the cuDNN indexer forward needs 128)"
    if HI not in (16, 32, 64):
        return "torch", f"H_I={HI} (the SM90 indexer forward needs 16, 32 or 64)"
    return "cudnn", "cudnn.indexer_forward_wrapper(THD, real rows) + scatter to [T, C]"


@_no_grad
def indexer_scores(q_idx, k_idx, weights, layout, ratio, *, scale=None, chunk_rows=None,
                   deterministic: bool = True):
    """Contract section 7 through cuDNN's THD indexer forward: float32 ``[T, C]``.

    Only the real rows of documents that have at least one compressed group are sent (as a THD
    batch: ``cu_seqlens_q`` = real lengths, ``cu_seqlens_k`` = group counts), so the kernel's
    ratio-causal mask ``c < min((p+1)//r, n_b)`` is the contract's visibility; padding and
    capacity rows stay ``-inf``. The kernel's local columns are scattered to global compressed
    ids ``cu_comp[b] + c`` (each target written once). ``w`` is used as given (bf16) with
    ``sm_scale = scale``: no ``w*scale`` rounding.
    """
    q, k, w, ratio, C, scale, dev = validate_indexer_scores(q_idx, k_idx, weights, layout,
                                                            ratio, scale, deterministic)
    T = q.shape[0]
    _require_cuda("q_idx", q)
    route, _ = _indexer_route(q, k, w)
    if route == "torch":
        return torch_backend.indexer_scores(q, k, w, layout, ratio, scale=scale,
                                            chunk_rows=chunk_rows)
    out = torch.full((T, C), -INF, dtype=F32, device=dev)
    real = layout.doc_lengths
    counts = layout.compressed_counts(ratio)
    docs = torch.nonzero((real > 0) & (counts > 0)).flatten()
    if docs.numel() == 0 or T == 0:
        return out
    cu_pad = layout.cu_seqlens_padded
    cu_comp = layout.compressed_offsets(ratio)
    lq, lk = real[docs], counts[docs]
    row_sel = torch.cat([torch.arange(int(cu_pad[b]), int(cu_pad[b] + real[b])) for b in docs])
    key_sel = torch.cat([torch.arange(int(cu_comp[b]), int(cu_comp[b + 1])) for b in docs])
    contiguous_rows = row_sel.numel() == T
    contiguous_keys = key_sel.numel() == C
    row_sel_d = row_sel.to(dev)
    q_sel = q.contiguous() if contiguous_rows else q.index_select(0, row_sel_d).contiguous()
    w_sel = w.contiguous() if contiguous_rows else w.index_select(0, row_sel_d).contiguous()
    k_sel = k if contiguous_keys else k.index_select(0, key_sel.to(dev))
    k_sel = k_sel.contiguous().unsqueeze(1)                          # (T_k, 1, D_I)
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q = torch.cat([zero, torch.cumsum(lq, 0)]).to(device=dev, dtype=torch.int32)
    cu_k = torch.cat([zero, torch.cumsum(lk, 0)]).to(device=dev, dtype=torch.int32)
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.indexer_forward_wrapper(
            q_sel, k_sel, w_sel, ratio=ratio, sm_scale=float(scale),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(lq.max()),
            max_seqlen_k=int(lk.max()))
    local = res["scores"]                                            # (T_sel, max_k) fp32
    maxk = local.shape[1]
    doc_of = torch.repeat_interleave(torch.arange(docs.numel()), lq)
    base = cu_comp[docs][doc_of].to(dev)                             # first global id per row
    nb = lk[doc_of].to(dev)
    col = torch.arange(maxk, device=dev).unsqueeze(0)
    inside = col < nb.unsqueeze(1)
    rows2 = row_sel_d.unsqueeze(1).expand(-1, maxk)
    cols2 = base.unsqueeze(1) + col
    out[rows2[inside], cols2[inside]] = local[:, :maxk][inside]
    return out


# --------------------------------------------------------------------------------------------
# sections 2, 3, 5 and 9: no cuDNN kernel (index arithmetic / elementwise): the torch backend
# --------------------------------------------------------------------------------------------
def build_csa_indices(layout, *, window, ratio, compressed_ids=None, device=None,
                      deterministic: bool = True):
    """Section 5: index arithmetic with no cuDNN kernel; runs :mod:`gpu_impl.torch_backend`
    (:func:`why_unsupported` reports this so the dispatcher names ``torch``)."""
    return torch_backend.build_csa_indices(layout, window=window, ratio=ratio,
                                           compressed_ids=compressed_ids, device=device,
                                           deterministic=deterministic)


def q_rms_norm(q, eps: float = QNORM_EPS, *, deterministic: bool = True):
    """Section 9: elementwise, no cuDNN kernel; runs :mod:`gpu_impl.torch_backend`."""
    return torch_backend.q_rms_norm(q, eps, deterministic=deterministic)


# --------------------------------------------------------------------------------------------
# section 6: sparse attention with a sink
# --------------------------------------------------------------------------------------------
FORWARD_KERNELS = ("auto", "triton", "cudnn_dsa")


def _forward_route(q, dv, kernel: str):
    T, H, D = q.shape
    major = _capability(q.device)[0] if q.device.type == "cuda" else 0
    if q.dtype not in HALF:
        return "torch", f"{q.dtype} inputs (the GPU kernels take bf16/fp16)"
    dsa_ok = (H, D) in ((64, 512), (64, 576), (128, 512)) and dv == 512
    if kernel == "cudnn_dsa" or (kernel == "auto" and major == 10 and dsa_ok):
        if major != 10 or not dsa_ok:
            raise ValueError("kernel='cudnn_dsa' needs SM100 and (H, D, Dv) in "
                             "{(64,512,512), (64,576,512), (128,512,512)}")
        return "cudnn_dsa", "cudnn.sparse_attention_forward_wrapper (SM100)"
    return "triton", "dsv4_oracle.gpu_impl.kernels_triton.attention_forward"


@_no_grad
def sparse_attention_forward(q, kv, ids, sink, *, scale=None, v_dim=None, lengths=None,
                             chunk_rows=None, deterministic: bool = True, kernel: str = "auto"):
    """Contract section 6 forward: ``out [T,H,Dv]`` (q's dtype) and float32 ``lse [T,H]``
    (excludes the sink; ``+inf`` with ``out = 0`` on rows with no valid slot). Bitwise
    repeatable in both modes (one program per output element, fixed reduction order).

    ``kernel`` (extension): ``"auto"`` (SM100: cuDNN DSA forward; otherwise Triton),
    ``"triton"`` or ``"cudnn_dsa"`` (SM100 only).
    """
    q, kv, ids, sink, scale, dv, lengths, _ = validate_attention_forward(
        q, kv, ids, sink, scale, v_dim, lengths, deterministic)
    kernel = choice(kernel, "kernel", FORWARD_KERNELS)
    dev = _require_cuda("q", q)
    reject_nan(sink=sink)
    route, _ = _forward_route(q, dv, kernel)
    if route == "torch":
        return torch_backend.sparse_attention_forward(q, kv, ids, sink, scale=scale, v_dim=dv,
                                                      lengths=lengths, chunk_rows=chunk_rows)
    sink32 = sink.to(F32).contiguous()
    S, K = kv.shape[0], ids.shape[1]
    if route == "triton":
        kt = _triton_kernels()
        with torch.cuda.device(dev):
            return kt.attention_forward(q, kv, ids, sink32, scale, dv, lengths)
    valid = (ids >= 0) & (ids < S)
    if lengths is not None:
        valid &= torch.arange(K, device=dev).unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
    compact_ids, compact_len = _compact(ids, valid)
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.sparse_attention_forward_wrapper(
            q.contiguous(), kv.contiguous(), _pad_cols(compact_ids, 64, -1), attn_sink=sink32,
            topk_length=compact_len, softmax_scale=float(scale))
    return res["out"], res["lse"]


# The SM90 deterministic attention backward: one Triton kernel design, "split"
# (gpu_impl.kernels_triton_split: a row pass for dq, P and dS, then column-sliced fixed-order
# planes for dkv; bitwise repeatable). ``kernel=`` accepts "auto" (the same) and "split".
BACKWARD_KERNELS = ("auto", "split")


def _backward_route(q, dv, deterministic: bool):
    T, H, D = q.shape
    major = _capability(q.device)[0] if q.device.type == "cuda" else 0
    if q.dtype not in HALF:
        return "torch", f"{q.dtype} inputs (the GPU kernels take bf16/fp16)"
    cudnn_shape = D in (512, 576) and dv == (512 if D == 576 else D) and H > 1
    if major == 10 and cudnn_shape and (not deterministic or H in (16, 32, 64, 96, 128)):
        return "cudnn", (f"cudnn.sparse_attention_backward_wrapper(deterministic={deterministic})"
                         " (SM100)")
    if not deterministic and major == 9 and cudnn_shape:
        return "cudnn", ("cudnn.sparse_attention_backward_wrapper (SM90; dkv/dsink float atomics: "
                         "not repeatable)")
    return "triton", ("dsv4_oracle.gpu_impl.kernels_triton_split.attention_backward (row pass + "
                      "column-sliced fixed-order planes)")


@_no_grad
def sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, scale=None, v_dim=None,
                              lengths=None, chunk_rows=None, deterministic: bool = True,
                              kernel: str = "auto"):
    """Contract section 6 backward: ``dq`` (q's dtype), ``dkv`` (kv's dtype) and float32
    ``dsink [H]``.

    ``kernel`` (extension): ``"auto"`` or ``"split"``, the one SM90 deterministic kernel
    (:data:`BACKWARD_KERNELS`; any other name is a ``ValueError``).

    Deterministic mode on SM90 runs the Triton split backward (row pass, then column-sliced
    planes): every ``dkv`` element is a fixed-order sum (private planes folded in a fixed
    order), ``dsink`` a fixed-shape reduction.
    Default mode on SM90 runs cuDNN's SM90 kernel (``dkv`` and ``dsink`` through float atomics:
    NOT bitwise repeatable) on sanitised copies of ids/lengths (invalid slots removed,
    compacted; the kernel assumes every slot inside ``topk_length`` is valid).
    """
    q, kv, ids, sink, scale, dv, lengths, deterministic, out, lse, dout = \
        validate_attention_backward(q, kv, ids, sink, out, lse, dout, scale, v_dim, lengths,
                                    deterministic)
    kernel = choice(kernel, "kernel", BACKWARD_KERNELS)
    dev = _require_cuda("q", q)
    reject_nan(sink=sink, lse=lse)
    S, K = kv.shape[0], ids.shape[1]
    route, _ = _backward_route(q, dv, deterministic)
    if route == "torch":
        return torch_backend.sparse_attention_backward(
            q, kv, ids, sink, out, lse, dout, scale=scale, v_dim=dv, lengths=lengths,
            chunk_rows=chunk_rows, deterministic=deterministic)
    sink32 = sink.to(F32).contiguous()
    lse32 = lse.to(F32).contiguous()
    out_c = out.to(q.dtype).contiguous()
    dout_c = dout.to(q.dtype).contiguous()
    if route == "triton":
        _triton_kernels()                          # a clear error when triton is missing
        ks = importlib.import_module("dsv4_oracle.gpu_impl.kernels_triton_split")
        with torch.cuda.device(dev):
            return ks.attention_backward(q, kv, ids, sink32, out_c, lse32, dout_c, scale, dv,
                                         lengths)
    valid = (ids >= 0) & (ids < S)
    if lengths is not None:
        valid &= torch.arange(K, device=dev).unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
    compact_ids, compact_len = _compact(ids, valid)
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.sparse_attention_backward_wrapper(
            q.contiguous(), kv.contiguous(), out_c, dout_c, lse32, sink32,
            _pad_cols(compact_ids, 64, -1), softmax_scale=float(scale),
            topk_length=compact_len,
            deterministic=deterministic and _capability(dev)[0] == 10)
    return res["dq"], res["dkv"], res["d_sink"]


# --------------------------------------------------------------------------------------------
# section 8: sparse indexer loss and its gradients
# --------------------------------------------------------------------------------------------
def _loss_route(q):
    T, H, D = q.shape
    if q.dtype not in HALF:
        return "torch", f"{q.dtype} q (the cuDNN score recompute takes bf16/fp16)"
    if D not in (512, 576) or H < 2 or H % 64 != 0:
        return "torch", f"(H, D) = ({H}, {D}) (routed to cuDNN only for D 512/576, H % 64 == 0)"
    return "cudnn", ("cudnn.sparse_attn_score_recompute_wrapper (teacher, lse := the "
                     "per-head normalisers logaddexp(lse, sink) + per-row constant, "
                     "renormalised) + torch student/KL")


@_no_grad
def sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *, coeff,
                        scale=None, num_real=None, loss_floor=LOSS_FLOOR, chunk_rows=None,
                        deterministic: bool = True):
    """Contract section 8 loss; float32 ``IndexerLoss`` on the inputs' device.

    Teacher: cuDNN's sparse attention score recompute computes
    ``sum_h exp(scale <q,k_c> - L_h) / (sum_c sum_h ... + 1e-10)``; with ``L`` the per-head
    normalisers of :func:`gpu_impl.torch_backend.teacher_normalisers` (``logaddexp(lse, sink)``
    up to a per-row constant, exact differences even at ``sink = 2.4e38``, ``L >= lse`` so
    ``exp`` neither overflows nor needlessly underflows) that is the contract's ``tau`` up to
    the ``+1e-10``, which the row renormalisation ``tau / sum(tau)`` removes exactly. Silenced
    heads (``L = +inf``) get a zero query and the finite ``L = 1e4`` (``exp(0 - 1e4) = 0``
    exactly); rows whose every head is silenced have teacher mass zero: ``tau = 0``,
    ``KL = 0``. Student ``softmax`` over the selected columns
    of ``index_scores`` (every selected row) and the KL in float32.
    """
    q, kc, sink, lse, ids, scores, coeff, scale, floor, n_real, dev = \
        validate_sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout,
                                     coeff, scale, num_real, loss_floor, deterministic)
    _require_cuda("q", q)
    reject_nan(sink=sink, lse=lse, index_scores=scores)
    reject_loss_values(lse, scores, ids, layout)
    T, H, D = q.shape
    C, Kc = kc.shape[0], ids.shape[1]
    route, _ = _loss_route(q)
    if route == "torch" or Kc == 0 or T == 0 or C == 0:
        return torch_backend.sparse_indexer_loss(
            q, kc, sink, lse, ids, scores, layout, coeff=coeff, scale=scale, num_real=n_real,
            loss_floor=floor, chunk_rows=chunk_rows)
    real = layout.is_real.to(dev)
    norm, has_mass = torch_backend.teacher_normalisers(lse.to(F32), sink.to(F32))           # L [T, H]
    row_ok = real & has_mass
    selected = (ids >= 0) & (ids < C) & real.unsqueeze(1)
    valid = selected & row_ok.unsqueeze(1)
    safe_ids = torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32)
    # silenced heads: zero query and a finite L = 1e4, so exp(0 - 1e4) = 0 exactly
    silenced = ~torch.isfinite(norm)
    full_in = torch.where(silenced, torch.full_like(norm, 1e4), norm)
    full_in = torch.where(row_ok.unsqueeze(1), full_in, torch.zeros_like(full_in)).contiguous()
    q_in = q.masked_fill(silenced.unsqueeze(-1), 0.0) if bool(silenced.any()) else q
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.sparse_attn_score_recompute_wrapper(
            q_in.contiguous().unsqueeze(0), kc.contiguous().unsqueeze(0), full_in.unsqueeze(0),
            _pad_cols(safe_ids, 128, -1).unsqueeze(0), float(scale), qhead_per_kv_head=H,
            topk_length=None, topk_indices_global=False)
    tau = res["target"][0, :, :Kc].to(F32)
    tau = torch.where(valid, tau, torch.zeros_like(tau))
    tot = tau.sum(dim=1, keepdim=True)
    tau = torch.where(tot > 0, tau / torch.where(tot > 0, tot, torch.ones_like(tot)), tau)
    safe = torch.where(selected, ids, torch.zeros_like(ids)).to(torch.int64)
    logits = torch.gather(scores.to(F32), 1, safe).masked_fill(~selected, -INF)
    m = logits.amax(dim=1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(logits - m)
    z = e.sum(dim=1, keepdim=True)
    p = e / torch.where(z > 0, z, torch.ones_like(z))
    a = torch.clamp_min(tau, floor)
    terms = a * (torch.log(a) - torch.log(torch.clamp_min(p, floor)))
    kl = torch.where(valid, terms, torch.zeros_like(terms)).sum(dim=1)
    loss = coeff * kl.sum() / n_real
    return IndexerLoss(loss, kl, tau, p, n_real)


def _grad_route(q, w, mode: str, grad_floor: float, deterministic: bool):
    T, HI, DI = q.shape
    major = _capability(q.device)[0] if q.device.type == "cuda" else 0
    if mode != "clipped":
        return "torch", "mode='autograd' (the kernels implement the clipped gradient only)"
    if q.dtype not in HALF or w.dtype not in HALF:
        return "torch", f"{q.dtype} q_idx / {w.dtype} weights (the kernels take bf16/fp16)"
    cudnn_ok = (grad_floor == CUDNN_GRAD_FLOOR and q.dtype == torch.bfloat16
                and w.dtype == torch.bfloat16 and HI >= 64 and DI == 128)
    if cudnn_ok and not deterministic:
        return "cudnn", "cudnn.indexer_backward_wrapper (d_weights/d_index_k not repeatable on SM90)"
    if cudnn_ok and major == 10 and HI in (32, 64):
        return "cudnn", "cudnn.indexer_backward_wrapper(deterministic=True) (SM100)"
    if importlib.util.find_spec("triton") is None:
        return "torch", "triton is not installed (the fixed-order indexer gradient is Triton)"
    return "triton", ("Triton fixed-order indexer gradient (gpu_impl.kernels_triton_indexer_grad: "
                      "row pass + key-major fold)")


@_no_grad
def sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target, predict, *, coeff,
                             num_real, grad_loss=1.0, scale=None, grad_floor=GRAD_FLOOR,
                             mode="clipped", loss_floor=LOSS_FLOOR, chunk_rows=None,
                             deterministic: bool = True):
    """Contract section 8 gradients ``(dq_idx, dw, dk_idx)`` in the inputs' dtypes (bf16).

    Deterministic mode (SM90, or shapes cuDNN does not take): the Triton kernels of
    :mod:`gpu_impl.kernels_triton_indexer_grad` (every output a fixed-order sum, bitwise
    repeatable; any gradient floor, bf16 or fp16). cuDNN: its kernel divides by ``B*S_q`` (= T
    here); ``loss_coeff = coeff*T/num_real`` restores the contract's global ``N``. Its
    ``attn_score`` argument is overwritten in place, so it gets a copy. Ids are sanitised
    (invalid -> -1) and padded to a multiple of 128 on copies.
    """
    q, k, w, ids, tau, p_in, coeff, n_real, grad_loss, scale, e, floor, mode, deterministic, \
        dev = validate_sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target,
                                                predict, coeff, num_real, grad_loss, scale,
                                                grad_floor, mode, loss_floor, deterministic)
    _require_cuda("q_idx", q)
    reject_nan(target=tau, predict=p_in)
    reject_negative(target=tau, predict=p_in)
    T = q.shape[0]
    C, Kc = k.shape[0], ids.shape[1]
    route, _ = _grad_route(q, w, mode, e, deterministic)
    kwargs = dict(coeff=coeff, num_real=n_real, grad_loss=grad_loss, scale=scale, grad_floor=e,
                  mode=mode, loss_floor=floor, chunk_rows=chunk_rows)
    if route == "torch" or T == 0 or Kc == 0:
        return torch_backend.sparse_indexer_loss_grad(q, k, w, ids, tau, p_in,
                                                      deterministic=deterministic, **kwargs)
    valid = (ids >= 0) & (ids < C)
    valid = valid & torch_backend.rows_with_teacher_mass(tau, valid)     # rows without teacher mass: zero gradients
    if route == "triton":
        _triton_kernels()                          # a clear error when triton is missing
        kg = importlib.import_module("dsv4_oracle.gpu_impl.kernels_triton_indexer_grad")
        ids_t = torch.where(valid, ids, torch.full_like(ids, -1))
        with torch.cuda.device(dev):
            return kg.indexer_loss_grad(q, k, w, ids_t, tau, p_in, coeff / n_real * grad_loss,
                                        scale, e)
    safe_ids = _pad_cols(torch.where(valid, ids, torch.full_like(ids, -1)).to(torch.int32),
                         128, -1)
    kp = safe_ids.shape[1]
    tgt = torch.zeros((T, kp), dtype=F32, device=dev)                 # overwritten by cuDNN
    tgt[:, :Kc] = torch.where(valid, tau.to(F32), torch.zeros((), dtype=F32, device=dev))
    prd = torch.zeros((T, kp), dtype=F32, device=dev)
    prd[:, :Kc] = torch.where(valid, p_in.to(F32), torch.zeros((), dtype=F32, device=dev))
    g_loss = torch.full((1,), grad_loss, dtype=F32, device=dev)
    dsa = _dsa()
    with torch.cuda.device(dev):
        res = dsa.indexer_backward_wrapper(
            q.contiguous().unsqueeze(0), w.contiguous().unsqueeze(0),
            k.contiguous().unsqueeze(0), tgt.unsqueeze(0), prd.unsqueeze(0),
            safe_ids.unsqueeze(0), g_loss, sm_scale=float(scale),
            loss_coeff=float(coeff) * T / n_real, topk_indices_global=False,
            deterministic=deterministic)
    return (res["d_index_q"][0].to(q.dtype), res["d_weights"][0].to(w.dtype),
            res["d_index_k"][0].to(k.dtype))


# --------------------------------------------------------------------------------------------
# describe: which kernels an op would run for these arguments (no computation)
# --------------------------------------------------------------------------------------------
def describe(op: str, *args, deterministic: bool = True, **kwargs) -> str:
    """The kernel chain ``op`` runs for these arguments (same signature as the op), e.g.
    ``"cudnn: cudnn.indexer_top_k_wrapper(deterministic=True, tie_break=1)"`` or
    ``"torch: k=4096 > 2048 (the cuDNN Top-K limit)"``. Reads metadata only."""
    op = choice(op, "op", OPS)
    if op in NO_KERNEL_OPS:
        return "torch: no cuDNN kernel for this op"
    first = args[0] if args else next(iter(kwargs.values()))
    reason = why_unsupported(op, first.device, deterministic)
    if reason is not None:
        return f"unavailable: {reason}"
    route, what = _route(op, args, kwargs, deterministic)
    return f"{route}: {what}"


# --------------------------------------------------------------------------------------------
# sections 13-15: the compressor (pooling by cuDNN on SM100, by Triton on SM90; the RMSNorm,
# RoPE and Hadamard stages in torch)
# --------------------------------------------------------------------------------------------
def _cudnn_compressor():
    """cuDNN's fused compressor module (``cudnn.csa.compressor``), or ``None``."""
    try:
        return importlib.import_module("cudnn.csa.compressor")
    except Exception:               # missing frontend, CuTe DSL or CUDA libraries
        return None


def cudnn_compressor_deterministic(module) -> bool:
    """Whether the cuDNN compressor backward takes ``deterministic=`` (a fixed-order ``d_ape``
    instead of float atomics); without it the backward is refused in deterministic mode."""
    import inspect
    fn = getattr(module, "csa_compressor_backward_wrapper", None)
    try:
        return fn is not None and "deterministic" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def compressor_route(kv, ratio, overlap, deterministic: bool, backward: bool,
                     capability=None, cudnn_module=...):
    """``(route, description)`` of a compressor op (metadata only): ``"cudnn"`` (SM100, cuDNN's
    fused pooling for ratios 2, 4 and 128, bf16; in deterministic mode a backward only if it
    takes ``deterministic=``), ``"triton"`` (the pooling kernels of
    :mod:`gpu_impl.kernels_triton_compressor`: bf16/fp16, a power-of-two slot count), else
    ``"torch"``. ``capability``/``cudnn_module`` override what is probed (for tests)."""
    c = 2 if (ratio == 4 if overlap is None else overlap) else 1
    d = kv.shape[1] // c if kv.shape[1] % c == 0 else 0
    S = c * ratio
    if kv.dtype not in HALF:
        return "torch", f"{kv.dtype} compressor inputs (the pooling kernels take bf16/fp16)"
    major = (capability or _capability(kv.device))[0]
    mod = _cudnn_compressor() if cudnn_module is ... else cudnn_module
    why = None
    if major < 10:
        why = f"cuDNN's compressor needs SM100 (this is SM{major}x)"
    elif mod is None:
        why = "cuDNN's compressor (cudnn.csa.compressor) is not installed"
    elif kv.dtype != torch.bfloat16 or ratio not in (2, 4, 128) or (ratio == 128 and d not in (128, 512)):
        why = f"cuDNN's compressor takes bf16, ratio 2/4/128 (d 128/512 at 128); got {kv.dtype}, r={ratio}, d={d}"
    elif backward and deterministic and not cudnn_compressor_deterministic(mod):
        why = "this cuDNN compressor backward sums d_ape with atomics (no deterministic=)"
    if why is None:
        return "cudnn", ("cudnn.csa.compressor pooling (deterministic d_ape)" if backward else
                         "cudnn.csa.compressor pooling") + " + torch RMSNorm/RoPE/Hadamard"
    if S & (S - 1) == 0 and importlib.util.find_spec("triton") is not None:
        return "triton", f"Triton pooling (S = {S} slots) + torch RMSNorm/RoPE/Hadamard ({why})"
    return "torch", f"no pooling kernel: {why}; S = {S} slots"


def compressor_slot_ape(ratio: int, coff: int, device) -> torch.Tensor:
    """The ``[r * c, d]`` row of ``ape`` each of the ``c * r`` slots adds (section 15): slot
    ``k < r`` row ``k * c``, slot ``r + k`` (the overlap's own tokens) row ``k * c + 1``."""
    s = torch.arange(coff * ratio)
    return ((s % ratio) * coff + (s // ratio if coff == 2 else 0)).to(device)


def _compressor_setup(a, layout, op):
    _require_cuda("kv", a.kv)
    slots = torch_backend._compressor_slots(layout, a.ratio, a.coff, a.kv.device)
    T = a.kv.shape[0]
    kv2 = a.kv.reshape(T * a.coff, a.d).contiguous()
    sc2 = a.score.reshape(T * a.coff, a.d).contiguous()
    read = slots.element[slots.element >= 0]
    for name, t in (("kv", kv2), ("score", sc2)):
        if read.numel() and not bool(torch.isfinite(t.index_select(0, read)).all()):
            raise ValueError(f"{name} has a non-finite value in an element the compressor reads")
    return slots, kv2, sc2


def _pooled(a, layout, route, slots, kv2, sc2):
    """float32 pooled rows ``[C, d]`` by cuDNN or Triton."""
    C = slots.position.numel()
    if route == "cudnn":
        fe = _cudnn_compressor()
        cu = layout.cu_seqlens_padded.to(device=a.kv.device, dtype=torch.int32)
        cuc = layout.compressed_offsets(a.ratio).to(device=a.kv.device, dtype=torch.int32)
        with torch.cuda.device(a.kv.device):
            out = fe.csa_compressor_forward_wrapper(
                a.kv.contiguous(), a.score.contiguous(), a.ape.to(F32).contiguous(), cu, cuc,
                ratio=a.ratio, head_dim=a.d, coff=a.coff, total_comp=C)["out"]
        return out.to(F32)
    from . import kernels_triton_compressor as K
    return K.pool_forward(kv2, sc2, a.ape.to(F32).reshape(-1, a.d).contiguous(), slots.element,
                          compressor_slot_ape(a.ratio, a.coff, a.kv.device))


@_no_grad
def compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                       rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None,
                       deterministic: bool = True):
    """Section 15 forward: the pooling by cuDNN (SM100) or Triton (SM90), then
    :func:`torch_backend.compressor_stages` (each stage stored once in ``kv``'s dtype)."""
    a = validate_compressor(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate,
                            eps, deterministic)
    route, _ = compressor_route(a.kv, a.ratio, overlap, a.deterministic, False)
    if route == "torch":
        return torch_backend.compressor_forward(kv, score, ape, norm_weight, layout, ratio,
                                                rope=rope, overlap=overlap, rotate=rotate,
                                                eps=eps, chunk_rows=chunk_rows,
                                                deterministic=deterministic)
    slots, kv2, sc2 = _compressor_setup(a, layout, "compressor_forward")
    ctil = _pooled(a, layout, route, slots, kv2, sc2)
    cos, sin = torch_backend._rope_cos_sin(a.rope, slots.position)
    y = torch_backend.compressor_stages(ctil, a.norm_weight.to(F32), a.eps, cos, sin, a.rotate,
                                        a.kv)
    return y.to(a.kv.dtype)


@_no_grad
def compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope, overlap=None,
                        rotate=False, eps=COMPRESSOR_EPS, chunk_rows=None,
                        deterministic: bool = True):
    """Section 15 backward: the stages' backward in torch, then the pooling's by cuDNN (SM100,
    ``deterministic=`` passed through) or the Triton kernel (fixed-order ``d_ape``, no
    atomics). ``dkv``/``dscore`` in ``kv``'s dtype, float32 ``dape``/``dnorm_weight``."""
    a = validate_compressor(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate,
                            eps, deterministic, dout)
    route, _ = compressor_route(a.kv, a.ratio, overlap, a.deterministic, True)
    if route == "torch":
        return torch_backend.compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout,
                                                 rope=rope, overlap=overlap, rotate=rotate,
                                                 eps=eps, chunk_rows=chunk_rows,
                                                 deterministic=deterministic)
    slots, kv2, sc2 = _compressor_setup(a, layout, "compressor_backward")
    ctil = _pooled(a, layout, route, slots, kv2, sc2)
    cos, sin = torch_backend._rope_cos_sin(a.rope, slots.position)
    dctil, dw = torch_backend.compressor_stages_backward(
        dout.to(F32), torch_backend._store(ctil, a.kv), a.norm_weight.to(F32), a.eps, cos, sin,
        a.rotate, a.kv)
    T, c, d = a.kv.shape[0], a.coff, a.d
    if route == "cudnn":
        fe = _cudnn_compressor()
        cu = layout.cu_seqlens_padded.to(device=a.kv.device, dtype=torch.int32)
        cuc = layout.compressed_offsets(a.ratio).to(device=a.kv.device, dtype=torch.int32)
        kw = dict(ratio=a.ratio, head_dim=d, coff=c)
        if cudnn_compressor_deterministic(fe):
            kw["deterministic"] = a.deterministic
        with torch.cuda.device(a.kv.device):
            dkv, dscore, dape = tuple(fe.csa_compressor_backward_wrapper(
                a.kv.contiguous(), a.score.contiguous(), a.ape.to(F32).contiguous(), cu, cuc,
                dctil.to(a.kv.dtype).contiguous(), **kw))[:3]
        return dkv.view(T, c * d), dscore.view(T, c * d), dape.to(F32).view(a.ratio, c * d), dw
    from . import kernels_triton_compressor as K
    slot_ape = compressor_slot_ape(a.ratio, c, a.kv.device)
    dkv2, dsc2, dape_slots = K.pool_backward(kv2, sc2, a.ape.to(F32).reshape(-1, d).contiguous(),
                                             slots.element, slot_ape, dctil.to(a.kv.dtype))
    dape = torch.zeros((a.ratio * c, d), dtype=F32, device=a.kv.device)
    dape.index_copy_(0, slot_ape, dape_slots)
    return dkv2.view(T, c * d), dsc2.view(T, c * d), dape.view(a.ratio, c * d), dw


def indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio, *, rope, overlap=None,
                               eps=COMPRESSOR_EPS, chunk_rows=None, deterministic: bool = True):
    """Section 15, the indexer's compressor (``rotate=True``)."""
    return compressor_forward(kv, score, ape, norm_weight, layout, ratio, rope=rope,
                              overlap=overlap, rotate=True, eps=eps, chunk_rows=chunk_rows,
                              deterministic=deterministic)


def indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, *, rope,
                                overlap=None, eps=COMPRESSOR_EPS, chunk_rows=None,
                                deterministic: bool = True):
    """Section 15 backward of the indexer's compressor (``rotate=True``)."""
    return compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout, rope=rope,
                               overlap=overlap, rotate=True, eps=eps, chunk_rows=chunk_rows,
                               deterministic=deterministic)
