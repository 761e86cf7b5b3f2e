"""The adapter protocol: how ``dsv4-oracle check`` (and the pytest suite) call an implementation.

An *adapter* is any object (a module, an instance, or a class/factory that makes one) with
some of the ops of :mod:`dsv4_oracle.protocol` (the op names in pipeline order, and one
``typing.Protocol`` per op with its exact call and what it returns), named and called exactly
like the float64 oracle's functions (``reference``), positional arguments first.

Optional attributes: ``name`` (str), ``device`` (``"cpu"`` by default), ``precision`` (a
:class:`reference.error_model.Precision`, or a callable ``dtype -> Precision``; the default is
float32 accumulation and statistics with outputs stored in the input dtype), ``ops`` (the
tuple of op names the adapter claims; each must be callable), ``unavailable()`` (``None``, or
a one-line reason why the adapter cannot run on this machine) and ``backward_convention``
(``"given"`` or ``"recomputed"``: the attention backward's ``Delta = <dO, out>`` uses the ``out``
it is handed, or its own recomputed forward's; contract section 6 allows both, and without the
attribute the checker measures which one the backward follows) and ``policies`` (a mapping
policy name -> value: the named policies of contract section 5.2 the implementation follows,
e.g. ``{"loss_norm": "rows", "topk_ties": "any"}``; the oracle is evaluated under them, every
other policy takes the contract's default, and the verdict states each non-default policy it
assumed; ``check --policy`` overrides the declaration).

An adapter may implement any subset: the runner feeds every op the oracle's result for the ops
the adapter lacks (rounded as a kernel would store it) and judges only what the adapter
computed. Built in: ``reference`` (the oracle itself: every ratio must be exactly 0, a self-test
of the runner), ``gpu_impl:torch`` (the portable backend), ``gpu_impl:cudnn`` (cuDNN/Triton
kernels where they run the op's shapes, the torch backend for the rest, on CUDA). A user's own
adapter is named ``module:attr`` or ``module`` (the current directory is importable), or
``path/to/file.py:attr`` (the module is the file, named by its stem; the modules beside it
import, as with ``python path/to/file.py``).

``precision`` may also be a mapping op name -> a Precision or a callable ``dtype -> Precision``,
for adapters whose ops differ (ops it does not name, and the packed layer unless it names
``csa_layer``, get :func:`default_precision`). A declared precision looser than the default
widens the adapter's own bounds: the verdict says so, and ``check --precision default`` ignores
the declaration.

Everything the adapter's own code does while it is loaded and inspected (importing it, making
it, reading ``name``, ``device``, ``precision``, ``ops``, calling ``unavailable()`` and
``precision``) that raises, or exits, is an :class:`AdapterError` with one line; while it runs,
:mod:`dsv4_oracle.invoke` guards each op call.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Mapping
from typing import Any, Callable

import torch

from dsv4_oracle.reference.error_model import ORACLE_PRECISION, Precision
from dsv4_oracle.reference.contract_policies import resolve_policies

from .invoke import Overrun, describe
from .protocol import ALL_OPS, LAYER_OP, OPS
from .wording import did_you_mean, misspelling_of

__all__ = [
    "OPS", "LAYER_OP", "ALL_OPS", "BUILTIN", "AdapterError", "AdapterTypeError", "Adapter",
    "load_adapter", "default_impl", "default_precision", "looser_than_default", "GpuImplAdapter",
    "checked_ops",
]

BUILTIN = ("reference", "gpu_impl:torch", "gpu_impl:cudnn")


class AdapterError(Exception):
    """An adapter cannot be loaded or cannot run here; the message is one line for the user."""


class AdapterTypeError(AdapterError, TypeError):
    """An :class:`AdapterError` about a value of the wrong type (a precision that is not a
    :class:`Precision`)."""


def default_precision(dtype: torch.dtype) -> Precision:
    """Working precision of a typical kernel (section 12): float32 accumulation and statistics,
    operands and outputs stored in the input dtype when it is a 16-bit float, else float32."""
    io = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    return Precision(acc=torch.float32, io=io, stats=torch.float32)


def looser_than_default(precision: Precision, dtype: torch.dtype) -> list[str]:
    """The fields of ``precision`` whose unit roundoff exceeds :func:`default_precision`'s for
    inputs of ``dtype`` (``["acc bfloat16 > float32", ...]``; empty when none is looser)."""
    d = default_precision(dtype)
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    return [f"{f} {name(getattr(precision, f))} > {name(getattr(d, f))}"
            for f in ("acc", "io", "stats")
            if Precision.unit_roundoff(getattr(precision, f)) >
            Precision.unit_roundoff(getattr(d, f))]


def _guarded(what: str, fn: Callable, *args):
    """``fn(*args)`` for adapter code run while loading or inspecting it: whatever it raises,
    or a ``SystemExit``, is an :class:`AdapterError` (one line) naming ``what``."""
    try:
        return fn(*args)
    except (AdapterError, KeyboardInterrupt, Overrun):
        raise
    except BaseException as exc:       # the adapter's own code: never a traceback, never exit
        raise AdapterError(f"{what}: {describe(exc)}") from None


class Adapter:
    """A loaded implementation: the object providing the ops plus what the runner needs to know.

    ``ops``: the op names it provides (in :data:`ALL_OPS` order); ``op(name)`` the callable
    (looked up once, when the adapter is loaded). ``precision_source``: ``"adapter"`` (it
    declares a precision), ``"default"`` (it declares none) or ``"forced default"``
    (:meth:`use_default_precision`).
    """

    def __init__(self, target: Any, *, name: str, device: str | None = None,
                 precision: Precision | Callable | Mapping | None = None,
                 spec: str | None = None):
        self.target = target
        self.name = name
        self.spec = spec or name
        attr = lambda a, default=None: _guarded(  # noqa: E731
            f"adapter {self.spec}: reading its attribute {a!r}", getattr, target, a, default)
        self.device = str(device if device is not None else attr("device", "cpu"))
        self._precision = precision if precision is not None else attr("precision")
        self._forced_default = False
        declared_policies = attr("policies")
        try:
            resolve_policies(declared_policies, "policies")
        except (TypeError, ValueError) as exc:
            raise AdapterError(f"adapter {self.spec}: {exc}") from None
        self._declared_policies = dict(declared_policies or {})
        self._policy_override: dict | None = None
        if isinstance(self._precision, Mapping):
            unknown = [o for o in self._precision if o not in ALL_OPS]
            if unknown:
                raise AdapterError(f"adapter {self.spec}: its precision names unknown op "
                                   f"{unknown[0]!r}; the protocol's ops are "
                                   f"{', '.join(ALL_OPS)}")
        elif not (self._precision is None or isinstance(self._precision, Precision)
                  or callable(self._precision)):
            raise AdapterError(f"adapter {self.spec}: precision is a "
                               f"{type(self._precision).__name__}; expected a Precision, a "
                               f"callable dtype -> Precision, or a mapping op -> either")
        declared = attr("ops")
        if isinstance(declared, (tuple, list, set, frozenset)):
            declared = tuple(declared)
            unknown = [o for o in declared if o not in ALL_OPS]
            if unknown:
                raise AdapterError(f"adapter {self.spec} declares unknown ops {unknown}; the "
                                   f"protocol's ops are {', '.join(ALL_OPS)}")
            fns = {o: attr(o) for o in declared}
            missing = [o for o in declared if not callable(fns[o])]
            if missing:
                raise AdapterError(f"adapter {self.spec} declares op {missing[0]} but has no "
                                   f"callable attribute {missing[0]!r}")
        else:
            fns = {o: attr(o) for o in ALL_OPS}
        self._fns = {o: f for o, f in fns.items() if callable(f)}
        self.ops = tuple(o for o in ALL_OPS if o in self._fns)
        if not isinstance(declared, (tuple, list, set, frozenset)):
            self._refuse_misspelled_ops(attr)
        if not self.ops:
            raise AdapterError(f"adapter {self.spec} provides none of the ops "
                               f"({', '.join(ALL_OPS)})")

    def _refuse_misspelled_ops(self, attr) -> None:
        """An attribute whose name misspells an op the adapter lacks
        (``sparse_attention_foward``) would leave that op to the oracle and pass silently: an
        :class:`AdapterError` naming the op it resembles."""
        names = _guarded(f"adapter {self.spec}: listing its attributes", dir, self.target)
        for a in names:
            if a.startswith("_") or a in ALL_OPS:
                continue
            op = misspelling_of(a, ALL_OPS)
            if op is not None and op not in self.ops and callable(attr(a)):
                raise AdapterError(f"adapter {self.spec}: its attribute {a!r} looks like a "
                                   f"misspelling of the op {op}, which it lacks (the oracle "
                                   f"would stand in for it, unjudged); rename it {op!r}, or "
                                   f"start its name with '_' if it is not an op")

    def op(self, name: str) -> Callable:
        return self._fns[name]

    def has(self, name: str) -> bool:
        return name in self.ops

    def use_default_precision(self) -> None:
        """Judge with :func:`default_precision` whatever the adapter declares
        (``check --precision default``)."""
        self._precision = None
        self._forced_default = True

    def set_policies(self, policies, *, forget_declared: bool = False) -> None:
        """Judge under ``policies`` (a mapping policy name -> value, contract section 5.2) on
        top of the adapter's declaration, or of the defaults with ``forget_declared``
        (``check --policy``); ``ValueError``/``TypeError`` naming a bad name or value."""
        resolve_policies(policies, "policies")
        base = {} if forget_declared else dict(self._declared_policies)
        self._policy_override = {**base, **dict(policies or {})}

    @property
    def policies(self) -> dict:
        """Every policy's value the oracle is evaluated under (section 5.2)."""
        return resolve_policies(self._policy_override if self._policy_override is not None
                                else self._declared_policies)

    @property
    def policy_source(self) -> str:
        """``"adapter"`` (as the adapter declares), ``"default"`` (it declares none),
        ``"command line"`` (:meth:`set_policies`)."""
        if self._policy_override is not None:
            return "command line"
        return "adapter" if self._declared_policies else "default"

    @property
    def precision_source(self) -> str:
        if self._forced_default:
            return "forced default"
        return "default" if self._precision is None else "adapter"

    def precision(self, dtype: torch.dtype, op: str | None = None) -> Precision:
        """The working precision the error model assumes for ``op`` on inputs of ``dtype``
        (``op=None``: the adapter's precision when it declares one for every op)."""
        p = self._precision
        if isinstance(p, Mapping):
            p = p.get(op) if op is not None else None
        if p is None:
            return default_precision(dtype)
        if isinstance(p, Precision):
            return p
        what = f"adapter {self.spec}: precision({dtype})" + (f" for {op}" if op else "")
        if not callable(p):
            raise AdapterTypeError(f"{what} is a {type(p).__name__}, expected a Precision or "
                                   f"a callable dtype -> Precision")
        got = _guarded(what, p, dtype)
        if not isinstance(got, Precision):
            raise AdapterTypeError(f"{what} returned {type(got).__name__}, expected "
                                   f"dsv4_oracle.reference.error_model.Precision")
        return got

    def unavailable(self) -> str | None:
        """Why the adapter cannot run here (``None`` when it can): its device is not a torch
        device, holds no data (``meta``), or is CUDA without CUDA; or its ``unavailable()``
        says why (or raises)."""
        dev = self.device
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError) as exc:
            return f"adapter {self.spec}: device {dev!r} is not a torch device ({exc})"
        if d.type == "cuda" and not torch.cuda.is_available():
            no_cuda = "this machine has no usable CUDA device (torch.cuda.is_available() is False)"
            if self.spec in BUILTIN:
                return f"{self.spec} runs on CUDA, and {no_cuda}; on the CPU use gpu_impl:torch"
            return (f"adapter {self.spec} runs on {dev!r} (its device), and {no_cuda}: run it on "
                    f"a CUDA machine, or on the CPU if it can (device 'cpu')")
        if d.type == "meta":
            return (f"device {dev!r} holds no values, and the check compares values; use "
                    f"cpu or cuda")
        try:
            torch.zeros(1, device=d).cpu()
        except Exception as exc:
            return (f"device {dev!r} cannot hold the inputs here: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        try:
            fn = _guarded(f"adapter {self.spec}: reading its attribute 'unavailable'",
                          getattr, self.target, "unavailable", None)
            why = _guarded(f"adapter {self.spec}: unavailable()", fn) if callable(fn) else None
        except AdapterError as exc:
            return str(exc)
        if why:
            lines = str(why).strip().splitlines()
            return f"{self.spec}: {lines[0] if lines else why!r}"
        return None

    def describe(self) -> dict:
        return {"spec": self.spec, "name": self.name, "device": self.device,
                "ops": list(self.ops)}


# ---------------------------------------------------------------------------------------------
# built-in adapters
# ---------------------------------------------------------------------------------------------
class GpuImplAdapter:
    """:mod:`gpu_impl` as an adapter: every op through :mod:`gpu_impl.api` with one ``backend``
    request (``"torch"``, or ``"auto"`` for cuDNN: cuDNN/Triton where its kernels take the op's
    shapes, the torch backend for the rest; each result says which ran), plus the packed layer
    :func:`gpu_impl.layer.csa_layer`."""

    ops = ALL_OPS

    def __init__(self, backend: str = "torch", device: str = "cpu", deterministic: bool = True,
                 chunk_rows: int | None = None):
        from dsv4_oracle.gpu_impl import api
        self._api = api
        self.backend = backend
        self.request = "torch" if backend == "torch" else "auto"
        self.device = device
        self.deterministic = deterministic
        self.chunk_rows = chunk_rows          # row chunking of the ops that take it
        self.name = f"gpu_impl:{backend}"

    def unavailable(self):
        if self.backend == "cudnn":
            if importlib.util.find_spec("cudnn") is None:
                return ("the cuDNN frontend is not installed (pip install -e '.[gpu]'); "
                        "without it use gpu_impl:torch")
        return None

    def _kw(self, chunked: bool = True):
        kw = dict(backend=self.request, deterministic=self.deterministic)
        if chunked and self.chunk_rows is not None:
            kw["chunk_rows"] = self.chunk_rows
        return kw

    def compressor_forward(self, kv, score, ape, norm_weight, layout, ratio, *, rope):
        return self._api.compressor_forward(kv, score, ape, norm_weight, layout, ratio, rope=rope,
                                            **self._kw())

    def indexer_compressor_forward(self, kv, score, ape, norm_weight, layout, ratio, *, rope):
        return self._api.indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio,
                                                    rope=rope, **self._kw())

    def compressor_backward(self, kv, score, ape, norm_weight, layout, ratio, dout, *, rope):
        return self._api.compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout,
                                             rope=rope, **self._kw())

    def indexer_compressor_backward(self, kv, score, ape, norm_weight, layout, ratio, dout, *,
                                    rope):
        return self._api.indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio,
                                                     dout, rope=rope, **self._kw())

    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        return self._api.indexer_scores(q_idx, k_idx, weights, layout, ratio, **self._kw())

    def stable_topk(self, scores, k, *, order="id"):
        return self._api.stable_topk(scores, k, order=order, **self._kw(False))

    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        return self._api.build_csa_indices(layout, window=window, ratio=ratio,
                                           compressed_ids=compressed_ids, device=self.device,
                                           **self._kw(False))

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        return self._api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                                  **self._kw())

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        return self._api.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=v_dim,
                                                   lengths=lengths, **self._kw())

    def sparse_indexer_loss(self, q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *,
                            coeff):
        return self._api.sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores,
                                             layout, coeff=coeff, **self._kw())

    def sparse_indexer_loss_grad(self, q_idx, k_idx, weights, compressed_ids, target, predict, *,
                                 coeff, num_real):
        return self._api.sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target,
                                                  predict, coeff=coeff, num_real=num_real,
                                                  **self._kw())

    def csa_layer(self, q, kv, sink, layout, *, compressor=None, **kwargs):
        from dsv4_oracle.gpu_impl.layer import csa_layer
        kwargs.setdefault("backend", self.request)
        kwargs.setdefault("deterministic", self.deterministic)
        return csa_layer(q, kv, sink, layout, compressor=compressor, **kwargs)


