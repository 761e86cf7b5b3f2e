"""Argument validation shared by the gpu_impl backends (contract: bad input is rejected first).

Every backend function validates with these helpers *before* it launches any computation, so a
bad argument raises a ``TypeError`` or ``ValueError`` that names it while the device is still
untouched. Checks on types, dtypes, shapes and devices read only tensor metadata (no kernel is
launched). The few checks that depend on tensor *values* (NaN scores or sinks, compressed ids
outside a row's visibility) run one small reduction and a host synchronisation; they also come
before any of the op's real work. Nothing here ever writes to a tensor it is given.

The ``validate_<op>`` functions hold each op's argument validation, shared by
:mod:`gpu_impl.torch_backend` and :mod:`gpu_impl.cudnn_backend` (so the two backends differ only
in what they compute); each returns a NamedTuple of the converted arguments. They check in a
fixed order (the order the error messages are documented and tested in) and read metadata
only, except :func:`validate_stable_topk` (NaN scores); the ops' other value checks go through
:func:`reject_nan`, which a backend calls after its own device check.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from dsv4_oracle.reference.layout import PackedLayout

__all__ = [
    "AttentionArgs", "AttentionBackwardArgs", "CompressorArgs", "FLOAT_DTYPES", "INDEX_DTYPES",
    "IndexerLossArgs", "IndexerLossGradArgs", "IndexerScoresArgs", "TopkArgs", "allocated",
    "as_bool", "as_device",
    "as_int", "as_real", "check_dim", "check_layout", "choice", "float_tensor", "has_nan",
    "head_dim", "index_tensor", "reject_loss_values", "reject_nan", "reject_negative",
    "same_device", "validate_attention_backward",
    "validate_attention_forward", "validate_indexer_scores", "validate_sparse_indexer_loss",
    "validate_sparse_indexer_loss_grad", "validate_stable_topk", "validate_compressor",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(x, name: str, ndim: int | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def float_tensor(x, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """A float tensor (bf16, fp16, fp32 or fp64), returned as is."""
    x = _tensor(x, name, ndim)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a bfloat16/float16/float32/float64 tensor, got dtype {x.dtype}")
    return x


def index_tensor(x, name: str, *, ndim: int | None = None) -> torch.Tensor:
    """An int32 or int64 tensor, returned as is (unsigned dtypes, ``uint64`` among them, are
    rejected with ``TypeError``: ids are signed, every id outside ``[0, S)`` is invalid)."""
    x = _tensor(x, name, ndim)
    if x.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {x.dtype}")
    return x


def as_device(device, name: str = "device") -> torch.device | None:
    """``device`` (``None``, a ``str`` or a ``torch.device``) as a ``torch.device`` that can hold
    data on this machine: ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device (e.g. 'cpu', 'cuda:0'), got "
                        f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{name}={device!r} is not a device ({exc})") from None
    if dev.type == "meta":
        raise ValueError(f"{name}={device!r} holds no data; the ops need values")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r}: CUDA is not available on this machine")
        if dev.index is not None and not dev.index < torch.cuda.device_count():
            raise ValueError(f"{name}={device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA devices")
    return dev


def allocated(make, name: str, what: str):
    """``make()``, an allocation whose size comes from the argument ``name``: an allocator
    failure is a ``ValueError`` naming ``name`` and ``what`` was to be allocated."""
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{name}: {what} cannot be allocated here ({first})") from None


def same_device(**named) -> torch.device:
    """The common device of the named tensors (``None`` entries are skipped); ``ValueError``
    naming them when they differ, or naming the first when they are meta tensors (no data)."""
    device, first = None, None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; "
                             "all tensors of one call must be on the same device")
    if device is not None and device.type == "meta":
        raise ValueError(f"{first} is a meta tensor (it holds no data); the ops need values")
    return device if device is not None else torch.device("cpu")


def check_dim(x: torch.Tensor, name: str, axis: int, size: int, what: str) -> None:
    if x.shape[axis] != size:
        raise ValueError(f"{name} has size {x.shape[axis]} in dimension {axis}, expected {size} "
                         f"({what}); shape {tuple(x.shape)}")


def as_int(x, name: str, *, minimum: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return x


def as_real(x, name: str, *, positive: bool = False) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}")
    return x


