"""The implementations under test and how the oracle tests run and judge them.

Data flow: a :class:`fixtures.case.Case` -> its inputs (rounded once to the case's dtype) ->
:func:`run_impl` (the implementation's whole pipeline through :mod:`gpu_impl.api`, on its
device) -> :func:`judge` (the oracle evaluated on the exact inputs the implementation consumed,
including its own intermediates: scores, ids, ``out``, ``lse``, target, predict) -> a list of
:class:`dsv4_oracle.compare.CheckResult` rows (exact and Top-K checks, and error/bound ratios
from ``reference.error_model``) -> :func:`assert_checks` (the table, and the verdict).

Implementations: the torch backend on the CPU (the CI lane), the torch and cuDNN backends on
CUDA (the GPU lane; marked ``gpu`` / ``cudnn`` so that conftest skips them without hardware).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
import torch

import reference as R
from dsv4_oracle import compare as C
from fixtures.case import Case
from gpu_impl import api
from reference import error_model as EM

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
# judging it against the oracle (dsv4_oracle.compare: one comparison engine for suite and CLI)
# --------------------------------------------------------------------------------------------
def judge(impl: Impl, case: Case, x: dict, got: dict) -> list[C.CheckResult]:
    """Every check of ``got`` (from :func:`run_impl`) against the oracle on consumed inputs."""
    lay = case.layout()
    prec = impl.precision(case.torch_dtype)
    v: list[C.CheckResult] = []
    xc = {k: t.to("cpu") for k, t in x.items()}
    ids = got["ids"] if case.is_layer else xc["ids"]
    lengths = (got["lengths"] if case.lengths == "layer" else None) if case.is_layer \
        else xc.get("lengths")
    ids_c = ids.to("cpu")
    len_c = None if lengths is None else lengths.to("cpu")
    if case.is_layer:
        if case.layer == "csa":
            scores = got["scores"].to("cpu")
            b = None
            if case.scores == "indexer":
                s_o = R.indexer_scores(xc["q_idx"], xc["k_idx"], xc["weights"], lay, case.ratio)
                b = EM.indexer_scores_bound(xc["q_idx"], xc["k_idx"], xc["weights"], lay,
                                            case.ratio, s_o, precision=prec)
                v.append(C.compare_numeric("scores", scores, s_o, b))
            else:
                s_o = xc["index_scores"].to(F64)
                v.append(C.compare_exact("scores (explicit input)", scores, xc["index_scores"],
                                         bitwise=True))
            # Top-K of the consumed scores: exact, order under the case's policy
            t_ids, t_len = R.stable_topk(scores, case.topk, order=case.order)
            v.append(C.compare_topk(got["cmp_ids"], got["cmp_lengths"], t_ids, t_len,
                                    order=case.order, name="cmp_ids (consumed scores)"))
            # and the oracle's own selection as sets, near ties (ulps or error bounds) excluded
            o_ids, o_len = R.stable_topk(s_o, case.topk, order=case.order)
            ties = C.near_tie_rows(s_o, case.topk, bound=b) if case.topk >= 1 else None
            v.append(C.compare_topk(got["cmp_ids"], got["cmp_lengths"], o_ids, o_len,
                                    near_tie_rows=ties, name="cmp_ids (oracle scores, sets)"))
        cmp = got.get("cmp_ids")
        r_ids, r_len = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                           compressed_ids=None if cmp is None else cmp.to("cpu"))
        v.append(C.compare_exact("ids", got["ids"], r_ids))
        v.append(C.compare_exact("lengths", got["lengths"], r_len))
    q, kv, sink, dout = xc["q"], xc["kv"], xc["sink"], xc["dout"]
    out_o, lse_o = R.sparse_attention_forward(q, kv, ids_c, sink, v_dim=case.v_dim, lengths=len_c)
    b_out, b_lse = EM.attention_forward_bound(q, kv, ids_c, sink, out_o, lse_o, precision=prec,
                                              v_dim=case.v_dim, lengths=len_c)
    v.append(C.compare_numeric("out", got["out"], out_o, b_out))
    v.append(C.compare_numeric("lse", got["lse"], lse_o, b_lse))
    empty = torch.isinf(lse_o[:, 0]) if lse_o.numel() else torch.zeros(0, dtype=torch.bool)
    out_i, lse_i = got["out"].to("cpu"), got["lse"].to("cpu")
    v.append(C.compare_exact("sink-only rows: out == 0", out_i[empty],
                             torch.zeros_like(out_i[empty])))
    v.append(C.compare_exact("sink-only rows: lse == +inf", lse_i[empty],
                             lse_o[empty].to(lse_i.dtype)))
    dq_o, dkv_o, ds_o = R.sparse_attention_backward(q, kv, ids_c, sink, out_i, lse_i, dout,
                                                    v_dim=case.v_dim, lengths=len_c)
    b_dq, b_dkv, b_ds = EM.attention_backward_bound(q, kv, ids_c, sink, out_i, lse_i, dout,
                                                    dq_o, dkv_o, ds_o, precision=prec,
                                                    v_dim=case.v_dim, lengths=len_c)
    v.append(C.compare_numeric("dq", got["dq"], dq_o, b_dq))
    v.append(C.compare_numeric("dkv", got["dkv"], dkv_o, b_dkv))
    v.append(C.compare_numeric("dsink", got["dsink"], ds_o, b_ds))
    dq_i = got["dq"].to("cpu")
    v.append(C.compare_exact("sink-only rows: dq == 0", dq_i[empty], torch.zeros_like(dq_i[empty])))
    if "loss" in got:
        scores = got["scores"].to("cpu")
        cmp = got["cmp_ids"].to("cpu")
        L = R.sparse_indexer_loss(q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay,
                                  coeff=case.coeff)
        LB = EM.indexer_loss_bound(q, xc["kv_cmp"], sink, lse_i, cmp, scores, lay, L,
                                   coeff=case.coeff, precision=prec)
        for name in ("loss", "kl", "target", "predict"):
            v.append(C.compare_numeric(name, got[name], getattr(L, name), getattr(LB, name)))
        if "dq_idx" in got:
            tgt, prd = got["target"].to("cpu"), got["predict"].to("cpu")
            g_o = R.sparse_indexer_loss_grad(xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt,
                                             prd, coeff=case.coeff, num_real=lay.num_real)
            g_b = EM.indexer_loss_grad_bound(xc["q_idx"], xc["k_idx"], xc["weights"], cmp, tgt,
                                             prd, *g_o, coeff=case.coeff,
                                             num_real=lay.num_real, precision=prec)
            for name, a, o, bb in zip(("dq_idx", "dw", "dk_idx"),
                                      (got["dq_idx"], got["dw"], got["dk_idx"]), g_o, g_b):
                v.append(C.compare_numeric(name, a, o, bb))
    return v


def assert_checks(checks: list, label: str = "") -> None:
    """Fail with every failing check; print the whole table (``pytest -rA -s`` shows it):
    numeric rows give error/bound ratios, exact rows mismatch counts."""
    def row(c):
        r = "" if c.ratio is None else f"ratio={c.ratio:.3g}"
        return f"  {'ok ' if c.passed else 'BAD'} {c.kind:10s} {c.name:42s} {r:14s} {c.detail}"
    table = "\n".join(row(c) for c in checks)
    print(f"{label}\n{table}")
    bad = [c for c in checks if not c.passed]
    assert not bad, f"{label}: {len(bad)} check(s) failed\n{table}"