def checked_ops(adapter: "Adapter", ops) -> tuple[str, ...] | None:
    """``ops`` (op names, or ``None`` for every op the adapter provides) checked against the
    protocol and the adapter: ``ValueError`` (one line) for an unknown op or one the adapter
    lacks. The one rule behind ``dsv4-oracle check --ops`` and ``assert_conforms(ops=...)``."""
    if ops is None:
        return None
    ops = tuple(ops)
    if not ops:
        raise ValueError(f"names no op; ops are {', '.join(ALL_OPS)}")
    unknown = [o for o in ops if o not in ALL_OPS]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}; ops are {', '.join(ALL_OPS)}"
                         + did_you_mean(unknown[0], ALL_OPS))
    missing = [o for o in ops if not adapter.has(o)]
    if missing:
        raise ValueError(f"{adapter.spec} lacks op {missing[0]} (it provides "
                         f"{', '.join(adapter.ops)})")
    return ops


def default_impl() -> str:
    """The embedded default: ``gpu_impl:cudnn`` on a machine with a CUDA device, else
    ``gpu_impl:torch`` (on the CPU)."""
    return "gpu_impl:cudnn" if torch.cuda.is_available() else "gpu_impl:torch"


def _builtin(spec: str, device: str | None) -> Adapter:
    if spec == "reference":
        from dsv4_oracle import reference
        return Adapter(reference, name="reference", device=device or "cpu",
                       precision=ORACLE_PRECISION, spec=spec)
    backend = spec.split(":", 1)[1]
    if device is None:
        device = "cuda" if (backend == "cudnn" or torch.cuda.is_available()) else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise AdapterError(f"--device {device!r} is not a torch device ({exc})") from None
    if backend == "cudnn" and kind != "cuda":
        raise AdapterError(f"gpu_impl:cudnn runs on CUDA, not on {device!r}; on the CPU use "
                           "gpu_impl:torch")
    return Adapter(GpuImplAdapter(backend, device), name=spec, device=device, spec=spec)


