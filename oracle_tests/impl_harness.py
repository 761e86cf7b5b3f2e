"""The implementations under test and how the oracle tests run and judge them.

Data flow: a :class:`fixtures.case.Case` -> its inputs (rounded once to the case's dtype) ->
:func:`run_impl` (the implementation's whole pipeline through :mod:`gpu_impl.api`, on its
device) -> :func:`judge` (the oracle evaluated on the exact inputs the implementation consumed,
including its own intermediates: scores, ids, ``out``, ``lse``, target, predict) -> a list of
:class:`Verdict` rows (exact checks, and error/bound ratios from ``reference.error_model``).

Implementations: the torch backend on the CPU (the CI lane), the torch and cuDNN backends on
CUDA (the GPU lane; marked ``gpu`` / ``cudnn`` so that conftest skips them without hardware).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import reference as R
from reference import error_model as EM
from fixtures.case import Case
from gpu_impl import api

F64 = torch.float64


@dataclass(frozen=True)
class Impl:
    """One implementation under test: a gpu_impl backend on a device."""

    backend: str
    device: str

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.device}"

    @property
    def request(self) -> str:
        """The ``backend`` argument passed to each op: ``"torch"``, or ``"auto"`` for cuDNN
        (cuDNN where its kernels run the op with these shapes, torch for the rest; every
        result records which backend ran, and the verdict table prints it)."""
        return "torch" if self.backend == "torch" else "auto"

    def precision(self, dtype: torch.dtype) -> EM.Precision:
        """Working precision (section 12): float32 accumulation and statistics, operands and
        outputs stored in the input dtype (bf16 for bf16 inputs)."""
        io = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        return EM.Precision(acc=torch.float32, io=io, stats=torch.float32)


TORCH_CPU = Impl("torch", "cpu")
TORCH_CUDA = Impl("torch", "cuda")
CUDNN_CUDA = Impl("cudnn", "cuda")

IMPLEMENTATIONS = [
    pytest.param(TORCH_CPU, id=TORCH_CPU.id),
    pytest.param(TORCH_CUDA, id=TORCH_CUDA.id, marks=pytest.mark.gpu),
    pytest.param(CUDNN_CUDA, id=CUDNN_CUDA.id, marks=[pytest.mark.gpu, pytest.mark.cudnn]),
]


def content_hash(tensors: dict) -> dict:
    """Per tensor, a hash of its dtype, shape and bytes (contract section 11: no mutation)."""
    out = {}
    for k, t in tensors.items():
        if isinstance(t, torch.Tensor):
            c = t.detach().to("cpu").contiguous().reshape(-1)
            h = hashlib.sha256(f"{c.dtype}{tuple(c.shape)}".encode())
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
            out[k] = h.hexdigest()
    return out


# --------------------------------------------------------------------------------------------
# running an implementation
# --------------------------------------------------------------------------------------------
def run_impl(impl: Impl, case: Case, x: dict, *, deterministic: bool = True,
             chunk_rows: int | None = None) -> dict:
    """The implementation's pipeline on ``x`` (tensors already on ``impl.device``): every output
    of :data:`fixtures.pipeline.OUTPUT_NAMES` it has, on its device, plus ``backends``.
    ``chunk_rows`` is passed to the ops that take it (row chunking of the implementation)."""
    b = dict(backend=impl.request, deterministic=deterministic)
    c = {} if chunk_rows is None else dict(chunk_rows=chunk_rows)
    lay = case.layout()
    res: dict = {"backends": {}}
    cmp_ids = None
    if case.is_layer:
        if case.layer == "csa":
            if case.scores == "indexer":
                sc = api.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], lay, case.ratio,
                                        **b, **c)
                res["backends"]["indexer_scores"] = sc.backend
                scores = sc.scores
            else:
                scores = x["index_scores"]
            top = api.stable_topk(scores, case.topk, order=case.order, **b)
            res["backends"]["stable_topk"] = top.backend
            res.update(scores=scores, cmp_ids=top.ids, cmp_lengths=top.lengths)
            cmp_ids = top.ids
        rows = api.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                     compressed_ids=cmp_ids, device=impl.device, **b)
        res["backends"]["build_csa_indices"] = rows.backend
        res.update(ids=rows.ids, lengths=rows.lengths)
        ids = rows.ids
        att_lengths = rows.lengths if case.lengths == "layer" else None
    else:
        ids, att_lengths = x["ids"], x.get("lengths")
    fwd = api.sparse_attention_forward(x["q"], x["kv"], ids, x["sink"], v_dim=case.v_dim,
                                       lengths=att_lengths, **b, **c)
    bwd = api.sparse_attention_backward(x["q"], x["kv"], ids, x["sink"], fwd.out, fwd.lse,
                                        x["dout"], v_dim=case.v_dim, lengths=att_lengths,
                                        **b, **c)
    res["backends"].update(sparse_attention_forward=fwd.backend,
                           sparse_attention_backward=bwd.backend)
    res.update(out=fwd.out, lse=fwd.lse, dq=bwd.dq, dkv=bwd.dkv, dsink=bwd.dsink)
    if case.is_layer and case.layer == "csa" and lay.num_real > 0:
        loss = api.sparse_indexer_loss(x["q"], x["kv_cmp"], x["sink"], fwd.lse, res["cmp_ids"],
                                       res["scores"], lay, coeff=case.coeff, **b, **c)
        res["backends"]["sparse_indexer_loss"] = loss.backend
        res.update(loss=loss.loss, kl=loss.kl, target=loss.target, predict=loss.predict)
        if case.scores == "indexer":
            g = api.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], res["cmp_ids"],
                                             loss.target, loss.predict, coeff=case.coeff,
                                             num_real=lay.num_real, **b, **c)
            res["backends"]["sparse_indexer_loss_grad"] = g.backend
            res.update(dq_idx=g.dq_idx, dw=g.dw, dk_idx=g.dk_idx)
    return res


# --------------------------------------------------------------------------------------------
# judging it against the oracle
# --------------------------------------------------------------------------------------------
class Verdict(NamedTuple):
    """One check: ``ratio`` is max error / bound (0 for a passing exact check, inf for a
    failing one); it passes iff ``ratio <= 1``."""

    name: str
    kind: str        # "exact" or "bound"
    ratio: float
    detail: str

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def _cpu64(t):
    return t.detach().to("cpu", F64)


def exact(name: str, got, want, what: str = "") -> Verdict:
    g = got.detach().to("cpu")
    w = want.detach().to("cpu")
    if g.shape != w.shape:
        return Verdict(name, "exact", math.inf, f"shape {tuple(g.shape)} != {tuple(w.shape)}")
    if g.is_floating_point() or w.is_floating_point():
        g, w = g.to(F64), w.to(F64)
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    else:
        same = g.to(torch.int64) == w.to(torch.int64)
    bad = (~same).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        return Verdict(name, "exact", math.inf,
                       f"{int((~same).sum())} entries differ{what}; first at {i}: "
                       f"got {g[i].item()}, want {w[i].item()}")
    return Verdict(name, "exact", 0.0, f"{same.numel()} entries equal{what}")


def bounded(name: str, got, want, bound) -> Verdict:
    """``max |got - want| / bound`` over entries where the oracle value is finite; non-finite
    oracle entries (``+-inf``) and zero bounds must match exactly."""
    g, w, b = _cpu64(got), _cpu64(want), _cpu64(bound)
    if g.shape != w.shape:
        return Verdict(name, "bound", math.inf, f"shape {tuple(g.shape)} != {tuple(w.shape)}")
    if bool(torch.isnan(g).any()):
        i = tuple(torch.isnan(g).nonzero()[0].tolist())
        return Verdict(name, "bound", math.inf, f"NaN in the implementation's result at {i}")
    fin = torch.isfinite(w)
    if not torch.equal(g[~fin], w[~fin]):
        return Verdict(name, "bound", math.inf, "non-finite oracle entries not matched exactly")
    err = (g - w).abs()
    zero_b = fin & (b <= 0)
    if bool((err[zero_b] > 0).any()):
        return Verdict(name, "bound", math.inf, "entries with a zero bound are not exact")
    pos = fin & (b > 0)
    if not bool(pos.any()):
        return Verdict(name, "bound", 0.0, "all entries exact")
    r = torch.where(pos, err / torch.where(pos, b, torch.ones_like(b)), torch.zeros_like(err))
    i = tuple((r == r.max()).nonzero()[0].tolist())
    return Verdict(name, "bound", float(r.max()),
                   f"max err/bound {float(r.max()):.3g} at {i} (err {float(err[i]):.3g}, "
                   f"bound {float(b[i]):.3g})")


def _forced_rows(scores: torch.Tensor, sel_ids: torch.Tensor, bound) -> torch.Tensor:
    """Rows whose Top-K set cannot change within the score bounds: every selected score minus
    its bound exceeds every unselected candidate's score plus its bound (section 12's
    near-tie exception, measured with the error model instead of a fixed ulp count)."""
    T, C = scores.shape
    b = torch.zeros_like(scores) if bound is None else bound.to(F64)
    sel = torch.zeros((T, C + 1), dtype=torch.bool)
    sel.scatter_(1, torch.where(sel_ids >= 0, sel_ids, torch.full_like(sel_ids, C)), True)
    sel = sel[:, :C]
    cand = torch.isfinite(scores)
    lo = torch.where(sel, scores - b, torch.full_like(scores, math.inf)).amin(dim=1) if C \
        else torch.full((T,), math.inf, dtype=F64)
    hi = torch.where(cand & ~sel, scores + b, torch.full_like(scores, -math.inf)).amax(dim=1) \
        if C else torch.full((T,), -math.inf, dtype=F64)
    return lo > hi


def judge(impl: Impl, case: Case, x: dict, got: dict) -> list[Verdict]:
    """Every check of ``got`` (from :func:`run_impl`) against the oracle on consumed inputs."""
    lay = case.layout()
    prec = impl.precision(case.torch_dtype)
    v: list[Verdict] = []
    xc = {k: t.to("cpu") for k, t in x.items()}
    ids = got["ids"] if case.is_layer else xc["ids"]
    lengths = (got["lengths"] if case.lengths == "layer" else None) if case.is_layer \
        else xc.get("lengths")
    ids_c = ids.to("cpu")
    len_c = None if lengths is None else lengths.to("cpu")
    if case.is_layer:
        if case.layer == "csa":
            scores = got["scores"].to("cpu")
            if case.scores == "indexer":
                s_o = R.indexer_scores(xc["q_idx"], xc["k_idx"], xc["weights"], lay, case.ratio)
                b = EM.indexer_scores_bound(xc["q_idx"], xc["k_idx"], xc["weights"], lay,
                                            case.ratio, s_o, precision=prec)
                v.append(bounded("scores", scores, s_o, b))
                v.append(exact("scores -inf pattern", torch.isinf(scores), torch.isinf(s_o)))
            else:
                s_o = xc["index_scores"].to(F64)
            # Top-K of the consumed scores: exact (ids under the case's order policy, lengths)
            t_ids, t_len = R.stable_topk(scores, case.topk, order=case.order)
            v.append(exact("cmp_ids", got["cmp_ids"], t_ids))
            v.append(exact("cmp_lengths", got["cmp_lengths"], t_len))
            # and the oracle's own selection, as sets, on every row whose selection the error
            # model forces (no selected score can fall below an unselected one within bounds)
            o_ids, o_len = R.stable_topk(s_o, case.topk, order="id")
            g_ids, _ = R.stable_topk(scores, case.topk, order="id")
            calm = _forced_rows(s_o, o_ids, b if case.scores == "indexer" else None)
            v.append(exact(f"cmp_ids vs oracle scores ({int(calm.sum())}/{calm.numel()} forced "
                           "rows)", g_ids[calm], o_ids[calm]))
            v.append(exact("cmp_lengths vs oracle scores", t_len, o_len))
        cmp = got.get("cmp_ids")
        r_ids, r_len = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                           compressed_ids=None if cmp is None else cmp.to("cpu"))
        v.append(exact("ids", got["ids"], r_ids))
        v.append(exact("lengths", got["lengths"], r_len))
    q, kv, sink, dout = xc["q"], xc["kv"], xc["sink"], xc["dout"]
    out_o, lse_o = R.sparse_attention_forward(q, kv, ids_c, sink, v_dim=case.v_dim, lengths=len_c)
    b_out, b_lse = EM.attention_forward_bound(q, kv, ids_c, sink, out_o, lse_o, precision=prec,
                                              v_dim=case.v_dim, lengths=len_c)
    v.append(bounded("out", got["out"], out_o, b_out))
    v.append(bounded("lse", got["lse"], lse_o, b_lse))
    empty = torch.isinf(lse_o[:, 0]) if lse_o.numel() else torch.zeros(0, dtype=torch.bool)
    v.append(exact("sink-only rows: out == 0", got["out"].to("cpu")[empty],
                   torch.zeros_like(out_o[empty])))
    v.append(exact("sink-only rows: lse == +inf", got["lse"].to("cpu")[empty], lse_o[empty]))
    out_i, lse_i = got["out"].to("cpu"), got["lse"].to("cpu")
    dq_o, dkv_o, ds_o = R.sparse_attention_backward(q, kv, ids_c, sink, out_i, lse_i, dout,
                                                    v_dim=case.v_dim, lengths=len_c)
    b_dq, b_dkv, b_ds = EM.attention_backward_bound(q, kv, ids_c, sink, out_i, lse_i, dout,
                                                    dq_o, dkv_o, ds_o, precision=prec,
                                                    v_dim=case.v_dim, lengths=len_c)
    v.append(bounded("dq", got["dq"], dq_o, b_dq))
    v.append(bounded("dkv", got["dkv"], dkv_o, b_dkv))
    v.append(bounded("dsink", got["dsink"], ds_o, b_ds))
    v.append(exact("sink-only rows: dq == 0", got["dq"].to("cpu")[empty],
                   torch.zeros_like(dq_o[empty])))
    if "loss" in got:
        scores = got["scores"].to("cpu")
        cmp = got["cmp_ids"].to("cpu")
        L = R.sparse_indexer_loss(q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay,
                                  coeff=case.coeff)
        LB = EM.indexer_loss_bound(q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay, L,
                                   coeff=case.coeff, precision=prec)
        for name in ("loss", "kl", "target", "predict"):
            v.append(bounded(name, got[name], getattr(L, name), getattr(LB, name)))
        if "dq_idx" in got:
            tgt, prd = got["target"].to("cpu"), got["predict"].to("cpu")
            g_o = R.sparse_indexer_loss_grad(xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt,
                                             prd, coeff=case.coeff, num_real=lay.num_real)
            g_b = EM.indexer_loss_grad_bound(xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt,
                                             prd, *g_o, coeff=case.coeff,
                                             num_real=lay.num_real, precision=prec)
            for name, a, o, bb in zip(("dq_idx", "dw", "dk_idx"),
                                      (got["dq_idx"], got["dw"], got["dk_idx"]), g_o, g_b):
                v.append(bounded(name, a, o, bb))
    return v


def assert_verdicts(verdicts: list[Verdict], label: str = "") -> None:
    """Fail with every failing row; print the whole table (``pytest -rA`` shows it)."""
    table = "\n".join(f"  {'ok ' if x.ok else 'BAD'} {x.kind:5s} {x.name:48s} "
                      f"ratio={x.ratio:.3g}  {x.detail}" for x in verdicts)
    print(f"{label}\n{table}")
    bad = [x for x in verdicts if not x.ok]
    assert not bad, f"{label}: {len(bad)} check(s) failed\n{table}"
