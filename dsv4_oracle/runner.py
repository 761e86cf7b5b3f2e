"""The conformance run of ``dsv4-oracle check``: an adapter over a list of catalog cases.

For each case (data flowing one way: case -> inputs -> implementation -> comparison):

1. ``case.materialize(device)``: the inputs, rounded once to the case's dtype;
2. per level (``op``: the op-level pipeline; ``layer``: the packed layer, when the adapter has
   ``csa_layer`` and the case is a layer case), the implementation runs once under each grad
   mode (``torch.enable_grad``, ``no_grad``, ``inference_mode``) with the inputs hashed before
   and after: grad-mode parity and no-mutation (section 11);
3. the grad-enabled run is judged against the oracle on the inputs it consumed
   (:func:`dsv4_oracle.conformance.judge`: exact checks and error/bound ratios, section 12);
4. ``replays - 1`` more runs must reproduce the first bit for bit (section 11);
5. one more run on inputs drawn from another seed (the next call of real use), not judged;
6. ``outputs_stable`` (section 11): the tensors the judged run returned, kept
   (:func:`dsv4_oracle.invoke.watching`), still hold the bits they were judged with after
   every later call of the case and at its end.

Every call into the implementation goes through :func:`dsv4_oracle.invoke.call_op`: an op
that raises, exits or returns something unusable fails its ``run`` check (under the quantity of
the unusable output) with the reason, and one that writes into an argument it was handed its
``no_mutation`` check (naming the argument and the elements); the oracle stands in for it and
the level goes on (:func:`dsv4_oracle.conformance.run_ops`). An op that overruns the per-op
timeout (``timeout``) ends its level; nothing aborts the run. The precision the error model
assumes is resolved per op (``Adapter.precision(dtype, op)``) and recorded per case; a declared
precision looser than the default is flagged (:func:`precision_summary`). Nothing here prints: the ``progress`` callback
and :mod:`dsv4_oracle.report` present the results.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adapters import LAYER_OP, OPS, Adapter, AdapterError, looser_than_default
from .compare import (CheckResult, check_grad_mode_parity, check_no_mutation, check_replays,
                      not_judged)
from .conformance import (FORWARD_OUTPUTS, QUANTITIES, OpError, forget_measurements, judge,
                          layer_applies, not_applicable, run_layer, run_ops, tensors_of)
from .invoke import op_timeout, text, watching
from .rejections import REJECTION_CASES, check_rejections
from .wording import did_you_mean

__all__ = ["CATALOGS", "CaseOutcome", "RunResult", "SelectionError", "select_cases", "quick_ids",
           "check_case", "run_check", "LEVELS", "STRUCTURAL", "precision_summary",
           "precision_lines", "policy_summary", "policy_lines"]

CATALOGS = ("quick", "full", "production")
LEVELS = ("op", "layer")
# quantities that hold however little ran: a run with only these judged nothing
STRUCTURAL = ("grad_modes", "no_mutation", "replays", "outputs_stable")
# categories whose cases are not single-device runs (CP layouts that must raise ValueError)
_NOT_RUNNABLE = ("cp_invalid",)


class SelectionError(ValueError):
    """The requested cases do not exist (the message is one line for the user)."""


def quick_ids() -> tuple[str, ...]:
    """The quick catalog: the curated regression subset of :data:`fixtures.STORED_CASES` (small
    cases that together touch every category but the large DSv4 shapes and the CP layouts that
    must raise) plus :data:`fixtures.QUICK_UNSTORED`: one case with the DSv4 head shape (H 64,
    D 512, H_I 64, D_I 128) and two key buffers above 2**17 rows read by a few query rows."""
    from dsv4_oracle import fixtures
    return tuple(fixtures.STORED_CASES) + tuple(fixtures.QUICK_UNSTORED)


def _runnable(cases):
    return [c for c in cases if not set(c.categories) & set(_NOT_RUNNABLE)]


def select_cases(catalog: str | None = None, patterns=(), *, cli: bool = True) -> tuple[list, str]:
    """``(cases, catalog name)``. ``catalog`` ``quick``, ``full`` or ``production`` (the
    DSv4 shapes at production row counts, :mod:`fixtures.production`: in neither of the
    others); default ``quick``, or ``full`` when ``patterns`` are given. Each pattern is a case
    id or a shell-style glob (``sink-*``) and must match at least one case (else a
    :class:`SelectionError` with the closest id; its advice names the command's options, or
    with ``cli=False`` the arguments of :func:`dsv4_oracle.pytest_plugin.cases`); the union
    keeps catalog order."""
    from dsv4_oracle import fixtures
    if catalog is None:
        catalog = "full" if patterns else "quick"
    if catalog not in CATALOGS:
        raise SelectionError(f"--catalog must be one of {', '.join(CATALOGS)}, got {catalog!r}")
    full = _runnable(fixtures.catalog())
    if catalog == "quick":
        want = set(quick_ids())
        cases = [c for c in full if c.id in want]
    elif catalog == "production":
        from dsv4_oracle.fixtures.production import production_cases
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
            slip = did_you_mean(p, [c.id for c in cases])
            if elsewhere and catalog != "full":
                hint = ("; it is in the full catalog (use --catalog full)" if cli else
                        "; it is in the full catalog (cases('full', ...))")
            elif slip:
                hint = slip
            else:
                hint = (f"; ids look like {', '.join(c.id for c in cases[:3])} "
                        + ("(see --list)" if cli else "(fixtures.catalog() lists them)"))
            what = f"--case {p!r}" if cli else f"pattern {p!r}"
            raise SelectionError(f"{what} matches no case of the {catalog} catalog{hint}")
        chosen |= hits
    return [c for c in cases if c.id in chosen], catalog


@dataclass
class CaseOutcome:
    """Everything checked on one case. Each check's ``extra`` holds ``quantity`` and ``level``.
    ``error``: why the case could not be set up (then ``checks`` is empty). ``maps``: per level
    (``op``, ``layer``), the per ``(row, head)`` error/bound maps (``out``, ``lse``, ``dq``) and
    row flags (``padding``, ``sink_only``) for the report.
    ``precision``: op -> the precision the error model assumed (``Precision.to_dict()``) for
    every op that ran (``csa_layer`` for the layer level); ``looser``: op -> the fields where
    that precision is looser than the default."""

    case: object
    checks: list = field(default_factory=list)
    backends: dict = field(default_factory=dict)
    precision: dict = field(default_factory=dict)
    looser: dict = field(default_factory=dict)
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
    timeout: float | None = None
    policies: dict | None = None          # every policy the verdicts assumed (section 5.2)
    policy_source: str = "default"

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.passed for o in self.outcomes)

    @property
    def judged(self) -> int:
        """Checks that judged something the implementation did (every failing check, and every
        passing one but those not judged and the :data:`STRUCTURAL` ones, which hold when
        nothing ran), plus cases that failed setup."""
        return sum(1 for o in self.outcomes for c in o.checks
                   if not c.passed or (getattr(c, "judged", True)
                                       and c.extra.get("quantity") not in STRUCTURAL)) + \
            sum(1 for o in self.outcomes if o.error)


def _with(res: CheckResult, **extra) -> CheckResult:
    return dataclasses.replace(res, extra={**res.extra, **extra})


def _failed(name: str, kind: str, quantity: str, level: str, detail: str) -> CheckResult:
    return CheckResult(name, kind, False, None, None, detail,
                       {"quantity": quantity, "level": level})


def _op_failed(exc: OpError, level: str, prefix: str = "", suffix: str = "") -> CheckResult:
    """The failing check of an op that failed: ``no_mutation`` when it wrote into an argument;
    else ``run``, carrying the quantity of the output it could not return usably (or ``run``
    when it raised, exited or hung)."""
    if exc.kind == "mutation":
        return _failed(f"no_mutation: {exc.op}", "no_mutation", "no_mutation", level,
                       prefix + exc.message + suffix)
    quantity = _QUANTITY.get(exc.output, exc.output)
    quantity = quantity if quantity in QUANTITIES else "run"
    return _failed(f"run: {exc.op}", "error", quantity, level, prefix + exc.message + suffix)


# outputs that are judged under another quantity's name
_QUANTITY = {"cmp_lengths": "cmp_ids"}


def _stability(watched, level: str) -> CheckResult:
    """Section 11: every tensor an op returned at ``level`` still holds the bits it had when it
    was returned, after every later call into the implementation and at the end of the case;
    a change fails the op that returned the tensor, naming the call that changed it."""
    found = [c for c in watched.changes if c[0] == level]
    held = watched.held.get(level, 0)
    if not found:
        return CheckResult("outputs_stable", "no_mutation", True, None, 0,
                           f"{held} returned tensors kept their bits through "
                           f"{watched.calls} later calls and the end of the case",
                           {"quantity": "outputs_stable", "level": level, "tensors": held})
    _, op, name, how, by_op, phase = found[0]
    when = (f"during {'the later call of ' if not by_op.startswith('the ') else ''}{by_op}"
            + (f" ({phase})" if phase else "") if by_op is not None else
            "after its last call (no call of the implementation was running)")
    more = ("; also changed: " + ", ".join(f"{c[2]} of {c[1]}" for c in found[1:])
            if len(found) > 1 else "")
    return CheckResult(f"outputs_stable: {op}", "no_mutation", False, None, len(found),
                       f"its returned {name} changed after it was returned, {when}: {how}; "
                       f"the caller sees values other than those judged{more}",
                       {"quantity": "outputs_stable", "level": level, "tensors": held,
                        "changed": [f"{c[1]}: {c[2]}" for c in found]})


def level_precision(adapter: Adapter, dtype, level: str) -> dict:
    """op -> the Precision the error model assumes for the outputs of each pipeline op: the
    adapter's per op at op level; at layer level every output comes from ``csa_layer``."""
    if level == "layer":
        p = adapter.precision(dtype, op=LAYER_OP)
        return {o: p for o in OPS}
    return {o: adapter.precision(dtype, op=o) for o in OPS}


