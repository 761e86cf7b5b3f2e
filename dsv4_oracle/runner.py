"""The conformance run of ``dsv4-oracle check``: an adapter over a list of catalog cases.

For each case (data flowing one way: case -> inputs -> implementation -> comparison):

1. ``case.materialize(device)``: the inputs, rounded once to the case's dtype;
2. per level (``op``: the op-level pipeline; ``layer``: the packed layer, when the adapter has
   ``csa_layer`` and the case is a layer case), the implementation runs once under each grad
   mode (``torch.enable_grad``, ``no_grad``, ``inference_mode``) with the inputs hashed before
   and after: grad-mode parity and no-mutation (section 11);
3. the grad-enabled run is judged against the oracle on the inputs it consumed
   (:func:`dsv4_oracle.conformance.judge`: exact checks and error/bound ratios, section 12);
4. ``replays - 1`` more runs must reproduce the first bit for bit (section 11).

An implementation that raises, or returns something that is not the protocol's result, fails
the case's ``run`` check with the reason (it never aborts the run). Nothing here prints: the
``progress`` callback and :mod:`dsv4_oracle.report` present the results.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adapters import LAYER_OP, OPS, Adapter
from .compare import CheckResult, check_grad_mode_parity, check_no_mutation, check_replays
from .conformance import (FORWARD_OUTPUTS, OpError, judge, layer_applies, run_layer, run_ops,
                          tensors_of)

__all__ = ["CATALOGS", "CaseOutcome", "RunResult", "SelectionError", "select_cases", "quick_ids",
           "check_case", "run_check", "LEVELS"]

CATALOGS = ("quick", "full", "production")
LEVELS = ("op", "layer")
# categories whose cases are not single-device runs (CP layouts that must raise ValueError)
_NOT_RUNNABLE = ("cp_invalid",)


class SelectionError(ValueError):
    """The requested cases do not exist (the message is one line for the user)."""


def quick_ids() -> tuple[str, ...]:
    """The quick catalog: the curated regression subset of :data:`fixtures.STORED_CASES` (small
    cases that together touch every category but the large DSv4 shapes and the CP layouts that
    must raise) plus one case with the DSv4 head shape (H 64, D 512, H_I 64, D_I 128)."""
    import fixtures
    return tuple(fixtures.STORED_CASES) + ("public-det-parity",)


def _runnable(cases):
    return [c for c in cases if not set(c.categories) & set(_NOT_RUNNABLE)]


def select_cases(catalog: str | None = None, patterns=()) -> tuple[list, str]:
    """``(cases, catalog name)``. ``catalog`` ``quick``, ``full`` or ``production`` (the
    DSv4 shapes at production row counts, :mod:`fixtures.production`: in neither of the
    others); default ``quick``, or ``full`` when ``patterns`` are given. Each pattern is a case
    id or a shell-style glob (``sink-*``) and must match at least one case; the union keeps
    catalog order."""
    import fixtures
    if catalog is None:
        catalog = "full" if patterns else "quick"
    if catalog not in CATALOGS:
        raise SelectionError(f"--catalog must be one of {', '.join(CATALOGS)}, got {catalog!r}")
    full = _runnable(fixtures.catalog())
    if catalog == "quick":
        want = set(quick_ids())
        cases = [c for c in full if c.id in want]
    elif catalog == "production":
        from fixtures.production import production_cases
        cases = list(production_cases())
    else:
        cases = full
    if not patterns:
        return cases, catalog
    chosen = set()
    for p in patterns:
        hits = {c.id for c in cases if fnmatch.fnmatchcase(c.id, p)}
        if not hits:
            elsewhere = [c.id for c in full if fnmatch.fnmatchcase(c.id, p)]
            hint = ("; it is in the full catalog (use --catalog full)" if elsewhere and
                    catalog != "full" else
                    f"; ids look like {', '.join(c.id for c in cases[:3])} (see --list)")
            raise SelectionError(f"--case {p!r} matches no case of the {catalog} catalog{hint}")
        chosen |= hits
    return [c for c in cases if c.id in chosen], catalog


@dataclass
class CaseOutcome:
    """Everything checked on one case. Each check's ``extra`` holds ``quantity`` and ``level``.
    ``error``: why the case could not be set up (then ``checks`` is empty). ``maps``: per
    ``(row, head)`` error/bound maps (``out``, ``lse``, ``dq``) and row flags for the report."""

    case: object
    checks: list = field(default_factory=list)
    backends: dict = field(default_factory=dict)
    precision: dict = field(default_factory=dict)
    elapsed_s: float = 0.0
    error: str | None = None
    maps: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.checks)

    @property
    def failed_checks(self) -> list:
        return [c for c in self.checks if not c.passed]


@dataclass
class RunResult:
    adapter: Adapter
    catalog: str
    patterns: tuple
    replays: int
    outcomes: list
    started_utc: str
    elapsed_s: float
    ops: tuple

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.passed for o in self.outcomes)


def _with(res: CheckResult, **extra) -> CheckResult:
    return dataclasses.replace(res, extra={**res.extra, **extra})


def _failed(name: str, kind: str, quantity: str, level: str, detail: str) -> CheckResult:
    return CheckResult(name, kind, False, None, None, detail,
                       {"quantity": quantity, "level": level})


def _level(adapter: Adapter, case, x: dict, level: str, replays: int, ops, cache: dict,
           maps: dict | None, oracle_device=None) -> tuple[list, dict]:
    """The checks of one level of one case, and the backends that ran."""
    def once(backward=True):
        if level == "op":
            return run_ops(adapter, case, x, ops=ops, backward=backward)
        return run_layer(adapter, case, x, backward=backward)
    runs: list = []

    def call():
        # section 11: the forward under no_grad / inference_mode must give the bits of the
        # grad-enabled forward; gradients are computed (and replayed) grad-enabled only
        mode = ("torch.inference_mode()" if torch.is_inference_mode_enabled() else
                "torch.no_grad()" if not torch.is_grad_enabled() else None)
        try:
            r = once(backward=mode is None)
        except OpError as exc:
            if mode is None:
                raise
            raise OpError(exc.op, f"{exc.message} (under {mode})") from exc
        runs.append(r)
        return {k: v for k, v in tensors_of(r.got).items() if k in FORWARD_OUTPUTS}

    box: list = []
    checks: list = []
    try:
        # GRAD_MODES runs grad-enabled first: runs[0] is the run that is judged
        nm = check_no_mutation(lambda _x: box.append(check_grad_mode_parity(call)), (x,))
    except OpError as exc:
        return [_failed(f"run: {exc.op}", "error", "run", level, exc.message)], {}
    first = runs[0]
    precision = adapter.precision(case.torch_dtype)
    try:
        verdicts = judge(case, x, first.got, consumed=first.consumed, precision=precision,
                         cache=cache, maps=maps, oracle_device=oracle_device)
    except Exception as exc:   # the oracle rejected an intermediate the implementation produced
        verdicts = [_failed("judge", "error", "run", level,
                            f"the oracle cannot evaluate the implementation's intermediates: "
                            f"{type(exc).__name__}: {exc}")]
    checks += [_with(v, level=level) for v in verdicts]
    parity = box[0]
    checks.append(_with(parity, quantity="grad_modes", level=level))
    checks.append(_with(nm, quantity="no_mutation", level=level))
    if replays >= 2:
        served = []

        def replay():
            if not served:                       # call 0 is the grad-enabled run above
                served.append(True)
                return tensors_of(first.got)
            return tensors_of(once().got)
        try:
            checks.append(_with(check_replays(replay, replays), quantity="replays", level=level))
        except OpError as exc:
            checks.append(_failed("replays", "replay", "replays", level,
                                  f"a replay raised in {exc.op}: {exc.message}"))
    return checks, dict(first.backends)


def check_case(adapter: Adapter, case, *, replays: int = 3, ops=None,
               oracle_device=None) -> CaseOutcome:
    """Every check of ``adapter`` on ``case`` (see the module docstring). ``oracle_device``
    (default: the CPU) runs the oracle's float64 code on that device
    (:func:`dsv4_oracle.conformance.judge`)."""
    t0 = time.perf_counter()
    out = CaseOutcome(case)
    try:
        x = case.materialize(device=adapter.device)
    except Exception as exc:
        out.error = f"cannot materialize the case's inputs: {type(exc).__name__}: {exc}"
        out.elapsed_s = time.perf_counter() - t0
        return out
    out.precision = adapter.precision(case.torch_dtype).to_dict()
    cache: dict = {}
    op_ops = [o for o in OPS if adapter.has(o) and (ops is None or o in ops)]
    levels = []
    if op_ops:
        levels.append("op")
    if adapter.has(LAYER_OP) and (ops is None or LAYER_OP in ops) and layer_applies(case):
        levels.append("layer")
    for level in levels:
        maps = {} if not out.maps else None
        try:
            checks, backends = _level(adapter, case, x, level, replays, ops, cache, maps,
                                      oracle_device)
        except OpError as exc:
            checks, backends = [_failed(f"run: {exc.op}", "error", "run", level, exc.message)], {}
        out.checks += checks
        out.backends[level] = backends
        if maps:
            out.maps = {k: (v.to(torch.float32).numpy() if isinstance(v, torch.Tensor) else v)
                        for k, v in maps.items()}
            out.maps["level"] = level
    if adapter.device.startswith("cuda"):
        torch.cuda.synchronize()
    out.elapsed_s = time.perf_counter() - t0
    return out


def run_check(adapter: Adapter, cases, *, catalog: str = "quick", patterns=(), replays: int = 3,
              ops=None, progress: Callable | None = None, oracle_device=None) -> RunResult:
    """Run :func:`check_case` over ``cases``; ``progress(event, case, outcome)`` is called with
    ``"start"`` before and ``"done"`` after each case."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    outcomes = []
    for case in cases:
        if progress:
            progress("start", case, None)
        o = check_case(adapter, case, replays=replays, ops=ops, oracle_device=oracle_device)
        outcomes.append(o)
        if progress:
            progress("done", case, o)
    used = tuple(o for o in adapter.ops if ops is None or o in ops)
    return RunResult(adapter, catalog, tuple(patterns), replays, outcomes, started,
                     time.perf_counter() - t0, used)
