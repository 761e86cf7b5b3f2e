"""The power table (``dsv4-oracle power``): how small an error each numeric check detects.

For every (case, quantity) of a catalog, at op level, the oracle's outputs
(:func:`fixtures.run_oracle`) and their section 12 bounds (:func:`fixtures.oracle_bounds`) for
the default working precision of the case's dtype (:func:`dsv4_oracle.adapters.default_precision`:
float32 accumulation and statistics, 16-bit outputs for 16-bit inputs) give, per element, the
smallest relative perturbation of that one element that the numeric check rejects:

    threshold = bound / |expected|

(an implementation whose element is off by more than that fails the check). Elements are
classified first, with the one rule of :func:`dsv4_oracle.compare.ill_conditioned`:

- *non-finite*: ``expected`` is ``+-inf`` or NaN (checked exactly by position, not here);
- *exact*: the bound is 0 (any error fails; e.g. ``out = 0`` on sink-only rows);
- *ill-conditioned*: the bound reaches ``|expected|`` (not judged); the table also counts how
  many of them are exact zeros (``expected == 0``: a relative threshold does not exist there;
  most carry only the error model's underflow allowance as their bound);
- *judged*: the rest, over which the minimum and the median threshold are reported.

A check has *power* 1% on an element when its threshold is at most 0.01. The table's target is
a minimum of at most 1% for every (case, quantity); ``docs/POWER.md`` explains each exception.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .wording import plural

__all__ = ["PowerRow", "power_of", "case_power", "power_table", "format_table", "main",
           "TARGET"]

TARGET = 0.01          # the minimum threshold of every (case, quantity) should be <= 1%
F64 = torch.float64


@dataclass
class PowerRow:
    """One (case, quantity): element counts by class and the thresholds over judged elements
    (``None`` when no element is judged)."""

    case: str
    quantity: str
    elements: int
    judged: int
    exact: int
    ill_conditioned: int
    ill_zeros: int              # of the ill-conditioned: expected exactly 0
    nonfinite: int
    min_threshold: float | None
    median_threshold: float | None
    max_threshold: float | None

    @property
    def meets_target(self) -> bool:
        return self.min_threshold is not None and self.min_threshold <= TARGET

    def to_dict(self) -> dict:
        return {**asdict(self), "meets_target": self.meets_target}


def power_of(case_id: str, quantity: str, expected: torch.Tensor, bound: torch.Tensor) -> PowerRow:
    """The :class:`PowerRow` of one quantity (``expected`` the oracle's value, ``bound`` its
    section 12 bound, broadcastable to it)."""
    from .compare import ill_conditioned

    e = expected.detach().to("cpu", F64).reshape(-1)
    b = torch.broadcast_to(bound.detach().to("cpu", F64), expected.shape).reshape(-1)
    finite = torch.isfinite(e)
    ill = ill_conditioned(e, b)
    exact = finite & (b == 0)
    judged = finite & ~ill & ~exact
    thr = (b[judged] / e[judged].abs())
    stats = (None, None, None)
    if thr.numel():
        stats = (float(thr.min()), float(thr.median()), float(thr.max()))
    return PowerRow(case_id, quantity, e.numel(), int(judged.sum()), int(exact.sum()),
                    int(ill.sum()), int((ill & (e == 0)).sum()), int((~finite).sum()), *stats)


# quantities in pipeline order (the numeric outputs of fixtures.run_oracle)
QUANTITIES = ("kv_cmp", "k_idx", "scores", "out", "lse", "dq", "dkv", "dsink", "d_cmp_kv",
              "d_cmp_score", "d_cmp_ape", "d_cmp_norm", "loss", "kl", "target", "predict",
              "dq_idx", "dw", "dk_idx", "d_idx_kv", "d_idx_score", "d_idx_ape", "d_idx_norm")


def case_power(case, policies=None) -> list[PowerRow]:
    """Every numeric quantity of ``case`` (op level, default precision of its dtype), under
    ``policies`` (contract section 5.2; default: the contract's): the expected values and
    bounds the judge itself checks an implementation against (:func:`conformance.judge` on the
    oracle's own outputs, ``record``)."""
    from .adapters import default_precision
    from .conformance import judge, oracle_outputs

    x = case.materialize()
    outputs = oracle_outputs(case, x, policies=policies)
    rec: dict = {}
    judge(case, x, outputs, precision=default_precision(case.torch_dtype), policies=policies,
          record=rec)
    return [power_of(case.id, q, *rec[q]) for q in QUANTITIES if q in rec]


def power_table(cases, *, progress=None, policies=None) -> list[PowerRow]:
    rows = []
    for case in cases:
        if progress:
            progress(case)
        rows += case_power(case, policies)
    return rows


def _pct(x) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2g}%" if x < 10 else f"{100 * x:.3g}%"


def format_table(rows, *, markdown: bool = False) -> str:
    head = ("case", "quantity", "elements", "judged", "exact", "ill-cond.", "of them 0",
            "non-finite", "min", "median")
    def flag(r):
        if r.min_threshold is not None:
            return "" if r.min_threshold <= TARGET else "  <-- above 1%"
        return "  <-- nothing judged" if r.ill_conditioned else ""
    body = [(r.case, r.quantity, str(r.elements), str(r.judged), str(r.exact),
             str(r.ill_conditioned), str(r.ill_zeros), str(r.nonfinite), _pct(r.min_threshold),
             _pct(r.median_threshold)) for r in rows]
    flags = [flag(r) for r in rows]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
        out += ["| " + " | ".join(b[:-1] + (b[-1] + f,)) + " |" for b, f in zip(body, flags)]
        return "\n".join(out)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    fmt = lambda cols: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(cols, widths)))
    # the flag after the last column, outside its width: the columns stay aligned
    return "\n".join([fmt(head).rstrip()] + [(fmt(b) + f).rstrip() for b, f in zip(body, flags)])