def choice(x, name: str, allowed: tuple) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a str, got {type(x).__name__}")
    if x not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {x!r}")
    return x


def as_bool(x, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def check_layout(layout) -> PackedLayout:
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a reference.PackedLayout, got {type(layout).__name__}")
    return layout


def has_nan(x: torch.Tensor) -> bool:
    """Whether a float tensor holds a NaN (one reduction and a host synchronisation)."""
    return x.is_floating_point() and bool(torch.isnan(x).any())


def reject_nan(**named) -> None:
    """``ValueError("<name> contains NaN")`` for the first named tensor that holds a NaN."""
    for name, t in named.items():
        if has_nan(t):
            raise ValueError(f"{name} contains NaN")


def head_dim(x: torch.Tensor, name: str) -> int:
    """The last (head) dimension of ``x``, which must be >= 1."""
    d = x.shape[-1]
    if d < 1:
        raise ValueError(f"{name} must have a head dimension >= 1, got shape {tuple(x.shape)}")
    return d


def reject_negative(**named) -> None:
    """``ValueError`` for the first named tensor holding a value below 0 (probabilities)."""
    for name, t in named.items():
        if t.numel() and bool((t < 0).any()):
            raise ValueError(f"{name} holds a negative value ({float(t.min())}); it is a "
                             "probability distribution over the selected slots (section 8)")


def reject_loss_values(lse, index_scores, compressed_ids, layout) -> None:
    """Section 8 value checks of the loss beyond NaN: ``lse = -inf`` (a KV-only lse is the log
    of a positive sum, or ``+inf``) and a ``+inf`` index score at a selected slot of a real row
    (the student softmax is undefined there). One reduction each and a host synchronisation."""
    if lse.numel() and bool((lse == -math.inf).any()):
        raise ValueError("lse contains -inf; a KV-only lse (section 6) is the log of a positive "
                         "sum, or +inf on a row without keys")
    C = index_scores.shape[1]
    if C == 0 or compressed_ids.numel() == 0:
        return
    real = layout.is_real.to(compressed_ids.device).unsqueeze(1)
    sel = (compressed_ids >= 0) & (compressed_ids < C) & real
    picked = torch.gather(index_scores, 1,
                          torch.where(sel, compressed_ids, torch.zeros_like(compressed_ids))
                          .to(torch.int64))
    bad = sel & (picked == math.inf)
    if bool(bad.any()):
        t, j = torch.nonzero(bad)[0].tolist()
        raise ValueError(f"index_scores is +inf at a selected slot (row {t}, compressed id "
                         f"{int(compressed_ids[t, j])}); the student softmax is undefined there "
                         "(section 8)")


# --------------------------------------------------------------------------------------------
# per-op validation (contract sections 4, 6, 7, 8), shared by the backends
# --------------------------------------------------------------------------------------------
class TopkArgs(NamedTuple):
    scores: torch.Tensor
    k: int
    order: str
    align: int | None
    width: int                  # k rounded up to a multiple of align
    deterministic: bool


def validate_stable_topk(scores, k, order, align, deterministic) -> TopkArgs:
    """Section 4 arguments, then the NaN check on ``scores`` (the one value check)."""
    s = float_tensor(scores, "scores", ndim=2)
    same_device(scores=s)                                      # no meta tensor
    k = as_int(k, "k", minimum=0)
    order = choice(order, "order", ("id", "score"))
    deterministic = as_bool(deterministic, "deterministic")
    width = k
    if align is not None:
        align = as_int(align, "align", minimum=1)
        width = -(-k // align) * align
    if has_nan(s):
        bad = torch.nonzero(torch.isnan(s))[0].tolist()
        raise ValueError(f"scores contains NaN (first at row {bad[0]}, column {bad[1]}); "
                         "Top-K selection is undefined")
    return TopkArgs(s, k, order, align, width, deterministic)


class IndexerScoresArgs(NamedTuple):
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    weights: torch.Tensor
    ratio: int
    num_compressed: int         # C of the layout at this ratio
    scale: float
    device: torch.device


def validate_indexer_scores(q_idx, k_idx, weights, layout, ratio, scale,
                            deterministic) -> IndexerScoresArgs:
    """Section 7 arguments (metadata only)."""
    check_layout(layout)
    ratio = as_int(ratio, "ratio", minimum=1)
    q = float_tensor(q_idx, "q_idx", ndim=3)
    k = float_tensor(k_idx, "k_idx", ndim=2)
    w = float_tensor(weights, "weights", ndim=2)
    as_bool(deterministic, "deterministic")
    dev = same_device(q_idx=q, k_idx=k, weights=w)
    T, HI, DI = q.shape
    head_dim(q, "q_idx")
    check_dim(q, "q_idx", 0, layout.num_rows, "layout.num_rows")
    check_dim(k, "k_idx", 1, DI, "q_idx head dim D_I")
    C = layout.num_compressed(ratio)
    check_dim(k, "k_idx", 0, C, f"compressed groups of the layout at ratio {ratio}")
    check_dim(w, "weights", 0, T, "rows T")
    check_dim(w, "weights", 1, HI, "indexer heads H_I")
    scale = DI ** -0.5 if scale is None else as_real(scale, "scale")
    return IndexerScoresArgs(q, k, w, ratio, C, scale, dev)


class AttentionArgs(NamedTuple):
    q: torch.Tensor
    kv: torch.Tensor
    ids: torch.Tensor
    sink: torch.Tensor
    scale: float
    v_dim: int
    lengths: torch.Tensor | None
    deterministic: bool


def validate_attention_forward(q, kv, ids, sink, scale, v_dim, lengths,
                               deterministic) -> AttentionArgs:
    """Section 6 forward arguments (metadata only; the sink's NaN check is the caller's)."""
    q = float_tensor(q, "q", ndim=3)
    kv = float_tensor(kv, "kv", ndim=2)
    ids = index_tensor(ids, "ids", ndim=2)
    sink = float_tensor(sink, "sink", ndim=1)
    if lengths is not None:
        lengths = index_tensor(lengths, "lengths", ndim=1)
    same_device(q=q, kv=kv, ids=ids, sink=sink, lengths=lengths)
    T, H, D = q.shape
    head_dim(q, "q")
    check_dim(kv, "kv", 1, D, "q head dim D")
    check_dim(ids, "ids", 0, T, "q rows T")
    check_dim(sink, "sink", 0, H, "q heads H")
    if lengths is not None:
        check_dim(lengths, "lengths", 0, T, "q rows T")
    if q.dtype != kv.dtype:
        raise TypeError(f"q ({q.dtype}) and kv ({kv.dtype}) must have the same dtype")
    dv = D if v_dim is None else as_int(v_dim, "v_dim", minimum=1)
    if dv > D:
        raise ValueError(f"v_dim={dv} exceeds the head dim D={D}")
    scale = D ** -0.5 if scale is None else as_real(scale, "scale")
    deterministic = as_bool(deterministic, "deterministic")
    return AttentionArgs(q, kv, ids, sink, scale, dv, lengths, deterministic)


# the forward's fields, then the backward's own tensors
AttentionBackwardArgs = NamedTuple("AttentionBackwardArgs", [
    *AttentionArgs.__annotations__.items(),
    ("out", torch.Tensor), ("lse", torch.Tensor), ("dout", torch.Tensor)])


def validate_attention_backward(q, kv, ids, sink, out, lse, dout, scale, v_dim, lengths,
                                deterministic) -> AttentionBackwardArgs:
    """Section 6 backward arguments: the forward's, then ``out``, ``lse``, ``dout``."""
    a = validate_attention_forward(q, kv, ids, sink, scale, v_dim, lengths, deterministic)
    T, H, _ = a.q.shape
    out = float_tensor(out, "out", ndim=3)
    lse = float_tensor(lse, "lse", ndim=2)
    dout = float_tensor(dout, "dout", ndim=3)
    same_device(q=a.q, out=out, lse=lse, dout=dout)
    for name, t, shape in (("out", out, (T, H, a.v_dim)), ("lse", lse, (T, H)),
                           ("dout", dout, (T, H, a.v_dim))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return AttentionBackwardArgs(*a, out, lse, dout)


class IndexerLossArgs(NamedTuple):
    q: torch.Tensor
    kv_cmp: torch.Tensor
    sink: torch.Tensor
    lse: torch.Tensor
    compressed_ids: torch.Tensor
    index_scores: torch.Tensor
    coeff: float
    scale: float
    loss_floor: float
    num_real: int
    device: torch.device


def validate_sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout,
                                 coeff, scale, num_real, loss_floor,
                                 deterministic) -> IndexerLossArgs:
    """Section 8 loss arguments (metadata only; the NaN checks of ``sink``, ``lse`` and
    ``index_scores`` are the caller's)."""
    check_layout(layout)
    q = float_tensor(q, "q", ndim=3)
    kc = float_tensor(kv_cmp, "kv_cmp", ndim=2)
    sink = float_tensor(sink, "sink", ndim=1)
    lse = float_tensor(lse, "lse", ndim=2)
    ids = index_tensor(compressed_ids, "compressed_ids", ndim=2)
    scores = float_tensor(index_scores, "index_scores", ndim=2)
    as_bool(deterministic, "deterministic")
    dev = same_device(q=q, kv_cmp=kc, sink=sink, lse=lse, compressed_ids=ids,
                      index_scores=scores)
    T, H, D = q.shape
    head_dim(q, "q")
    check_dim(q, "q", 0, layout.num_rows, "layout.num_rows")
    check_dim(kc, "kv_cmp", 1, D, "q head dim D")
    check_dim(sink, "sink", 0, H, "q heads H")
    check_dim(lse, "lse", 0, T, "rows T")
    check_dim(lse, "lse", 1, H, "heads H")
    check_dim(ids, "compressed_ids", 0, T, "rows T")
    check_dim(scores, "index_scores", 0, T, "rows T")
    check_dim(scores, "index_scores", 1, kc.shape[0], "compressed keys C (rows of kv_cmp)")
    if q.dtype != kc.dtype:
        raise TypeError(f"q ({q.dtype}) and kv_cmp ({kc.dtype}) must have the same dtype")
    coeff = as_real(coeff, "coeff")
    scale = D ** -0.5 if scale is None else as_real(scale, "scale")
    floor = as_real(loss_floor, "loss_floor", positive=True)
    n_real = layout.num_real if num_real is None else as_int(num_real, "num_real", minimum=1)
    if n_real < 1:
        raise ValueError("num_real: the layout has no real tokens; N must be >= 1")
    return IndexerLossArgs(q, kc, sink, lse, ids, scores, coeff, scale, floor, n_real, dev)


class IndexerLossGradArgs(NamedTuple):
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    weights: torch.Tensor
    compressed_ids: torch.Tensor
    target: torch.Tensor
    predict: torch.Tensor
    coeff: float
    num_real: int
    grad_loss: float
    scale: float
    grad_floor: float
    loss_floor: float
    mode: str
    deterministic: bool
    device: torch.device


def validate_sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target, predict,
                                      coeff, num_real, grad_loss, scale, grad_floor, mode,
                                      loss_floor, deterministic) -> IndexerLossGradArgs:
    """Section 8 gradient arguments (metadata only; the NaN checks of ``target`` and
    ``predict`` are the caller's)."""
    q = float_tensor(q_idx, "q_idx", ndim=3)
    k = float_tensor(k_idx, "k_idx", ndim=2)
    w = float_tensor(weights, "weights", ndim=2)
    ids = index_tensor(compressed_ids, "compressed_ids", ndim=2)
    tau = float_tensor(target, "target", ndim=2)
    p_in = float_tensor(predict, "predict", ndim=2)
    deterministic = as_bool(deterministic, "deterministic")
    dev = same_device(q_idx=q, k_idx=k, weights=w, compressed_ids=ids, target=tau,
                      predict=p_in)
    T, HI, DI = q.shape
    head_dim(q, "q_idx")
    Kc = ids.shape[1]
    check_dim(k, "k_idx", 1, DI, "q_idx head dim D_I")
    check_dim(w, "weights", 0, T, "rows T")
    check_dim(w, "weights", 1, HI, "indexer heads H_I")
    check_dim(ids, "compressed_ids", 0, T, "rows T")
    for name, t in (("target", tau), ("predict", p_in)):
        if tuple(t.shape) != (T, Kc):
            raise ValueError(f"{name} must have shape {(T, Kc)} like compressed_ids, "
                             f"got {tuple(t.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"q_idx ({q.dtype}) and k_idx ({k.dtype}) must have the same dtype")
    coeff = as_real(coeff, "coeff")
    n_real = as_int(num_real, "num_real", minimum=1)
    grad_loss = as_real(grad_loss, "grad_loss")
    scale = DI ** -0.5 if scale is None else as_real(scale, "scale")
    e = as_real(grad_floor, "grad_floor", positive=True)
    floor = as_real(loss_floor, "loss_floor", positive=True)
    mode = choice(mode, "mode", ("clipped", "autograd"))
    return IndexerLossGradArgs(q, k, w, ids, tau, p_in, coeff, n_real, grad_loss, scale, e,
                               floor, mode, deterministic, dev)


class CompressorArgs(NamedTuple):
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    norm_weight: torch.Tensor
    ratio: int
    coff: int
    d: int
    rope: object
    rotate: bool
    eps: float
    deterministic: bool
    device: torch.device


def validate_compressor(kv, score, ape, norm_weight, layout, ratio, rope, overlap, rotate, eps,
                        deterministic, dout=None) -> CompressorArgs:
    """Contract section 15 arguments (metadata only): ``kv``, ``score [T, c*d]`` of one float
    dtype, ``ape [r, c*d]`` and ``norm_weight [d]`` float tensors, a layout, ``ratio >= 1``,
    ``overlap`` (None: ``ratio == 4``), ``rope`` (a ``reference.RopeSpec`` with an even
    ``dim <= d``, or a ``[P, dim/2, 2]`` table), ``rotate`` (``d`` a power of two), ``eps > 0``,
    the upstream ``dout [C, d]`` of a backward."""
    from dsv4_oracle.reference.rope import RopeSpec
    check_layout(layout)
    ratio = as_int(ratio, "ratio", minimum=1)
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool or None, got {type(overlap).__name__}")
    c = 2 if (ratio == 4 if overlap is None else overlap) else 1
    kv = float_tensor(kv, "kv", ndim=2)
    score = float_tensor(score, "score", ndim=2)
    ape = float_tensor(ape, "ape", ndim=2)
    norm_weight = float_tensor(norm_weight, "norm_weight", ndim=1)
    rotate = as_bool(rotate, "rotate")
    eps = as_real(eps, "eps", positive=True)
    deterministic = as_bool(deterministic, "deterministic")
    dev = same_device(kv=kv, score=score, ape=ape, norm_weight=norm_weight, dout=dout)
    check_dim(kv, "kv", 0, layout.num_rows, "layout.num_rows")
    if kv.shape[1] % c or kv.shape[1] == 0:
        raise ValueError(f"kv must have c*d columns with c = {c}, got shape {tuple(kv.shape)}")
    d = kv.shape[1] // c
    if score.shape != kv.shape or score.dtype != kv.dtype:
        raise ValueError(f"score must have kv's shape {tuple(kv.shape)} and dtype {kv.dtype}, "
                         f"got {tuple(score.shape)} {score.dtype}")
    if tuple(ape.shape) != (ratio, c * d):
        raise ValueError(f"ape must have shape ({ratio}, {c * d}), got {tuple(ape.shape)}")
    check_dim(norm_weight, "norm_weight", 0, d, "the compressed key width d")
    if isinstance(rope, RopeSpec):
        if isinstance(rope.dim, bool) or not isinstance(rope.dim, int) or rope.dim < 2 \
                or rope.dim % 2 or rope.dim > d:
            raise ValueError(f"rope.dim must be an even int in [2, {d}], got {rope.dim!r}")
    elif isinstance(rope, torch.Tensor):
        float_tensor(rope, "rope", ndim=3)
        if rope.shape[2] != 2 or 2 * rope.shape[1] > d or rope.shape[1] < 1:
            raise ValueError(f"rope table must have shape [P, dim/2, 2] with dim <= {d}, got "
                             f"{tuple(rope.shape)}")
    else:
        raise TypeError(f"rope must be a reference.RopeSpec or a (cos, sin) table tensor, got "
                        f"{type(rope).__name__}")
    if rotate and d & (d - 1):
        raise ValueError(f"the Hadamard rotation (rotate=True) needs a power-of-two d, got {d}")
    if dout is not None:
        float_tensor(dout, "dout", ndim=2)
        want = (layout.num_compressed(ratio), d)
        if tuple(dout.shape) != want:
            raise ValueError(f"dout must have shape {want}, got {tuple(dout.shape)}")
    return CompressorArgs(kv, score, ape, norm_weight, ratio, c, d, rope, rotate, eps,
                          deterministic, dev)
