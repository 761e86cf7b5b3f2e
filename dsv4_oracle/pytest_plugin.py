"""The dsv4-oracle pytest plugin: check a DSv4 sparse-attention implementation from any pytest suite.

Loaded by the ``pytest11`` entry point ``dsv4_oracle.pytest_plugin`` when dsv4-oracle is
installed, with ``-p dsv4_oracle.pytest_plugin`` when it is not, and by this repository's
``conftest.py`` (``pytest_plugins``). The entry point carries the module's own name, so pytest
registers the plugin once however many of these ask for it; ``-p no:dsv4_oracle.pytest_plugin``
turns it off (the two functions below work without it).

What it provides:

- :func:`cases`: the catalog cases as ``pytest.param`` objects with the case ids, for
  ``@pytest.mark.parametrize("case", cases("quick"))``;
- :func:`assert_conforms`: every check of ``dsv4-oracle check`` on one case (error/bound ratios
  against the float64 oracle, exact checks, bitwise replays, grad-mode parity, no mutation);
  raises :class:`ConformanceError` (an ``AssertionError``) whose message is the case's table of
  checks, failed ones first;
- markers (registered here, for ``--strict-markers``): the hardware markers ``gpu``, ``sm90``,
  ``sm100``, ``cudnn``, ``multigpu``, plus ``slow`` and ``production``. A test carrying a
  hardware marker is skipped, with the reason, when this machine lacks what the marker names:

  - ``gpu``: a CUDA device that torch can use;
  - ``sm90``: compute capability exactly 9.0 (H100/H200); ``sm100``: major 10 (B200/GB200);
  - ``cudnn``: the cuDNN frontend (``import cudnn``) and a CUDA device;
  - ``multigpu``: two or more CUDA devices.

  GPU tests never oversubscribe the GPU under ``pytest -n``: every test carrying a hardware
  marker is put in the xdist group ``"gpu"``, and ``-n`` runs use ``--dist loadgroup`` (set here
  unless ``--dist`` is given), so one worker runs all of them, one at a time;
- the ``--replays N`` option (bitwise replays per determinism check, default 3) and the
  ``replays`` fixture that reads it.

Nothing heavy is imported until a function needs it: loading the plugin into a suite costs no
torch import.
"""
from __future__ import annotations

import copy

import importlib.util

import pytest

__all__ = ["MARKERS", "HARDWARE_MARKERS", "PRODUCTION_CATEGORIES", "ConformanceError", "cases",
           "assert_conforms", "hardware", "DEFAULT_TIMEOUT_S"]

MARKERS = {
    "gpu": "needs a CUDA GPU (the GPU lane is `pytest -m gpu`)",
    "sm90": "needs compute capability exactly 9.0 (H100/H200)",
    "sm100": "needs compute capability major 10 (B200/GB200)",
    "cudnn": "needs the cuDNN frontend (nvidia-cudnn-frontend)",
    "multigpu": "needs two or more CUDA GPUs (NCCL)",
    "slow": "long-running (stress replays, large shapes)",
    "production": "DSv4-Flash/Pro production head shapes: seconds of float64 oracle per case on "
                  "a CPU (deselect with -m 'not production')",
}
HARDWARE_MARKERS = ("gpu", "sm90", "sm100", "cudnn", "multigpu")
# catalog categories whose cases :func:`cases` marks ``production``
PRODUCTION_CATEGORIES = ("dsv4_flash", "dsv4_pro")
DEFAULT_TIMEOUT_S = 900.0      # assert_conforms(timeout=...), as dsv4-oracle check --timeout


# ---------------------------------------------------------------------------------------------
# hooks: markers, hardware, --replays
# ---------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--replays", type=int, default=3,
                     help="bitwise replays per determinism check (default 3)")


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


@pytest.fixture
def replays(request):
    """The ``--replays`` option: bitwise replays per determinism check."""
    return request.config.getoption("--replays")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Under xdist (``-n``), default to ``--dist loadgroup`` so the ``gpu`` group is honoured."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"


def hardware() -> dict:
    """What this machine offers, as reasons keyed by hardware marker (``None`` = available)."""
    try:
        import torch
        cuda = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda else 0
        cap = torch.cuda.get_device_capability(0) if cuda else None
    except Exception as exc:                      # a broken CUDA install must not crash collection
        cuda, count, cap = False, 0, None
        no_cuda = f"torch cannot use CUDA ({type(exc).__name__}: {exc})"
    else:
        no_cuda = "no CUDA GPU (torch.cuda.is_available() is False)"
    has_cudnn = importlib.util.find_spec("cudnn") is not None
    return {
        "gpu": None if cuda else no_cuda,
        "sm90": None if cap == (9, 0) else (no_cuda if not cuda else
                                            f"needs compute capability 9.0, this GPU is {cap}"),
        "sm100": None if cap is not None and cap[0] == 10 else (
            no_cuda if not cuda else f"needs compute capability 10.x, this GPU is {cap}"),
        "cudnn": None if (has_cudnn and cuda) else (
            "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)"
            if not has_cudnn else no_cuda),
        "multigpu": None if count >= 2 else f"needs 2 or more CUDA GPUs, found {count}",
    }


