"""Conformance of one implementation on one case: run it, then judge it against the oracle.

This module and :mod:`dsv4_oracle.compare` are the comparison engine that both the pytest
suite (``oracle_tests/impl_harness.py``, ``test_impl_*.py``, the CP lane) and the
``dsv4-oracle check`` command use; there is no second copy of these rules.

Data flow (contract section 12: the oracle is evaluated on the exact inputs the implementation
consumed, including its own intermediates):

    case.materialize()  ->  run_ops / run_layer (the adapter's pipeline)  ->  Run(got, consumed)
                        ->  judge(case, inputs, got, consumed)  ->  [CheckResult, ...]

- :func:`run_ops`: the op-level pipeline (indexer scores -> Top-K -> CSA rows -> attention
  forward -> backward -> indexer loss -> loss gradients). Each op the adapter provides runs on
  what the previous ops produced; an op it lacks is replaced by the oracle's result, rounded as
  a kernel would store it (int32 ids, float32 statistics, ``out`` in the input dtype), so that
  the adapter's own ops still get realistic inputs. Only the adapter's outputs are judged.
- :func:`run_layer`: the packed layer (``csa_layer``): forward, then autograd backward of
  ``out`` (upstream ``dout``) and of the indexer loss (upstream 1).
- :func:`judge`: exact checks (Top-K sets/lengths/order policy on the consumed scores, and as
  sets on the oracle's scores with near ties excluded; CSA rows; sink-only rows) and
  error/bound ratios
  (``reference.error_model``) for every numeric output. Every check carries the quantity it
  judges (``extra["quantity"]``), one of :data:`QUANTITIES`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

import reference as R
from reference import error_model as EM
from reference._checks import as_device, compute_on, to_cpu

from .adapters import Adapter
from .invoke import OpError, call_op, where
from .compare import (CheckResult, compare_exact, compare_numeric, compare_topk, content_hash,
                      near_tie_rows)

__all__ = ["QUANTITIES", "FORWARD_OUTPUTS", "BACKWARD_OPS", "Run", "OpError", "run_ops", "run_layer", "layer_applies", "judge",
           "tensors_of", "error_ratio_map"]

F64 = torch.float64

# quantity -> (contract section, what it is); the report's rows, in pipeline order
QUANTITIES = {
    "scores": ("7", "indexer scores [T, C]"),
    "cmp_ids": ("4", "Top-K compressed ids: sets, lengths, order policy"),
    "ids": ("5", "CSA key-id rows"),
    "lengths": ("5", "valid entries per CSA row"),
    "out": ("6", "attention output [T, H, Dv]"),
    "lse": ("6", "log-sum-exp without the sink [T, H]"),
    "sink_only": ("3, 6", "rows with no key: out 0, lse +inf, dq 0"),
    "dq": ("6", "gradient wrt q"),
    "dkv": ("6", "gradient wrt the key buffer"),
    "dsink": ("6", "gradient wrt the sink"),
    "loss": ("8", "indexer KL loss"),
    "kl": ("8", "per-row KL"),
    "target": ("8", "teacher distribution"),
    "predict": ("8", "student distribution"),
    "dq_idx": ("8", "gradient wrt q_idx"),
    "dw": ("8", "gradient wrt the indexer weights"),
    "dk_idx": ("8", "gradient wrt k_idx"),
    "replays": ("11", "bitwise identical replays"),
    "grad_modes": ("11", "identical bits in no_grad / inference_mode / grad-enabled"),
    "no_mutation": ("11", "no input modified"),
    "run": ("-", "the implementation ran without raising"),
}


# the outputs of the forward pipeline (what section 11's grad-mode parity compares)
FORWARD_OUTPUTS = ("scores", "cmp_ids", "cmp_lengths", "ids", "lengths", "out", "lse", "loss",
                   "kl", "target", "predict")


class Run(NamedTuple):
    """One pipeline run: ``got`` the adapter's outputs (judged), ``consumed`` what each op was
    fed (the adapter's outputs, or the oracle's where the adapter lacks the op), ``backends``
    op -> the backend that ran it."""

    got: dict
    consumed: dict
    backends: dict


def tensors_of(d: dict) -> dict:
    """The tensor entries of a dict (for replays, parity and hashing)."""
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------
# running an adapter
# ---------------------------------------------------------------------------------------------
def _fields(op: str, res, n: int) -> tuple:
    """The first ``n`` tensor fields of an op's result (a tensor when ``n == 1``, or a
    tuple/NamedTuple); anything else is an :class:`OpError`."""
    if n == 1 and isinstance(res, torch.Tensor):
        return (res,)
    if not isinstance(res, (tuple, list)) or len(res) < n:
        raise OpError(op, f"returned {type(res).__name__}, expected a tuple of {n} tensors")
    out = tuple(res[:n])
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise OpError(op, f"field {i} of its result is {type(t).__name__}, not a tensor")
    return out


def _call(adapter: Adapter, backends: dict, op: str, n: int, *args, **kwargs) -> tuple:
    res = call_op(adapter.op(op), op, args, kwargs)
    b = getattr(res, "backend", None)
    backends[op] = b if isinstance(b, str) else adapter.name
    return _fields(op, res, n)


BACKWARD_OPS = ("sparse_attention_backward", "sparse_indexer_loss_grad")


def run_ops(adapter: Adapter, case, x: dict, *, ops=None, backward: bool = True) -> Run:
    """The op-level pipeline of ``case`` on the inputs ``x`` (on ``adapter.device``).

    ``ops``: restrict to these op names (default: every op the adapter provides);
    ``backward=False`` skips the gradient ops (the forward of section 11's grad-mode parity).
    Raises :class:`OpError` when an op raises or returns a malformed result.
    """
    dev = adapter.device
    lay = case.layout()
    use = lambda op: (adapter.has(op) and (ops is None or op in ops)  # noqa: E731
                      and (backward or op not in BACKWARD_OPS))
    got: dict = {}
    con: dict = {}
    backends: dict = {}

    def filled(t, dtype):
        return t.to(dtype).to(dev)

    if case.is_layer:
        cmp_ids = None
        if case.has_indexer:
            if case.scores == "indexer":
                if use("indexer_scores"):
                    (s,) = _call(adapter, backends, "indexer_scores", 1, x["q_idx"], x["k_idx"],
                                 x["weights"], lay, case.ratio)
                    got["scores"] = s
                else:
                    s = filled(R.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], lay,
                                                case.ratio), torch.float32)
            else:
                s = x["index_scores"]
            con["scores"] = s
            if use("stable_topk"):
                c_ids, c_len = _call(adapter, backends, "stable_topk", 2, s, case.topk,
                                     order=case.order)
                got.update(cmp_ids=c_ids, cmp_lengths=c_len)
            else:
                c_ids, c_len = (filled(t, torch.int32) for t in
                                R.stable_topk(s, case.topk, order=case.order))
            con.update(cmp_ids=c_ids, cmp_lengths=c_len)
            cmp_ids = c_ids
        if use("build_csa_indices"):
            ids, lengths = _call(adapter, backends, "build_csa_indices", 2, lay,
                                 window=case.window, ratio=case.ratio, compressed_ids=cmp_ids)
            got.update(ids=ids, lengths=lengths)
        else:
            ids, lengths = (filled(t, torch.int32) for t in R.build_csa_indices(
                lay, window=case.window, ratio=case.ratio,
                compressed_ids=None if cmp_ids is None else cmp_ids.to("cpu")))
        con.update(ids=ids, lengths=lengths)
        ids, lengths = ids.to(dev), lengths.to(dev)
        att_lengths = lengths if case.lengths == "layer" else None
    else:
        ids, att_lengths = x["ids"], x.get("lengths")
    loss_stage = (case.is_layer and case.has_indexer and lay.num_real > 0
                  and (use("sparse_indexer_loss")
                       or (use("sparse_indexer_loss_grad") and case.scores == "indexer")))
    if use("sparse_attention_forward"):
        out, lse = _call(adapter, backends, "sparse_attention_forward", 2, x["q"], x["kv"], ids,
                         x["sink"], v_dim=case.v_dim, lengths=att_lengths)
        got.update(out=out, lse=lse)
    elif use("sparse_attention_backward") or loss_stage:
        o, l_ = R.sparse_attention_forward(x["q"], x["kv"], ids, x["sink"], v_dim=case.v_dim,
                                           lengths=att_lengths)
        out, lse = filled(o, x["q"].dtype), filled(l_, torch.float32)
    else:
        out = lse = None
    if out is not None:
        con.update(out=out, lse=lse)
    if use("sparse_attention_backward"):
        dq, dkv, dsink = _call(adapter, backends, "sparse_attention_backward", 3, x["q"],
                               x["kv"], ids, x["sink"], out.to(dev), lse.to(dev), x["dout"],
                               v_dim=case.v_dim, lengths=att_lengths)
        got.update(dq=dq, dkv=dkv, dsink=dsink)
    if loss_stage:
        scores, c_ids = con["scores"].to(dev), con["cmp_ids"].to(dev)
        if use("sparse_indexer_loss"):
            loss, kl, target, predict = _call(adapter, backends, "sparse_indexer_loss", 4,
                                              x["q"], x["kv_cmp"], x["sink"], lse.to(dev),
                                              c_ids, scores, lay, coeff=case.coeff)
            got.update(loss=loss, kl=kl, target=target, predict=predict)
        else:
            L = R.sparse_indexer_loss(x["q"], x["kv_cmp"], x["sink"], lse, c_ids, scores, lay,
                                      coeff=case.coeff)
            target, predict = filled(L.target, torch.float32), filled(L.predict, torch.float32)
        con.update(target=target, predict=predict)
        if case.scores == "indexer" and use("sparse_indexer_loss_grad"):
            dq_idx, dw, dk_idx = _call(adapter, backends, "sparse_indexer_loss_grad", 3,
                                       x["q_idx"], x["k_idx"], x["weights"], c_ids,
                                       target.to(dev), predict.to(dev), coeff=case.coeff,
                                       num_real=lay.num_real)
            got.update(dq_idx=dq_idx, dw=dw, dk_idx=dk_idx)
    return Run(got, con, backends)


LAYER_LEAVES = ("q", "kv_raw", "kv_cmp", "sink", "q_idx", "k_idx", "weights")


def layer_applies(case) -> bool:
    """The packed layer runs on layer cases whose indexer scores it computes itself."""
    return case.is_layer and case.scores == "indexer"


def run_layer(adapter: Adapter, case, x: dict, *, backward: bool = True) -> Run:
    """The packed layer of ``case``: ``adapter.csa_layer`` forward on leaf copies of the inputs
    and, with ``backward``, autograd backward of ``out`` (upstream ``x["dout"]``) and of the
    indexer loss (upstream 1). A leaf that autograd gives no gradient gets zeros (no flow)."""
    op = "csa_layer"
    lay = case.layout()
    train = backward and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    leaf = {k: x[k].detach().clone().requires_grad_(train) for k in LAYER_LEAVES
            if k in x and not (k == "kv_cmp" and case.ratio == 0)
            and not (k in ("q_idx", "k_idx", "weights") and not case.has_indexer)}
    kw = dict(window=case.window, ratio=case.ratio, v_dim=case.v_dim, coeff=case.coeff,
              order=case.order)
    if case.ratio:
        kw["kv_cmp"] = leaf["kv_cmp"]
    if case.has_indexer:
        kw.update(q_idx=leaf["q_idx"], k_idx=leaf["k_idx"], weights=leaf["weights"],
                  topk=case.topk)
    try:
        res = adapter.op(op)(leaf["q"], leaf["kv_raw"], leaf["sink"], lay, **kw)
        if train:
            roots, grads = [res.out], [x["dout"]]
            if isinstance(res.loss, torch.Tensor) and res.loss.requires_grad:
                roots.append(res.loss)
                grads.append(torch.ones_like(res.loss))
            torch.autograd.backward(roots, grads)
    except Exception as exc:
        raise OpError(op, f"raised {type(exc).__name__}: {exc}{where(exc)}") from exc
    b = getattr(res, "backends", None)
    backends = dict(b) if isinstance(b, dict) else {op: adapter.name}
    try:
        got = dict(out=res.out.detach(), lse=res.lse, ids=res.ids, lengths=res.lengths)
        if case.has_indexer:
            got.update(scores=res.index_scores, cmp_ids=res.compressed_ids,
                       cmp_lengths=res.compressed_lengths)
            L = getattr(res, "indexer_loss", None)
            if L is not None:
                got["loss"] = res.loss.detach()
                for k in ("kl", "target", "predict"):
                    got[k] = getattr(L, k)
    except AttributeError as exc:
        raise OpError(op, f"its result lacks a field of the protocol ({exc})") from exc
    if train:
        g = lambda k: (leaf[k].grad if leaf[k].grad is not None  # noqa: E731
                       else torch.zeros_like(leaf[k]))
        got["dq"], got["dsink"] = g("q"), g("sink")
        got["dkv"] = torch.cat([g("kv_raw")] + ([g("kv_cmp")] if case.ratio else []))
        if case.has_indexer and "loss" in got:
            got.update(dq_idx=g("q_idx"), dw=g("weights"), dk_idx=g("k_idx"))
    for k, v in got.items():
        if not isinstance(v, torch.Tensor):
            raise OpError(op, f"result field {k} is {type(v).__name__}, not a tensor")
    return Run(got, dict(got), backends)


# ---------------------------------------------------------------------------------------------
# judging against the oracle
# ---------------------------------------------------------------------------------------------
def _tagged(res: CheckResult, quantity: str) -> CheckResult:
    return dataclasses.replace(res, extra={**res.extra, "quantity": quantity})


def _numeric(name: str, actual, expected, bound) -> CheckResult:
    """:func:`compare_numeric`, plus a diagnosis when it fails: if ``-actual`` is within the
    bound everywhere, the detail says so (a flipped sign is the likeliest cause)."""
    res = compare_numeric(name, actual, expected, bound)
    if res.passed or res.ratio is None or not math.isfinite(res.ratio) or \
            tuple(actual.shape) != tuple(expected.shape):
        return res
    neg = compare_numeric(name, -actual.detach().to("cpu", F64), expected, bound)
    if neg.passed:
        return dataclasses.replace(
            res, detail=res.detail + "; -actual is within the bound everywhere: a flipped sign?",
            extra={**res.extra, "hint": "sign"})
    return res


def _key(*parts):
    """A cache key from tensors (content hashes) and plain values."""
    out = []
    for p in parts:
        if isinstance(p, torch.Tensor):
            out.append(content_hash(p))
        else:
            out.append(p)
    return tuple(out)


def _memo(cache, name, fn, *parts):
    if cache is None:
        return fn()
    k = (name,) + _key(*parts)
    if k not in cache:
        cache[k] = fn()
    return cache[k]


def _on_device(device):
    """``run(fn)``: ``fn()`` with the oracle computing on ``device`` and its results moved to
    the CPU (``None``: the CPU oracle, unchanged)."""
    if device is None:
        return lambda fn: fn()
    dev = as_device(device, "oracle_device")

    def run(fn):
        with compute_on(dev):
            return to_cpu(fn())
    return run


def error_ratio_map(actual, expected, bound) -> torch.Tensor:
    """Per ``(row, head)`` the largest ``|actual - expected| / bound`` over the trailing
    dimensions (0 where equal, ``inf`` where a non-finite value differs or a zero bound is
    broken), float64 ``[T, H]`` (``[T, 1]`` for 1-D tensors). Shapes must match."""
    a = actual.detach().to("cpu", F64)
    e = expected.detach().to("cpu", F64)
    b = torch.broadcast_to(bound.detach().to("cpu", F64), e.shape)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    fin = torch.isfinite(a) & torch.isfinite(e)
    err = torch.where(fin, (a - e).abs(), torch.full_like(a, math.inf))
    r = torch.where(same, torch.zeros_like(a), err / b)
    r = torch.nan_to_num(r, nan=math.inf)
    if r.dim() == 1:
        return r.unsqueeze(1)
    return r.reshape(r.shape[0], r.shape[1], -1).amax(dim=2) if r.shape[-1] else \
        torch.zeros(r.shape[:2], dtype=F64)


def judge(case, x: dict, got: dict, *, precision: EM.Precision, consumed: dict | None = None,
          cache: dict | None = None, maps: dict | None = None,
          oracle_device=None) -> list[CheckResult]:
    """Every check of ``got`` against the oracle on the consumed inputs (section 12).

    ``x``: the case's inputs as the implementation received them; ``got``: its outputs (only
    the quantities present are judged); ``consumed``: what each op was fed (defaults to
    ``got``; intermediates missing from both come from ``x`` or the oracle); ``precision``:
    the implementation's working precision for the error model. ``cache`` (a dict, per case)
    memoises oracle evaluations on identical consumed inputs (op and layer levels of one
    case). ``maps``, when a dict, receives per ``(row, head)`` error/bound maps of ``out``,
    ``lse``, ``dq`` and the row flags ``padding`` and ``sink_only`` (for the report's heat map).
    ``oracle_device`` (default: the CPU, the oracle's definition) runs the memoised oracle and
    error-model evaluations on that device (``reference._checks.compute_on``); their results
    come back to the CPU.
    """
    con = dict(got if consumed is None else consumed)
    lay = case.layout()
    prec = precision
    v: list[CheckResult] = []
    xc = {k: t.detach().to("cpu") for k, t in x.items()}
    cpu = lambda t: None if t is None else t.detach().to("cpu")  # noqa: E731
    on = _on_device(oracle_device)
    memo = lambda name, fn, *parts: _memo(cache, name, lambda: on(fn), prec, *parts)  # noqa: E731

    if case.is_layer:
        cmp_ids = None
        if case.has_indexer:
            b_s = None
            if case.scores == "indexer":
                s_o = memo("scores", lambda: R.indexer_scores(
                    xc["q_idx"], xc["k_idx"], xc["weights"], lay, case.ratio),
                    xc["q_idx"], xc["k_idx"], xc["weights"])
                b_s = memo("scores_bound", lambda: EM.indexer_scores_bound(
                    xc["q_idx"], xc["k_idx"], xc["weights"], lay, case.ratio, s_o,
                    precision=prec), xc["q_idx"], xc["k_idx"], xc["weights"])
                if "scores" in got:
                    v.append(_tagged(_numeric("scores", got["scores"], s_o, b_s), "scores"))
            else:
                s_o = xc["index_scores"].to(F64)
            scores = cpu(con.get("scores", got.get("scores")))
            if scores is None:
                scores = s_o
            if "cmp_ids" in got:
                # Top-K of the consumed scores: exact sets, lengths and the case's order policy
                t_ids, t_len = R.stable_topk(scores, case.topk, order=case.order)
                v.append(_tagged(compare_topk(got["cmp_ids"], got["cmp_lengths"], t_ids, t_len,
                                              order=case.order,
                                              name="cmp_ids (consumed scores)"), "cmp_ids"))
                if "scores" in got and case.topk >= 1:
                    # the oracle's own selection, as sets, rows whose K-th and (K+1)-th scores
                    # are within a few float32 ulps or within their error bounds excluded
                    o_ids, o_len = R.stable_topk(s_o, case.topk, order=case.order)
                    ties = near_tie_rows(s_o, case.topk, bound=b_s)
                    v.append(_tagged(compare_topk(got["cmp_ids"], got["cmp_lengths"], o_ids,
                                                  o_len, near_tie_rows=ties,
                                                  name="cmp_ids (oracle scores, sets)"),
                                     "cmp_ids"))
            cmp_ids = cpu(con.get("cmp_ids"))
            if cmp_ids is None:
                cmp_ids, _ = R.stable_topk(scores, case.topk, order=case.order)
        if "ids" in got:
            r_ids, r_len = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                               compressed_ids=cmp_ids)
            v.append(_tagged(compare_exact("ids", got["ids"], r_ids), "ids"))
            v.append(_tagged(compare_exact("lengths", got["lengths"], r_len), "lengths"))
        ids_c, len_c = cpu(con.get("ids")), cpu(con.get("lengths"))
        if ids_c is None:
            ids_c, len_c = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                               compressed_ids=cmp_ids)
        if case.lengths != "layer":
            len_c = None
    else:
        ids_c, len_c = xc["ids"], xc.get("lengths")

    q, kv, sink, dout = xc["q"], xc["kv"], xc["sink"], xc["dout"]
    need_fwd = any(k in got for k in ("out", "lse", "dq", "dkv", "dsink"))
    if need_fwd or maps is not None:
        out_o, lse_o = memo("fwd", lambda: R.sparse_attention_forward(
            q, kv, ids_c, sink, v_dim=case.v_dim, lengths=len_c), q, kv, ids_c, sink, len_c)
        empty = torch.isinf(lse_o[:, 0]) if lse_o.numel() else torch.zeros(lay.num_rows,
                                                                            dtype=torch.bool)
        if maps is not None:
            maps["padding"] = ~lay.is_real
            maps["sink_only"] = empty
    if "out" in got:
        b_out, b_lse = memo("fwd_bound", lambda: EM.attention_forward_bound(
            q, kv, ids_c, sink, out_o, lse_o, precision=prec, v_dim=case.v_dim, lengths=len_c),
            q, kv, ids_c, sink, len_c)
        v.append(_tagged(_numeric("out", got["out"], out_o, b_out), "out"))
        v.append(_tagged(_numeric("lse", got["lse"], lse_o, b_lse), "lse"))
        g_out, g_lse = cpu(got["out"]), cpu(got["lse"])
        if g_out.shape == out_o.shape:
            v.append(_tagged(compare_exact("sink-only rows: out == 0", g_out[empty],
                                           torch.zeros_like(out_o[empty])), "sink_only"))
        if g_lse.shape == lse_o.shape:
            v.append(_tagged(compare_exact("sink-only rows: lse == +inf", g_lse[empty],
                                           lse_o[empty].to(g_lse.dtype)), "sink_only"))
        if maps is not None:
            if g_out.shape == out_o.shape:
                maps["out"] = error_ratio_map(g_out, out_o, b_out)
            if g_lse.shape == lse_o.shape:
                maps["lse"] = error_ratio_map(g_lse, lse_o, b_lse)
    out_i, lse_i = cpu(con.get("out")), cpu(con.get("lse"))
    if out_i is None and need_fwd:
        out_i, lse_i = out_o, lse_o
    if "dq" in got:
        dq_o, dkv_o, ds_o = memo("bwd", lambda: R.sparse_attention_backward(
            q, kv, ids_c, sink, out_i, lse_i, dout, v_dim=case.v_dim, lengths=len_c),
            q, kv, ids_c, sink, out_i, lse_i, dout, len_c)
        b_dq, b_dkv, b_ds = memo("bwd_bound", lambda: EM.attention_backward_bound(
            q, kv, ids_c, sink, out_i, lse_i, dout, dq_o, dkv_o, ds_o, precision=prec,
            v_dim=case.v_dim, lengths=len_c), q, kv, ids_c, sink, out_i, lse_i, dout, len_c)
        v.append(_tagged(_numeric("dq", got["dq"], dq_o, b_dq), "dq"))
        v.append(_tagged(_numeric("dkv", got["dkv"], dkv_o, b_dkv), "dkv"))
        v.append(_tagged(_numeric("dsink", got["dsink"], ds_o, b_ds), "dsink"))
        g_dq = cpu(got["dq"])
        if g_dq.shape == dq_o.shape:
            v.append(_tagged(compare_exact("sink-only rows: dq == 0", g_dq[empty],
                                           torch.zeros_like(dq_o[empty])), "sink_only"))
            if maps is not None:
                maps["dq"] = error_ratio_map(g_dq, dq_o, b_dq)
    if "loss" in got or "dq_idx" in got:
        scores = cpu(con["scores"]) if "scores" in con else xc.get("index_scores")
        cmp = cpu(con["cmp_ids"])
        if "loss" in got:
            L = memo("loss", lambda: R.sparse_indexer_loss(
                q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay, coeff=case.coeff),
                q, xc["kv_cmp"], sink, lse_i, cmp, scores, case.coeff)
            LB = memo("loss_bound", lambda: EM.indexer_loss_bound(
                q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay, L, coeff=case.coeff,
                precision=prec), q, xc["kv_cmp"], sink, lse_i, cmp, scores, case.coeff)
            for name in ("loss", "kl", "target", "predict"):
                v.append(_tagged(_numeric(name, got[name], getattr(L, name),
                                                 getattr(LB, name)), name))
        if "dq_idx" in got:
            tgt, prd = cpu(con["target"]), cpu(con["predict"])
            g_o = memo("grad", lambda: R.sparse_indexer_loss_grad(
                xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt, prd, coeff=case.coeff,
                num_real=lay.num_real), xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt, prd,
                case.coeff)
            g_b = memo("grad_bound", lambda: EM.indexer_loss_grad_bound(
                xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt, prd, *g_o, coeff=case.coeff,
                num_real=lay.num_real, precision=prec), xc["q_idx"], xc["k_idx"],
                xc["weights"], cmp, tgt, prd, case.coeff)
            for name, o, bb in zip(("dq_idx", "dw", "dk_idx"), g_o, g_b):
                v.append(_tagged(_numeric(name, got[name], o, bb), name))
    return v

