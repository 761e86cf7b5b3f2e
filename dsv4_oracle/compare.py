"""The comparison engine (contract sections 4, 11 and 12), shared by the pytest suite and the
``dsv4-oracle check`` command: one piece of code for both.

Every check returns a :class:`CheckResult`; nothing here raises on a *failed* comparison (a
wrong shape, a wrong value, a nondeterministic kernel are results, not errors). Bad *arguments*
(not a tensor, an unknown policy, a bound of the wrong shape) raise ``TypeError``/``ValueError``
naming the argument. No function modifies its inputs. No pytest dependency.

- :func:`compare_numeric`: ``ratio = max |actual - expected| / bound`` (the error model of
  ``reference.error_model``), after an exact check of the ``-inf``/``+inf``/NaN positions;
- :func:`compare_exact`: value (or bitwise) equality with the count and first location of
  mismatches;
- :func:`compare_topk` and :func:`near_tie_rows`: Top-K sets and lengths exactly per row,
  order only under a named policy, near-tie rows excluded and counted;
- :func:`check_replays`, :func:`check_grad_mode_parity`, :func:`check_no_mutation`: the
  determinism checks of section 11.
"""
from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from dsv4_oracle.reference._checks import compute_device

__all__ = [
    "CheckResult",
    "compare_numeric",
    "NumericComparison",
    "compare_exact",
    "compare_topk",
    "near_tie_rows",
    "check_replays",
    "check_grad_mode_parity",
    "check_no_mutation",
    "TOPK_ORDERS",
    "ill_conditioned",
    "error_ratios",
    "row_chunks",
    "not_judged",
    "STATUSES",
]