def _level(adapter: Adapter, case, x: dict, level: str, replays: int, ops, cache: dict,
           maps: dict | None, oracle_device=None, watched=None) -> tuple[list, dict]:
    """The checks of one level of one case, and the backends that ran."""
    policies = adapter.policies

    def once(backward=True, probe=False, on=(case, x)):
        if level == "op":
            return run_ops(adapter, on[0], on[1], ops=ops, backward=backward, policies=policies,
                           probe=probe)
        return run_layer(adapter, on[0], on[1], backward=backward)
    runs: list = []
    failures: list = []

    def call():
        # section 11: the forward under no_grad / inference_mode must give the bits of the
        # grad-enabled forward; gradients are computed (and replayed) grad-enabled only
        mode = ("torch.inference_mode()" if torch.is_inference_mode_enabled() else
                "torch.no_grad()" if not torch.is_grad_enabled() else None)
        if watched is not None:
            watched.record = not runs            # runs[0] is what is judged: keep what it returned
            watched.phase = f"the {mode or 'grad-enabled'} run"
        try:
            # the judged run (the first, grad-enabled) also probes the backward's convention
            r = once(backward=mode is None, probe=mode is None and not runs)
        except OpError as exc:
            if mode is None:
                raise
            raise OpError(exc.op, f"{exc.message} (under {mode})", exc.kind,
                          exc.output) from exc
        finally:
            if watched is not None:
                watched.record = False
        if runs:               # an op that failed here only: a failure of its own
            failures.extend(_op_failed(e, level, suffix=f" (under {mode})")
                            for k, e in r.failed.items() if k not in runs[0].failed)
        runs.append(r)
        return {k: v for k, v in tensors_of(r.got).items() if k in FORWARD_OUTPUTS}

    box: list = []
    checks: list = []
    try:
        # GRAD_MODES runs grad-enabled first: runs[0] is the run that is judged
        nm = check_no_mutation(lambda _x: box.append(check_grad_mode_parity(call)), (x,))
    except OpError as exc:
        return [_op_failed(exc, level)], {}
    first = runs[0]
    checks += [_op_failed(e, level) for e in first.failed.values()] + failures
    if not first.got:           # every op the implementation ran failed: nothing else to judge
        return checks, dict(first.backends)
    precision = level_precision(adapter, case.torch_dtype, level)
    try:
        verdicts = judge(case, x, first.got, consumed=first.consumed, precision=precision,
                         cache=cache, maps=maps, oracle_device=oracle_device,
                         policies=policies)
    except Exception as exc:   # the oracle rejected an intermediate the implementation produced
        verdicts = [_failed("judge", "error", "run", level,
                            f"the oracle cannot evaluate the implementation's intermediates: "
                            f"{type(exc).__name__}: {exc}")]
    checks += [_with(v, level=level) for v in verdicts]
    if level == "op" and case.id in REJECTION_CASES:
        checks += check_rejections(adapter, case, x, first.consumed, policies=policies)
    parity = box[0]
    checks.append(_with(parity, quantity="grad_modes", level=level))
    checks.append(_with(nm, quantity="no_mutation", level=level))
    if replays >= 2:
        served = []

        def replay():
            if not served:                       # call 0 is the grad-enabled run above
                served.append(True)
                return tensors_of(first.got)
            if watched is not None:
                watched.phase = f"replay {len(served)}"
            served.append(True)
            r = once()
            new = [e for k, e in r.failed.items() if k not in first.failed]
            if new:
                raise new[0]
            return tensors_of(r.got)
        try:
            checks.append(_with(check_replays(replay, replays), quantity="replays", level=level))
        except OpError as exc:
            checks.append(_op_failed(exc, level, "in a replay: ") if exc.kind == "mutation"
                          else _failed("replays", "replay", "replays", level,
                                       f"a replay failed in {exc.op}: {exc.message}"))
    if watched is not None and watched.held.get(level):
        # the next call in real use has other inputs: a workspace that every call rewrites
        # shows only then (its verdict is outputs_stable; nothing of this run is judged)
        watched.phase = "a call on other inputs, after the replays"
        other = _other_inputs(case, adapter.device)
        if other is not None:
            try:
                once(on=other)
            except OpError:
                pass
    return checks, dict(first.backends)


