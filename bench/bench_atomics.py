"""Micro-benchmark: how fast can the dkv scatter of the attention backward go on this GPU, per
accumulation method? (docs/CUDNN.md, "The deterministic attention backward".)

The pattern is the backward's: T rows x K slots, each slot adds a D-wide float32 row into the
accumulator row of its key id (S keys, an L2-sized accumulator), programs = (row, column slice).
Methods: ``fp32`` (float atomics, as cuDNN: not order-independent), ``int32`` (integer atomics of
fixed-point values: order-independent), ``fp32x`` (float atomics of integer-valued floats below
2^24: exact, hence order-independent), ``fp64x`` and ``int64`` (the same in 64 bits), ``rmw`` (plain load + add + store, racy: a bandwidth
reference only), ``store`` (plain stores). Contributions are generated in registers (no loads),
so the numbers isolate the scatter.

Usage: ``python bench/bench_atomics.py [--T 4096] [--K 640] [--S 5120] [--D 512] [--reps 10]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_gpu import timeit                      # noqa: E402  (this folder is on sys.path)


@triton.jit
def _scatter_kernel(ids_ptr, acc_ptr, K, D, METHOD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1)
    dd = col * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in range(0, K, BLOCK_N):
        slot = j0 + offs_n
        ok = slot < K
        idv = tl.load(ids_ptr + t * K + slot, mask=ok, other=0).to(tl.int64)
        val = (slot[:, None] * 3 + dd[None, :] + t).to(tl.float32) * 0.001
        ptrs = acc_ptr + idv[:, None] * D + dd[None, :]
        m = ok[:, None] & (dd < D)[None, :]
        if METHOD == 0:                                      # fp32 atomics
            tl.atomic_add(ptrs, val, mask=m, sem="relaxed")
        elif METHOD == 1:                                    # int32 fixed point
            tl.atomic_add(ptrs, (val * 1024.0).to(tl.int32), mask=m, sem="relaxed")
        elif METHOD == 2:                                    # integer-valued fp32
            tl.atomic_add(ptrs, tl.floor(val * 16.0), mask=m, sem="relaxed")
        elif METHOD == 5:                                    # integer-valued fp64
            tl.atomic_add(ptrs, tl.floor(val.to(tl.float64) * 16.0), mask=m, sem="relaxed")
        elif METHOD == 6:                                    # int64 fixed point
            tl.atomic_add(ptrs, (val * 1024.0).to(tl.int64), mask=m, sem="relaxed")
        elif METHOD == 3:                                    # racy read-modify-write
            old = tl.load(ptrs, mask=m, other=0.0, cache_modifier=".cg")
            tl.store(ptrs, old + val, mask=m)
        else:                                                # plain stores
            tl.store(ptrs, val, mask=m)


METHODS = {"fp32": 0, "int32": 1, "fp32x": 2, "rmw": 3, "store": 4, "fp64x": 5, "int64": 6}
DTYPES = {"int32": torch.int32, "fp64x": torch.float64, "int64": torch.int64}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--K", type=int, default=640)
    ap.add_argument("--S", type=int, default=5120)
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args()
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(args.T, args.S, device=dev, generator=g).argsort(dim=1)[:, :args.K]
    ids = ids.to(torch.int32).contiguous()
    nbytes = args.T * args.K * args.D * 4
    rows = []
    for block_d in (64, 128):
        for name, code in METHODS.items():
            dt = DTYPES.get(name, torch.float32)
            acc = torch.zeros((args.S, args.D), dtype=dt, device=dev)
            grid = (args.T, triton.cdiv(args.D, block_d))
            for warps in (4, 8):
                def call():
                    _scatter_kernel[grid](ids, acc, args.K, args.D, METHOD=code, BLOCK_N=64,
                                          BLOCK_D=block_d, num_warps=warps)
                ms = timeit(call, args.reps) if dev == "cuda" else (call(), float("nan"))[1]
                r = dict(method=name, block_d=block_d, num_warps=warps, ms=round(ms, 4),
                         GBps=round(nbytes / (ms * 1e-3) / 1e9, 1))
                rows.append(r)
                print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"{name}: T {args.T} K {args.K} S {args.S} D {args.D}: "
          f"{args.T * args.K * args.D / 1e9:.2f} G element updates per call")


if __name__ == "__main__":
    main()
