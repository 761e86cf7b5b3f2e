"""GPU benchmark of the cuDNN backend (the H200 lane); results go to docs/PERFORMANCE.md.

Shapes: T in {4096, 8192}, H 64, D 512 (Dv 512), W 128, top-k K 512 (so 640 key
slots per row: 512 compressed + 128 window), H_I 64, D_I 128, ratio 4 (C = T/4 compressed keys).
Key ids are synthetic but layer-like: row t selects 512 distinct compressed ids at random among
the C (ids T..T+C-1) and its window t-127..t (fewer at the start, -1 padded), with lengths.

Timed (CUDA events, median of ``--reps`` calls after warm-up; every call includes the backend's
own argument checks and sanitisation unless the row says "raw"):

- attention forward: Triton (this backend, default config, plus a small config sweep), the
  torch backend;
- attention backward: cuDNN SM90 (default mode; raw wrapper and through the backend), the
  Triton split deterministic backward (plus a config sweep; ``--det-backward-only``: alone,
  with its phases, no cuDNN needed), bitwise replay check;
- indexer forward (cuDNN THD, raw and with the scatter to [T, C]), Top-K (cuDNN deterministic
  and default), indexer loss (cuDNN teacher + torch), loss gradients (cuDNN default and the
  Triton fixed-order kernels; ``--indexer-grad-only``: the Triton kernels alone with phases and a
  config sweep, no cuDNN needed);
- the whole DSA step (indexer scores, Top-K, attention forward + backward, indexer loss +
  gradients) through the backend, deterministic and default mode.

FLOP counts use the number of valid slots ``n = sum_t len_t``: forward ``2 n H (D + Dv)``,
backward ``2 n H (3 D + 2 Dv)`` (recompute S, dP, dQ, dKV from dS and from P). The memory floor
is the unavoidable traffic (inputs once, outputs once, gathered key rows once per slot) over the
measured copy bandwidth; the compute floor is FLOPs over the measured bf16 GEMM rate.

Usage: ``python bench/bench_gpu.py [--T 4096 8192] [--reps 20] [--no-sweep] [--lean]
[--indexer-grad-only | --det-backward-only] [--out results.json]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4_oracle.gpu_impl import cudnn_backend as cb          # noqa: E402
from dsv4_oracle.gpu_impl import kernels_triton as kt         # noqa: E402
from dsv4_oracle.gpu_impl import kernels_triton_split as ks   # noqa: E402
from dsv4_oracle.gpu_impl import torch_backend as tb          # noqa: E402

H, D, DV, W, K, HI, DI, RATIO = 64, 512, 512, 128, 512, 64, 128, 4


def timeit(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceilings():
    """Measured copy bandwidth (bytes read + written per second) and bf16 GEMM rate."""
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timeit(lambda: y.copy_(x), 10)
    bw = 2 * x.numel() / (ms * 1e-3)
    x = y = None                 # free the buffers
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = timeit(lambda: a @ b, 10)
    return bw, 2 * n ** 3 / (ms * 1e-3)


def make_inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = T // RATIO
    S = T + C
    dev = "cuda"
    q = torch.randn(T, H, D, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, D, device=dev, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device=dev, generator=g)
    dout = torch.randn(T, H, DV, device=dev, generator=g).to(torch.bfloat16)
    # compressed part: 512 distinct random ids per row (ascending), then the window
    cmp = torch.rand(T, C, device=dev, generator=g).argsort(dim=1)[:, :K].sort(dim=1)[0] + T
    t = torch.arange(T, device=dev).unsqueeze(1)
    win = t - (W - 1) + torch.arange(W, device=dev).unsqueeze(0)
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    ids = torch.cat([cmp, win], dim=1)
    valid = ids >= 0
    lengths = valid.sum(dim=1).to(torch.int32)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)   # compact (valid first)
    ids = torch.gather(ids, 1, order).to(torch.int32).contiguous()
    q_idx = torch.randn(T, HI, DI, device=dev, generator=g).to(torch.bfloat16)
    k_idx = torch.randn(C, DI, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(T, HI, device=dev, generator=g).to(torch.bfloat16)
    return dict(q=q, kv=kv, sink=sink, dout=dout, ids=ids, lengths=lengths, q_idx=q_idx,
                k_idx=k_idx, w=w, C=C, S=S)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


SPLIT_SWEEP = (dict(num_warps=4), dict(block_n=32), dict(block_n=128, dkv_block_n=128),
               dict(d_chunks=8), dict(num_warps=4, d_chunks=8), dict(programs_per_sm=16))


def bench_det_backward(x: dict, T: int, reps: int, row, log, sweep: bool = False):
    """The deterministic backward (:mod:`gpu_impl.kernels_triton_split`: row pass + column-sliced
    planes): bitwise replays, time (whole call, layout building included), the row pass alone,
    the phases, and a config sweep. Needs no cuDNN."""
    q, kv, ids, lengths, sink, dout = x["q"], x["kv"], x["ids"], x["lengths"], x["sink"], x["dout"]
    scale = D ** -0.5
    n = int(lengths.sum())
    f_bwd = 2.0 * n * H * (3 * D + 2 * DV)
    out, lse = kt.attention_forward(q, kv, ids, sink, scale, DV, lengths)
    stats: dict = {}
    a = ks.attention_backward(q, kv, ids, sink, out, lse, dout, scale, DV, lengths, stats=stats)
    b = ks.attention_backward(q, kv, ids, sink, out, lse, dout, scale, DV, lengths)
    same = all(torch.equal(u, v) for u, v in zip(a, b))
    log(f"T={T} split {stats}; bitwise replay equal: {same}")
    del a, b
    row("attention bwd: Triton split (deterministic)",
        timeit(lambda: ks.attention_backward(q, kv, ids, sink, out, lse, dout, scale, DV,
                                             lengths), reps), f_bwd,
        note=f"replay equal {same}; {stats}; {ks.SPLIT_CONFIG}")
    delta, full2, _ = kt.row_statistics(out, lse, dout, sink)
    row("attention bwd: row pass alone (dq only)",
        timeit(lambda: ks.row_pass(q, kv, ids, lengths, dout, full2, delta, scale, DV), reps),
        2.0 * n * H * (2 * D + DV))
    for c in ({},) + SPLIT_SWEEP:
        for _ in range(2):                       # the second call: compiled, warm
            st = dict(time=True)
            ks.attention_backward(q, kv, ids, sink, out, lse, dout, scale, DV, lengths,
                                  stats=st, **c)
        log(f"T={T} split phases {c}: {st.get('ms')} (plane bytes {st['plane_bytes']})")
    if not sweep:
        return
    for c in SPLIT_SWEEP:
        try:
            row("attention bwd: split sweep", timeit(lambda c=c: ks.attention_backward(
                q, kv, ids, sink, out, lse, dout, scale, DV, lengths, **c), reps), f_bwd,
                note=f"{c}")
        except Exception as exc:                               # keep sweeping
            log(f"FAILED split {c}: {type(exc).__name__}: {str(exc)[:300]}")


GRAD_SWEEP = (dict(num_warps=8), dict(num_warps=2), dict(block_n=32), dict(block_n=128),
              dict(num_stages=1), dict(num_stages=3), dict(block_n=32, num_stages=3),
              dict(fold_block=64), dict(fold_warps=2), dict(fold_warps=8))


def indexer_grad_inputs(x: dict, T: int, seed: int = 1):
    """Layer-like loss-gradient inputs: per row ``K`` distinct compressed ids at random among
    the ``C`` (ascending), ``target`` and ``predict`` softmax rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    C = x["C"]
    ids = torch.rand(T, C, device="cuda", generator=g).argsort(dim=1)[:, :K].sort(dim=1)[0]
    tau = torch.softmax(3 * torch.randn(T, K, device="cuda", generator=g), dim=1)
    p = torch.softmax(3 * torch.randn(T, K, device="cuda", generator=g), dim=1)
    return ids.to(torch.int32).contiguous(), tau, p


