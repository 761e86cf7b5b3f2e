"""Time of the CP layer (``gpu_impl/cp.py``, forward + backward) per CP size, and the share of
that time spent in communication.

Every CP size runs in fresh processes (one per rank; gloo on the CPU, NCCL on GPUs with
``NCCL_NVLS_ENABLE=0``). Each rank draws random local inputs (seeded per rank), then per
iteration: barrier, (CUDA sync), forward + backward of the whole layer, (CUDA sync); the
iteration time is the slowest rank's. The communication time is measured separately with the
very collectives the layer issues (``gpu_impl.cp``'s helpers, the same sizes, dtypes and
order: validation agreement, halo send/receive, the all-gathers of compressed and indexer
keys, the loss fold, and in the backward the halo return, the two all-to-alls and the sink
fold), timed the same way; ``share = communication / layer``. With ``--cp 1`` the plain
layer (``gpu_impl.layer.csa_layer``, no process group) is timed too, on the whole ``T``.

Usage::

    python bench/bench_cp.py --device cpu --cp 1 2 4                  # small shape, gloo
    NCCL_NVLS_ENABLE=0 python bench/bench_cp.py --device cuda --cp 1 2 --flash --T 8192
    python bench/bench_cp.py ... --json out.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_oracle import reference as R  # noqa: E402

SMALL = dict(H=8, D=64, Dv=64, W=32, ratio=4, topk=16, HI=4, DI=32, dtype="float32")
FLASH = dict(H=64, D=512, Dv=512, W=128, ratio=4, topk=512, HI=64, DI=128, dtype="bfloat16")


def bench_layout(T: int) -> R.PackedLayout:
    """Documents of ~3/16, 3/8, 0 (empty), 5/16 and 1/8 of T with a little padding each;
    rank boundaries at T/2 and T/4, 3T/4 fall inside documents (halos are used)."""
    unit = T // 16
    padded = [3 * unit, 6 * unit, 0, 5 * unit, T - 14 * unit]
    real = [max(0, p - p // 48) for p in padded]
    cu_pad, cu = [0], [0]
    for p, r in zip(padded, real):
        cu_pad.append(cu_pad[-1] + p)
        cu.append(cu[-1] + r)
    return R.PackedLayout(cu, cu_pad, T)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rank(rank, world, cfg, out_dir):
    import torch.distributed as dist

    from dsv4_oracle.gpu_impl import cp as CP
    from dsv4_oracle.gpu_impl.layer import csa_layer
    torch.set_num_threads(1)          # one thread per rank: CPU ranks stand for devices
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{cfg['store']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600),
                            **({"device_id": dev} if cuda else {}))
    s = cfg["shape"]
    dt = getattr(torch, s["dtype"])
    lay = bench_layout(cfg["T"])
    L = cfg["T"] // world
    n_own = CP.owned_group_counts(lay, world, ratio=s["ratio"])[rank]
    g = torch.Generator(device=dev).manual_seed(1234 + rank)

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    x = dict(q=rnd(L, s["H"], s["D"]), kv=rnd(L, s["D"]), kv_cmp=rnd(n_own, s["D"]),
             q_idx=rnd(L, s["HI"], s["DI"]), k_idx=rnd(n_own, s["DI"]),
             weights=rnd(L, s["HI"]))
    # The sink is replicated: the same values on every rank (the layer checks it).
    x["sink"] = torch.randn(s["H"], generator=torch.Generator(device=dev).manual_seed(1234),
                            device=dev, dtype=torch.float32)
    dout = rnd(L, s["H"], s["Dv"])
    kw = dict(window=s["W"], ratio=s["ratio"], topk=s["topk"], coeff=0.01, v_dim=s["Dv"],
              backend=cfg["backend"], deterministic=cfg["deterministic"])

    def layer_step():
        leaves = {k: v.detach().requires_grad_(True) for k, v in x.items()}
        res = CP.cp_csa_layer(leaves["q"], leaves["kv"], leaves["sink"], lay,
                              kv_cmp=leaves["kv_cmp"], q_idx=leaves["q_idx"],
                              k_idx=leaves["k_idx"], weights=leaves["weights"], **kw)
        torch.autograd.backward([res.out, res.loss], [dout, torch.ones_like(res.loss)])
        return res.backends

    geo = CP.cp_geometry(lay, world, rank, window=s["W"], ratio=s["ratio"])
    comm = CP._Comm(None, CP.DEFAULT_TIMEOUT_S)
    agreed = dict(kw, layout=lay, **x)

    def comm_step():        # the layer's validation exchange and collectives, no compute
        CP._check_values(rank, **x)
        CP._agree(comm, None, agreed)
        CP._shift_to_next(comm, geo, x["kv"][L - geo.d_win:] if world > 1 else x["kv"][:0],
                          x["kv"].new_zeros((geo.d_win, s["D"])))
        CP._all_gather_rows(comm, geo, x["kv_cmp"], "kv_cmp")
        CP._all_gather_rows(comm, geo, x["k_idx"], "k_idx")
        CP._sum_over_ranks(comm, geo, torch.zeros(1, device=dev), cfg["deterministic"], "loss")
        CP._shift_to_previous(comm, geo, x["kv"][:geo.d_win],
                              x["kv"].new_zeros((geo.d_win, s["D"])))
        CP._return_to_owners(comm, geo, x["kv"].new_zeros((world * geo.cap, s["D"])), n_own,
                             cfg["deterministic"], "dkv_cmp")
        CP._return_to_owners(comm, geo, x["k_idx"].new_zeros((world * geo.cap, s["DI"])), n_own,
                             cfg["deterministic"], "dk_idx")
        CP._sum_over_ranks(comm, geo, torch.zeros(s["H"], device=dev), cfg["deterministic"],
                           "dsink")

    def timed(step, reps):
        times, info = [], None
        for i in range(cfg["warmup"] + reps):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            info = step()
            _sync(dev)
            dt_ = time.perf_counter() - t0
            if i >= cfg["warmup"]:
                times.append(dt_)
        t = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)          # per iteration, the slowest rank
        return [float(v) for v in t.cpu()], info

    layer_times, backends = timed(layer_step, cfg["reps"])
    comm_times, _ = timed(comm_step, cfg["reps"])
    plain = None
    if world == 1 and cfg["plain"]:
        def plain_step():
            leaves = {k: v.detach().requires_grad_(True) for k, v in x.items()}
            res = csa_layer(leaves["q"], leaves["kv"], leaves["sink"], lay,
                            kv_cmp=leaves["kv_cmp"], q_idx=leaves["q_idx"],
                            k_idx=leaves["k_idx"], weights=leaves["weights"], **kw)
            torch.autograd.backward([res.out, res.loss], [dout, torch.ones_like(res.loss)])
        plain, _ = timed(plain_step, cfg["reps"])
    if rank == 0:
        rec = dict(cp=world, layer_s=layer_times, comm_s=comm_times, plain_layer_s=plain,
                   backends=backends,
                   peak_mem_gib=(torch.cuda.max_memory_allocated(dev) / 2 ** 30) if cuda else None)
        with open(os.path.join(out_dir, f"cp{world}.json"), "w") as f:
            json.dump(rec, f)
    dist.destroy_process_group()


def run(cfg) -> list:
    import torch.multiprocessing as mp
    records = []
    for world in cfg["cp"]:
        with tempfile.TemporaryDirectory(prefix="bench_cp_") as tmp:
            c = dict(cfg, store=os.path.join(tmp, "store"))
            mp.start_processes(_rank, args=(world, c, tmp), nprocs=world, join=True,
                               start_method="spawn")
            with open(os.path.join(tmp, f"cp{world}.json")) as f:
                rec = json.load(f)
        med = statistics.median(rec["layer_s"])
        cmed = statistics.median(rec["comm_s"])
        rec.update(layer_median_s=med, comm_median_s=cmed, comm_share=cmed / med)
        if rec["plain_layer_s"]:
            rec["plain_layer_median_s"] = statistics.median(rec["plain_layer_s"])
        records.append(rec)
        print(f"cp={world}: layer fwd+bwd {med * 1e3:.2f} ms (median of {len(rec['layer_s'])}), "
              f"communication {cmed * 1e3:.2f} ms = {100 * cmed / med:.1f}%"
              + (f"; plain layer (no CP) {rec['plain_layer_median_s'] * 1e3:.2f} ms"
                 if rec.get("plain_layer_median_s") else "")
              + f"; backends {rec['backends']}", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--T", type=int, default=None, help="packed rows (default 512 cpu, 8192 cuda)")
    ap.add_argument("--flash", action="store_true", help="DSv4-Flash head shapes (bf16)")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "cudnn"))
    ap.add_argument("--nondeterministic", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-plain", action="store_true", help="skip the plain (no CP) layer")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and os.environ.get("NCCL_NVLS_ENABLE") != "0":
        print("set NCCL_NVLS_ENABLE=0 (NVLink multicast must stay off)", file=sys.stderr)
        return 2
    shape = FLASH if a.flash else SMALL
    T = a.T or (8192 if a.device == "cuda" else 512)
    cfg = dict(device=a.device, cp=a.cp, T=T, shape=shape, backend=a.backend,
               deterministic=not a.nondeterministic, reps=a.reps, warmup=a.warmup,
               plain=not a.no_plain, threads=torch.get_num_threads())
    lay = bench_layout(T)
    print(f"bench_cp: {a.device}, T={T}, layout cu={lay.cu_seqlens.tolist()} "
          f"pad={lay.cu_seqlens_padded.tolist()}, shape {shape}, backend={a.backend}, "
          f"deterministic={cfg['deterministic']}, torch {torch.__version__}, "
          f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
          flush=True)
    records = run(cfg)
    if a.json:
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                    torch=torch.__version__, device=a.device,
                    gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else None,
                    cpus=os.cpu_count(), load=os.getloadavg()[0])
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, config={k: v for k, v in cfg.items()}, records=records),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
