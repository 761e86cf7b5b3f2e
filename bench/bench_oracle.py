"""Speed and peak memory of the float64 oracle next to a dense-mask float64 form.

The measured pipeline is one DSv4 CSA layer's reference work on a packed THD micro-batch:

    indexer scores -> stable Top-K + CSA key ids -> attention forward -> attention backward
    -> sparse indexer loss -> indexer loss gradients

once with the gather oracle (``reference``, stage by stage through the stage table of
``dsv4_oracle.conformance``: the same ops, arguments and names the conformance check uses) and
once with the dense-mask form of the public
anchors: a key-count matrix over the whole logical key buffer (``reference.dense``), full softmax
attention per head chunk with its backward by autograd; the indexer and the loss over the whole
``T x C`` score matrix, loss gradients by autograd. Both run on the same inputs; when they run at
the same ``T`` a checker compares them (ids exactly, every float output with the contract's
error model through ``dsv4_oracle.compare.compare_numeric``, section 12), so the timing
compares two computations of the same numbers.

Every configuration (the float64 GEMM probe, the oracle, the dense form, the checker) runs in a
fresh subprocess, so its peak resident memory is its own. Per stage, the peak RSS above the
stage's starting RSS is read from ``VmHWM`` after resetting it through ``/proc/self/clear_refs``
(Linux); the whole child's peak is tracked across those resets.

FLOPs count a multiply-add as 2 and only the matrix products (exp/log/mask passes are not
counted: they are part of what separates a measured time from the GEMM floor). The oracle's
*computed* count is what it evaluates: every row over its own slot extent (its last valid slot
+ 1 rounded up to 64, padding rows one extent of 64); its *useful* count is the valid slots only.
``floor = computed FLOPs / measured float64 GEMM rate``.
Formulas: :func:`oracle_flops`, :func:`dense_flops`.

Usage::

    python bench/bench_oracle.py --json out.json               # DSv4-Flash shape, T=4096
    python bench/bench_oracle.py --T 4096 --dense-T 1024       # dense form measured at 1024
    python bench/bench_oracle.py --quick                       # small smoke-test shape
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_oracle import reference as ref  # noqa: E402
from dsv4_oracle import conformance  # noqa: E402
from dsv4_oracle.compare import compare_numeric  # noqa: E402
from dsv4_oracle.fixtures.case import Case  # noqa: E402
from dsv4_oracle.reference import dense  # noqa: E402
from dsv4_oracle.reference._reduce import row_extents  # noqa: E402
from dsv4_oracle.reference.attention import SLOT_MULTIPLE, valid_slots  # noqa: E402

STAGES = ("indexer_scores", "topk_and_ids", "attn_forward", "attn_backward",
          "indexer_loss", "loss_grad")
# the benchmark's stage of each op of the conformance stage table (Top-K and the CSA rows are
# timed together)
STAGE_OF_OP = {"indexer_scores": "indexer_scores", "stable_topk": "topk_and_ids",
               "build_csa_indices": "topk_and_ids", "sparse_attention_forward": "attn_forward",
               "sparse_attention_backward": "attn_backward",
               "sparse_indexer_loss": "indexer_loss", "sparse_indexer_loss_grad": "loss_grad"}
COEFF = 1e-2  # the DSv4-Flash recipe's indexer loss coefficient


# ---------------------------------------------------------------------------------------------
# The case
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    T: int
    H: int = 64
    D: int = 512
    W: int = 128
    K: int = 512
    HI: int = 64
    DI: int = 128
    ratio: int = 4


def flash_shape(T: int) -> Shape:
    """DSv4-Flash: H=64, D=512 (= Dv, shared K/V), W=128, K=512, H_I=64, D_I=128, ratio 4."""
    return Shape(T=T)


def quick_shape() -> Shape:
    return Shape(T=256, H=4, D=64, W=16, K=16, HI=4, DI=32, ratio=4)


def packed_layout(T: int) -> ref.PackedLayout:
    """Three documents filling 5/8, 1/4 and 1/8 of the rows, each ending in ~2.3% padding rows
    (T=4096: ``cu_seqlens [0, 2500, 3500, 4000]``, ``cu_seqlens_padded [0, 2560, 3584, 4096]``).
    The first document is long enough (2500 > 4*512 rows) for the Top-K to bind."""
    if T < 8 or T % 8:
        raise ValueError(f"T must be a positive multiple of 8, got {T}")
    padded = [5 * T // 8, T // 4, T // 8]
    real = [p - (3 * p) // 128 for p in padded]
    cu_pad, cu = [0], [0]
    for p, r in zip(padded, real):
        cu_pad.append(cu_pad[-1] + p)
        cu.append(cu[-1] + r)
    return ref.PackedLayout(cu, cu_pad)


def bench_case(shape: Shape) -> Case:
    """The layer at ``shape`` as a :class:`fixtures.Case` (its description only: the inputs are
    :func:`make_inputs`), so that the conformance stage table runs it."""
    lay = packed_layout(shape.T)
    return Case(name=f"bench-T{shape.T}", seed=0, cu_seqlens=tuple(lay.cu_seqlens.tolist()),
                cu_seqlens_padded=tuple(lay.cu_seqlens_padded.tolist()), num_rows=shape.T,
                heads=shape.H, head_dim=shape.D, window=shape.W, ratio=shape.ratio,
                topk=shape.K, index_heads=shape.HI, index_dim=shape.DI, layer="csa",
                coeff=COEFF, dtype="float64")


def make_inputs(shape: Shape, seed: int = 0) -> dict:
    """Random float64 inputs of one CSA layer at ``shape`` (fixed seed); ``kv`` is the logical
    key buffer ``[kv_raw; kv_cmp]``."""
    g = torch.Generator().manual_seed(seed)
    lay = packed_layout(shape.T)
    T, C = shape.T, lay.num_compressed(shape.ratio)

    def rnd(*size, s=1.0):
        return torch.randn(*size, generator=g, dtype=torch.float64) * s

    x = dict(
        layout=lay,
        q=rnd(T, shape.H, shape.D),
        kv_raw=rnd(T, shape.D),
        kv_cmp=rnd(C, shape.D),
        sink=rnd(shape.H),
        q_idx=rnd(T, shape.HI, shape.DI),
        k_idx=rnd(C, shape.DI),
        weights=rnd(T, shape.HI, s=shape.HI ** -0.5),
        dout=rnd(T, shape.H, shape.D),
    )
    x["kv"] = torch.cat([x["kv_raw"], x["kv_cmp"]])
    return x


# ---------------------------------------------------------------------------------------------
# FLOP counts (matrix products only; a multiply-add is 2 FLOPs)
# ---------------------------------------------------------------------------------------------
def indexer_pairs(lay: ref.PackedLayout, ratio: int) -> int:
    """(row, group) pairs the oracle's indexer evaluates: ``sum_b L_b * n_b``."""
    return int((lay.doc_lengths * lay.compressed_counts(ratio)).sum())