def _other_inputs(case, device):
    """``(case, inputs)`` of ``case`` drawn from another seed: the same shapes, layout and
    kinds of values, other numbers (``None`` when they cannot be made)."""
    try:
        other = dataclasses.replace(case, seed=(case.seed + 1) % (1 << 32))
        return other, other.materialize(device=device)
    except Exception:            # a case that cannot be redrawn: the probe is skipped
        return None


def check_case(adapter: Adapter, case, *, replays: int = 3, ops=None,
               oracle_device=None, oracle_cache: dict | None = None) -> CaseOutcome:
    """Every check of ``adapter`` on ``case`` (see the module docstring). ``oracle_device``
    (default: the CPU) runs the oracle's float64 code on that device
    (:func:`dsv4_oracle.conformance.judge`). ``oracle_cache``: a dict kept by the caller for
    this case across runs of several implementations (mutation testing): the oracle's results
    are memoised there on the content hash of what they read."""
    t0 = time.perf_counter()
    out = CaseOutcome(case)
    why = not_applicable(case, adapter.policies)
    if why is not None:                 # section 5.2: the declared policies void this case
        level = "op" if any(adapter.has(o) for o in OPS) else "layer"
        out.checks.append(not_judged("not applicable", "error", "this case does not apply "
                                     f"under the declared policies: {why}", quantity="run",
                                     level=level))
        out.elapsed_s = time.perf_counter() - t0
        return out
    try:
        x = case.materialize(device=adapter.device)
    except Exception as exc:
        out.error = f"cannot materialize the case's inputs: {type(exc).__name__}: {exc}"
        out.elapsed_s = time.perf_counter() - t0
        return out
    cache: dict = {} if oracle_cache is None else oracle_cache
    op_ops = [o for o in OPS if adapter.has(o) and (ops is None or o in ops)]
    levels = []
    if op_ops:
        levels.append("op")
    if adapter.has(LAYER_OP) and (ops is None or LAYER_OP in ops) and layer_applies(case):
        levels.append("layer")
    try:
        for op in op_ops + ([LAYER_OP] if "layer" in levels else []):
            p = adapter.precision(case.torch_dtype, op=op)
            out.precision[op] = p.to_dict()
            loose = looser_than_default(p, case.torch_dtype)
            if loose:
                out.looser[op] = loose
    except AdapterError as exc:
        out.error = str(exc)
        out.elapsed_s = time.perf_counter() - t0
        return out
    ran: list = []
    with watching() as watched:
        for level in levels:
            maps: dict = {}
            watched.tag = level
            try:
                checks, backends = _level(adapter, case, x, level, replays, ops, cache, maps,
                                          oracle_device, watched)
            except OpError as exc:
                checks, backends = [_op_failed(exc, level)], {}
            except Exception as exc:     # what the implementation returned broke the runner
                checks, backends = [_failed("run", "error", "run", level,
                                            f"cannot handle the implementation's result: "
                                            f"{type(exc).__name__}: {text(exc)}")], {}
            out.checks += checks
            out.backends[level] = backends
            if watched.held.get(level):
                ran.append(level)
            if maps:
                # float64: a ratio just over 1 must not round to 1 in the plot
                out.maps[level] = {k: (v.detach().to("cpu").numpy()
                                       if isinstance(v, torch.Tensor) else v)
                                   for k, v in maps.items()}
        watched.phase = ""
        watched.verify()                 # the end of the case: no call running
    out.checks += [_stability(watched, level) for level in ran]
    forget_measurements(cache)              # what this implementation did stays with it
    if adapter.device.startswith("cuda"):
        torch.cuda.synchronize()
    out.elapsed_s = time.perf_counter() - t0
    return out


