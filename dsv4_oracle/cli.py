"""The ``dsv4-oracle`` console script."""
from __future__ import annotations

import argparse
import sys


def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    return run_selfcheck(verbose=args.verbose)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4-oracle",
        description="Float64 oracle and conformance checks for DeepSeek-V4 sparse attention.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="prove the float64 oracle against itself on built-in cases")
    p.add_argument("-v", "--verbose", action="store_true", help="print details of every check")
    p.set_defaults(func=_selfcheck)
    from .check import add_parser as add_check_parser
    add_check_parser(sub)
    from .mutation import add_parser as add_mutate_parser
    from .power import add_parser as add_power_parser
    add_mutate_parser(sub)
    add_power_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
