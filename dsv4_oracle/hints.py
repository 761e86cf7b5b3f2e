"""What a failed numeric check's error pattern says is wrong, and where the error concentrates:
hints printed after the check's finding, never part of the verdict.

- :func:`what_is_wrong`: the pattern of the error over the whole output: exactly 0 everywhere
  (never computed or never written), the opposite sign, a constant factor, exactly 0 where it
  is wrong (missing contributions), non-finite values where the oracle's are finite;
- :data:`SINK_VARIANTS`, :data:`PRECISION_VARIANTS`: the forward's sink taken with the wrong
  sign or ignored, bfloat16 accumulation (the judge compares a failing ``out``/``lse`` with
  the oracle on such a sink, or with the bound of such a precision);
- :func:`concentration_hint`: where the over-bound elements lie (one head, one document,
  padding rows, the last slots or columns);
- :func:`pattern_lines`: per failing quantity of a run, the most common pattern, for the
  terminal summary.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import torch

from dsv4_oracle.reference.error_model import Precision

__all__ = ["AXES", "Pattern", "SINK_VARIANTS", "PRECISION_VARIANTS", "concentration_hint",
           "what_is_wrong", "nonfinite_pattern", "pattern_lines", "looser_precision"]

# per numeric quantity, what each dimension indexes: "row" packed query rows, "key" the logical
# key buffer (raw rows first, then compressed groups), "cmp" compressed ids, "head", "col"
# feature columns, "slot" Top-K slots
AXES = {"scores": ("row", "cmp"), "out": ("row", "head", "col"), "lse": ("row", "head"),
        "dq": ("row", "head", "col"), "dkv": ("key", "col"), "dsink": ("head",), "loss": (),
        "kl": ("row",), "target": ("row", "slot"), "predict": ("row", "slot"),
        "dq_idx": ("row", "head", "col"), "dw": ("row", "head"), "dk_idx": ("cmp", "col")}
_TRAILING = {"col": "columns", "slot": "slots", "cmp": "compressed ids"}


def concentration_hint(over: torch.Tensor, axes: tuple, layout=None,
                       what: str = "over-bound elements") -> str | None:
    """Where the over-bound elements of a failed numeric check concentrate, or ``None``.

    ``over``: bool mask of the elements over their bound; ``axes``: what each dimension indexes
    (see :data:`AXES`); ``layout``: the case's :class:`reference.PackedLayout` (for rows and
    raw key rows). Reported when there are at least two over-bound elements and they all lie in
    one head (of several), one document (of several), only padding or capacity rows (of a
    layout that has real rows too), or the last half of the slots or columns. Returns a phrase
    such as ``"all 12 over-bound elements in head 3, in padding/capacity rows"``.
    """
    if over.dim() != len(axes):
        raise ValueError(f"over has {over.dim()} dimensions, axes names {len(axes)}")
    idx = torch.nonzero(over.to("cpu"))
    n = idx.shape[0]
    if n < 2:
        return None
    parts = []
    for d, ax in enumerate(axes):
        size = over.shape[d]
        vals = torch.unique(idx[:, d])
        if ax == "head" and size > 1 and vals.numel() == 1:
            parts.append(f"head {int(vals[0])}")
        elif ax in ("row", "key") and layout is not None:
            rows = vals[vals < layout.num_rows]
            if rows.numel() < vals.numel():
                if rows.numel() == 0:
                    parts.append("compressed key rows")
                continue
            real = layout.is_real[rows]
            if not bool(real.any()) and bool(layout.is_real.any()):
                parts.append("padding/capacity rows")
                continue
            docs = torch.unique(layout.doc[rows])
            used = int((layout.doc_padded_lengths > 0).sum())
            if docs.numel() == 1 and int(docs[0]) >= 0 and used > 1:
                b = int(docs[0])
                lo, hi = int(layout.cu_seqlens_padded[b]), int(layout.cu_seqlens_padded[b + 1])
                parts.append(f"document {b} (rows {lo}..{hi - 1})")
        elif ax in _TRAILING and size > 1:
            lo = int(vals.min())
            if lo >= size / 2:
                parts.append(f"the last {size - lo} of {size} {_TRAILING[ax]}")
    if not parts:
        return None
    return f"all {n} {what} in " + ", in ".join(parts)


class Pattern(NamedTuple):
    """What is wrong with an output: ``key`` (one word, the same for every check showing this
    pattern, e.g. ``"zero"``) and ``phrase`` (one sentence for the user, without numbers, so
    that checks of one quantity showing one pattern read the same)."""

    key: str
    phrase: str


# sink -> a wrong sink a forward may have used, and what that means (contract section 6)
SINK_VARIANTS = {
    "negated": (lambda sink: -sink,
                "out matches the oracle with the sink negated: the sink enters with the wrong "
                "sign"),
    "ignored": (lambda sink: torch.full_like(sink, -math.inf),
                "out matches the oracle without a sink: the sink is ignored"),
}
# precision -> a looser one a kernel may really have, and what that means (contract section 12)
PRECISION_VARIANTS = {
    "bf16_accumulation": (
        lambda p: Precision(acc=torch.bfloat16, io=p.io, stats=torch.bfloat16),
        "{name} is within the bounds of bfloat16 accumulation: the kernel accumulates (or keeps "
        "its statistics) in bfloat16 where float32 is assumed"),
}
_SQRT_LIMIT = 4096            # a factor c with c**2 or 1/c**2 an integer up to this is named


def looser_precision(a: Precision, b: Precision) -> bool:
    """Whether ``a`` has a larger unit roundoff than ``b`` in its accumulation or statistics."""
    u = Precision.unit_roundoff
    return u(a.acc) > u(b.acc) or u(a.stats) > u(b.stats)


def _factor_name(c: float) -> str:
    """``" (sqrt(512)?)"`` when ``c`` or ``1/c`` is close to the square root of an integer >= 2
    (a softmax scale ``D ** -0.5`` applied twice or not at all), else ``""``."""
    for v, inv in ((c * c, ""), (1 / (c * c), "1/")):
        n = round(v)
        if 2 <= n <= _SQRT_LIMIT and abs(v - n) <= 1e-3 * n:
            return f" ({inv}sqrt({n})?)"
    return ""


def what_is_wrong(name: str, actual: torch.Tensor, expected: torch.Tensor,
                  bound: torch.Tensor) -> Pattern | None:
    """The pattern of a failed numeric check of output ``name`` whose non-finite positions
    agree with the oracle's (tensors of one shape; ``bound`` broadcasts), or ``None``:

    - ``zero``: ``actual`` is exactly 0 everywhere, the oracle's is not;
    - ``sign``: ``-actual`` is within the bound everywhere;
    - ``factor``: ``actual`` is within the bound of ``c * expected`` everywhere for one
      constant ``c`` (the least-squares one), ``c`` not 1;
    - ``zero_where_wrong``: every element over its bound is exactly 0 (contributions missing).
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    b = torch.broadcast_to(bound.detach().to(a.device, torch.float64), e.shape)
    fin = torch.isfinite(a) & torch.isfinite(e)
    a, e, b = (torch.where(fin, t, torch.zeros_like(t)) for t in (a, e, b))
    if not bool((e != 0).any()):
        return None
    if not bool((a != 0).any()):
        return Pattern("zero", f"{name} is exactly 0 everywhere and the oracle's is not: "
                               f"never computed, or never written?")
    if bool(((-a - e).abs() <= b).all()):
        return Pattern("sign", f"a flipped sign: -{name} is within the bound everywhere")
    ee = float((e * e).sum())
    c = float((a * e).sum()) / ee if ee > 0 else math.nan
    if math.isfinite(c) and c != 0 and bool(((a - c * e).abs() <= b * max(1.0, abs(c))).all()):
        return Pattern("factor", f"off by a constant factor: {name} is {c:.4g} times the "
                                 f"oracle's{_factor_name(c)}")
    over = (a - e).abs() > b
    if bool(over.any()) and not bool((a[over] != 0).any()):
        return Pattern("zero_where_wrong", f"{name} is exactly 0 wherever it is wrong: "
                                           f"contributions missing?")
    return None