def run_check(adapter: Adapter, cases, *, catalog: str = "quick", patterns=(), replays: int = 3,
              ops=None, progress: Callable | None = None, timeout: float | None = None,
              hard_exit: bool = False, oracle_device=None) -> RunResult:
    """Run :func:`check_case` over ``cases``; ``progress(event, case, outcome)`` is called with
    ``"start"`` before and ``"done"`` after each case. ``timeout``: seconds per op call
    (``None`` or 0: no limit; ``hard_exit``: see :func:`dsv4_oracle.invoke.op_timeout`)."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    outcomes = []
    with op_timeout(timeout or None, hard_exit=hard_exit):
        for case in cases:
            if progress:
                progress("start", case, None)
            o = check_case(adapter, case, replays=replays, ops=ops,
                           oracle_device=oracle_device)
            outcomes.append(o)
            if progress:
                progress("done", case, o)
    used = tuple(o for o in adapter.ops if ops is None or o in ops)
    return RunResult(adapter, catalog, tuple(patterns), replays, outcomes, started,
                     time.perf_counter() - t0, used, timeout or None, adapter.policies,
                     adapter.policy_source)


def policy_summary(result: RunResult) -> dict:
    """The policies of contract section 5.2 every verdict assumed: ``source`` (``adapter``,
    ``default``, ``command line``), ``policies`` (every policy's value) and ``non_default``."""
    from dsv4_oracle.reference.contract_policies import non_default, resolve_policies
    pol = resolve_policies(result.policies)
    return {"source": result.policy_source, "policies": pol, "non_default": non_default(pol)}


def policy_lines(s: dict) -> list[str]:
    """One line naming the non-default policies a verdict assumed (none when every policy is
    the contract's default)."""
    if not s["non_default"]:
        return []
    src = {"adapter": "declared by the adapter", "command line": "--policy"}.get(s["source"],
                                                                             s["source"])
    return [f"policies assumed ({src}; contract section 5.2): "
            + ", ".join(f"{k}={v}" for k, v in s["non_default"].items())]


def _pstr(d: dict) -> str:
    return f"acc {d['acc']}, io {d['io']}, stats {d['stats']}".replace("torch.", "")


def precision_summary(result: RunResult) -> dict:
    """The precision each verdict assumed: ``source`` (``adapter``: its declaration;
    ``default``: it declares none; ``forced default``: ``--precision default``), ``assumed``
    (case dtype -> op -> ``"acc float32, io bfloat16, stats float32"``) and ``looser`` (one
    line per op and dtype whose assumed precision is looser than the default)."""
    assumed: dict = {}
    looser: dict = {}
    for o in result.outcomes:
        dt = str(o.case.dtype)
        for op, d in o.precision.items():
            assumed.setdefault(dt, {})[op] = _pstr(d)
        for op, fields in o.looser.items():
            looser.setdefault(f"{op} ({dt})", fields)
    return {"source": result.adapter.precision_source, "assumed": assumed,
            "looser": [f"{k}: {', '.join(v)}" for k, v in looser.items()]}


def precision_lines(s: dict) -> tuple[list[str], str]:
    """``(lines, flag)`` of a :func:`precision_summary`: the precision assumed (per input dtype,
    per op where the ops differ), a warning when it is looser than the default, and ``flag``,
    the verdict line's note ("" if none)."""
    src = {"adapter": "declared by the adapter", "default": "the default",
           "forced default": "the default, --precision default"}.get(s["source"], s["source"])
    if not s["assumed"]:
        return [], ""
    groups: dict = {}            # description -> dtypes of the cases it applies to
    for dt, ops in s["assumed"].items():
        ps = set(ops.values())
        desc = (next(iter(ps)) if len(ps) == 1 else
                "; ".join(f"{op}: {p}" for op, p in ops.items()))
        groups.setdefault(desc, []).append(dt)
    if len(groups) == 1:
        lines = [f"precision assumed ({src}): {next(iter(groups))}"]
    else:
        lines = [f"precision assumed ({src}):"] + [f"  {', '.join(dts)} inputs: {desc}"
                                                   for desc, dts in groups.items()]
    flag = ""
    if s["looser"]:
        lines.append("WARNING: the adapter declares a precision looser than the default, which "
                     "widens its own bounds (--precision default judges with the default): "
                     + "; ".join(s["looser"]))
        ops = sorted({x.split(" (")[0] for x in s["looser"]})
        flag = f" [bounds widened by the adapter's declared precision: {', '.join(ops)}]"
    return lines, flag