TOPK_ORDERS = ("id", "score")
# a check's status: the implementation passed it, failed it, or it could not be judged (every
# element ill-conditioned, an empty tensor, or an upstream output the oracle cannot consume)
STATUSES = ("passed", "failed", "not_judged")
_F64 = torch.float64


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    ``kind``: ``"numeric"``, ``"exact"``, ``"topk"``, ``"replay"``, ``"grad_mode"``,
    ``"no_mutation"`` or ``"error"``. ``passed``: the implementation did not fail this check
    (the verdict is the conjunction of ``passed``). ``judged``: ``False`` when the check could
    not be judged (section 12: every element ill-conditioned, nothing to compare, or an upstream
    output the oracle cannot consume); such a check is never a failure and never a pass:
    :attr:`status` is ``"not_judged"`` and reports count it separately. ``ratio``: error/bound
    for numeric checks (``<= 1`` passes). ``mismatches``: the number of mismatching elements
    (exact, replay, grad-mode), rows (top-k), tensors (no-mutation) or over-bound elements
    (numeric). ``detail``: one human-readable line. ``extra``: further JSON-ready facts (worst
    index, excluded rows, ill-conditioned count, ...).
    """

    name: str
    kind: str
    passed: bool
    ratio: float | None = None
    mismatches: int | None = None
    detail: str = ""
    extra: dict = field(default_factory=dict)
    judged: bool = True

    def __post_init__(self):
        if not self.judged and not self.passed:
            raise ValueError(f"check {self.name!r}: a failed check is judged (judged=False "
                             "requires passed=True)")

    @property
    def status(self) -> str:
        """``"passed"``, ``"failed"`` or ``"not_judged"`` (one of :data:`STATUSES`)."""
        return "failed" if not self.passed else ("passed" if self.judged else "not_judged")

    def to_dict(self) -> dict:
        """A JSON-ready dict (non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"``)."""
        d = {"name": self.name, "kind": self.kind, "passed": self.passed,
             "status": self.status, "ratio": self.ratio, "mismatches": self.mismatches,
             "detail": self.detail}
        d.update(self.extra)
        return _jsonable(d)

    def raise_if_failed(self) -> "CheckResult":
        """Raise ``AssertionError`` with the detail when the check failed; return self otherwise."""
        if not self.passed:
            raise AssertionError(f"{self.name} ({self.kind}): {self.detail}")
        return self


def not_judged(name: str, kind: str, reason: str, **extra) -> CheckResult:
    """A check that could not be judged, with the reason (never a pass, never a failure)."""
    return CheckResult(name, kind, True, None, None, f"not judged: {reason}",
                       {**extra, "not_judged": reason}, judged=False)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    return x


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _name(x, what: str = "name") -> str:
    if not isinstance(x, str):
        raise TypeError(f"{what} must be a str, got {type(x).__name__}")
    return x


def _index(flat: int, shape) -> list[int]:
    """The multi-index of a flat (row-major) position."""
    out = []
    for size in reversed(tuple(shape)):
        out.append(flat % size if size else 0)
        flat //= max(size, 1)
    return out[::-1]


def _cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu")


def _work(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached on the device comparisons run on: the CPU, or the oracle's compute device
    inside ``reference._checks.compute_on`` (the checker's ``--oracle-device``). Comparisons are
    elementwise float64 arithmetic, maxima and counts, exact on every device."""
    return x.detach().to(compute_device())


# ---------------------------------------------------------------------------------------------
# Numeric and exact comparisons
# ---------------------------------------------------------------------------------------------

def _nonfinite_code(x: torch.Tensor) -> torch.Tensor:
    code = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
    code[torch.isnan(x)] = 1
    code[x == math.inf] = 2
    code[x == -math.inf] = 3
    return code


def ill_conditioned(expected, bound) -> torch.Tensor:
    """Section 12, power: the elements a numeric check cannot judge.

    An element is *ill-conditioned* when its bound is positive and reaches the magnitude of the
    value it judges (``bound >= |expected|``, ``expected`` finite): any implementation value
    between 0 and twice the expected one would pass there, so agreement on it proves nothing.
    Such elements are reported as "not judged (ill-conditioned)" with a count, never counted as
    a pass. A zero bound is an exact check and never ill-conditioned. Returns a bool tensor of
    ``expected``'s shape on the CPU (on the compute device inside ``compute_on``). This is the
    one copy of the rule: the comparison and the power table both use it.
    """
    e64 = _work(_tensor(expected, "expected")).to(_F64)
    b64 = torch.broadcast_to(_work(_tensor(bound, "bound")).to(_F64), e64.shape)
    return torch.isfinite(e64) & (b64 > 0) & (b64 >= e64.abs())


def error_ratios(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per element ``|actual - expected| / bound`` (float64, ``expected``'s shape): 0 where the
    two are equal (non-finite values included), ``inf`` where a non-finite value differs or a
    positive error meets a zero bound. ``bound`` must broadcast to ``expected``; shapes of
    ``actual`` and ``expected`` must match."""
    a64 = _work(actual).to(_F64)
    e64 = _work(expected).to(_F64)
    b64 = torch.broadcast_to(_work(bound).to(_F64), e64.shape)
    same = (a64 == e64) | (torch.isnan(a64) & torch.isnan(e64))
    fin = torch.isfinite(a64) & torch.isfinite(e64)
    err = torch.where(fin, (a64 - e64).abs(), torch.full_like(e64, math.inf))
    r = torch.where(same, torch.zeros_like(e64), err / b64)          # x/0 = inf for x > 0
    return torch.nan_to_num(r, nan=math.inf, posinf=math.inf)


def compare_numeric(name: str, actual, expected, bound) -> CheckResult:
    """Section 12: ``ratio = max |actual - expected| / bound``.

    First, the positions of ``-inf``, ``+inf`` and NaN must be identical in ``actual`` and
    ``expected`` (an exact check; any difference fails with ``ratio = inf``). Then over the
    finite positions an element with zero error contributes 0 and an element with a positive
    error and a zero bound contributes ``inf`` (a zero bound is an exact check).

    Power (section 12, :func:`ill_conditioned`): an element whose bound reaches the magnitude
    of its expected value is *not judged*; it is counted (``extra["ill_conditioned"]``) and
    never makes the check pass, but an error over its bound still fails. The check fails iff
    some element's ratio exceeds 1 (``ratio`` is then the largest); it passes when every judged
    element is within its bound (``ratio`` is the largest over the judged elements); when no
    element can be judged (all ill-conditioned, or an empty tensor) its status is
    ``"not_judged"`` (``passed`` True, ``judged`` False, ``ratio`` the largest over all).
    ``bound`` must broadcast to ``expected`` and be non-negative (it comes from
    ``reference.error_model``). A shape mismatch between ``actual`` and ``expected`` fails.
    """
    name = _name(name)
    a = _tensor(actual, "actual")
    e = _tensor(expected, "expected")
    b = _tensor(bound, "bound")
    if a.is_complex() or e.is_complex() or b.is_complex():
        raise TypeError("compare_numeric: complex tensors are not supported")
    if not b.is_floating_point():
        raise TypeError(f"bound must be a floating-point tensor, got dtype {b.dtype}")
    try:
        b_full = torch.broadcast_to(b, e.shape)          # a view: nothing is copied
    except RuntimeError:
        raise ValueError(f"bound of shape {tuple(b.shape)} does not broadcast to expected "
                         f"{tuple(e.shape)}") from None
    c = NumericComparison(name, a, e.shape)
    c.add(..., e, b_full)
    return c.result()


class NumericComparison:
    """:func:`compare_numeric` of ``actual`` against an expected tensor of shape ``shape`` that
    arrives in blocks of rows, in row order (``add``), each dropped once scanned: a judge that
    streams the oracle row block by row block never holds the whole expected tensor or its
    bound. Every field of :meth:`result` is the one :func:`compare_numeric` gives on the whole
    tensors (the scan's counts add over blocks, a maximum keeps the first index that reaches it,
    and the expected value and bound at a reported index are kept when scanned)."""

    def __init__(self, name: str, actual: torch.Tensor, shape):
        self.name = _name(name)
        self.actual = _tensor(actual, "actual")
        self.shape = tuple(shape)
        self.same_shape = tuple(self.actual.shape) == self.shape
        self.scan = _NumericScan()

    def add(self, rows, expected: torch.Tensor, bound: torch.Tensor) -> None:
        """The next block: ``expected`` and ``bound`` (broadcastable to it) of the rows
        ``rows`` (a slice of the first dimension; ``...`` for all of it)."""
        e = _tensor(expected, "expected")
        b = torch.broadcast_to(_tensor(bound, "bound"), e.shape)
        chunks = list(row_chunks(e))
        if e.numel() and any(bool(torch.isnan(c).any()) or bool((c < 0).any())
                             for c in (_work(b[r]).to(_F64) for r in chunks)):
            raise ValueError("bound must be non-negative and free of NaN")
        if not self.same_shape or not e.numel():
            return
        a = self.actual if rows is ... else self.actual[rows]
        for r in chunks:
            self.scan.add(_work(a[r]).to(_F64), _work(e[r]).to(_F64), _work(b[r]).to(_F64))

    def result(self) -> CheckResult:
        name, a, shape, s = self.name, self.actual, self.shape, self.scan
        if not self.same_shape:
            return CheckResult(name, "numeric", False, math.inf, None,
                               f"shape {tuple(a.shape)} != expected {shape}",
                               {"shape": list(a.shape), "expected_shape": list(shape)})
        n = math.prod(shape)
        if n == 0:
            return not_judged(name, "numeric", "empty tensor, nothing to compare", numel=0)
        if s.nbad:
            # 1. the non-finite positions (-inf, +inf, NaN) must be identical: an exact check
            idx = _index(s.first_bad[0], shape)
            av, ev = _element(a, idx), s.first_bad[1]
            return CheckResult(
                name, "numeric", False, math.inf, s.nbad,
                f"{s.nbad} of {n} non-finite positions differ; first at {idx}: actual "
                f"{av!r}, expected {ev!r}",
                {"nonfinite_mismatches": s.nbad, "worst_index": idx, "numel": n})
        # 2. error / bound over the finite positions; ill-conditioned elements are not judged
        passed = s.over == 0
        judged = not passed or s.n_ill < n
        worst, i, ev, bv = s.worst_all if not passed or not judged else s.worst_judged
        idx = _index(i, shape)
        av = _element(a, idx)
        ei = abs(av - ev) if math.isfinite(av) and math.isfinite(ev) else 0.0
        extra = {"max_error": s.max_error, "worst_index": idx, "worst_error": ei,
                 "worst_bound": bv, "numel": n, "ill_conditioned": s.n_ill}
        if ev == 0.0 and not passed:    # the contract makes it exactly 0: say so, not a ratio
            extra["expected_zero"] = True
            zeros = "everywhere" if s.n_zero == n else f"at {s.n_zero} of {n} elements"
            at = (f"expected exactly 0 {zeros}; actual {av!r} at {idx} (error {ei:.3g}, bound "
                  f"{bv:.3g}: ratio {worst:.3g})")
        else:
            at = (f"ratio {worst:.3g} (error {ei:.3g} / bound {bv:.3g}) at {idx}: "
                  f"actual {av!r}, expected {ev!r}")
        # ill-conditioned elements over their bound fail the check: only the others are not
        # judged
        quiet = s.n_ill - s.n_ill_over
        ill_txt = (f"; {quiet} of {n} elements not judged (ill-conditioned)" if quiet and judged
                   else "")
        if not judged:
            return CheckResult(name, "numeric", True, worst, 0,
                               f"not judged: all {n} elements ill-conditioned (bound >= "
                               f"|expected|); largest {at}",
                               {**extra, "not_judged": "ill-conditioned"}, judged=False)
        detail = at + ("" if passed else f"; {s.over} of {n} elements over their bound") + ill_txt
        return CheckResult(name, "numeric", passed, worst, s.over, detail, extra)


_COMPARE_ELEMENTS = 1 << 24     # elements per chunk of a numeric comparison


def row_chunks(t: torch.Tensor):
    """Indices of consecutive pieces of ``t`` along its first dimension, about
    ``_COMPARE_ELEMENTS`` elements each (``t[index]`` for each; ``...``, the whole tensor, for
    a 0-d one): a comparison's float64 temporaries stay a few chunks in size whatever the
    tensor's size."""
    if t.dim() == 0:
        yield ...
        return
    step = max(1, _COMPARE_ELEMENTS // max(1, t[0].numel() if t.shape[0] else 1))
    for r0 in range(0, t.shape[0], step):
        yield slice(r0, min(r0 + step, t.shape[0]))


def _element(t: torch.Tensor, idx: list) -> float:
    """The element of ``t`` at multi-index ``idx`` as a Python float (float64)."""
    return float(t[tuple(idx)].detach().to("cpu", _F64))


class _NumericScan:
    """The running statistics of :func:`compare_numeric` over row chunks: non-finite position
    mismatches (count, first flat index), the largest finite error, the count of elements over
    their bound, the count of ill-conditioned ones, and the largest ratio with its first flat
    index over all elements and over the judged ones. Exactly the whole-tensor statistics: the
    counts add, a maximum's first index is the first chunk's that reaches it."""

    def __init__(self):
        self.seen = 0                    # elements scanned so far: the next chunk's offset
        self.nbad, self.first_bad = 0, None    # (flat index, expected value there)
        self.max_error = 0.0
        self.over = self.n_ill = self.n_ill_over = self.n_zero = 0
        self.worst_all = (-math.inf, 0, 0.0, 0.0)     # (ratio, flat index, expected, bound)
        self.worst_judged = (-math.inf, 0, 0.0, 0.0)

    @staticmethod
    def _better(cur, value, off, i, e64, b64):
        if value > cur[0]:
            return value, off + i, float(e64.reshape(-1)[i]), float(b64.reshape(-1)[i])
        return cur

    def add(self, a64, e64, b64):
        """The next chunk in row-major order: float64 tensors of one shape."""
        off, self.seen = self.seen, self.seen + e64.numel()
        sa, se = _nonfinite_code(a64), _nonfinite_code(e64)
        bad = (sa != se).reshape(-1)
        nbad = int(bad.sum())
        if nbad and self.first_bad is None:
            i = int(torch.nonzero(bad)[0])
            self.first_bad = (off + i, float(e64.reshape(-1)[i]))
        self.nbad += nbad
        fin = (se == 0).reshape(-1)
        err = torch.where(fin, (a64 - e64).abs().reshape(-1), 0.0)
        self.max_error = max(self.max_error, float(err.max()))
        r = error_ratios(a64, e64, b64).reshape(-1)
        ill = ill_conditioned(e64, b64).reshape(-1)
        self.n_ill += int(ill.sum())
        self.n_ill_over += int((ill & (r > 1)).sum())
        self.n_zero += int((e64 == 0).sum())
        self.over += int((r > 1).sum())
        i = int(torch.argmax(r))
        self.worst_all = self._better(self.worst_all, float(r[i]), off, i, e64, b64)
        rj = torch.where(ill, -1.0, r)
        i = int(torch.argmax(rj))
        self.worst_judged = self._better(self.worst_judged, float(rj[i]), off, i, e64, b64)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as integers of the same width (floats), or the values."""
    x = _cpu(x).contiguous()
    if x.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.view(width)
    return x


def _mismatch_mask(a: torch.Tensor, e: torch.Tensor, bitwise: bool) -> torch.Tensor:
    if bitwise:
        return _bits(a) != _bits(e)
    a, e = _cpu(a), _cpu(e)
    if a.is_floating_point() or e.is_floating_point():
        a64, e64 = a.to(_F64), e.to(_F64)
        return ~((a64 == e64) | (torch.isnan(a64) & torch.isnan(e64)))
    return a.to(torch.int64) != e.to(torch.int64)


def _dtype_kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "floating-point" if t.is_floating_point() else "integer"


def compare_exact(name: str, actual, expected, *, bitwise: bool = False) -> CheckResult:
    """Sections 4, 5 and 12: exact equality of dtype kind and values (an empty comparison is
    not judged).

    ``bitwise=False``: the same kind of dtype (integer, floating point, bool, complex: float
    ids never equal integer ids, whatever their values) and equal values (``-0.0 == +0.0``,
    NaN equals NaN; integer dtypes compared as values, so int32 ids match int64 ids).
    ``bitwise=True``: identical dtype and bits. Reports the number of mismatching elements and
    the first one.
    """
    name = _name(name)
    a = _tensor(actual, "actual")
    e = _tensor(expected, "expected")
    if not isinstance(bitwise, bool):
        raise TypeError(f"bitwise must be a bool, got {type(bitwise).__name__}")
    if tuple(a.shape) != tuple(e.shape):
        return CheckResult(name, "exact", False, None, None,
                           f"shape {tuple(a.shape)} != expected {tuple(e.shape)}",
                           {"shape": list(a.shape), "expected_shape": list(e.shape)})
    if bitwise and a.dtype != e.dtype:
        return CheckResult(name, "exact", False, None, None,
                           f"dtype {a.dtype} != expected {e.dtype} (bitwise comparison)")
    if _dtype_kind(a) != _dtype_kind(e):
        return CheckResult(name, "exact", False, None, None,
                           f"dtype {a.dtype} is {_dtype_kind(a)}, expected {_dtype_kind(e)} "
                           f"like {e.dtype}", {"dtype": str(a.dtype),
                                               "expected_dtype": str(e.dtype)})
    bad = _mismatch_mask(a, e, bitwise).reshape(-1)
    nbad = int(bad.sum())
    n = bad.numel()
    if n == 0:
        return not_judged(name, "exact", "nothing to compare (0 elements)", numel=0)
    if not nbad:
        return CheckResult(name, "exact", True, None, 0, f"all {n} elements equal", {"numel": n})
    i = int(torch.nonzero(bad)[0])
    idx = _index(i, a.shape)
    av, ev = _cpu(a).reshape(-1)[i].item(), _cpu(e).reshape(-1)[i].item()
    return CheckResult(name, "exact", False, None, nbad,
                       f"{nbad} of {n} elements differ; first at {idx}: actual {av!r}, "
                       f"expected {ev!r}", {"first_index": idx, "numel": n})


# ---------------------------------------------------------------------------------------------
# Top-K (section 4)
# ---------------------------------------------------------------------------------------------

def _ulp32(x: torch.Tensor) -> torch.Tensor:
    """The float32 spacing at ``|x|`` (as float64)."""
    m = x.abs().to(torch.float32)
    return (torch.nextafter(m, torch.full_like(m, math.inf)) - m).to(_F64)


def near_tie_rows(scores, k: int, ulps: int = 4, *, bound=None) -> torch.Tensor:
    """Section 12: rows whose K-th and (K+1)-th best candidate scores lie within ``ulps``
    float32 ulps (of the larger magnitude) -- plus, when ``bound`` (the scores' error bound,
    same shape) is given, within the sum of their two bounds. Candidates are the non ``-inf``
    scores; a row with at most ``k`` candidates is never a near tie. Returns bool ``[T]``.
    """
    s = _tensor(scores, "scores")
    if s.dim() != 2:
        raise ValueError(f"scores must have 2 dimensions, got shape {tuple(s.shape)}")
    if not s.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got dtype {s.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if isinstance(ulps, bool) or not isinstance(ulps, int) or ulps < 0:
        raise ValueError(f"ulps must be an int >= 0, got {ulps!r}")
    s64 = _cpu(s).to(_F64)
    if bool(torch.isnan(s64).any()):
        raise ValueError("scores contains NaN")
    T, N = s64.shape
    if N <= k:
        return torch.zeros(T, dtype=torch.bool)
    if bound is not None:
        b = _cpu(_tensor(bound, "bound")).to(_F64)
        if tuple(b.shape) != tuple(s.shape):
            raise ValueError(f"bound must have the shape of scores {tuple(s.shape)}, got {tuple(b.shape)}")
    vals, order = torch.sort(s64, dim=1, descending=True, stable=True)
    sk, sk1 = vals[:, k - 1], vals[:, k]
    cand = sk1 > -math.inf
    gap = sk - sk1
    tol = ulps * torch.maximum(_ulp32(sk), _ulp32(torch.where(cand, sk1, sk)))
    if bound is not None:
        tol = tol + b.gather(1, order[:, k - 1:k]).squeeze(1) + b.gather(1, order[:, k:k + 1]).squeeze(1)
    return cand & (gap <= tol)


def _row_mask(rows, T: int, name: str) -> torch.Tensor:
    r = _tensor(rows, name)
    if r.dtype == torch.bool:
        if tuple(r.shape) != (T,):
            raise ValueError(f"{name} must be a bool mask of shape ({T},), got {tuple(r.shape)}")
        return _cpu(r)
    if r.is_floating_point() or r.dim() != 1:
        raise TypeError(f"{name} must be a bool mask [T] or a 1-D integer tensor of row indices")
    r = _cpu(r).to(torch.int64)
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= T):
        raise ValueError(f"{name} holds a row index outside [0, {T})")
    m = torch.zeros(T, dtype=torch.bool)
    m[r] = True
    return m


def _ids_2d(x, name: str) -> torch.Tensor:
    t = _tensor(x, name)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must have 2 dimensions [T, width], got shape {tuple(t.shape)}")
    return _cpu(t).to(torch.int64)


def _lengths_1d(x, name: str, T: int) -> torch.Tensor:
    t = _tensor(x, name)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if tuple(t.shape) != (T,):
        raise ValueError(f"{name} must have shape ({T},), got {tuple(t.shape)}")
    return _cpu(t).to(torch.int64)


def compare_topk(ids, lengths, ids_ref, lengths_ref, *, order: str | None = None,
                 near_tie_rows=None, name: str = "topk", ties: str = "by_id",
                 scores=None) -> CheckResult:
    """Section 4: per row, the lengths and the selected *sets* must match exactly; slots at or
    beyond a row's length must be ``-1``; a row must not select an id twice. Under a named
    ``order`` policy (``"id"`` or ``"score"``, the reference computed under the same policy)
    the first ``length`` slots must also match in order. Rows flagged in ``near_tie_rows``
    (bool ``[T]`` or row indices) are excluded and counted. Widths may differ (alignment
    padding): the narrower side is padded with ``-1``.

    ``ties="any"`` (policy ``topk_ties``, section 5.2: any member of an exact tie may be
    selected) judges the set against the ``scores [T, N]`` it was selected from instead of the
    reference's set: every selected id is a candidate (a finite or ``+inf`` score), and every
    selected score is ``>=`` every unselected candidate's (exact comparisons, ``-0.0 == +0.0``);
    the lengths must still equal the reference's; the order policy is checked on the row itself
    (``"id"``: ascending ids; ``"score"``: non-increasing scores).
    """
    name = _name(name)
    if order is not None:
        if not isinstance(order, str):
            raise TypeError(f"order must be a str or None, got {type(order).__name__}")
        if order not in TOPK_ORDERS:
            raise ValueError(f"order must be one of {TOPK_ORDERS} or None, got {order!r}")
    if ties not in ("by_id", "any"):
        raise ValueError(f"ties must be 'by_id' or 'any', got {ties!r}")
    if ties == "any" and scores is None:
        raise ValueError("ties='any' judges the set against the scores it was selected from: "
                         "pass scores")
    ref = _ids_2d(ids_ref, "ids_ref")
    T = ref.shape[0]
    lref = _lengths_1d(lengths_ref, "lengths_ref", T)
    excluded = torch.zeros(T, dtype=torch.bool) if near_tie_rows is None else \
        _row_mask(near_tie_rows, T, "near_tie_rows")
    got_t = _tensor(ids, "ids")
    if got_t.dim() != 2 or got_t.shape[0] != T:
        return CheckResult(name, "topk", False, None, None,
                           f"ids shape {tuple(got_t.shape)} does not have {T} rows [T, width]",
                           {"shape": list(got_t.shape), "expected_shape": [T, ref.shape[1]]})
    got = _ids_2d(ids, "ids")
    lt = _tensor(lengths, "lengths")
    if tuple(lt.shape) != (T,):
        return CheckResult(name, "topk", False, None, None,
                           f"lengths shape {tuple(lt.shape)} != ({T},)",
                           {"shape": list(lt.shape), "expected_shape": [T]})
    lgot = _lengths_1d(lengths, "lengths", T)
    W = max(got.shape[1], ref.shape[1], 1)
    pad = lambda x: torch.cat([x, torch.full((T, W - x.shape[1]), -1, dtype=torch.int64)], 1)  # noqa: E731
    got, ref = pad(got), pad(ref)
    slot = torch.arange(W).unsqueeze(0)
    in_got = slot < lgot.clamp(0, W).unsqueeze(1)
    in_ref = slot < lref.clamp(0, W).unsqueeze(1)
    bad_len = (lgot != lref) | (lgot < 0) | (lgot > W)
    big = torch.iinfo(torch.int64).max
    sg, _ = torch.sort(torch.where(in_got, got, torch.full_like(got, big)), dim=1)
    sr, _ = torch.sort(torch.where(in_ref, ref, torch.full_like(ref, big)), dim=1)
    if ties == "any":
        bad_set, picked = _not_a_topk(got, in_got, _cpu(_tensor(scores, "scores")), T)
    else:
        bad_set = (sg != sr).any(dim=1)
    dup = ((sg[:, 1:] == sg[:, :-1]) & (sg[:, 1:] != big)).any(dim=1) if W > 1 else \
        torch.zeros(T, dtype=torch.bool)
    bad_tail = (torch.where(in_got, torch.full_like(got, -1), got) != -1).any(dim=1)
    bad_neg = (in_got & (got < 0)).any(dim=1)
    bad_order = torch.zeros(T, dtype=torch.bool)
    if order is not None and ties == "any":
        pair = in_got[:, 1:]                  # slot j and j-1 both within the length
        step = (got[:, 1:] <= got[:, :-1]) if order == "id" else (picked[:, 1:] > picked[:, :-1])
        bad_order = (pair & step).any(dim=1) & ~bad_len
    elif order is not None:
        bad_order = (torch.where(in_ref, got, ref) != ref).any(dim=1) & ~bad_len
    bad = (bad_len | bad_set | dup | bad_tail | bad_neg | bad_order) & ~excluded
    nbad = int(bad.sum())
    extra = {"rows": T, "excluded_near_tie": int(excluded.sum()),
             "length_mismatch_rows": int((bad_len & ~excluded).sum()),
             "set_mismatch_rows": int((bad_set & ~excluded).sum()),
             "duplicate_rows": int((dup & ~excluded).sum()),
             "tail_not_minus_one_rows": int((bad_tail & ~excluded).sum()),
             "negative_in_length_rows": int((bad_neg & ~excluded).sum()),
             "order_policy": order, "ties_policy": ties,
             "order_mismatch_rows": int((bad_order & ~excluded).sum())}
    if not nbad:
        return CheckResult(name, "topk", True, None, 0,
                           f"{T - extra['excluded_near_tie']} rows match "
                           f"({extra['excluded_near_tie']} near-tie rows excluded)", extra)
    t = int(torch.nonzero(bad)[0])
    gs = set(got[t][in_got[t]].tolist())
    rs = set(ref[t][in_ref[t]].tolist())
    missing, surplus = sorted(rs - gs)[:8], sorted(gs - rs)[:8]
    extra.update(first_row=t, first_row_missing=missing, first_row_extra=surplus)
    what = (f"missing {missing}, extra {surplus}" if ties == "by_id" else
            "not a Top-K of its scores (an unselected candidate scores above a selected id, or "
            "a selected id is no candidate)" if bool(bad_set[t]) else "a Top-K of its scores")
    return CheckResult(name, "topk", False, None, nbad,
                       f"{nbad} of {T} rows differ; first row {t}: length {int(lgot[t])} vs "
                       f"{int(lref[t])}, {what}"
                       + (", order differs" if bool(bad_order[t]) else "")
                       + (", duplicate ids" if bool(dup[t]) else "")
                       + (", slots past the length are not -1" if bool(bad_tail[t]) else ""),
                       extra)


def _not_a_topk(got: torch.Tensor, in_got: torch.Tensor, scores: torch.Tensor, T: int):
    """Per row, whether the selected ids (``got`` within ``in_got``) fail to be a Top-K set of
    ``scores [T, N]`` (an id outside ``[0, N)`` or with a ``-inf``/NaN score, or an unselected
    candidate scoring above a selected id); and the selected scores (``-inf`` past the
    length), for the order check."""
    if scores.dim() != 2 or scores.shape[0] != T:
        raise ValueError(f"scores must have shape [{T}, N], got {tuple(scores.shape)}")
    sc = scores.to(torch.float64)
    N = sc.shape[1]
    ok_id = (got >= 0) & (got < N)
    safe = torch.where(ok_id & in_got, got, torch.zeros_like(got)).clamp_max(max(N - 1, 0))
    picked = sc.gather(1, safe) if N else torch.full(got.shape, -math.inf, dtype=torch.float64)
    picked = torch.where(in_got & ok_id, picked, torch.full_like(picked, -math.inf))
    no_cand = in_got & (~ok_id | ~(picked > -math.inf))
    chosen = torch.zeros((T, N + 1), dtype=torch.bool)
    chosen.scatter_(1, torch.where(in_got & ok_id, got, torch.full_like(got, N)), True)
    chosen = chosen[:, :N]
    lowest = torch.where(in_got, picked, torch.full_like(picked, math.inf)).amin(dim=1) \
        if got.shape[1] else torch.full((T,), math.inf, dtype=torch.float64)
    rest = torch.where(~chosen & (sc > -math.inf), sc, torch.full_like(sc, -math.inf))
    highest = rest.amax(dim=1) if N else torch.full((T,), -math.inf, dtype=torch.float64)
    return no_cand.any(dim=1) | (highest > lowest), picked


# ---------------------------------------------------------------------------------------------
# Determinism (section 11)
# ---------------------------------------------------------------------------------------------

def _leaves(x, path: str = "out") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples/lists/dicts/NamedTuples; tensors and other leaves."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, Mapping):
        for k in x:
            yield from _leaves(x[k], f"{path}[{k!r}]")
    elif isinstance(x, tuple) and hasattr(x, "_fields"):
        for k in x._fields:
            yield from _leaves(getattr(x, k), f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def _snapshot(x) -> list[tuple[str, Any]]:
    """Detached CPU copies of every tensor leaf (other leaves kept as they are)."""
    return [(p, _cpu(v).clone() if isinstance(v, torch.Tensor) else v) for p, v in _leaves(x)]


def _diff(a: list, b: list) -> dict[str, int | str]:
    """Per leaf path, how many elements of ``b`` differ bitwise from ``a`` (or why they can't
    be compared); identical leaves are omitted."""
    out: dict[str, int | str] = {}
    pa, pb = [p for p, _ in a], [p for p, _ in b]
    if pa != pb:
        return {"structure": f"outputs differ in structure: {pa} vs {pb}"}
    for (p, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            out[p] = "tensor vs non-tensor"
        elif isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                out[p] = f"{x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            else:
                n = int((_bits(x) != _bits(y)).sum())
                if n:
                    out[p] = n
        elif not (x == y or (isinstance(x, float) and isinstance(y, float)
                             and math.isnan(x) and math.isnan(y))):
            out[p] = f"{x!r} vs {y!r}"
    return out


def _callable(fn, name: str) -> Callable:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def check_replays(fn, n: int, *, name: str = "replays") -> CheckResult:
    """Section 11 (run to run): call ``fn()`` ``n`` times (``n >= 2``); every tensor of every
    output must be bitwise identical to the first call's (same dtype, shape and bits).
    ``fn`` returns a tensor or nested tuples/lists/dicts of them. Reports, per tensor, the
    largest number of differing elements and the calls that differed."""
    name = _name(name)
    fn = _callable(fn, "fn")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")
    first = _snapshot(fn())
    worst: dict[str, int | str] = {}
    differing_calls = []
    for i in range(1, n):
        d = _diff(first, _snapshot(fn()))
        if d:
            differing_calls.append(i)
        for p, v in d.items():
            if isinstance(v, int) and isinstance(worst.get(p, 0), int):
                worst[p] = max(v, worst.get(p, 0))
            else:
                worst[p] = v
    tensors = [p for p, v in first if isinstance(v, torch.Tensor)]
    extra = {"calls": n, "tensors": tensors, "differing": worst, "differing_calls": differing_calls}
    if not worst:
        return CheckResult(name, "replay", True, None, 0,
                           f"{n} calls bitwise identical ({len(tensors)} tensors)", extra)
    count = sum(v for v in worst.values() if isinstance(v, int))
    parts = ", ".join(f"{p}: {v}" + (" elements" if isinstance(v, int) else "")
                      for p, v in worst.items())
    return CheckResult(name, "replay", False, None, count,
                       f"calls {differing_calls} of {n} differ from call 0: {parts}", extra)


GRAD_MODES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("grad_enabled", torch.enable_grad),
    ("no_grad", torch.no_grad),
    ("inference_mode", torch.inference_mode),
)


def check_grad_mode_parity(fn, *, name: str = "grad_modes") -> CheckResult:
    """Section 11 (across grad modes): ``fn()`` under ``torch.enable_grad()``,
    ``torch.no_grad()`` and ``torch.inference_mode()`` must return bitwise identical tensors
    (compared detached, on the CPU; the grad-enabled call is the reference)."""
    name = _name(name)
    fn = _callable(fn, "fn")
    runs = {}
    for mode, ctx in GRAD_MODES:
        with ctx():
            out = fn()
        runs[mode] = _snapshot(out)
    ref = runs["grad_enabled"]
    diffs = {mode: _diff(ref, runs[mode]) for mode in ("no_grad", "inference_mode")}
    diffs = {m: d for m, d in diffs.items() if d}
    extra = {"modes": [m for m, _ in GRAD_MODES], "differing": diffs}
    if not diffs:
        return CheckResult(name, "grad_mode", True, None, 0,
                           "identical under grad-enabled, no_grad and inference_mode", extra)
    count = sum(v for d in diffs.values() for v in d.values() if isinstance(v, int))
    parts = "; ".join(f"{m}: " + ", ".join(f"{p}: {v}" for p, v in d.items())
                      for m, d in diffs.items())
    return CheckResult(name, "grad_mode", False, None, count,
                       f"differs from grad-enabled under {parts}", extra)


_HASH_CHUNK = 1 << 26      # bytes per sha256 leaf of content_hash (64 MiB)


def content_hash(t: torch.Tensor, *, piecewise: bool | None = None) -> str:
    """A sha256 fingerprint of dtype, shape and the bytes of the values in logical (row-major)
    order: the sha256 of the header and the sha256 digests of consecutive 64 MiB pieces of the
    bytes (a two-level tree; one piece for tensors up to 64 MiB). The pieces are hashed in
    parallel threads, straight from the tensor's memory (``hashlib`` releases the GIL), so a
    production-size tensor costs its bytes over the machine's cores, not one core. A tensor on
    another device (a GPU) is brought to the host one piece at a time (``piecewise``, the
    default off the CPU): the host holds a few pieces, never a copy of the whole tensor; the
    value is the same. The value is an in-memory fingerprint (replays, no-mutation checks,
    cache keys), never stored."""
    x = t.detach()
    if piecewise is None:
        piecewise = x.device.type != "cpu"
    x = x.contiguous() if piecewise else x.to("cpu").contiguous()
    h = hashlib.sha256(f"{x.dtype}|{tuple(x.shape)}|".encode())
    if x.numel():
        flat = x.reshape(-1).view(torch.uint8)
        if piecewise:
            pieces = [(i, min(i + _HASH_CHUNK, flat.numel()))
                      for i in range(0, flat.numel(), _HASH_CHUNK)]
            digest = lambda r: hashlib.sha256(  # noqa: E731
                flat[r[0]:r[1]].to("cpu").numpy()).digest()
        else:
            buf = memoryview(flat.numpy())
            pieces = [buf[i:i + _HASH_CHUNK] for i in range(0, len(buf), _HASH_CHUNK)]
            digest = lambda b: hashlib.sha256(b).digest()  # noqa: E731
        if len(pieces) == 1 and not piecewise:
            h.update(pieces[0])
        elif len(pieces) == 1:
            h.update(flat.to("cpu").numpy())
        else:
            workers = min(len(pieces), os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for d in pool.map(digest, pieces):
                    h.update(d)
    return h.hexdigest()


def check_no_mutation(fn, inputs, *, name: str = "no_mutation") -> CheckResult:
    """Section 11 (inputs untouched): hash every tensor in ``inputs`` (content, dtype, shape),
    call ``fn(*inputs)`` (a tuple or list) or ``fn(**inputs)`` (a mapping), hash again; every
    hash must be unchanged. Nested containers are searched for tensors."""
    name = _name(name)
    fn = _callable(fn, "fn")
    if isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise TypeError("inputs: mapping keys must be str (keyword arguments)")
        call = lambda: fn(**inputs)  # noqa: E731
        root = "inputs"
    elif isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        call = lambda: fn(*inputs)  # noqa: E731
        root = "inputs"
    else:
        raise TypeError(f"inputs must be a tuple/list (positional) or a mapping (keyword), "
                        f"got {type(inputs).__name__}")
    before = {p: content_hash(v) for p, v in _leaves(inputs, root) if isinstance(v, torch.Tensor)}
    call()
    after = {p: content_hash(v) for p, v in _leaves(inputs, root) if isinstance(v, torch.Tensor)}
    changed = sorted(p for p in before if after.get(p) != before[p])
    extra = {"tensors": sorted(before), "changed": changed}
    if not changed:
        return CheckResult(name, "no_mutation", True, None, 0,
                           f"{len(before)} input tensors unchanged", extra)
    return CheckResult(name, "no_mutation", False, None, len(changed),
                       f"{len(changed)} of {len(before)} input tensors modified: {', '.join(changed)}",
                       extra)
