"""``dsv4-oracle check``: is this DSv4 sparse-attention implementation right and deterministic?

Runs an implementation (an adapter: :mod:`dsv4_oracle.adapters`) over catalog cases
(:mod:`fixtures`) at op level and for the packed layer, judges every output against the
float64 oracle with the contract's error model, checks bitwise replays, grad-mode parity and
input immutability (:mod:`dsv4_oracle.runner`), then prints a summary table and optionally
writes ``report.json`` / ``report.md`` / PNG plots and a JUnit file (:mod:`dsv4_oracle.report`).

Exit status: 0 when every check holds, 1 when a check fails, 2 for a bad invocation (an
unknown case, an adapter that cannot be imported or lacks an op, a CUDA implementation on a
machine without CUDA): one line on stderr, no traceback.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "main_check", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(sub) -> argparse.ArgumentParser:
    from .adapters import ALL_OPS
    p = sub.add_parser(
        "check", help="check an implementation against the oracle over catalog cases",
        description="Run an implementation over fixture cases, at op level and for the packed "
                    "layer, and judge it against the float64 oracle: error/bound ratios of the "
                    "contract's error model, exact checks, bitwise replays, grad-mode parity "
                    "and input immutability. Exit status 0 iff every check holds.",
        epilog="Adapters: 'reference' (the oracle; every ratio must be 0), 'gpu_impl:torch', "
               "'gpu_impl:cudnn', or your own 'module:attr' (see examples/"
               "megatron_style_adapter.py). Default: gpu_impl:cudnn on a CUDA machine, else "
               "gpu_impl:torch on the CPU.")
    p.add_argument("--impl", metavar="SPEC", default=None,
                   help="the implementation: reference | gpu_impl:torch | gpu_impl:cudnn | "
                        "module:attr (default: gpu_impl:cudnn with CUDA, else gpu_impl:torch)")
    p.add_argument("--device", default=None,
                   help="device the inputs are put on (default: the adapter's own)")
    p.add_argument("--catalog", choices=("quick", "full", "production"), default=None,
                   help="case catalog (default: quick; full when --case is given; production: "
                        "the DSv4 shapes at T 4096 to 65536, in neither of the others)")
    p.add_argument("--oracle-device", metavar="DEVICE", default=None,
                   help="run the oracle's float64 code on DEVICE (e.g. cuda) instead of the "
                        "CPU, for the production catalog (default: the CPU, the definition)")
    p.add_argument("--case", metavar="PATTERN", action="append", default=[],
                   help="case id or glob (e.g. 'sink-*'); repeatable")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops to check (default: every op the adapter has); "
                        f"ops: {', '.join(ALL_OPS)}")
    p.add_argument("--replays", type=int, default=3, metavar="N",
                   help="bitwise replays per case and level (default 3; below 2: no replay check)")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="write report.json, report.md and PNG plots into DIR")
    p.add_argument("--junit", metavar="FILE", default=None, help="write JUnit XML to FILE")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn on stderr only when that is a terminal)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="also print one line per case")
    p.set_defaults(func=main_check)
    return p


def _usage_error(msg: str) -> int:
    print(f"dsv4-oracle check: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def main_check(args) -> int:
    from .adapters import ALL_OPS, AdapterError, default_impl, load_adapter
    from .runner import SelectionError, run_check, select_cases

    if args.replays < 0:
        return _usage_error(f"--replays must be >= 0, got {args.replays}")
    try:
        cases, catalog = select_cases(args.catalog, args.case)
    except SelectionError as exc:
        return _usage_error(str(exc))
    if args.list:
        for c in cases:
            print(f"{c.id:34s} {', '.join(c.categories)}")
        print(f"{len(cases)} cases ({catalog} catalog)")
        return EXIT_OK
    if args.oracle_device is not None:
        from reference._checks import as_device
        try:
            as_device(args.oracle_device, "--oracle-device")
        except (TypeError, ValueError) as exc:
            return _usage_error(str(exc))
    spec = args.impl or default_impl()
    try:
        adapter = load_adapter(spec, device=args.device)
    except AdapterError as exc:
        return _usage_error(str(exc))
    why = adapter.unavailable()
    if why:
        return _usage_error(why)
    ops = None
    if args.ops:
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
        unknown = [o for o in ops if o not in ALL_OPS]
        if unknown:
            return _usage_error(f"--ops: unknown op {unknown[0]!r}; ops are {', '.join(ALL_OPS)}")
        missing = [o for o in ops if not adapter.has(o)]
        if missing:
            return _usage_error(f"adapter {adapter.spec} lacks op {missing[0]} (it provides "
                                f"{', '.join(adapter.ops)})")

    from .progress import ProgressBar, progress_enabled
    bar = ProgressBar(len(cases), enabled=progress_enabled(sys.stderr, args.no_progress),
                      label=f"check {adapter.spec}")
    try:
        result = run_check(adapter, cases, catalog=catalog, patterns=args.case,
                           replays=args.replays, ops=ops, progress=bar,
                           oracle_device=args.oracle_device)
    except KeyboardInterrupt:
        bar.close()
        print("dsv4-oracle check: interrupted", file=sys.stderr)
        return 130
    finally:
        bar.close()

    from .report import format_summary, write_junit, write_report
    color = sys.stdout.isatty()
    print(format_summary(result, color=color, verbose=args.verbose))
    try:
        if args.report:
            paths = write_report(result, args.report)
            print(f"report: {', '.join(paths)}")
        if args.junit:
            write_junit(result, args.junit)
            print(f"junit: {args.junit}")
    except OSError as exc:
        return _usage_error(f"cannot write the report: {exc}")
    return EXIT_OK if result.passed else EXIT_FAILED