def bench_indexer_grad(x: dict, T: int, reps: int, row, log, sweep: bool = False):
    """The deterministic indexer-loss gradient (Triton fixed-order kernels; needs no cuDNN):
    whole call through the backend's kernel module, its phases, bitwise replays, agreement with
    the torch backend's deterministic path, and a config sweep."""
    from dsv4_oracle.gpu_impl import kernels_triton_indexer_grad as kg
    q_idx, k_idx, w = x["q_idx"], x["k_idx"], x["w"]
    ids, tau, p = indexer_grad_inputs(x, T)
    gs, scale, e = 0.01 / T, DI ** -0.5, math.exp(-100)
    f_grad = 2.0 * 3 * T * K * HI * DI

    def call(**cfg):
        return kg.indexer_loss_grad(q_idx, k_idx, w, ids, tau, p, gs, scale, e, **cfg)
    a, b = call(), call()
    same = all(torch.equal(u, v) for u, v in zip(a, b))
    ref = tb.sparse_indexer_loss_grad(q_idx, k_idx, w, ids, tau, p, coeff=0.01, num_real=T,
                                      grad_floor=e)
    log(f"T={T} indexer grad (Triton) bitwise replay equal: {same}; vs torch backend: "
        + ", ".join(f"{n} rel {rel(u, v):.2e}" for n, u, v in zip(("dq", "dw", "dk"), a, ref)))
    row("indexer loss grad: Triton fixed-order (deterministic)", timeit(call, reps), f_grad,
        note=f"config {kg.GRAD_CONFIG}; replay equal {same}")
    st = {"time": True}
    call(stats=st)
    log(f"T={T} indexer grad phases (ms): rows {st['rows_ms']:.3f}, sort {st['sort_ms']:.3f}, "
        f"fold {st['fold_ms']:.3f}; chunks {st['chunks']}")
    if sweep:
        for c in GRAD_SWEEP:
            try:
                row("indexer loss grad: Triton sweep", timeit(lambda c=c: call(**c), reps),
                    f_grad, note=f"{c}")
            except Exception as exc:                               # keep sweeping
                log(f"FAILED indexer grad {c}: {type(exc).__name__}: {str(exc)[:300]}")


