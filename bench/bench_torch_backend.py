"""Benchmark of the portable torch backend (gpu_impl.torch_backend) on one device.

Times every op of one packed CSA layer at DSv4 shapes (one document of T rows, H=64, D=512,
W=128, K=512, ratio 4, H_I=64, D_I=128), deterministic and default mode, with CUDA events
(median of ``--iters`` after ``--warmup``), and checks that the deterministic results replay
bitwise. Prints one JSON object per measurement; results go to docs/TORCH_BACKEND.md.

    python3 bench/bench_torch_backend.py --T 4096 8192 [--device cuda] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_oracle import reference as R                        # noqa: E402
from dsv4_oracle.gpu_impl import torch_backend as TB     # noqa: E402


def timed(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def same_bits(x, y):
    if isinstance(x, torch.Tensor):
        return torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                           y.view(-1).view(torch.uint8) if y.numel() else y)
    return all(same_bits(a, b) for a, b in zip(x, y) if isinstance(a, torch.Tensor))


def run(T, device, warmup, iters, H=64, D=512, W=128, K=512, HI=64, DI=128, ratio=4):
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    lay = R.PackedLayout([0, T])
    C = lay.num_compressed(ratio)
    mk = lambda *s: torch.randn(*s, generator=g).to(bf).to(device)   # noqa: E731
    q, kv_raw, kv_cmp, dout = mk(T, H, D), mk(T, D), mk(C, D), mk(T, H, D)
    q_idx, k_idx, w = mk(T, HI, DI), mk(C, DI), mk(T, HI)
    sink = torch.randn(H, generator=g).to(device)
    kv = torch.cat([kv_raw, kv_cmp])
    rows = []

    def rec(op, ms, flops=None, det=None, replay=None, **extra):
        r = dict(op=op, T=T, device=str(device), ms=round(ms, 3), deterministic=det, **extra)
        if flops:
            r["tflops"] = round(flops / ms / 1e9, 1)
        if replay is not None:
            r["bitwise_replay"] = replay
        rows.append(r)
        print(json.dumps(r), flush=True)

    scores = TB.indexer_scores(q_idx, k_idx, w, lay, ratio)
    vis = lay.visible_compressed(ratio).float()
    rec("indexer_scores", timed(lambda: TB.indexer_scores(q_idx, k_idx, w, lay, ratio), device,
                                warmup, iters), flops=2 * HI * DI * float(vis.sum()) / 1)
    top = TB.stable_topk(scores, K)
    rec("stable_topk", timed(lambda: TB.stable_topk(scores, K), device, warmup, iters))
    ids, lengths = TB.build_csa_indices(lay, window=W, ratio=ratio, compressed_ids=top[0])
    rec("build_csa_indices", timed(lambda: TB.build_csa_indices(
        lay, window=W, ratio=ratio, compressed_ids=top[0]), device, warmup, iters))
    n_valid = float(lengths.float().sum())
    fwd_flops = 2 * H * n_valid * (D + D)
    bwd_flops = 2 * H * n_valid * D * 5
    out, lse = TB.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    again = TB.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    rec("sparse_attention_forward", timed(lambda: TB.sparse_attention_forward(
        q, kv, ids, sink, lengths=lengths), device, warmup, iters), flops=fwd_flops,
        replay=same_bits((out, lse), again))
    for det in (True, False):
        a = TB.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, lengths=lengths,
                                         deterministic=det)
        b = TB.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, lengths=lengths,
                                         deterministic=det)
        rec("sparse_attention_backward", timed(lambda: TB.sparse_attention_backward(
            q, kv, ids, sink, out, lse, dout, lengths=lengths, deterministic=det), device,
            warmup, iters), flops=bwd_flops, det=det, replay=same_bits(a, b))
    # the deterministic dkv reduction alone, on one chunk of rows (contributions fp32 [n*K, D])
    n = 256
    valid = ids[:n].reshape(-1) >= 0
    dest = ids[:n].reshape(-1)[valid].long()
    vals = torch.randn(int(valid.sum()), D, device=device)
    for method in ("tree", "sorted_put"):
        acc = torch.zeros(kv.shape[0], D, device=device)
        rec("fixed_order_scatter_add", timed(lambda: TB.fixed_order_scatter_add(
            acc, dest, vals, method=method), device, warmup, iters), method=method,
            terms=int(dest.numel()), D=D)
    acc = torch.zeros(kv.shape[0], D, device=device)
    rec("index_add_ (atomics)", timed(lambda: acc.index_add_(0, dest, vals), device, warmup,
                                      iters), terms=int(dest.numel()), D=D)
    vals = None
    loss = TB.sparse_indexer_loss(q, kv_cmp, sink, lse, top[0], scores, lay, coeff=0.01)
    rec("sparse_indexer_loss", timed(lambda: TB.sparse_indexer_loss(
        q, kv_cmp, sink, lse, top[0], scores, lay, coeff=0.01), device, warmup, iters))
    for det in (True, False):
        a = TB.sparse_indexer_loss_grad(q_idx, k_idx, w, top[0], loss.target, loss.predict,
                                        coeff=0.01, num_real=T, deterministic=det)
        b = TB.sparse_indexer_loss_grad(q_idx, k_idx, w, top[0], loss.target, loss.predict,
                                        coeff=0.01, num_real=T, deterministic=det)
        rec("sparse_indexer_loss_grad", timed(lambda: TB.sparse_indexer_loss_grad(
            q_idx, k_idx, w, top[0], loss.target, loss.predict, coeff=0.01, num_real=T,
            deterministic=det), device, warmup, iters), det=det, replay=same_bits(a, b))
    rec("q_rms_norm", timed(lambda: TB.q_rms_norm(q), device, warmup, iters))
    if device.type == "cuda":
        rec("peak_memory", 0.0, gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 2))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        print(json.dumps(dict(gpu=torch.cuda.get_device_name(dev), torch=torch.__version__)))
    rows = []
    for T in a.T:
        rows += run(T, dev, a.warmup, a.iters)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