def nonfinite_pattern(name: str, actual: torch.Tensor, expected: torch.Tensor) -> Pattern | None:
    """The pattern of an output whose non-finite positions differ from the oracle's: NaN (or
    inf) where the oracle is finite, or finite where the oracle is infinite."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(a.device, torch.float64)
    nan = torch.isnan(a) & torch.isfinite(e)
    if bool(nan.any()):
        return Pattern("nan", f"NaN in {name} where the oracle's is finite (a NaN or inf read "
                              f"from a key row no valid slot selects?)")
    if bool((torch.isinf(a) & torch.isfinite(e)).any()):
        return Pattern("inf", f"inf in {name} where the oracle's is finite (an overflow?)")
    if bool((torch.isfinite(a) & ~torch.isfinite(e)).any()):
        return Pattern("finite", f"{name} is finite where the oracle's is not (+-inf on rows "
                                 f"without keys, a -inf or +inf sink?)")
    return None


def pattern_lines(failed) -> list[str]:
    """Per quantity, the most common pattern of its failing checks: ``failed`` is
    ``(quantity, Pattern or None)`` per failing check, in report order; returns lines such as
    ``"dsink: dsink is exactly 0 everywhere ... (32 of 35 failing checks)"`` (the phrase of
    the first check showing the pattern)."""
    by_q: dict = {}
    for q, pattern in failed:
        by_q.setdefault(q, []).append(pattern)
    lines = []
    for q, patterns in by_q.items():
        seen = Counter(p.key for p in patterns if p)
        if not seen:
            continue
        key, k = seen.most_common(1)[0]
        phrase = next(p.phrase for p in patterns if p and p.key == key)
        lines.append(f"{q}: {phrase} ({k} of {len(patterns)} failing check"
                     f"{'s' if len(patterns) != 1 else ''})")
    return lines