def pytest_collection_modifyitems(config, items):
    reasons = None
    for item in items:
        marks = [m for m in HARDWARE_MARKERS if item.get_closest_marker(m) is not None]
        if not marks:
            continue
        item.add_marker(pytest.mark.xdist_group("gpu"))
        if reasons is None:
            reasons = hardware()
        for m in marks:
            if reasons[m] is not None:
                item.add_marker(pytest.mark.skip(reason=f"[{m}] {reasons[m]}"))
                break


# ---------------------------------------------------------------------------------------------
# checking an implementation from a test
# ---------------------------------------------------------------------------------------------
class ConformanceError(AssertionError):
    """An implementation failed a check on a case. ``outcome``: the
    :class:`dsv4_oracle.runner.CaseOutcome` (every check, with ratios and details)."""

    def __init__(self, message: str, outcome):
        super().__init__(message)
        self.outcome = outcome


def cases(catalog: str = "quick", pattern=None, *, shape=None) -> list:
    """The runnable cases of ``catalog`` (``"quick"``: small cases touching every category;
    ``"full"``: every runnable catalog case) as ``pytest.param(case, id=case.id)``, in catalog
    order. ``pattern``: a case id or shell glob (``"sink-*"``), or a list of them, each of which
    must match a case of the catalog. Cases of :data:`PRODUCTION_CATEGORIES` carry the
    ``production`` marker. ``shape``: instead of the catalog, cases at your own shapes, one per
    spec (``"H=64,D=512,K=512,W=128,T=4096,sink=finite"``, a dict of the same keys, or a list
    of them; :func:`fixtures.shape_case`)."""
    from .runner import CATALOGS, SelectionError, select_cases

    if shape is not None:
        if catalog != "quick" or pattern is not None:
            raise ValueError("shape builds its own cases: leave out catalog and pattern")
        from dsv4_oracle.fixtures.shapes import shape_case
        specs = shape if isinstance(shape, list) else [shape]
        built = []
        for s in specs:
            try:
                built.append(shape_case(s))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"shape {s!r}: {exc}") from None
        return [pytest.param(c, id=c.id) for c in built]

    if not isinstance(catalog, str) or catalog not in CATALOGS:
        raise ValueError(f"catalog must be one of {', '.join(CATALOGS)}, got {catalog!r}")
    if pattern is None:
        patterns: tuple = ()
    elif isinstance(pattern, str):
        patterns = (pattern,)
    elif isinstance(pattern, (list, tuple)) and all(isinstance(p, str) for p in pattern):
        patterns = tuple(pattern)
    else:
        raise TypeError(f"pattern must be a case id or glob, or a list of them, got "
                        f"{type(pattern).__name__}")
    try:
        selected, _ = select_cases(catalog, patterns, cli=False)
    except SelectionError as exc:
        raise ValueError(str(exc)) from None
    return [pytest.param(c, id=c.id, marks=[pytest.mark.production]
                         if set(c.categories) & set(PRODUCTION_CATEGORIES) else [])
            for c in selected]


def _case(case):
    from dsv4_oracle import fixtures
    if isinstance(case, fixtures.Case):
        return case
    if isinstance(case, str):
        try:
            return fixtures.get(case)
        except KeyError:
            from dsv4_oracle.fixtures.production import production_cases
            for c in production_cases():          # the ids cases("production") gives
                if c.id == case:
                    return c
            from .wording import did_you_mean
            slip = did_you_mean(case, [c.id for c in fixtures.catalog()])
            raise ValueError(f"case: no catalog case has id {case!r}"
                             + (slip or " (fixtures.catalog() lists them)")) from None
    raise TypeError(f"case must be a fixtures.Case or a case id, got {type(case).__name__}")


def _precision_argument(precision):
    from collections.abc import Mapping

    from dsv4_oracle.reference.error_model import Precision
    if precision is None or isinstance(precision, (Precision, Mapping)) or callable(precision):
        return precision
    raise TypeError(f"precision must be a reference.error_model.Precision, a callable dtype -> "
                    f"Precision or a mapping op -> either, got {type(precision).__name__}")