def exceptions(rows) -> list[PowerRow]:
    """Rows that miss the target: a judged minimum above 1%, or nothing judged although some
    element is neither exact nor non-finite."""
    out = []
    for r in rows:
        if r.min_threshold is not None:
            if r.min_threshold > TARGET:
                out.append(r)
        elif r.ill_conditioned:
            out.append(r)
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--catalog", choices=("quick", "full"), default="full",
                   help="case catalog (default: full)")
    p.add_argument("--case", metavar="PATTERN", action="append", default=[],
                   help="case id or glob; repeatable")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--policy", metavar="NAME=VALUE", action="append", default=[],
                   help="the power under this named policy of contract section 5.2 "
                        "(repeatable; default: the contract's defaults)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the rows as JSON")
    p.add_argument("--markdown", metavar="FILE", default=None,
                   help="write the table as Markdown")
    p.set_defaults(func=main_power)
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("power", help="the power table: the smallest relative error of one "
                                     "element each numeric check detects",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    return add_arguments(p)


def main_power(args) -> int:
    from .runner import SelectionError, select_cases

    try:
        cases, catalog = select_cases(args.catalog, args.case)
    except SelectionError as exc:
        print(f"dsv4-oracle power: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(c.id)
        print(f"{plural(len(cases), 'case')} ({catalog} catalog)")
        return 0
    try:
        from dsv4_oracle.reference.contract_policies import resolve_policies
        from .check import _parse_policies
        pol, _ = _parse_policies(args.policy)
        resolve_policies(pol, "--policy")
    except (TypeError, ValueError) as exc:
        print(f"dsv4-oracle power: error: --policy: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def progress(case):
        if sys.stderr.isatty():
            print(f"\r\033[K{case.id}", end="", file=sys.stderr, flush=True)

    rows = power_table(cases, progress=progress, policies=pol or None)
    if sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr)
    print(format_table(rows))
    bad = exceptions(rows)
    print(f"\n{plural(len(rows), '(case, quantity) row')} over {plural(len(cases), 'case')} "
          f"({catalog} catalog); "
          f"{len(bad)} above the 1% target; {time.perf_counter() - t0:.0f} s")
    for r in bad:
        print(f"  {r.case} / {r.quantity}: min {_pct(r.min_threshold)}, "
              f"{r.ill_conditioned} ill-conditioned ({r.ill_zeros} zeros) of {r.elements}")
    try:
        if args.json:
            Path(args.json).write_text(json.dumps([r.to_dict() for r in rows], indent=1))
        if args.markdown:
            Path(args.markdown).write_text(format_table(rows, markdown=True) + "\n")
    except OSError as exc:
        print(f"dsv4-oracle power: error: cannot write: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_oracle.power",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
    add_arguments(p)
    return main_power(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
