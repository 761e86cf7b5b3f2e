"""The ``dsv4-oracle`` console script.

A usage error (an unknown option or value, a missing command) is one line on stderr and exit
status 2, never a traceback; Ctrl-C is one line and exit status 130; a closed stdout (``| head``)
ends the command quietly with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 1


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: message``), status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())}\n")


def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    return run_selfcheck(verbose=args.verbose)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dsv4-oracle",
        description="Float64 oracle and conformance checks for DeepSeek-V4 sparse attention.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"dsv4-oracle {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p = sub.add_parser("selfcheck", help="prove the float64 oracle against itself on catalog cases")
    p.add_argument("-v", "--verbose", action="store_true", help="print details of every check")
    p.set_defaults(func=_selfcheck)
    from .check import add_parser as add_check_parser
    add_check_parser(sub)
    from .init_adapter import add_parser as add_init_adapter_parser
    add_init_adapter_parser(sub)
    from .mutation import add_parser as add_mutate_parser
    from .power import add_parser as add_power_parser
    add_mutate_parser(sub)
    add_power_parser(sub)
    return parser


def printable_streams() -> None:
    """stdout and stderr write any text: a character their encoding lacks (an ASCII terminal, a
    lone surrogate in an adapter's message) is written as a backslash escape, never an error."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass


def main(argv=None) -> int:
    printable_streams()
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:          # a usage error (one line) or --help
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        rc = args.func(args)
        sys.stdout.flush()                 # a closed stdout shows here, not at interpreter exit
        return rc
    except BrokenPipeError:                # stdout closed early (``| head``): no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("dsv4-oracle: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
