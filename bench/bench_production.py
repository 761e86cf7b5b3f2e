"""How the float64 oracle scales over the production tier: time and peak memory per ``T``.

For each ``T`` (default 4096, 16384 and 65536) the DSv4-Flash production case
``prod-flash-T<T>`` (``fixtures.production``: H 64, D 512, W 128, ratio 4, K 512, H_I 64,
D_I 128, several documents with padding, an empty one, capacity rows) runs in a fresh
subprocess, which times three stages of exactly what ``dsv4-oracle check`` evaluates:

- ``materialize``: the case's inputs (bf16, drawn on the CPU);
- ``oracle``: :func:`fixtures.run_oracle` (indexer scores, Top-K, CSA ids, attention forward
  and backward, indexer loss and its gradients);
- ``bounds``: :func:`fixtures.oracle_bounds` for a bf16 implementation (the error model).

With ``--check ADAPTER`` the child instead times the whole check of that implementation on the
case (``runner.check_case``, 3 replays, the oracle on ``--compute-device``): what
``dsv4-oracle check --case prod-flash-T<T>`` costs end to end, with its verdict and worst
ratio. ``--T`` takes any multiple of 1024 (``fixtures.production.production_case``), so the
cost can be followed below the catalog's sizes on a small machine.

Peak memory is the child's peak resident set (``ru_maxrss``), on the CPU; with
``--compute-device cuda`` the oracle's float64 code runs on the GPU and the peak of
``torch.cuda.max_memory_allocated`` is reported as well. ``--threads`` sets the child's torch
intra-op threads (default: torch's own choice, the machine's cores). One JSON document with the
machine, the settings and one row per ``T`` goes to ``--json`` (default
``bench/results/bench_production.json``).

Usage::

    python bench/bench_production.py --T 4096 --threads 2            # smoke run
    python bench/bench_production.py --threads 16                    # the full table
    python bench/bench_production.py --compute-device cuda           # the oracle on a GPU
    python bench/bench_production.py --T 2048 --check gpu_impl:torch # the whole check
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "bench" / "results" / "bench_production.json"
ROWS = (4096, 16384, 65536)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def child_main(T: int, device: str | None, out_path: str, check: str | None = None) -> None:
    """One ``T`` in this process: time each stage, record the peaks, write JSON."""
    from dsv4_oracle.fixtures import oracle_bounds, run_oracle
    from dsv4_oracle.fixtures.production import production_case
    from dsv4_oracle.reference import error_model as E

    case = production_case("flash", T)
    cuda = device is not None and torch.device(device).type == "cuda"
    row = {"case": case.id, "T": case.T, "C": case.C, "real_tokens": case.layout().num_real,
           "compute_device": device or "cpu", "threads": torch.get_num_threads(),
           "stages_s": {}}

    def stage(name, fn):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        if cuda:
            torch.cuda.synchronize()
        row["stages_s"][name] = round(time.perf_counter() - t0, 3)
        return r

    if check:
        from dsv4_oracle.adapters import load_adapter
        from dsv4_oracle.runner import check_case
        adapter = load_adapter(check)
        outcome = stage("check", lambda: check_case(adapter, case, replays=3,
                                                    oracle_device=device))
        judged = [c.ratio for c in outcome.checks if c.judged and c.ratio is not None]
        row.update(adapter=check, passed=outcome.passed and outcome.error is None,
                   checks=len(outcome.checks), worst_ratio=max(judged, default=None),
                   check_error=outcome.error)
    else:
        x = stage("materialize", case.materialize)
        o = stage("oracle", lambda: run_oracle(case, x, compute_device=device))
        stage("bounds", lambda: oracle_bounds(case, x, o,
                                              precision=E.Precision.of(torch.bfloat16),
                                              compute_device=device))
    row["total_s"] = round(sum(row["stages_s"].values()), 3)
    row["peak_rss_gib"] = round(_peak_rss_bytes() / 2 ** 30, 3)
    if cuda:
        row["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
    Path(out_path).write_text(json.dumps(row))


def spawn(T: int, threads: int | None, device: str | None, check: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(T),
               "--child-out", out]
        if device:
            cmd += ["--compute-device", device]
        if check:
            cmd += ["--check", check]
        env = dict(os.environ)
        if threads:
            cmd += ["--threads", str(threads)]
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return {"T": T, "error": f"exit {r.returncode}: {tail[0]}"}
        return json.loads(Path(out).read_text())


def _rows(text: str) -> int:
    try:
        T = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if T < 1024 or T % 1024:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 1024, got {T}")
    return T


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Time and peak memory of the float64 oracle on "
                                             "the DSv4-Flash production cases, per T.")
    ap.add_argument("--T", type=_rows, action="append", default=None,
                    help="packed rows, a multiple of 1024; repeatable (default: 4096, 16384 "
                         "and 65536, the production catalog's)")
    ap.add_argument("--check", metavar="ADAPTER", default=None,
                    help="time the whole check of ADAPTER (e.g. gpu_impl:torch) on the case "
                         "instead of the oracle's stages: runner.check_case with 3 replays, "
                         "the oracle on --compute-device")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads of each run (default: torch's choice)")
    ap.add_argument("--compute-device", default=None,
                    help="run the oracle's float64 code on this device (e.g. cuda)")
    ap.add_argument("--json", metavar="OUT", default=str(DEFAULT_JSON),
                    help=f"where to write the results (default {DEFAULT_JSON.relative_to(ROOT)})")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.compute_device is not None:
        from dsv4_oracle.reference._checks import as_device
        try:
            as_device(args.compute_device, "--compute-device")
        except (TypeError, ValueError) as exc:
            ap.error(str(exc))
    if args.check is not None and args.child is None:
        from dsv4_oracle.adapters import load_adapter
        try:
            load_adapter(args.check)
        except Exception as exc:                   # an adapter that cannot load: one line
            ap.error(f"--check {args.check!r}: {exc}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child is not None:
        child_main(args.child, args.compute_device, args.child_out, args.check)
        return 0
    rows = []
    for T in args.T or ROWS:
        row = spawn(T, args.threads, args.compute_device, args.check)
        rows.append(row)
        if "error" in row:
            print(f"T={T:6d}  FAILED {row['error']}", flush=True)
            continue
        s = row["stages_s"]
        gpu = f"  peak CUDA {row['peak_cuda_gib']:.2f} GiB" if "peak_cuda_gib" in row else ""
        if args.check:
            verdict = "PASS" if row["passed"] else f"FAIL {row.get('check_error') or ''}"
            print(f"T={T:6d}  check {s['check']:9.2f} s  {verdict}  worst ratio "
                  f"{row['worst_ratio']}  peak RSS {row['peak_rss_gib']:7.2f} GiB{gpu}",
                  flush=True)
            continue
        print(f"T={T:6d}  oracle {s['oracle']:9.2f} s  bounds {s['bounds']:9.2f} s  "
              f"inputs {s['materialize']:7.2f} s  peak RSS {row['peak_rss_gib']:7.2f} GiB{gpu}",
              flush=True)
    doc = {"benchmark": "bench_production", "shape": "dsv4-flash", "machine": machine(),
           "threads": args.threads, "compute_device": args.compute_device or "cpu",
           "check": args.check,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out)
    print(f"json: {out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
