"""The contract's rejection rules, checked: inputs an op must refuse, and the error it must raise.

The contract names values an op may not accept (section 4: a NaN score; section 6: unsigned
64-bit ids, a NaN ``lse`` handed to the backward; section 8: a ``+inf`` index score on a
selected slot, an ``lse`` of ``-inf``, a negative ``target`` or ``predict``). An op that
computes something from them instead (ranks a NaN first, wraps an unsigned id into "no
selection") passes every valid input and still returns garbage on these. Each
:class:`Rejection` takes the valid inputs an op consumed in the judged run, changes one value
as the contract describes, calls the adapter's op once more (through
:func:`dsv4_oracle.invoke.call_op`, never on its valid path) and requires the named exception
type with the argument's name in its message: quantity ``rejects``.

They run on a few small catalog cases (:data:`REJECTION_CASES`) that together reach every op.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .compare import CheckResult
from .invoke import OpError, call_op

__all__ = ["Rejection", "REJECTIONS", "REJECTION_CASES", "check_rejections"]

# small quick-catalog cases whose pipelines reach every op: a CSA layer with padding, the
# DeepSeek-V3.2 DSA configuration, and an op-level case with int64 ids
REJECTION_CASES = ("padding-edge-layout", "dsa-padded", "hostile-ids-int64")


class Rejection(NamedTuple):
    """One rule: ``op`` must raise ``error`` naming ``argument`` when ``change`` (``(reads) ->
    reads`` with one value made illegal, or ``None`` when the case has no place for it) is
    applied to the inputs it consumed (contract ``section``); ``applies(policies)``: whether
    the op reads that value under the declared policies."""

    op: str
    what: str
    section: str
    error: type
    argument: str
    change: Callable
    applies: Callable = lambda pol: True


def _first(mask: torch.Tensor):
    """The index tuple of the first True element of ``mask`` (``None`` if none)."""
    hit = torch.nonzero(mask)
    return tuple(hit[0].tolist()) if hit.numel() else None


def _set(t: torch.Tensor, mask: torch.Tensor, value) -> torch.Tensor | None:
    """A copy of ``t`` with ``value`` at the first element where ``mask`` holds."""
    at = _first(mask)
    if at is None:
        return None
    out = t.detach().clone()
    out[at] = value
    return out


def _with(v: dict, name: str, t) -> dict | None:
    return None if t is None else {**v, name: t}


def _nan_score(v):
    s = v["scores"]
    return _with(v, "scores", _set(s, torch.isfinite(s), math.nan))


def _uint64_ids(v):
    ids = v["ids"]
    if not hasattr(torch, "uint64"):
        return None
    return _with(v, "ids", ids.detach().clamp_min(0).to(torch.uint64))


def _nan_lse(v):
    lse = v["lse"]
    return _with(v, "lse", _set(lse, torch.isfinite(lse), math.nan))


def _neg_inf_lse(v):
    lse = v["loss_lse"]
    return _with(v, "loss_lse", _set(lse, torch.isfinite(lse), -math.inf))


def _inf_selected_score(v):
    ids, s = v["loss_ids"], v["scores"]
    C = s.shape[1]
    ok = (ids >= 0) & (ids < C)
    at = _first(ok)
    if at is None:
        return None
    t, j = at
    s = s.detach().clone()
    s[t, int(ids[t, j])] = math.inf
    return _with(v, "scores", s)


def _negative(name):
    def change(v):
        t = v[name]
        return _with(v, name, _set(t, t > 0, -0.5))
    return change


REJECTIONS = (
    Rejection("stable_topk", "a NaN score", "4", ValueError, "scores", _nan_score),
    Rejection("sparse_attention_forward", "unsigned 64-bit ids", "6", TypeError, "ids",
              _uint64_ids),
    Rejection("sparse_attention_backward", "unsigned 64-bit ids", "6", TypeError, "ids",
              _uint64_ids),
    Rejection("sparse_attention_backward", "a NaN lse", "6", ValueError, "lse", _nan_lse),
    Rejection("sparse_indexer_loss", "+inf index score at a selected slot", "8", ValueError,
              "index_scores", _inf_selected_score),
    # the dense teacher (section 5.2) normalises each head itself: it does not read lse
    Rejection("sparse_indexer_loss", "an lse of -inf", "8", ValueError, "lse", _neg_inf_lse,
              lambda pol: pol["teacher"] == "sparse"),
    Rejection("sparse_indexer_loss_grad", "a negative target", "8", ValueError, "target",
              _negative("target")),
    Rejection("sparse_indexer_loss_grad", "a negative predict", "8", ValueError, "predict",
              _negative("predict")),
)


def _verdict(rule: Rejection, exc: BaseException | None, message: str) -> CheckResult:
    name = f"rejects: {rule.op}: {rule.what}"
    if exc is None:
        return CheckResult(name, "rejects", False, None, None,
                           f"accepted {rule.what} and returned a result; contract section "
                           f"{rule.section} requires {rule.error.__name__} naming "
                           f"{rule.argument!r}")
    ok_type = isinstance(exc, rule.error)
    ok_name = rule.argument in str(exc)
    passed = ok_type and ok_name
    detail = (f"raised {type(exc).__name__} naming {rule.argument!r}" if passed else
              f"raised {message}; contract section {rule.section} requires "
              f"{rule.error.__name__} naming {rule.argument!r}")
    return CheckResult(name, "rejects", passed, None, None if passed else 1, detail)


def check_rejections(adapter, case, x: dict, consumed: dict, *, policies=None,
                     level: str = "op") -> list[CheckResult]:
    """The :data:`REJECTIONS` of every op ``adapter`` provides and ``case`` reaches, each on
    the inputs that op consumed in the judged run (``consumed``, the op-level pipeline's)
    with one value made illegal. Each check carries quantity ``rejects``."""
    from .conformance import _STAGE, _read, _moved
    from dsv4_oracle.reference.contract_policies import resolve_policies
    pol = resolve_policies(policies)
    out = []
    lay = case.layout()
    for rule in REJECTIONS:
        st = _STAGE[rule.op]
        if not adapter.has(rule.op) or not st.applies(case) or not rule.applies(pol):
            continue
        try:
            v = {r: _read(case, r, x, consumed, pol=pol, oracle=False) for r in st.reads}
        except KeyError:                 # an input this pipeline never produced
            continue
        if any(not isinstance(t, torch.Tensor) for k, t in v.items()
               if k in ("scores", "ids", "lse", "loss_lse", "loss_ids", "teacher_ids", "target",
                        "predict")):
            continue
        bad = rule.change(v)
        if bad is None:
            continue
        args, kw = st.call(case, lay, _moved(bad, adapter.device))
        try:
            call_op(adapter.op(rule.op), rule.op, args, kw)
            exc, message = None, ""
        except OpError as err:
            if err.kind != "error" or err.__cause__ is None:
                exc, message = RuntimeError(err.message), err.message
            else:
                exc, message = err.__cause__, err.message
        c = _verdict(rule, exc, message)
        out.append(CheckResult(c.name, c.kind, c.passed, c.ratio, c.mismatches, c.detail,
                               {"quantity": "rejects", "level": level, "op": rule.op}))
    return out
