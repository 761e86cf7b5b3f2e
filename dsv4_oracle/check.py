"""``dsv4-oracle check``: is this DSv4 sparse-attention implementation right and deterministic?

Runs an implementation (an adapter: :mod:`dsv4_oracle.adapters`) over catalog cases
(:mod:`fixtures`) at op level and for the packed layer, judges every output against the
float64 oracle with the contract's error model, checks bitwise replays, grad-mode parity and
input immutability (:mod:`dsv4_oracle.runner`), then prints a summary table and optionally
writes ``report.json`` / ``report.md`` / PNG plots and a JUnit file (:mod:`dsv4_oracle.report`).

Exit status: 0 when every check holds, 1 when a check fails (an op that raises, exits, hangs
past ``--timeout``, writes into its arguments or returns something unusable fails its checks;
an op that no interrupt reaches ends the process with status 1 and one line), 2 for a bad
invocation (an unknown case, a bad option value such as ``--timeout 1e12``, a ``--report`` or
``--junit`` path that cannot be written, an adapter that cannot be imported, made or inspected
within ``--timeout`` or lacks an op, a device that cannot hold the inputs, a CUDA
implementation on a machine without CUDA, a selection that judges nothing): one line on
stderr, no traceback, before anything runs; 130 when interrupted (Ctrl-C), with one line. The
process never exits 0 without a verdict.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

__all__ = ["add_parser", "main_check", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE",
           "EXIT_INTERRUPTED", "DEFAULT_TIMEOUT_S"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_TIMEOUT_S = 900.0


def add_parser(sub) -> argparse.ArgumentParser:
    from dsv4_oracle.reference.contract_policies import POLICIES
    from .adapters import ALL_OPS
    p = sub.add_parser(
        "check", help="check an implementation against the oracle over catalog cases",
        description="Run an implementation over fixture cases, at op level and for the packed "
                    "layer, and judge it against the float64 oracle: error/bound ratios of the "
                    "contract's error model, exact checks, bitwise replays, grad-mode parity "
                    "and input immutability. Exit status 0 iff every check holds.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(textwrap.fill(t, 78) for t in (
            "Adapters: 'reference' (the oracle; every ratio must be 0), 'gpu_impl:torch', "
            "'gpu_impl:cudnn', or your own as 'module:attr' or 'path/to/file.py:attr' "
            "('dsv4-oracle init-adapter' writes one that passes as written; a worked example "
            "is dsv4_oracle.examples.megatron_style_adapter:MegatronStyleAdapter). "
            "Default: gpu_impl:cudnn on a CUDA machine, else gpu_impl:torch on the CPU.",
            "Exit status: 0 every check holds; 1 a check failed (each failing check is "
            "printed); 2 a bad invocation (one line on stderr); 130 interrupted.")))
    p.add_argument("--impl", metavar="SPEC", default=None,
                   help="the implementation: reference | gpu_impl:torch | gpu_impl:cudnn | "
                        "module:attr | path/to/file.py:attr (default: gpu_impl:cudnn with "
                        "CUDA, else gpu_impl:torch)")
    p.add_argument("--device", default=None,
                   help="device the inputs are put on (default: the adapter's own)")
    p.add_argument("--catalog", choices=("quick", "full", "production"), default=None,
                   help="case catalog (default: quick; full when --case is given; production: "
                        "the DSv4 shapes at T 4096 to 65536, in neither of the others)")
    p.add_argument("--oracle-device", metavar="DEVICE", default=None,
                   help="run the oracle's float64 code and the numeric comparisons on DEVICE "
                        "(e.g. cuda) instead of the CPU, for the production catalog "
                        "(default: the CPU, the definition)")
    p.add_argument("--case", metavar="PATTERN", action="append", default=[],
                   help="case id or glob (e.g. 'sink-*'); repeatable")
    p.add_argument("--shape", metavar="SPEC", action="append", default=[],
                   help="check at your own shapes instead of the catalog: a case built from "
                        "key=value pairs, e.g. 'H=64,D=512,K=512,W=128,T=4096,sink=finite' "
                        "(keys: H, D, Dv, K, W, ratio, H_I, D_I, T, dtype, sink "
                        "finite|none|+inf|large|log_k|mixed, layer csa|hca|window|dsa, layout "
                        "mixed|single|uniform, B, seed; the others take the DSv4-Flash "
                        "values); repeatable")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops to check (default: every op the adapter has); "
                        f"ops: {', '.join(ALL_OPS)}")
    p.add_argument("--replays", type=int, default=3, metavar="N",
                   help="bitwise replays per case and level (default 3; below 2: no replay check)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"an op call that does not return within SECONDS fails; loading the "
                        f"adapter (import, construction) gets the same limit (default "
                        f"{DEFAULT_TIMEOUT_S:g}; 0: no limit; at most 1e6)")
    p.add_argument("--precision", choices=("adapter", "default"), default="adapter",
                   help="the working precision the error model assumes: the adapter's "
                        "declaration (default; a declaration looser than the default is "
                        "flagged) or the default (float32 accumulation, outputs in the input "
                        "dtype) whatever the adapter declares")
    p.add_argument("--policy", metavar="NAME=VALUE", action="append", default=[],
                   help="judge under this named policy of contract section 5.2 (repeatable; "
                        "on top of what the adapter declares); 'default' first forgets the "
                        "adapter's declaration (the contract's defaults). Policies: "
                        + "; ".join(f"{n}: {'|'.join(p.values)}" for n, p in POLICIES.items()))
    p.add_argument("--report", metavar="DIR", default=None,
                   help="write report.json, report.md and PNG plots into DIR")
    p.add_argument("--junit", metavar="FILE", default=None, help="write JUnit XML to FILE")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is drawn on stderr only when that is a terminal)")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print one line per case (and, without a progress bar, one "
                        "flushed line on stderr as each case finishes)")
    p.set_defaults(func=main_check)
    return p


def _usage_error(msg: str) -> int:
    print(f"dsv4-oracle check: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _parse_policies(items: list) -> tuple[dict, dict]:
    """``(policies, {"forget_declared": bool})`` of the ``--policy`` arguments: ``NAME=VALUE``
    each, or ``default`` (forget the adapter's declaration)."""
    pol: dict = {}
    forget = False
    for item in items:
        if item.strip() == "default":
            forget = True
            continue
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ValueError(f"expected NAME=VALUE or 'default', got {item!r}")
        pol[name.strip()] = value.strip()
    return pol, {"forget_declared": forget}


def main_check(args) -> int:
    try:
        return _main_check(args)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("dsv4-oracle check: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main_check(args) -> int:
    from .adapters import AdapterError
    from .invoke import bounded, check_timeout
    from .runner import SelectionError, run_check, select_cases
    from .wording import plural

    if args.replays < 0:
        return _usage_error(f"--replays must be >= 0, got {args.replays}")
    try:
        timeout = check_timeout(args.timeout, "--timeout")
    except (TypeError, ValueError) as exc:
        return _usage_error(str(exc))
    if args.shape:
        if args.case or args.catalog:
            return _usage_error("--shape builds its own cases: leave out --case and --catalog")
        from dsv4_oracle.fixtures.shapes import describe, shape_case
        cases, catalog = [], "shape"
        for spec in args.shape:
            try:
                cases.append(shape_case(spec))
            except (TypeError, ValueError) as exc:
                return _usage_error(f"--shape {spec!r}: {exc}")
    else:
        try:
            cases, catalog = select_cases(args.catalog, args.case)
        except SelectionError as exc:
            return _usage_error(str(exc))
    if args.list:
        for c in cases:
            what = describe(c) if args.shape else ", ".join(c.categories)
            print(f"{c.id:34s} {what}")
        print(f"{plural(len(cases), 'case')} ({catalog} catalog)" if not args.shape else
              f"{plural(len(cases), 'case')} at your shapes")
        return EXIT_OK
    if args.oracle_device is not None:
        from dsv4_oracle.reference._checks import as_device
        try:
            as_device(args.oracle_device, "--oracle-device")
        except (TypeError, ValueError) as exc:
            return _usage_error(str(exc))
    if args.device is not None:
        import torch
        try:
            kind = torch.device(args.device).type
        except (RuntimeError, TypeError) as exc:
            return _usage_error(f"--device {args.device!r} is not a torch device ({exc})")
        if kind == "cuda" and not torch.cuda.is_available():
            return _usage_error(f"--device {args.device}: this machine has no usable CUDA device "
                                f"(torch.cuda.is_available() is False); leave out --device to "
                                f"run on the adapter's own device")
    ops = None
    if args.ops is not None:
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    why = _outputs_problem(args)
    if why:
        return _usage_error(why)
    from .adapters import default_impl
    spec = default_impl() if args.impl is None else args.impl
    try:                # the adapter's own code (import, construction, attributes), bounded
        adapter, ops = bounded(lambda: _load(spec, args, ops, cases),
                               f"loading the adapter {spec}",
                               timeout=timeout, hard_exit=True)
    except (AdapterError, TimeoutError) as exc:
        return _usage_error(str(exc))

    from .progress import ProgressBar, progress_enabled
    bar = ProgressBar(len(cases), enabled=progress_enabled(sys.stderr, args.no_progress),
                      label=f"check {adapter.spec}", lines=args.verbose)
    try:
        result = run_check(adapter, cases, catalog=catalog, patterns=args.case or args.shape,
                           replays=args.replays, ops=ops, progress=bar,
                           timeout=timeout, hard_exit=True,
                           oracle_device=args.oracle_device)
    finally:
        bar.close()
    if result.judged == 0:
        what = f"--ops {','.join(ops)}" if ops else f"adapter {adapter.spec}'s ops"
        ids = ", ".join(c.id for c in cases[:3]) + (", ..." if len(cases) > 3 else "")
        return _usage_error(f"nothing was judged: {what} on the {plural(len(cases), 'selected case')} "
                            f"({ids}) yield no check that can fail (csa_layer runs on "
                            f"layer cases with indexer scores, the attention ops on every case)")
    rc = _present(result, args)
    from .invoke import abandoned
    stuck = abandoned()
    if stuck:           # an op thread that never returned: do not wait for it at exit
        print(f"dsv4-oracle check: {', '.join(stuck)} never returned; exiting without "
              f"waiting for it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc if rc != EXIT_OK else EXIT_FAILED)
    return rc


def _load(spec, args, ops, cases):
    """``(adapter, ops)``: the adapter loaded and inspected (its device, ``unavailable()``, the
    ops selected, its precision for every op and dtype) before anything runs;
    :class:`AdapterError` (one line) for anything wrong."""
    from .adapters import AdapterError, checked_ops, load_adapter

    adapter = load_adapter(spec, device=args.device)
    why = adapter.unavailable()
    if why:
        raise AdapterError(why)
    if args.precision == "default":
        adapter.use_default_precision()
    if args.policy:
        try:
            pol, opts = _parse_policies(args.policy)
            adapter.set_policies(pol, **opts)
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"--policy: {exc}") from None
    try:
        ops = checked_ops(adapter, ops)
    except ValueError as exc:
        raise AdapterError(f"--ops: {exc}") from None
    for dtype in {c.torch_dtype for c in cases}:
        for op in (o for o in adapter.ops if ops is None or o in ops):
            adapter.precision(dtype, op=op)
    return adapter, ops


# the files --report DIR writes
REPORT_FILES = ("report.json", "report.md", "ratios.png", "worst_case.png")


def _writable(directory: str, option: str, path: str) -> str | None:
    """Why nothing can be written into ``directory`` (created if missing), or ``None``."""
    import tempfile
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dsv4-oracle-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{option} {path!r}: cannot write into {directory!r}: {exc.strerror or exc}"
    return None


def _outputs_problem(args) -> str | None:
    """Why ``--report`` / ``--junit`` cannot be written (checked before the run, so that a bad
    path is a usage error, never a failure after the verdict), or ``None``."""
    if args.report is not None:
        if not args.report.strip():
            return "--report must name a directory, got ''"
        if os.path.exists(args.report) and not os.path.isdir(args.report):
            return f"--report {args.report!r} exists and is not a directory"
        why = _writable(args.report, "--report", args.report)
        if why:
            return why
    if args.junit is not None:
        if not args.junit.strip():
            return "--junit must name a file, got ''"
        if os.path.isdir(args.junit):
            return f"--junit {args.junit!r} is a directory, not a file"
        junit = os.path.realpath(args.junit)
        if args.report is not None and junit in {
                os.path.realpath(os.path.join(args.report, f)) for f in REPORT_FILES}:
            return (f"--junit {args.junit!r} is one of the files --report {args.report!r} "
                    f"writes ({', '.join(REPORT_FILES)})")
        why = _writable(os.path.dirname(junit), "--junit", args.junit)
        if why:
            return why
    return None


def _present(result, args) -> int:
    """Print the summary, write the report files; the exit status of the verdict."""
    from .report import format_summary, write_junit, write_report
    color = sys.stdout.isatty()
    print(format_summary(result, color=color, verbose=args.verbose))
    try:
        if args.report:
            paths = write_report(result, args.report)
            print(f"report: {', '.join(paths)}")
            from .plots import unavailable
            skipped = unavailable()
            if skipped:
                print(f"report: PNG plots skipped: {skipped}")
        if args.junit:
            write_junit(result, args.junit)
            print(f"junit: {args.junit}")
    except OSError as exc:
        print(f"dsv4-oracle check: error: cannot write the report: {exc}", file=sys.stderr)
        return EXIT_FAILED if not result.passed else EXIT_USAGE
    return EXIT_OK if result.passed else EXIT_FAILED