def bench_shape(T: int, reps: int, bw: float, rate: float, sweep: bool, rows: list, log,
                lean: bool = False):
    x = make_inputs(T)
    q, kv, ids, lengths, sink, dout = x["q"], x["kv"], x["ids"], x["lengths"], x["sink"], x["dout"]
    n = int(lengths.sum())
    scale = D ** -0.5
    f_fwd = 2.0 * n * H * (D + DV)
    f_bwd = 2.0 * n * H * (3 * D + 2 * DV)
    # memory floors: q + kv rows per slot + out (+ lse, ids); bwd: q, dout, out, kv per slot,
    # dq, dkv (fp32 accumulation not counted)
    b_fwd = T * H * D * 2 + n * D * 2 + T * H * DV * 2 + T * H * 4 + ids.numel() * 4
    b_bwd = 3 * T * H * D * 2 + n * D * 2 + T * H * D * 2 + x["S"] * D * 2 + ids.numel() * 4

    def row(what, ms, flops=None, floor_bytes=None, note=""):
        r = dict(T=T, what=what, ms=round(ms, 4))
        if flops:
            r["TFLOPs"] = round(flops / (ms * 1e-3) / 1e12, 1)
            r["compute_floor_ms"] = round(flops / rate * 1e3, 4)
        if floor_bytes:
            r["memory_floor_ms"] = round(floor_bytes / bw * 1e3, 4)
        r["note"] = note
        rows.append(r)
        log(json.dumps(r))

    def attempt(name, fn):
        try:
            return fn()
        except Exception as exc:                                   # keep benchmarking
            log(f"FAILED {name} (T={T}): {type(exc).__name__}: {exc}")
            log(traceback.format_exc(limit=3))
            rows.append(dict(T=T, what=name, ms=None, note=f"failed: {type(exc).__name__}: {exc}"[:300]))
            return None

    # ---- forward ---------------------------------------------------------------------------
    def fwd_triton(**cfg):
        return kt.attention_forward(q, kv, ids, sink, scale, DV, lengths, **cfg)
    out, lse = fwd_triton()
    ref_out, ref_lse = None, None

    def check_fwd():
        nonlocal ref_out, ref_lse
        ref_out, ref_lse = tb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
        log(f"T={T} triton fwd vs torch backend: out rel {rel(out, ref_out):.2e}, "
            f"lse rel {rel(lse, ref_lse):.2e}")
    if not lean:
        attempt("check forward", check_fwd)
    attempt("fwd triton", lambda: row("attention fwd: Triton (deterministic)",
                                      timeit(fwd_triton, reps), f_fwd, b_fwd,
                                      f"config {kt.FORWARD_CONFIG}"))
    if sweep:
        for cfg in (dict(num_stages=3), dict(block_n=32), dict(block_d=128),
                    dict(num_warps=4), dict(block_dv=256)):
            attempt(f"fwd triton {cfg}", lambda cfg=cfg: row(
                "attention fwd: Triton sweep", timeit(lambda: fwd_triton(**cfg), reps), f_fwd,
                b_fwd, f"config {cfg}"))
    attempt("fwd backend", lambda: row(
        "attention fwd: cudnn_backend (checks + Triton)",
        timeit(lambda: cb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths), reps),
        f_fwd, b_fwd))
    attempt("fwd torch", lambda: None if lean else row("attention fwd: torch backend",
                                     timeit(lambda: tb.sparse_attention_forward(
                                         q, kv, ids, sink, lengths=lengths), max(3, reps // 4)),
                                     f_fwd, b_fwd))
    # ---- backward --------------------------------------------------------------------------
    dsa = cb._dsa()

    def raw_cudnn_bwd():
        return dsa.sparse_attention_backward_wrapper(q, kv, out, dout, lse, sink, ids,
                                                     softmax_scale=scale, topk_length=lengths)
    attempt("bwd cudnn raw", lambda: row("attention bwd: cuDNN SM90 raw wrapper (atomics)",
                                         timeit(raw_cudnn_bwd, reps), f_bwd, b_bwd))
    attempt("bwd cudnn backend", lambda: row(
        "attention bwd: cudnn_backend default mode (cuDNN SM90, sanitise incl.)",
        timeit(lambda: cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                    lengths=lengths, deterministic=False), reps),
        f_bwd, b_bwd))

    def bwd_split():
        return ks.attention_backward(q, kv, ids, sink, out, lse, dout, scale, DV, lengths)

    def check_bwd():
        c = raw_cudnn_bwd()
        a = bwd_split()
        b = bwd_split()
        same = all(torch.equal(u, v) for u, v in zip(a, b))
        log(f"T={T} triton split bwd bitwise replay equal: {same}; vs cuDNN: dq rel "
            f"{rel(a[0], c['dq']):.2e}, dkv rel {rel(a[1], c['dkv']):.2e}, dsink rel "
            f"{rel(a[2], c['d_sink']):.2e}")
        rows.append(dict(T=T, what="triton split bwd replay bitwise equal", ms=None,
                         note=str(same)))
    if not lean:
        attempt("check backward", check_bwd)
        attempt("bwd det kernel", lambda: bench_det_backward(x, T, reps, row, log,
                                                             sweep=sweep))
    attempt("bwd backend det", lambda: row(
        "attention bwd: cudnn_backend deterministic (Triton, checks incl.)",
        timeit(lambda: cb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                    lengths=lengths, deterministic=True), reps),
        f_bwd, b_bwd))
    attempt("bwd torch det", lambda: None if lean else row(
        "attention bwd: torch backend deterministic",
        timeit(lambda: tb.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                    lengths=lengths, deterministic=True), 3, 1),
        f_bwd, b_bwd))
    out = lse = ref_out = ref_lse = None         # free the buffers
    torch.cuda.empty_cache()
    # ---- indexer -----------------------------------------------------------------------------
    from dsv4_oracle import reference as R
    lay = R.PackedLayout([0, T])
    q_idx, k_idx, w = x["q_idx"], x["k_idx"], x["w"]
    f_idx = 2.0 * H * DI * (T * (T // RATIO) / 2) + 2.0 * T * HI * (T // RATIO) / 2
    scores = attempt("indexer", lambda: cb.indexer_scores(q_idx, k_idx, w, lay, RATIO))
    attempt("indexer time", lambda: row("indexer scores: cuDNN THD fwd + scatter to [T,C]",
                                        timeit(lambda: cb.indexer_scores(q_idx, k_idx, w, lay,
                                                                         RATIO), reps), f_idx))
    if scores is None:
        return

    def idx_check():
        s_t = tb.indexer_scores(q_idx, k_idx, w, lay, RATIO)
        fin = torch.isfinite(s_t)
        log(f"T={T} indexer vs torch backend: rel {rel(scores[fin], s_t[fin]):.2e}, -inf "
            f"pattern equal {torch.equal(fin, torch.isfinite(scores))}")
    attempt("indexer check", idx_check)
    for det in (True, False):
        attempt(f"topk det={det}", lambda det=det: row(
            f"Top-K {K} of [T, C]: cuDNN deterministic={det}",
            timeit(lambda: cb.stable_topk(scores, K, deterministic=det), reps)))
    attempt("topk torch", lambda: None if lean else row("Top-K: torch backend",
                                      timeit(lambda: tb.stable_topk(scores, K), reps)))
    cmp_ids, _ = cb.stable_topk(scores, K)
    kv_cmp = kv[T:]
    out2, lse2 = kt.attention_forward(q, kv, ids, sink, scale, DV, lengths)
    loss = attempt("loss", lambda: cb.sparse_indexer_loss(q, kv_cmp, sink, lse2, cmp_ids,
                                                          scores, lay, coeff=0.01))
    attempt("loss time", lambda: row(
        "indexer loss: cuDNN teacher recompute + torch KL",
        timeit(lambda: cb.sparse_indexer_loss(q, kv_cmp, sink, lse2, cmp_ids, scores, lay,
                                              coeff=0.01), reps)))
    if loss is None:
        return
    for det in (False, True):
        attempt(f"loss grad det={det}", lambda det=det: row(
            "indexer loss grad: " + cb.describe(
                "sparse_indexer_loss_grad", q_idx, k_idx, w, cmp_ids, loss.target, loss.predict,
                coeff=0.01, num_real=T, deterministic=det),
            timeit(lambda: cb.sparse_indexer_loss_grad(
                q_idx, k_idx, w, cmp_ids, loss.target, loss.predict, coeff=0.01,
                num_real=T, deterministic=det), reps)))

    def grad_check():
        a = cb.sparse_indexer_loss_grad(q_idx, k_idx, w, cmp_ids, loss.target, loss.predict,
                                        coeff=0.01, num_real=T, deterministic=True)
        b = cb.sparse_indexer_loss_grad(q_idx, k_idx, w, cmp_ids, loss.target, loss.predict,
                                        coeff=0.01, num_real=T, deterministic=False)
        log(f"T={T} indexer grad deterministic vs cuDNN default: "
            + ", ".join(f"{n} rel {rel(u, v):.2e}" for n, u, v in zip(("dq", "dw", "dk"), a, b)))
    attempt("loss grad check", grad_check)

    # ---- the whole DSA step: indexer, Top-K, attention fwd + bwd, indexer loss + gradients --
    def step(det: bool):
        s_ = cb.indexer_scores(q_idx, k_idx, w, lay, RATIO, deterministic=det)
        cmp_ids, _ = cb.stable_topk(s_, K, deterministic=det)
        o, l_ = cb.sparse_attention_forward(q, kv, ids, sink, lengths=lengths, deterministic=det)
        cb.sparse_attention_backward(q, kv, ids, sink, o, l_, dout, lengths=lengths,
                                     deterministic=det)
        ls = cb.sparse_indexer_loss(q, kv_cmp, sink, l_, cmp_ids, s_, lay, coeff=0.01,
                                    deterministic=det)
        cb.sparse_indexer_loss_grad(q_idx, k_idx, w, cmp_ids, ls.target, ls.predict, coeff=0.01,
                                    num_real=T, deterministic=det)
    for det in (False, True):
        attempt(f"step det={det}", lambda det=det: row(
            f"whole DSA step ({'deterministic' if det else 'default mode'}): indexer, Top-K, "
            "attention fwd + bwd, indexer loss + gradients", timeit(lambda: step(det), reps)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--det-backward-only", action="store_true",
                    help="only the deterministic attention backward (Triton split; no cuDNN)")
    ap.add_argument("--indexer-grad-only", action="store_true",
                    help="only the deterministic indexer-loss gradient (Triton; no cuDNN)")
    ap.add_argument("--lean", action="store_true",
                    help="skip the torch backend, the deterministic backward's own phases and "
                         "sweep, and the checks")
    args = ap.parse_args()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    props = torch.cuda.get_device_properties(0)
    log(f"device {props.name} cc {props.major}.{props.minor} SMs {props.multi_processor_count}; "
        f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M')}")
    bw, rate = ceilings()
    log(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    rows: list = []
    for i, T in enumerate(args.T):
        def row(what, ms, flops=None, note="", T=T):
            r = dict(T=T, what=what, ms=round(ms, 4), note=note)
            if flops:
                r["TFLOPs"] = round(flops / (ms * 1e-3) / 1e12, 1)
            rows.append(r)
            log(json.dumps(r))
        if args.det_backward_only:
            bench_det_backward(make_inputs(T), T, args.reps, row, log,
                               sweep=not args.no_sweep and i == 0)
            continue
        if args.indexer_grad_only:
            bench_indexer_grad(make_inputs(T), T, args.reps, row, log,
                               sweep=not args.no_sweep and i == 0)
            continue
        bench_shape(T, args.reps, bw, rate, sweep=not args.no_sweep and i == 0, rows=rows, log=log,
                    lean=args.lean)
        torch.cuda.empty_cache()
    log("\n| T | what | ms | TFLOP/s | compute floor ms | memory floor ms | note |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['T']} | {r['what']} | {r.get('ms')} | {r.get('TFLOPs', '')} | "
            f"{r.get('compute_floor_ms', '')} | {r.get('memory_floor_ms', '')} | {r.get('note', '')} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceilings=dict(copy_TBs=bw / 1e12, bf16_TFLOPs=rate / 1e12), rows=rows,
                           device=props.name), f, indent=1)


if __name__ == "__main__":
    main()