def computed_slots(valid: torch.Tensor) -> int:
    """(row, slot) pairs the oracle evaluates for a ``[T, width]`` validity mask: each row over
    its own extent, its last valid slot + 1 rounded up to 64 (``reference._reduce.row_extents``)."""
    width = -(-max(valid.shape[1], 1) // SLOT_MULTIPLE) * SLOT_MULTIPLE
    padded = torch.cat([valid, valid.new_zeros((valid.shape[0], width - valid.shape[1]))], 1)
    return int(row_extents(padded, SLOT_MULTIPLE).sum())


def oracle_flops(shape: Shape, lay: ref.PackedLayout, attn_slots: int, loss_slots: int) -> dict:
    """Per stage, for ``attn_slots`` attention (row, slot) pairs and ``loss_slots`` loss pairs
    (computed: :func:`computed_slots`, what the oracle evaluates; useful: the valid pairs only;
    full width: ``T (K + W)`` and ``T K``):

    - indexer_scores: ``sum_b L_b n_b (2 H_I D_I + 2 H_I)``  (z = q_idx k_idx^T; w . relu(z))
    - attn_forward:   ``attn_slots H (2 D + 2 Dv)``          (s = q k^T; out = P v)
    - attn_backward:  ``attn_slots H (6 D + 4 Dv)``          (s again, dP = dO v^T, dq, dk, dv)
    - indexer_loss:   ``loss_slots H 2 D``                   (teacher logits q kv_cmp^T)
    - loss_grad:      ``loss_slots H_I (6 D_I + 2)``         (z, dw, dq_idx, dk_idx)
    """
    H, D, Dv, HI, DI = shape.H, shape.D, shape.D, shape.HI, shape.DI
    return {
        "indexer_scores": indexer_pairs(lay, shape.ratio) * (2 * HI * DI + 2 * HI),
        "topk_and_ids": 0,
        "attn_forward": attn_slots * H * (2 * D + 2 * Dv),
        "attn_backward": attn_slots * H * (6 * D + 4 * Dv),
        "indexer_loss": loss_slots * H * 2 * D,
        "loss_grad": loss_slots * HI * (6 * DI + 2),
    }


def dense_flops(shape: Shape, lay: ref.PackedLayout) -> dict:
    """The dense form over the whole logical key buffer, ``S = T + C`` keys:

    - indexer_scores: ``T C (2 H_I D_I + 2 H_I)``
    - attn_forward:   ``T S H (2 D + 2 Dv)``
    - attn_backward:  ``T S H (4 D + 4 Dv)``   (autograd: dq, dk from s; dP, dv from out)
    - indexer_loss:   ``T C H 2 D``
    - loss_grad:      ``T C H_I (6 D_I + 4)``  (autograd through the recomputed indexer)
    """
    T, H, D, Dv, HI, DI = shape.T, shape.H, shape.D, shape.D, shape.HI, shape.DI
    C = lay.num_compressed(shape.ratio)
    S = T + C
    return {
        "indexer_scores": T * C * (2 * HI * DI + 2 * HI),
        "topk_and_ids": 0,
        "attn_forward": T * S * H * (2 * D + 2 * Dv),
        "attn_backward": T * S * H * (4 * D + 4 * Dv),
        "indexer_loss": T * C * H * 2 * D,
        "loss_grad": T * C * HI * (6 * DI + 4),
    }


# ---------------------------------------------------------------------------------------------
# Memory probes
# ---------------------------------------------------------------------------------------------
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_seen_peak = [0]  # this process's peak RSS before the last reset (a reset clears ru_maxrss too)


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak` (the lifetime peak where it cannot reset)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if sys.platform == "darwin":
            kib //= 1024
    return kib * 1024


def lifetime_peak_bytes() -> int:
    return max(_seen_peak[0], peak_bytes())


def reset_peak() -> bool:
    """Reset the peak RSS (VmHWM) of this process; False where the kernel does not allow it."""
    _seen_peak[0] = lifetime_peak_bytes()
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class StageTimer:
    """Wall time per stage and repeat; peak RSS above the stage's starting RSS."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}
        self.peak_extra: dict[str, int] = {}
        self.can_reset = reset_peak()

    def start(self):
        base = rss_bytes()
        if self.can_reset:
            reset_peak()
        return base, time.perf_counter()

    def stop(self, name: str, mark, add_to_last: bool = False) -> None:
        base, t0 = mark
        dt = time.perf_counter() - t0
        extra = max(0, peak_bytes() - base) if self.can_reset else 0
        secs = self.seconds.setdefault(name, [])
        if add_to_last and secs:
            secs[-1] += dt
        else:
            secs.append(dt)
        self.peak_extra[name] = max(self.peak_extra.get(name, 0), extra)

    def run(self, name, fn, *args, **kwargs):
        mark = self.start()
        result = fn(*args, **kwargs)
        self.stop(name, mark)
        return result


# ---------------------------------------------------------------------------------------------
# The two pipelines
# ---------------------------------------------------------------------------------------------
def oracle_pipeline(shape: Shape, x: dict, timer: StageTimer) -> dict:
    """The oracle through the conformance stage table (:func:`conformance.oracle_stage`, stage
    by stage in table order), each op timed into its benchmark stage (:data:`STAGE_OF_OP`)."""
    case = bench_case(shape)
    done: dict = {}
    prev = None
    for st in conformance.STAGES:
        if not conformance.applies(st.op, case):
            continue
        name = STAGE_OF_OP[st.op]
        mark = timer.start()
        done.update(conformance.oracle_stage(case, st, x, done))
        timer.stop(name, mark, add_to_last=name == prev)
        prev = name
    return done


def _dense_indexer(q_idx, k_idx, w, visible, scale):
    """``I = scale * sum_h w relu(q_idx k_idx^T)`` over whole ``[rows, C]`` blocks, -inf where
    ``visible`` is False (differentiable)."""
    z = torch.einsum("thd,cd->thc", q_idx, k_idx)
    i = scale * torch.einsum("th,thc->tc", w, torch.relu(z))
    return i.masked_fill(~visible, -math.inf)


def _dense_student(i, selected):
    """Softmax of the indexer logits over each row's selected set (0 elsewhere and on rows with
    no selection)."""
    logits = i.masked_fill(~selected, -math.inf)
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(logits - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def _dense_kl(tau, p, selected, floor=2.0 ** -126):
    a = torch.clamp_min(tau, floor)
    terms = a * (torch.log(a) - torch.log(torch.clamp_min(p, floor)))
    return torch.where(selected, terms, torch.zeros_like(terms)).sum(dim=-1)


def dense_pipeline(shape: Shape, x: dict, timer: StageTimer, heads_per_step: int = 2,
                   rows_per_step: int = 512) -> dict:
    """The anchors' dense-mask form of the same pipeline. Work is split into head chunks
    (attention, teacher) and row chunks (indexer, loss gradients) only to bound memory; every
    chunk is dense over all ``S`` keys or all ``C`` groups."""
    lay = x["layout"]
    T, H, D = shape.T, shape.H, shape.D
    C = lay.num_compressed(shape.ratio)
    kv = x["kv"]
    s_idx, s_att = shape.DI ** -0.5, D ** -0.5
    vis = dense.dense_visibility(lay, shape.W, shape.ratio)[:, T:]      # [T, C] compressed part

    def indexer():
        return torch.cat([_dense_indexer(x["q_idx"][r0:r0 + rows_per_step], x["k_idx"],
                                         x["weights"][r0:r0 + rows_per_step],
                                         vis[r0:r0 + rows_per_step], s_idx)
                          for r0 in range(0, T, rows_per_step)])

    scores = timer.run("indexer_scores", indexer)

    def topk_and_ids():
        cmp_ids, _ = ref.stable_topk(scores, shape.K)
        ids, lengths = ref.build_csa_indices(lay, window=shape.W, ratio=shape.ratio,
                                             compressed_ids=cmp_ids)
        counts = dense.slot_counts(ids, T + C, lengths)                  # [T, S] key counts
        return cmp_ids, ids, lengths, counts

    cmp_ids, ids, lengths, counts = timer.run("topk_and_ids", topk_and_ids)

    # Attention: forward, then autograd backward, per head chunk; each part timed into its stage.
    kv_leaf = kv.clone().requires_grad_(True)
    dkv = torch.zeros_like(kv)
    outs, lses, dqs, dsinks = [], [], [], []
    for h0 in range(0, H, heads_per_step):
        h1 = min(h0 + heads_per_step, H)
        qh = x["q"][:, h0:h1].clone().requires_grad_(True)
        sh = x["sink"][h0:h1].clone().requires_grad_(True)
        with torch.enable_grad():
            mark = timer.start()
            o, l = dense.dense_attention(qh, kv_leaf, counts, sh, s_att, D)
            timer.stop("attn_forward", mark, add_to_last=h0 > 0)
            mark = timer.start()
            gq, gkv, gs = torch.autograd.grad(o, (qh, kv_leaf, sh), x["dout"][:, h0:h1])
            dkv += gkv
            timer.stop("attn_backward", mark, add_to_last=h0 > 0)
        outs.append(o.detach())
        lses.append(l.detach())
        dqs.append(gq)
        dsinks.append(gs)
        del o, l, gq, gkv, gs
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)

    ok = cmp_ids >= 0
    safe = torch.where(ok, cmp_ids, torch.zeros_like(cmp_ids))
    selected = torch.zeros((T, C), dtype=torch.bool)
    selected[torch.arange(T).unsqueeze(1).expand_as(cmp_ids)[ok], cmp_ids[ok]] = True
    selected &= lay.is_real.unsqueeze(1)
    n_real = lay.num_real

    def loss_forward():
        full = torch.logaddexp(lse, x["sink"].unsqueeze(0))               # LSEf [T, H]
        a = torch.zeros((T, C), dtype=torch.float64)
        for h0 in range(0, H, heads_per_step):
            h1 = min(h0 + heads_per_step, H)
            logit = s_att * torch.einsum("thd,cd->thc", x["q"][:, h0:h1], x["kv_cmp"])
            a += torch.exp(logit - full[:, h0:h1].unsqueeze(-1)).sum(dim=1)
        a = torch.where(selected, a, torch.zeros_like(a))
        tot = a.sum(dim=1, keepdim=True)
        tau = a / torch.where(tot > 0, tot, torch.ones_like(tot))
        p = _dense_student(scores, selected)
        kl = _dense_kl(tau, p, selected)
        return tau, p, kl, COEFF * kl.sum() / n_real

    tau, p, kl, loss = timer.run("indexer_loss", loss_forward)

    def loss_grad():
        # The loss is a sum over rows: autograd per row chunk (dk_idx accumulated) bounds memory.
        dq_idx = torch.empty_like(x["q_idx"])
        dw = torch.empty_like(x["weights"])
        dk_idx = torch.zeros_like(x["k_idx"])
        ka = x["k_idx"].clone().requires_grad_(True)
        with torch.enable_grad():
            for r0 in range(0, T, rows_per_step):
                r1 = min(r0 + rows_per_step, T)
                qa = x["q_idx"][r0:r1].clone().requires_grad_(True)
                wa = x["weights"][r0:r1].clone().requires_grad_(True)
                i = _dense_indexer(qa, ka, wa, vis[r0:r1], s_idx)
                kl_rows = _dense_kl(tau[r0:r1], _dense_student(i, selected[r0:r1]),
                                    selected[r0:r1])
                gq, gw, gk = torch.autograd.grad(COEFF * kl_rows.sum() / n_real, (qa, wa, ka))
                dq_idx[r0:r1], dw[r0:r1] = gq, gw
                dk_idx += gk
        return dq_idx, dw, dk_idx

    dq_idx, dw, dk_idx = timer.run("loss_grad", loss_grad)
    slot = selected.gather(1, safe) & ok
    zero = torch.zeros((), dtype=torch.float64)
    return dict(scores=scores, cmp_ids=cmp_ids, ids=ids, lengths=lengths, out=out, lse=lse,
                dq=torch.cat(dqs, dim=1), dkv=dkv, dsink=torch.cat(dsinks), loss=loss, kl=kl,
                target=torch.where(slot, tau.gather(1, safe), zero),
                predict=torch.where(slot, p.gather(1, safe), zero),
                dq_idx=dq_idx, dw=dw, dk_idx=dk_idx)


# ---------------------------------------------------------------------------------------------
# Children (one fresh process per configuration)
# ---------------------------------------------------------------------------------------------
def gemm_rate(n: int, repeats: int) -> dict:
    """Best-of-``repeats`` float64 ``n x n x n`` matmul rate (GFLOP/s) on this machine."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    b = torch.randn(n, n, generator=g, dtype=torch.float64)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return dict(n=n, seconds=min(times), gflops=2 * n ** 3 / min(times) / 1e9,
                all_seconds=times)


def check_agreement(shape: Shape, o: dict, d: dict) -> dict:
    """The dense results judged against the oracle as an implementation would be: ids, lengths
    and the selection exactly, every float output by ``compare.compare_numeric`` (the error
    model's ratio after an exact check of the non-finite pattern, ill-conditioned elements not
    judged; section 12; float64 on both sides). Per output its ratio; ``passed`` when every
    exact check holds and every numeric check passes. The loss gradients of the dense form are
    exact derivatives, so they are judged against the oracle's ``mode="autograd"``."""
    from dsv4_oracle.reference import error_model as em

    x = make_inputs(shape)
    lay = x["layout"]
    kv = x["kv"]
    prec = em.ORACLE_PRECISION
    checks = []

    def ratio(name, actual, expected, bound):
        c = compare_numeric(name, actual, expected, bound)
        checks.append(c)
        return c.ratio if c.ratio is not None else 0.0

    res = {"ids_equal": bool(torch.equal(o["ids"], d["ids"])),
           "lengths_equal": bool(torch.equal(o["lengths"], d["lengths"])),
           "cmp_ids_equal": bool(torch.equal(o["cmp_ids"], d["cmp_ids"]))}
    b = em.indexer_scores_bound(x["q_idx"], x["k_idx"], x["weights"], lay, shape.ratio,
                                o["scores"], precision=prec)
    res["scores"] = ratio("scores", d["scores"], o["scores"], b)
    b_out, b_lse = em.attention_forward_bound(x["q"], kv, o["ids"], x["sink"], o["out"], o["lse"],
                                              precision=prec, lengths=o["lengths"])
    res["out"] = ratio("out", d["out"], o["out"], b_out)
    res["lse"] = ratio("lse", d["lse"], o["lse"], b_lse)
    bounds = em.attention_backward_bound(x["q"], kv, o["ids"], x["sink"], o["out"], o["lse"],
                                         x["dout"], o["dq"], o["dkv"], o["dsink"],
                                         precision=prec, lengths=o["lengths"])
    for k, bd in zip(("dq", "dkv", "dsink"), bounds):
        res[k] = ratio(k, d[k], o[k], bd)
    result = ref.IndexerLoss(o["loss"], o["kl"], o["target"], o["predict"], lay.num_real)
    lb = em.indexer_loss_bound(x["q"], x["kv_cmp"], x["sink"], o["lse"], o["cmp_ids"],
                               o["scores"], lay, result, coeff=COEFF, precision=prec)
    for k in ("loss", "kl", "target", "predict"):
        res[k] = ratio(k, d[k].reshape(o[k].shape), o[k], getattr(lb, k))
    auto = ref.sparse_indexer_loss_grad(x["q_idx"], x["k_idx"], x["weights"], o["cmp_ids"],
                                        o["target"], o["predict"], coeff=COEFF,
                                        num_real=lay.num_real, mode="autograd")
    gb = em.indexer_loss_grad_bound(x["q_idx"], x["k_idx"], x["weights"], o["cmp_ids"],
                                    o["target"], o["predict"], *auto, coeff=COEFF,
                                    num_real=lay.num_real, precision=prec, mode="autograd")
    for k, e, bd in zip(("dq_idx", "dw", "dk_idx"), auto, gb):
        res[k] = ratio(k, d[k], e, bd)
    res["worst_ratio"] = max(v for v in res.values() if not isinstance(v, bool))
    res["passed"] = bool(res["ids_equal"] and res["lengths_equal"] and res["cmp_ids_equal"]
                         and all(c.passed for c in checks))
    return res


def child_main(kind: str, shape: Shape, repeats: int, out_path: str, save_path: str | None,
               load_paths: list[str] | None):
    if kind == "gemm":
        result = gemm_rate(shape.T, repeats)
    elif kind == "check":
        o, d = (torch.load(p) for p in load_paths)
        result = check_agreement(shape, o, d)
    else:
        x = make_inputs(shape)
        lay = x["layout"]
        base = rss_bytes()
        timer = StageTimer()
        run = oracle_pipeline if kind == "oracle" else dense_pipeline
        res, totals = None, []
        for _ in range(repeats):
            res = None
            t0 = time.perf_counter()
            res = run(shape, x, timer)
            totals.append(time.perf_counter() - t0)
        if save_path:
            torch.save({k: v.detach() for k, v in res.items()}, save_path)
        num_keys = shape.T + lay.num_compressed(shape.ratio)
        attn_valid = valid_slots(res["ids"], num_keys, res["lengths"])
        loss_valid = (res["cmp_ids"] >= 0) & lay.is_real.unsqueeze(1)
        result = dict(
            kind=kind, shape=asdict(shape),
            cu_seqlens=lay.cu_seqlens.tolist(), cu_seqlens_padded=lay.cu_seqlens_padded.tolist(),
            num_compressed=lay.num_compressed(shape.ratio),
            attn_width=int(res["ids"].shape[1]), loss_width=int(res["cmp_ids"].shape[1]),
            computed_attn_slots=computed_slots(attn_valid),
            computed_loss_slots=computed_slots(loss_valid),
            valid_attn_slots=int(attn_valid.sum()), valid_loss_slots=int(loss_valid.sum()),
            seconds=timer.seconds, pipeline_seconds=totals,
            peak_extra_bytes=timer.peak_extra, per_stage_peak=timer.can_reset,
            inputs_rss_bytes=base,
        )
    result["threads"] = torch.get_num_threads()
    result["peak_rss_bytes"] = lifetime_peak_bytes()
    Path(out_path).write_text(json.dumps(result))


def spawn(kind: str, shape: Shape, repeats: int = 1, threads: int | None = None,
          save_path: str | None = None, load_paths: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind,
               "--child-shape", json.dumps(asdict(shape)), "--repeats", str(repeats),
               "--child-out", out]
        if threads:
            cmd += ["--threads", str(threads)]
        if save_path:
            cmd += ["--child-save", save_path]
        for p in load_paths or ():
            cmd += ["--child-load", p]
        subprocess.run(cmd, check=True)
        return json.loads(Path(out).read_text())


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    cpu = platform.processor() or "?"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    return dict(nproc=os.cpu_count(), cpu=cpu, torch=torch.__version__,
                threads=torch.get_num_threads(), python=platform.python_version(),
                loadavg=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def summarize(kind_result: dict, flops: dict, gemm_gflops: float) -> dict:
    """Per stage: median seconds over repeats, FLOPs, GFLOP/s, seconds at the GEMM rate
    (``floor``), seconds / floor, peak RSS above the stage's start."""
    rows = {}
    for st in STAGES:
        secs = kind_result["seconds"][st]
        med = statistics.median(secs)
        rows[st] = dict(seconds=med, all_seconds=secs, flops=flops[st],
                        gflops=flops[st] / med / 1e9 if med > 0 else 0.0,
                        floor_seconds=flops[st] / (gemm_gflops * 1e9),
                        peak_extra_bytes=kind_result["peak_extra_bytes"].get(st, 0))
    tot_s = sum(r["seconds"] for r in rows.values())
    tot_f = sum(flops.values())
    rows["total"] = dict(seconds=tot_s, flops=tot_f, gflops=tot_f / tot_s / 1e9,
                         floor_seconds=tot_f / (gemm_gflops * 1e9),
                         peak_extra_bytes=max(r["peak_extra_bytes"] for r in rows.values()))
    for r in rows.values():
        r["to_floor"] = r["seconds"] / r["floor_seconds"] if r["floor_seconds"] else None
    return rows


def table(o_rows: dict, useful: dict, d_rows: dict | None, dense_scale: float) -> str:
    """Markdown table: the oracle's stages, and the dense form's (scaled to ``T`` by FLOPs when
    it was measured at a smaller ``T``)."""
    lines = ["| stage | oracle s | GFLOP computed | GFLOP/s | x GEMM floor | GFLOP useful | "
             "peak +MiB | dense s | dense GFLOP | dense / oracle |",
             "|" + "---|" * 10]
    for st in STAGES + ("total",):
        o = o_rows[st]
        uf = sum(useful.values()) if st == "total" else useful[st]
        floor = f"{o['to_floor']:.2f}" if o["to_floor"] else "-"
        if d_rows:
            ds = d_rows[st]["seconds"] * dense_scale
            dense_cols = f"{ds:.3g} | {d_rows[st]['flops'] * dense_scale / 1e9:.4g} | " \
                         f"{ds / o['seconds']:.3g}"
        else:
            dense_cols = "- | - | -"
        lines.append(f"| {st} | {o['seconds']:.3g} | {o['flops'] / 1e9:.4g} | {o['gflops']:.3g} | "
                     f"{floor} | {uf / 1e9:.4g} | {o['peak_extra_bytes'] / 2**20:.0f} | "
                     f"{dense_cols} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Speed and peak memory of the float64 oracle "
                                             "next to a dense-mask float64 form.")
    ap.add_argument("--T", type=int, default=4096, help="packed rows (DSv4-Flash shape)")
    ap.add_argument("--quick", action="store_true",
                    help="a small shape (T=256, H=4, D=64, W=16, K=16, H_I=4, D_I=32): smoke test")
    ap.add_argument("--json", metavar="OUT", help="write every figure as JSON to OUT")
    ap.add_argument("--repeats", type=int, default=None,
                    help="oracle pipeline repeats, median per stage (default 3; 1 with --quick)")
    ap.add_argument("--dense-T", type=int, default=None,
                    help="T of the dense form (default --T). When smaller, the oracle is measured "
                         "there too (measured ratio) and the dense time at --T is extrapolated "
                         "by its FLOP count")
    ap.add_argument("--dense-repeats", type=int, default=1)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense form")
    ap.add_argument("--no-check", action="store_true",
                    help="skip the error-model comparison of the dense form with the oracle")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads in the measured processes (default: torch's default)")
    ap.add_argument("--gemm-n", type=int, default=None, help="GEMM probe size (default 2048)")
    ap.add_argument("--child", choices=("gemm", "oracle", "dense", "check"), help=argparse.SUPPRESS)
    ap.add_argument("--child-shape", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-save", help=argparse.SUPPRESS)
    ap.add_argument("--child-load", action="append", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.threads is not None:
        if a.threads < 1:
            ap.error(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)  # this process only (a fresh child per configuration)
    if a.child:
        child_main(a.child, Shape(**json.loads(a.child_shape)), a.repeats, a.child_out,
                   a.child_save, a.child_load)
        return 0

    for name in ("T", "repeats", "dense_T", "dense_repeats", "gemm_n"):
        v = getattr(a, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    shape = quick_shape() if a.quick else flash_shape(a.T)
    try:
        lay = packed_layout(shape.T)
    except ValueError as e:
        ap.error(f"--T: {e}")
    repeats = a.repeats or (1 if a.quick else 3)
    gemm_n = a.gemm_n or (256 if a.quick else 2048)
    dense_T = a.dense_T or shape.T
    if dense_T > shape.T:
        ap.error("--dense-T must not exceed --T")
    try:
        packed_layout(dense_T)
    except ValueError as e:
        ap.error(f"--dense-T: {e}")
    same_T = dense_T == shape.T
    check = not (a.no_dense or a.no_check) and same_T
    info = machine_info()
    print(f"machine: {info['nproc']} CPUs, {info['cpu']}, torch {info['torch']}, "
          f"{a.threads or info['threads']} threads, load {info['loadavg']}", flush=True)

    gemm = spawn("gemm", Shape(T=gemm_n), 5, a.threads)
    rate = gemm["gflops"]
    print(f"float64 GEMM {gemm_n}^3: {rate:.1f} GFLOP/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        o_save, d_save = os.path.join(tmp, "oracle.pt"), os.path.join(tmp, "dense.pt")
        o = spawn("oracle", shape, repeats, a.threads, o_save if check else None)
        nominal = oracle_flops(shape, lay, o["computed_attn_slots"], o["computed_loss_slots"])
        useful = oracle_flops(shape, lay, o["valid_attn_slots"], o["valid_loss_slots"])
        full_width = oracle_flops(shape, lay, shape.T * o["attn_width"],
                                  shape.T * o["loss_width"])
        o_rows = summarize(o, nominal, rate)
        print(f"oracle T={shape.T}: {o_rows['total']['seconds']:.2f} s, "
              f"{o_rows['total']['to_floor']:.2f}x the GEMM floor", flush=True)
        report = dict(machine=info, command=" ".join(["python", "bench/bench_oracle.py"]
                                                     + list(sys.argv[1:] if argv is None else argv)),
                      gemm=gemm, shape=asdict(shape), layout=dict(
                          cu_seqlens=o["cu_seqlens"], cu_seqlens_padded=o["cu_seqlens_padded"]),
                      oracle=o, oracle_stages=o_rows, oracle_useful_flops=useful,
                      oracle_full_width_flops=full_width,
                      oracle_over_floor=o_rows["total"]["to_floor"])
        d_rows, dense_scale = None, 1.0
        if not a.no_dense:
            d_shape = Shape(**{**asdict(shape), "T": dense_T})
            d_lay = packed_layout(dense_T)
            d = spawn("dense", d_shape, a.dense_repeats, a.threads, d_save if check else None)
            d_rows = summarize(d, dense_flops(d_shape, d_lay), rate)
            report.update(dense=d, dense_stages=d_rows, dense_T=dense_T)
            print(f"dense T={dense_T}: {d_rows['total']['seconds']:.2f} s", flush=True)
            if not same_T:
                o_small = spawn("oracle", d_shape, repeats, a.threads)
                o_small_rows = summarize(o_small, oracle_flops(
                    d_shape, d_lay, o_small["computed_attn_slots"],
                    o_small["computed_loss_slots"]), rate)
                dense_scale = sum(dense_flops(shape, lay).values()) / sum(
                    dense_flops(d_shape, d_lay).values())
                report.update(oracle_at_dense_T=o_small, oracle_at_dense_T_stages=o_small_rows,
                              dense_over_oracle_at_dense_T=d_rows["total"]["seconds"]
                              / o_small_rows["total"]["seconds"],
                              dense_extrapolation_factor=dense_scale)
                print(f"at T={dense_T}: dense / oracle = "
                      f"{report['dense_over_oracle_at_dense_T']:.1f} (measured); dense time "
                      f"extrapolated to T={shape.T} by FLOPs (x{dense_scale:.2f})", flush=True)
            report["dense_over_oracle"] = (d_rows["total"]["seconds"] * dense_scale
                                           / o_rows["total"]["seconds"])
            report["dense_measured_at_T"] = same_T
            if check:
                report["agreement"] = spawn("check", shape, 1, a.threads,
                                            load_paths=[o_save, d_save])
        report["table"] = table(o_rows, useful, d_rows, dense_scale)

    print()
    print(report["table"])
    print()
    print(f"oracle total / GEMM floor: {report['oracle_over_floor']:.2f} (target <= 3)")
    print(f"oracle peak RSS: {o['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"(inputs {o['inputs_rss_bytes'] / 2**30:.2f} GiB)")
    if "dense_over_oracle" in report:
        how = "measured" if same_T else f"dense extrapolated from T={dense_T}"
        print(f"dense / oracle total ({how}): {report['dense_over_oracle']:.1f} (target >= 10)")
        print(f"dense peak RSS: {report['dense']['peak_rss_bytes'] / 2**30:.2f} GiB"
              + ("" if same_T else f" at T={dense_T}"))
    if "agreement" in report:
        ag = report["agreement"]
        print(f"dense vs oracle: ids equal {ag['ids_equal']}, lengths equal "
              f"{ag['lengths_equal']}, worst error-model ratio {ag['worst_ratio']:.3g} "
              f"({'pass' if ag['passed'] else 'FAIL'})")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