def load_adapter(spec: str, device: str | None = None, *, arg: str = "--impl") -> Adapter:
    """The adapter named ``spec``: a built-in (:data:`BUILTIN`), ``module:attr`` or ``module``.

    ``attr`` may be dotted. A class is instantiated with no arguments; a function that provides
    no op is called with no arguments and must return the adapter object. ``device`` overrides
    the adapter's own. Raises :class:`AdapterError` (one line, naming the argument ``arg``
    that gave ``spec``, with the closest valid name for a slip) when anything is wrong.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise AdapterError(f"{arg} must name an adapter: reference, gpu_impl:torch, "
                           "gpu_impl:cudnn, module:attr or path/to/file.py:attr")
    spec = spec.strip()
    who = f"{arg} {spec}" if arg.startswith("-") else f"{arg} {spec!r}"
    if spec in BUILTIN:
        return _builtin(spec, device)
    if spec.startswith("gpu_impl:"):
        raise AdapterError(f"unknown built-in {spec!r}; built-ins are {', '.join(BUILTIN)}"
                           + did_you_mean(spec, BUILTIN))
    if spec.endswith(".py") or ".py:" in spec:
        path, _, attr = spec.rpartition(".py")
        path, attr = path + ".py", attr[1:]
        if spec.endswith(".py:") or (attr and attr.startswith(":")):
            raise AdapterError(f"{who} is not of the form path/to/file.py:attr")
        module_name, obj = _import_file(path, who)
    else:
        module_name, _, attr = spec.partition(":")
        if not module_name or (":" in spec and not attr):
            raise AdapterError(f"{who} is not of the form module:attr")
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)          # the user's own adapter lives beside them
        try:
            obj = _guarded(f"cannot import module {module_name!r} for {who}",
                           importlib.import_module, module_name)
        except AdapterError as exc:
            raise AdapterError(f"{exc}{_import_slip(spec, module_name)}") from None
    for part in attr.split(".") if attr else ():
        has = _guarded(f"{who}: reading {part!r}", hasattr, obj, part)
        if not has:
            names = _guarded(f"{who}: listing {module_name!r}", dir, obj)
            raise AdapterError(f"module {module_name!r} has no attribute {attr!r} ({who})"
                               + did_you_mean(part, [n for n in names if not n.startswith("_")]))
        obj = _guarded(f"{who}: reading {part!r}", getattr, obj, part)
    provides = any(callable(_guarded(f"{who}: reading {o!r}", getattr, obj, o, None))
                   for o in ALL_OPS)
    if not attr and not provides and isinstance(obj, types.ModuleType):
        inside = _adapters_in(obj)
        if inside:
            form = spec if spec.endswith(".py") else module_name
            raise AdapterError(f"{who}: module {module_name!r} provides none of the ops itself; "
                               f"{', '.join(inside)} {'does' if len(inside) == 1 else 'do'}: "
                               f"name one, as in {arg} {form}:{inside[0]}")
    if isinstance(obj, type) or (callable(obj) and not provides):
        obj = _guarded(f"{who}: calling {attr or module_name}() to make the "
                       f"adapter failed",
                       obj)
    name = _guarded(f"adapter {spec}: reading its attribute 'name'", getattr, obj, "name", None)
    name = name if isinstance(name, str) and name else spec
    return Adapter(obj, name=name, device=device, spec=spec)


def _adapters_in(module) -> list[str]:
    """The public classes and objects defined in ``module`` that provide an op."""
    found = []
    for n, v in list(vars(module).items()):
        if n.startswith("_") or isinstance(v, types.ModuleType):
            continue
        if isinstance(v, type) and v.__module__ != module.__name__:
            continue
        try:
            if any(callable(getattr(v, o, None)) for o in ALL_OPS):
                found.append(n)
        except Exception:             # a property of the user's object: not an adapter then
            continue
    return found


def _import_slip(spec: str, module_name: str) -> str:
    """``"; did you mean ..."`` for a module that does not import: a built-in misspelled
    (``refrence``), or ``module.attr`` written for ``module:attr``."""
    slip = did_you_mean(spec, BUILTIN)
    if slip or ":" in spec or "." not in module_name:
        return slip
    parent, _, child = module_name.rpartition(".")
    try:
        has = hasattr(importlib.import_module(parent), child)
    except BaseException:             # the user's module: anything it raises means no hint
        return ""
    return f"; did you mean {parent}:{child}? (module:attr)" if has else ""


def _module_name_for(stem: str, path: str) -> str:
    """The name under which the adapter file ``path`` is registered in ``sys.modules``: its
    stem, unless that names another module (the standard library's ``json``, an installed
    package, a module already imported from elsewhere), which must keep its name for the rest
    of the run; then a private name."""
    other = sys.modules.get(stem)
    if other is None:
        try:
            found = importlib.util.find_spec(stem)
        except (ImportError, ValueError):
            found = None
        origin = getattr(found, "origin", None)
    else:
        origin = getattr(other, "__file__", None)
    taken = stem in sys.stdlib_module_names or (
        (other is not None or origin is not None)
        and not (origin and os.path.abspath(origin) == path))
    return f"_dsv4_oracle_adapter_{stem}" if taken else stem


def _import_file(path: str, who: str):
    """``(module name, module)`` of the adapter file ``path``, imported from that path. Its
    folder is made importable, as ``python path`` does, so that the adapter imports the modules
    beside it; the folder goes to the end of ``sys.path``, where it shadows no installed or
    standard module. The module is named by the file's stem (:func:`_module_name_for`)."""
    if not os.path.isfile(path):
        if os.path.isdir(path):
            raise AdapterError(f"{who}: the file {path!r} is a directory")
        folder = os.path.dirname(path) or "."
        here = sorted(f for f in os.listdir(folder) if f.endswith(".py")) \
            if os.path.isdir(folder) else []
        slip = did_you_mean(os.path.basename(path), here)
        raise AdapterError(f"{who}: the file {path!r} does not exist{slip}")
    stem = os.path.splitext(os.path.basename(path))[0]
    if not stem.isidentifier():
        raise AdapterError(f"{who}: the file name {os.path.basename(path)!r} is not a "
                           f"Python module name")
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.append(folder)         # the modules beside the adapter import
    name = _module_name_for(stem, full)
    loader_spec = importlib.util.spec_from_file_location(name, full)
    if loader_spec is None or loader_spec.loader is None:
        raise AdapterError(f"{who}: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module          # (dataclasses and pickling look the module up)
    try:
        _guarded(f"cannot import module {stem!r} for {who}",
                 loader_spec.loader.exec_module, module)
    except AdapterError:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    return stem, module
