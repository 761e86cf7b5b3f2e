"""The one error model of the contract (section 12): first-order bounds for every numeric output.

An implementation's result ``y`` is compared with the oracle ``y*`` evaluated in float64 on the
exact inputs the implementation consumed. The verdict is ``ratio = max |y - y*| / bound``;
the check passes iff ``ratio <= 1``. ``bound`` is an elementwise, first-order forward error
bound in the standard model of floating-point arithmetic (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., sections 2.2 and 3.1):

    fl(x op y) = (x op y)(1 + d) + e,    |d| <= u,   |e| <= eta

- a sum of ``n`` terms accumulated in precision ``acc`` errs by at most ``n * u_acc`` times the
  sum of the terms' absolute values (``gamma_n``, to first order);
- a value rounded once to a storage precision errs by ``u`` times its magnitude, plus ``eta``
  (the smallest normal number of that format: kernels flush subnormals to zero);
- ``exp``/``log`` (hardware ``ex2``/``lg2`` approximations) count 2 roundings each;
- errors propagate through the exact derivatives (``exp`` turns an absolute error of its
  argument into the same relative error of its result).

Every term of every bound is therefore *(unit roundoff) x (count of roundings or reduction
length) x (magnitude of the quantity rounded)*, where magnitudes are the same formulas evaluated
on absolute values (``|q|.|k|``, ``P @ |v|``, ...) in float64, gather-based and chunked like the
oracle (never a dense ``T x S`` mask). Nothing is tuned per test. The bounds are linear in the
unit roundoffs, so the oracle's own float64 error is accounted for by adding the float64 unit
roundoff to every unit (``y*`` is itself a float64 computation).

The precision of an implementation is a :class:`Precision`: ``acc`` (accumulations, softmax
statistics, products: float32 for bf16 kernels), ``io`` (operands rounded before tensor-core
products -- P, dS -- and stored outputs such as ``out``, ``dq``, ``dkv``) and ``stats`` (stored
float32 statistics: ``lse``, ``dsink``, indexer scores, target/predict, KL, loss).

The derivation of every formula, per contract section, is in ``docs/ERROR_MODEL.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._checks import as_float64, as_index, as_int, as_real, check_dim, choice
from ._checks import chunk_rows as rows_per_chunk
from .attention import _inputs as _attention_inputs
from .attention import valid_slots
from .indexer_loss import FLT_MIN, IndexerLoss
from .layout import PackedLayout

__all__ = [
    "Precision",
    "ORACLE_PRECISION",
    "attention_forward_bound",
    "attention_backward_bound",
    # extended next: indexer_scores_bound, indexer_loss_bound, indexer_loss_grad_bound,
    # q_rms_norm_bound
]

F64 = torch.float64
INF = math.inf


def _float_dtype(x, name: str) -> torch.dtype:
    if not isinstance(x, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(x).__name__}")
    if not x.is_floating_point:
        raise TypeError(f"{name} must be a floating-point dtype, got {x}")
    return x


@dataclass(frozen=True)
class Precision:
    """Working precisions of an implementation (section 12).

    ``acc``: accumulation/statistics precision, multiplied by reduction lengths (float32 for
    bf16 kernels). ``io``: storage precision of rounded intermediates and outputs, applied
    once per stored rounding (bf16). ``stats``: storage precision of float32 statistics and
    fp32 outputs (``lse``, ``dsink``, scores, target/predict, KL, loss); defaults to ``acc``.
    """

    acc: torch.dtype = torch.float64
    io: torch.dtype = torch.float64
    stats: torch.dtype | None = None

    def __post_init__(self):
        _float_dtype(self.acc, "acc")
        _float_dtype(self.io, "io")
        if self.stats is None:
            object.__setattr__(self, "stats", self.acc)
        _float_dtype(self.stats, "stats")

    @classmethod
    def of(cls, dtype: torch.dtype) -> "Precision":
        """Everything computed and stored in one precision (e.g. the float64 oracle)."""
        dtype = _float_dtype(dtype, "dtype")
        return cls(acc=dtype, io=dtype, stats=dtype)

    @staticmethod
    def unit_roundoff(dtype: torch.dtype) -> float:
        """``u = eps / 2`` (round to nearest): 2**-53 float64, 2**-24 float32, 2**-8 bf16."""
        return torch.finfo(dtype).eps / 2

    @property
    def u_acc(self) -> float:
        return self.unit_roundoff(self.acc)

    @property
    def u_io(self) -> float:
        return self.unit_roundoff(self.io)

    @property
    def u_stats(self) -> float:
        return self.unit_roundoff(self.stats)

    def to_dict(self) -> dict:
        return {"acc": str(self.acc), "io": str(self.io), "stats": str(self.stats),
                "u_acc": self.u_acc, "u_io": self.u_io, "u_stats": self.u_stats}


ORACLE_PRECISION = Precision.of(torch.float64)


class _Units(NamedTuple):
    """Unit roundoffs (``a`` acc, ``o`` io, ``s`` stats) and underflow thresholds (``ea``,
    ``eo``, ``es``) of the implementation plus those of the float64 oracle."""

    a: float
    o: float
    s: float
    ea: float
    eo: float
    es: float


def _units(precision) -> _Units:
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a Precision, got {type(precision).__name__}")
    p, r = precision, ORACLE_PRECISION
    tiny = lambda d: torch.finfo(d).tiny  # noqa: E731
    return _Units(p.u_acc + r.u_acc, p.u_io + r.u_io, p.u_stats + r.u_stats,
                  tiny(p.acc) + tiny(r.acc), tiny(p.io) + tiny(r.io),
                  tiny(p.stats) + tiny(r.stats))


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _same_shape(t: torch.Tensor, name: str, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# Section 6: sparse attention with a sink
# ---------------------------------------------------------------------------------------------

def _gathered(q, kv, ids, valid, r0, r1, scale):
    """Per chunk: gathered keys, masked logits, masked magnitudes ``a = |scale| |q|.|k|``."""
    n, K, D = r1 - r0, ids.shape[1], kv.shape[1]
    safe = torch.where(valid[r0:r1], ids[r0:r1], torch.zeros_like(ids[r0:r1]))
    kg = kv.index_select(0, safe.reshape(-1)).view(n, K, D)
    v = valid[r0:r1].unsqueeze(1)
    s = (scale * torch.bmm(q[r0:r1], kg.transpose(1, 2))).masked_fill(~v, -INF)
    a = (abs(scale) * torch.bmm(q[r0:r1].abs(), kg.abs().transpose(1, 2))).masked_fill(~v, 0.0)
    return kg, s, a


def attention_forward_bound(q, kv, ids, sink, out, lse, *, precision, scale=None, v_dim=None,
                            lengths=None, chunk_rows=None):
    """Section 12 bound for the section 6 forward: ``(bound_out [T,H,Dv], bound_lse [T,H])``.

    ``out`` and ``lse`` are the oracle's outputs (:func:`sparse_attention_forward` on the same
    inputs). With ``M = max_j |scale| |q|.|k_j|`` and ``n`` valid slots of the row:

    - ``relP = u_a (2 (D+4) M + n + 8 + p_sink |sink - m|) + u_o`` (relative error of ``P``);
    - ``bound_out = (relP + 2 n u_a) (P @ |v|) + (eta_a + eta_o) (1_valid @ |v|) + u_o |out| + eta_o``;
    - ``bound_lse = u_a ((D+4) M + n + 2 ln n + 5) + (2 u_a + u_s) |lse|``.

    Rows with no valid slot (``lse = +inf``) get bound 0: their ``out`` must be exactly 0 and
    their ``lse`` exactly ``+inf`` (compared exactly).
    """
    u = _units(precision)
    q, kv, ids, sink, scale, dv, lengths = _attention_inputs(q, kv, ids, sink, scale, v_dim, lengths)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    out = as_float64(out, "out", ndim=3)
    lse = as_float64(lse, "lse", ndim=2)
    _same_shape(out, "out", (T, H, dv))
    _same_shape(lse, "lse", (T, H))
    valid = valid_slots(ids, S, lengths)
    bound_out = torch.zeros_like(out)
    bound_lse = torch.zeros_like(lse)
    step = rows_per_chunk(chunk_rows, 8 * K * (3 * D + 4 * H))
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        kg, s, a = _gathered(q, kv, ids, valid, r0, r1, scale)
        l = lse[r0:r1]
        empty = ~(torch.isfinite(l) & valid[r0:r1].any(dim=1, keepdim=True))    # [n, H]
        l0 = torch.where(empty, torch.zeros_like(l), l)
        full = torch.logaddexp(l0, sink.unsqueeze(0))                          # [n, H]
        p = torch.exp(s - full.unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
        m_abs = a.amax(dim=-1) if K else torch.zeros_like(l)                    # M  [n, H]
        m_log = _finite_or_zero(s.amax(dim=-1) if K else torch.zeros_like(l))  # m  [n, H]
        nv = valid[r0:r1].sum(dim=1, keepdim=True).to(F64)                     # n  [n, 1]
        p_sink = torch.sigmoid(sink.unsqueeze(0) - l0)
        sink_arg = torch.where(torch.isfinite(sink).unsqueeze(0) & ~empty,
                               p_sink * (sink.unsqueeze(0) - m_log).abs(), torch.zeros_like(l))
        rel_p = u.a * (2 * (D + 4) * m_abs + nv + 8 + sink_arg) + u.o
        vabs = kg[:, :, :dv].abs()
        pv = torch.bmm(p, vabs)                                                 # P @ |v|
        mask_v = torch.bmm(valid[r0:r1].to(F64).unsqueeze(1), vabs)             # 1 @ |v|  [n,1,Dv]
        b = (rel_p + 2 * nv * u.a).unsqueeze(-1) * pv + (u.ea + u.eo) * mask_v \
            + u.o * out[r0:r1].abs() + u.eo
        bound_out[r0:r1] = b.masked_fill(empty.unsqueeze(-1), 0.0)
        logn = torch.log(nv.clamp_min(1.0))
        bl = u.a * ((D + 4) * m_abs + nv + 2 * logn + 5) + (2 * u.a + u.s) * l0.abs()
        bound_lse[r0:r1] = bl.masked_fill(empty, 0.0)
    return bound_out, bound_lse


def attention_backward_bound(q, kv, ids, sink, out, lse, dout, dq, dkv, dsink, *, precision,
                             scale=None, v_dim=None, lengths=None, chunk_rows=None):
    """Section 12 bound for the section 6 backward: ``(bound_dq [T,H,D], bound_dkv [S,D],
    bound_dsink [H])``.

    ``out``, ``lse`` and ``dout`` are the inputs the implementation consumed (its own forward's
    ``out`` and float32 ``lse``); ``dq``, ``dkv``, ``dsink`` are the oracle's outputs
    (:func:`sparse_attention_backward` on those inputs). With ``LSE' = logaddexp(lse, sink)``,
    ``b_j = |dO|.|v_j|``, ``c = |dO|.|out|``:

    - ``relP = u_a ((D+3) M + 3 |LSE'| + 6) + u_o`` (P recomputed from ``lse``, rounded for dV);
    - ``E_dS_j = (relP + 2 u_a + u_o) |dS_j| + u_a Dv P_j (b_j + c) + eta_o``;
    - ``bound_dq = |scale| sum_j E_dS_j |k_j| + n u_a |scale| sum_j |dS_j| |k_j| + (u_a + u_o) |dq| + eta_o``;
    - ``bound_dkv[s]`` = sum over the ``n_s`` contributions ``(t,h,j)`` with ``id_j = s`` of
      ``|scale| (E_dS_j + u_a |dS_j|) |q| + relP P_j |dO|``, plus
      ``u_a n_s sum (|scale| |dS_j| |q| + P_j |dO|)``, plus ``u_o |dkv| + eta_o``;
    - ``bound_dsink[h] = sum_t p_sink (u_a ((1 - p_sink) |sink - lse| + 5) |Delta| + u_a Dv c)
      + u_a n_h sum_t p_sink |Delta| + u_s |dsink| + eta_s``.
    """
    u = _units(precision)
    q, kv, ids, sink, scale, dv, lengths = _attention_inputs(q, kv, ids, sink, scale, v_dim, lengths)
    T, H, D = q.shape
    S, K = kv.shape[0], ids.shape[1]
    out = as_float64(out, "out", ndim=3)
    lse = as_float64(lse, "lse", ndim=2)
    dout = as_float64(dout, "dout", ndim=3)
    dq = as_float64(dq, "dq", ndim=3)
    dkv = as_float64(dkv, "dkv", ndim=2)
    dsink = as_float64(dsink, "dsink", ndim=1)
    for name, t, shape in (("out", out, (T, H, dv)), ("lse", lse, (T, H)),
                           ("dout", dout, (T, H, dv)), ("dq", dq, (T, H, D)),
                           ("dkv", dkv, (S, D)), ("dsink", dsink, (H,))):
        _same_shape(t, name, shape)
    sc = abs(scale)
    valid = valid_slots(ids, S, lengths)
    b_dq = torch.zeros_like(dq)
    err_kv = torch.zeros_like(dkv)                 # sum of propagated errors per kv row
    mag_kv = torch.zeros_like(dkv)                 # sum of |terms| per kv row
    n_kv = torch.zeros((S, 1), dtype=F64)          # number of contributions per kv row
    err_sink = torch.zeros(H, dtype=F64)
    mag_sink = torch.zeros(H, dtype=F64)
    n_sink = torch.zeros(H, dtype=F64)
    step = rows_per_chunk(chunk_rows, 8 * K * (6 * D + 8 * H))
    for r0 in range(0, T, step):
        r1 = min(r0 + step, T)
        n = r1 - r0
        v = valid[r0:r1]
        kg, s, a = _gathered(q, kv, ids, valid, r0, r1, scale)
        l = lse[r0:r1]
        empty = ~(torch.isfinite(l) & v.any(dim=1, keepdim=True))
        l0 = torch.where(empty, torch.zeros_like(l), l)
        full = torch.logaddexp(l0, sink.unsqueeze(0))
        p = torch.exp(s - full.unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
        m_abs = a.amax(dim=-1) if K else torch.zeros_like(l)
        nv = v.sum(dim=1, keepdim=True).to(F64)
        rel_p = u.a * ((D + 3) * m_abs + 3 * _finite_or_zero(full).abs() + 6) + u.o
        rel_p = rel_p.masked_fill(empty, 0.0)
        do = dout[r0:r1]
        vg = kg[:, :, :dv]
        delta = (do * out[r0:r1]).sum(dim=-1)                                   # [n, H]
        c = (do.abs() * out[r0:r1].abs()).sum(dim=-1)                           # [n, H]
        dp = torch.bmm(do, vg.transpose(1, 2))
        bmag = torch.bmm(do.abs(), vg.abs().transpose(1, 2))                    # b_j [n,H,K]
        ds = (p * (dp - delta.unsqueeze(-1))).abs()                             # |dS|
        e_ds = (rel_p + 2 * u.a + u.o).unsqueeze(-1) * ds \
            + u.a * dv * p * (bmag + c.unsqueeze(-1)) + u.eo * v.unsqueeze(1)
        e_ds = e_ds.masked_fill(empty.unsqueeze(-1), 0.0)
        kabs = kg.abs()
        b_dq[r0:r1] = sc * torch.bmm(e_ds, kabs) + (nv * u.a).unsqueeze(-1) * sc * torch.bmm(ds, kabs)
        qa, doa = q[r0:r1].abs(), do.abs()
        err = sc * torch.bmm((e_ds + u.a * ds).transpose(1, 2), qa)            # [n, K, D]
        err[:, :, :dv] += torch.bmm((rel_p.unsqueeze(-1) * p).transpose(1, 2), doa)
        mag = sc * torch.bmm(ds.transpose(1, 2), qa)
        mag[:, :, :dv] += torch.bmm(p.transpose(1, 2), doa)
        flat = v.reshape(-1)
        rows = ids[r0:r1].reshape(-1)[flat]
        err_kv.index_add_(0, rows, err.reshape(n * K, D)[flat])
        mag_kv.index_add_(0, rows, mag.reshape(n * K, D)[flat])
        n_kv.index_add_(0, rows, torch.full((rows.numel(), 1), float(H), dtype=F64))
        # dsink: p_sink = sigmoid(sink - lse), 0 on rows without keys and where sink = -inf.
        z = sink.unsqueeze(0) - l0
        ps = torch.sigmoid(z).masked_fill(empty, 0.0)
        rel_ps = u.a * (torch.where(torch.isfinite(z), (1 - ps) * z.abs(), torch.zeros_like(z)) + 5)
        err_sink += (ps * (rel_ps * delta.abs() + u.a * dv * c)).sum(dim=0)
        mag_sink += (ps * delta.abs()).sum(dim=0)
        n_sink += (~empty).to(F64).sum(dim=0)
    b_dq += (u.a + u.o) * dq.abs() + u.eo
    b_dkv = err_kv + u.a * n_kv * mag_kv + u.o * dkv.abs() + u.eo
    b_dsink = err_sink + u.a * n_sink * mag_sink + u.s * dsink.abs() + u.es
    return b_dq, b_dkv, b_dsink
