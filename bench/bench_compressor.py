"""Benchmark of the compressor (contract section 15) at DSv4 shapes: the deterministic GPU path
(``gpu_impl.cudnn_backend``: Triton pooling on SM90, cuDNN's fused compressor on SM100, torch
RMSNorm/RoPE/Hadamard) against the eager torch compressor (``gpu_impl.torch_backend``, the same
stages with the pooling as gathers and elementwise torch ops), forward and backward.

Per configuration (the main CSA compressor ``r = 4``, ``d = 512``; the indexer's ``r = 4``,
``d = 128``, with the Hadamard rotation; the HCA compressor ``r = 128``, ``d = 512``) and ``T``:
the median time of ``--iters`` calls after ``--warmup`` (CUDA events), the route the GPU path
took, whether its results replay bitwise (``--replays``), and its worst error/bound ratio
against the float64 oracle (``--judge``, on the CPU: minutes at large ``T``). Prints one JSON
object per measurement.

    python3 bench/bench_compressor.py --T 4096 16384 65536 --out bench/results/<name>.json
    python3 bench/bench_compressor.py --T 64 --device cpu --iters 2     # a smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4_oracle import reference as R                            # noqa: E402
from dsv4_oracle.gpu_impl import torch_backend as TB               # noqa: E402
from bench_torch_backend import timed                              # noqa: E402

CONFIGS = {"csa_main": (4, 512, False), "csa_indexer": (4, 128, True), "hca": (128, 512, False)}
ROPE = R.RopeSpec(64, 160000.0, 16.0, 65536)          # the DSv4-Flash checkpoint's constants


def inputs(T, ratio, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = 2 if ratio == 4 else 1
    lay = R.PackedLayout([0, T - 3, T], [0, T - 3, T])            # two documents, tails
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    kv, score = mk(T, c * d), mk(T, c * d)
    ape = torch.randn(ratio, c * d, generator=g).to(device)
    w = (1 + torch.randn(d, generator=g) / 4).to(device)
    dout = mk(lay.num_compressed(ratio), d)
    return lay, (kv, score, ape, w), dout


def bits(x):
    return [t.contiguous().view(torch.uint8).clone() for t in (x if isinstance(x, tuple) else (x,))]


def run(name, T, device, impl, warmup, iters, replays, judge):
    ratio, d, rotate = CONFIGS[name]
    lay, args, dout = inputs(T, ratio, d, device)
    fwd = lambda: impl.compressor_forward(*args, lay, ratio, rope=ROPE, rotate=rotate)  # noqa
    bwd = lambda: impl.compressor_backward(*args, lay, ratio, dout, rope=ROPE,          # noqa
                                           rotate=rotate)
    row = {"config": name, "T": T, "r": ratio, "d": d, "device": str(device),
           "impl": impl.__name__.rsplit(".", 1)[-1],
           "forward_ms": timed(fwd, device, warmup, iters),
           "backward_ms": timed(bwd, device, warmup, iters)}
    if impl is not TB and device.type == "cuda":
        row["route"] = impl.compressor_route(args[0], ratio, None, True, True)[1]
    out, grads = fwd(), tuple(bwd())
    ref = bits(out) + sum((bits(g) for g in grads), [])
    row["bitwise_replays"] = all(
        all(torch.equal(a, b) for a, b in zip(ref, bits(fwd()) + sum((bits(g) for g in bwd()), [])))
        for _ in range(replays))
    if judge:
        from dsv4_oracle.adapters import default_precision
        from dsv4_oracle.reference import error_model as EM
        cpu = [a.cpu() for a in args]
        p = default_precision(torch.bfloat16)
        o = R.compressor_forward(*cpu, lay, ratio, rope=ROPE, rotate=rotate)
        b = EM.compressor_forward_bound(*cpu, lay, ratio, o, rope=ROPE, precision=p, rotate=rotate)
        ratios = [float(((out.cpu().double() - o).abs() / b).max())]
        gr = R.compressor_backward(*cpu, lay, ratio, dout.cpu(), rope=ROPE, rotate=rotate)
        gb = EM.compressor_backward_bound(*cpu, lay, ratio, dout.cpu(), gr, rope=ROPE,
                                          precision=p, rotate=rotate)
        for g, e, bb in zip(grads, gr, gb):
            err = (g.cpu().double() - e).abs()
            ratios.append(float(torch.where(err == 0, torch.zeros_like(err), err / bb).max()))
        row["worst_ratio"] = max(ratios)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--config", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--judge", action="store_true", help="worst error/bound ratio vs the oracle")
    p.add_argument("--out", default=None, help="write every row as a JSON list")
    a = p.parse_args(argv)
    if any(t < 8 for t in a.T):
        p.error("--T must be at least 8")
    device = torch.device(a.device)
    impls = [TB]
    if device.type == "cuda":
        from dsv4_oracle.gpu_impl import cudnn_backend
        impls.append(cudnn_backend)
    rows = []
    for T in a.T:
        for name in a.config:
            if T < 2 * CONFIGS[name][0]:
                continue
            for impl in impls:
                row = run(name, T, device, impl, a.warmup, a.iters, a.replays, a.judge)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