def _adapter(implementation, precision, timeout):
    from .adapters import Adapter, AdapterError, load_adapter
    from .invoke import bounded

    def load():
        if isinstance(implementation, Adapter):
            if precision is None:
                return implementation
            return Adapter(implementation.target, name=implementation.name,
                           device=implementation.device, precision=precision,
                           spec=implementation.spec)
        if isinstance(implementation, str):
            a = load_adapter(implementation, arg="implementation")
            return a if precision is None else Adapter(a.target, name=a.name, device=a.device,
                                                       precision=precision, spec=a.spec)
        if implementation is None:
            raise TypeError("implementation must be an adapter object, a spec string "
                            "('module:attr', 'gpu_impl:torch', ...) or a dsv4_oracle Adapter, "
                            "got None")
        target = implementation() if isinstance(implementation, type) else implementation
        name = getattr(target, "name", None)
        name = name if isinstance(name, str) and name else type(target).__name__
        return Adapter(target, name=name, precision=precision)
    try:
        return bounded(load, "loading the implementation", timeout=timeout, hard_exit=True)
    except (AdapterError, TimeoutError) as exc:
        raise ValueError(f"implementation: {exc}") from None


def _ops_argument(ops):
    if ops is None:
        return None
    if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
        raise TypeError(f"ops must be a list of op names, got {ops!r}")
    ops = list(ops)                      # once: a generator is read here, not by the check
    if not all(isinstance(o, str) for o in ops):
        raise TypeError(f"ops must be a list of op names, got {ops!r}")
    return ops


def assert_conforms(implementation, case, *, replays: int = 2, ops=None, precision=None,
                    policies=None, timeout=DEFAULT_TIMEOUT_S):
    """Check ``implementation`` on ``case`` exactly as ``dsv4-oracle check`` does; raise
    :class:`ConformanceError` (an ``AssertionError``) when any check fails.

    ``implementation``: an adapter object (or class, instantiated without arguments; see
    :mod:`dsv4_oracle.adapters` for the protocol), a spec string (``"mypkg.dsa:Adapter"``,
    ``"gpu_impl:torch"``, ``"reference"``) or a :class:`dsv4_oracle.adapters.Adapter`.
    ``case``: a :class:`fixtures.Case` (from :func:`cases`) or a case id. ``replays``: runs that
    must reproduce the first bit for bit (below 2: no replay check). ``ops``: check only these
    ops (default: every op the implementation has; the oracle stands in for the others).
    ``precision``: the working precision the error model assumes (a
    :class:`reference.error_model.Precision`, a callable ``dtype -> Precision``, or a mapping op
    -> either), overriding the implementation's own. ``policies``: the named policies of
    contract section 5.2 to judge under (a mapping policy name -> value; the others take the
    contract's default), overriding the implementation's own ``policies``. ``timeout``: seconds
    for loading the implementation (import, construction) and for each op call, as ``check
    --timeout`` (default 900; ``None`` or 0: no limit): an op that overruns it fails; one that
    no interrupt reaches ends the test process after the timeout plus a grace period (one line
    on stderr, exit status 1) rather than hanging the suite.

    The message of the error is the case's table of checks, failed ones first (case, level,
    quantity, check, ratio, detail). The test is skipped, with the reason, when the
    implementation cannot run on this machine (``unavailable()``, a CUDA device without CUDA)
    or when nothing could be judged on this case (no op of the implementation applies to it,
    or every check is not judged). Bad arguments (a precision that is not one or does not
    resolve to one included) raise ``TypeError``/``ValueError`` naming the argument before
    anything runs. Returns the :class:`dsv4_oracle.runner.CaseOutcome`.
    """
    __tracebackhide__ = True
    from .adapters import AdapterError, checked_ops
    from .invoke import check_timeout, op_timeout
    from .report import format_case
    from .runner import check_case

    if isinstance(replays, bool) or not isinstance(replays, int):
        raise TypeError(f"replays must be an int, got {type(replays).__name__}")
    if replays < 0:
        raise ValueError(f"replays must be >= 0, got {replays}")
    timeout = check_timeout(timeout, "timeout")
    the_case = _case(case)
    ops = _ops_argument(ops)
    adapter = _adapter(implementation, _precision_argument(precision), timeout)
    if policies is not None:
        adapter = copy.copy(adapter)            # never the caller's Adapter object
        try:
            adapter.set_policies(policies, forget_declared=True)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"policies: {exc}") from None
    if ops is not None:
        try:
            ops = checked_ops(adapter, ops)
        except ValueError as exc:
            raise ValueError(f"ops: {exc}") from None
    why = adapter.unavailable()
    if why:
        pytest.skip(why)
    try:                # the precision of every op that runs, resolved before anything runs
        for op in (o for o in adapter.ops if ops is None or o in ops):
            adapter.precision(the_case.torch_dtype, op=op)
    except AdapterError as exc:
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(
            f"precision: {exc}") from None
    with op_timeout(timeout, hard_exit=True):
        outcome = check_case(adapter, the_case, replays=replays, ops=ops)
    if not outcome.passed:
        raise ConformanceError(format_case(outcome, adapter, ops), outcome)
    if not any(c.judged for c in outcome.checks):
        pytest.skip(f"{the_case.id}: nothing judged for {adapter.spec} ("
                    + (f"{len(outcome.checks)} checks, none judged" if outcome.checks else
                       "no op of the implementation applies to this case") + ")")
    return outcome
