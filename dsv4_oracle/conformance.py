"""Conformance of one implementation on one case: run it, then judge it against the oracle.

This module and :mod:`dsv4_oracle.compare` are the comparison engine that both the pytest
suite (``oracle_tests/helpers/impl_harness.py``, ``gpu_impl/test_*.py``, the CP lane) and the
``dsv4-oracle check`` command use; there is no second copy of these rules.

Data flow (contract section 12: the oracle is evaluated on the exact inputs the implementation
consumed, including its own intermediates):

    case.materialize()  ->  run_ops / run_layer (the adapter's pipeline)  ->  Run(got, consumed)
                        ->  judge(case, inputs, got, consumed)  ->  [CheckResult, ...]

Everything both halves need to know about the pipeline is one table, :data:`STAGES`: per op,
what it reads, what it writes, when it applies to a case, how a kernel stores its outputs and
which judge holds its rules. The oracle's function for a stage is the op of the same name in
``reference`` (the adapter protocol uses the oracle's names and argument order), called with
the same arguments as the adapter's op.

- :func:`oracle_outputs`: the oracle alone through the same table (every applicable stage on
  the oracle's own earlier outputs): the reference outputs the regression store keeps, the CP
  lane compares against and the oracle benchmark times (:func:`oracle_stage` is one step).
- :func:`run_ops`: the op-level pipeline. Each stage the adapter provides runs on what the
  previous stages produced, and its outputs are checked the moment it returns
  (:mod:`dsv4_oracle.outputs`); a stage it lacks, or one that fails (raises, writes into an
  argument, returns something unusable), is replaced, where a later stage reads its outputs,
  by the oracle's result rounded as a kernel stores it (:attr:`Stage.stored`).
- :func:`run_layer`: the packed layer (``csa_layer``): forward (its outputs copied and checked
  when it returns), then autograd backward of ``out`` (upstream ``dout``) and of the indexer
  loss (upstream 1), and of the loss alone (section 8: its gradients on ``q``, ``kv`` and the
  sink must be exact zeros).
- :func:`judge`: stage by stage, in pipeline order, the oracle on what that stage consumed,
  with its bound (``reference.error_model``) and its primitive check (``compare``). A stage
  that reads an output whose own check found it unusable (a non-finite pattern or a shape the
  oracle cannot consume) is *not judged*, never a crash. The attention backward is judged under
  the two conventions of contract section 6 (``Delta`` from the ``out`` it was given, or from
  its own recomputed forward). Every check carries the quantity it judges
  (``extra["quantity"]``), one of :data:`QUANTITIES`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from typing import Callable, NamedTuple

import torch

from dsv4_oracle import reference as R
from dsv4_oracle.reference import error_model as EM
from dsv4_oracle.reference._checks import as_device, compute_on, to_cpu

from .adapters import Adapter
from .hints import AXES, concentration_hint
from .invoke import OpError, call_op, text
from .outputs import unusable
from .compare import (CheckResult, compare_exact, compare_numeric, compare_topk, content_hash,
                      error_ratios, near_tie_rows, not_judged, row_chunks)

__all__ = ["QUANTITIES", "FORWARD_OUTPUTS", "BACKWARD_OPS", "BACKWARD_CONVENTIONS", "STAGES",
           "Stage", "Run", "OpError", "applies", "oracle_stage", "oracle_outputs", "run_ops",
           "run_layer", "layer_applies", "judge", "tensors_of", "error_ratio_map",
           "concentration_hint"]

F64 = torch.float64

# quantity -> (contract section, what it is); the report's rows, in pipeline order
QUANTITIES = {
    "scores": ("7", "indexer scores [T, C]"),
    "cmp_ids": ("4", "Top-K compressed ids: sets, lengths, order policy"),
    "ids": ("5", "CSA key-id rows"),
    "lengths": ("5", "valid entries per CSA row"),
    "out": ("6", "attention output [T, H, Dv]"),
    "lse": ("6", "log-sum-exp without the sink [T, H]"),
    "sink_only": ("3, 6", "rows with no key: out 0, lse +inf, dq 0"),
    "dq": ("6", "gradient wrt q"),
    "dkv": ("6", "gradient wrt the key buffer"),
    "dsink": ("6", "gradient wrt the sink"),
    "loss": ("8", "indexer KL loss"),
    "kl": ("8", "per-row KL"),
    "target": ("8", "teacher distribution"),
    "predict": ("8", "student distribution"),
    "dq_idx": ("8", "gradient wrt q_idx"),
    "dw": ("8", "gradient wrt the indexer weights"),
    "dk_idx": ("8", "gradient wrt k_idx"),
    "loss_detached": ("8", "the indexer loss alone backpropagates exact zeros to q, kv, sink"),
    "replays": ("11", "bitwise identical replays"),
    "grad_modes": ("11", "identical bits in no_grad / inference_mode / grad-enabled"),
    "no_mutation": ("11", "no input modified"),
    "outputs_stable": ("11", "returned tensors keep their bits after they are returned"),
    "run": ("-", "the implementation ran without raising"),
}

# the outputs of the forward pipeline (what section 11's grad-mode parity compares)
FORWARD_OUTPUTS = ("scores", "cmp_ids", "cmp_lengths", "ids", "lengths", "out", "lse", "loss",
                   "kl", "target", "predict")
BACKWARD_OPS = ("sparse_attention_backward", "sparse_indexer_loss_grad")
# contract section 6: Delta = <dO, out> with the out the backward was handed ("given", kernel
# style) or with its own recomputed, unrounded forward ("recomputed", autograd style)
BACKWARD_CONVENTIONS = ("given", "recomputed")
IO = "io"                       # Stage.stored: the case's input dtype


class Run(NamedTuple):
    """One pipeline run: ``got`` the adapter's outputs (judged), ``consumed`` what each op was
    fed (the adapter's outputs, or the oracle's where the adapter lacks the op or the op
    failed; plus ``"backward_convention"`` when the adapter pins one, and ``"not_run"``, op ->
    reason, when the pipeline stopped because the oracle could not stand in for a missing op
    on the adapter's outputs), ``backends`` op -> the backend that ran it, ``failed`` op ->
    the :class:`OpError` of an op that raised, exited, wrote into an argument or returned
    something unusable (its outputs are not in ``got``)."""

    got: dict
    consumed: dict
    backends: dict
    failed: dict


def tensors_of(d: dict) -> dict:
    """The tensor entries of a dict (for replays, parity and hashing)."""
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------
# the stage table
# ---------------------------------------------------------------------------------------------
class Stage(NamedTuple):
    """One op of the pipeline.

    ``reads``: the names it consumes (case inputs, or outputs of earlier stages; ``att_lengths``
    is the attention's ``lengths`` argument: the CSA row lengths of a layer case whose
    ``case.lengths`` is ``"layer"``, the case's own ``lengths`` of an op case). ``writes``: its
    outputs (the first fields of its result). ``stored``: per output, the dtype the oracle's
    result is rounded to when the adapter lacks the op (``IO``: the case's dtype). ``applies``:
    whether the stage exists for a case. ``call``: ``(case, layout, reads) -> (args, kwargs)``,
    the same for the adapter's op and for ``reference.<op>``. ``judge``: the stage's rules.
    """

    op: str
    section: str
    reads: tuple
    writes: tuple
    stored: tuple
    applies: Callable
    call: Callable
    judge: Callable


def _csa(case) -> bool:
    """The case has an indexer stage (a CSA layer, or DeepSeek-V3.2 DSA)."""
    return case.is_layer and case.has_indexer


def _indexer(case) -> bool:
    return _csa(case) and case.scores == "indexer"


def _loss(case) -> bool:
    return _csa(case) and case.layout().num_real > 0


# which quantity's checks vouch for a read (cmp_lengths is judged with cmp_ids)
_QUANTITY_OF = {"cmp_lengths": "cmp_ids", "att_lengths": "lengths"}


def _read(case, name: str, x: dict, con: dict, produced: Callable | None = None):
    """The value a stage reads under ``name``: what the pipeline consumed (``con``), else the
    oracle's output for a name an applicable stage produces (``produced``), else the case's
    inputs (``index_scores`` for a layer case with given scores; ``None`` for the compressed
    selection of a layer without one)."""
    if name == "att_lengths":
        if not case.is_layer:
            return x.get("lengths")
        return _read(case, "lengths", x, con, produced) if case.lengths == "layer" else None
    if name in con:
        return con[name]
    st = _PRODUCER.get(name)
    if st is not None and st.applies(case):
        return produced(name) if produced is not None else None
    if name == "scores":
        return x.get("index_scores")
    if name in ("cmp_ids", "cmp_lengths"):
        return None
    return x[name]


def _stored(case, dtype):
    return case.torch_dtype if dtype == IO else dtype


# ---------------------------------------------------------------------------------------------
# running an adapter
# ---------------------------------------------------------------------------------------------
def _fields(op: str, res, n: int, kind: str = "error") -> tuple:
    """The first ``n`` tensor fields of an op's result (a tensor when ``n == 1``, or a
    tuple/NamedTuple); anything else is an :class:`OpError` of ``kind``."""
    if n == 1 and isinstance(res, torch.Tensor):
        return (res,)
    if not isinstance(res, (tuple, list)) or len(res) < n:
        raise OpError(op, f"returned {type(res).__name__}, expected a tuple of {n} tensors", kind)
    out = tuple(res[:n])
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise OpError(op, f"field {i} of its result is {type(t).__name__}, not a tensor",
                          kind)
    return out


# stages whose outputs are judged together (a Top-K's ids with its lengths, a CSA row's ids
# with its lengths): when one is unusable, the other is not judged either
_JOINT = ("stable_topk", "build_csa_indices")


def _unusable_outputs(st: "Stage", case, lay, reads: dict, named: dict) -> tuple:
    """``(error, usable)`` for the outputs ``named`` of stage ``st``: ``error`` ``None`` when
    every output follows :mod:`dsv4_oracle.outputs`, else an :class:`OpError`
    (``kind="result"``) naming the first that does not and what was expected; ``usable`` the
    outputs that may still be judged (none of a joint stage's)."""
    bad = {}
    for name, t in named.items():
        why = unusable(st.op, case, lay, reads, {name: t})
        if why is not None:
            bad[name] = why[1]
    if not bad:
        return None, named
    first = next(iter(bad))
    error = OpError(st.op, f"returned an unusable {first}: {bad[first]}", "result", output=first)
    usable = {} if st.op in _JOINT else {n: t for n, t in named.items() if n not in bad}
    return error, usable


def _call(adapter: Adapter, backends: dict, st: "Stage", args, kwargs) -> dict:
    """The adapter's op of stage ``st``: its outputs by name (private copies of what it
    returned); a failure (it raised, exited, wrote into an argument, returned no tuple of
    tensors) is an :class:`OpError`."""
    op = st.op

    def result(res):
        named = dict(zip(st.writes, _fields(op, res, len(st.writes), "result")))
        b = getattr(res, "backend", None)
        backends[op] = text(b) if isinstance(b, str) else adapter.name
        return named
    return call_op(adapter.op(op), op, args, kwargs, result=result)


def _moved(v: dict, device) -> dict:
    return {k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in v.items()}


def _pinned_convention(adapter: Adapter, op: str) -> str | None:
    """The backward convention the adapter declares (attribute ``backward_convention``)."""
    conv = getattr(adapter.target, "backward_convention", None)
    if conv is not None and conv not in BACKWARD_CONVENTIONS:
        raise OpError(op, f"the adapter's backward_convention is {conv!r}; it must be one of "
                          f"{', '.join(BACKWARD_CONVENTIONS)} (contract section 6)")
    return conv


_STOOD_IN = "; the oracle's result, rounded as a kernel stores it, stood in for it downstream"


def run_ops(adapter: Adapter, case, x: dict, *, ops=None, backward: bool = True) -> Run:
    """The op-level pipeline of ``case`` on the inputs ``x`` (on ``adapter.device``).

    ``ops``: restrict to these op names (default: every op the adapter provides);
    ``backward=False`` skips the gradient ops (the forward of section 11's grad-mode parity).
    A stage runs when the adapter provides it, or (as the oracle, rounded per
    :attr:`Stage.stored`) when a later stage that runs reads one of its outputs.

    An op that fails (raises, exits, writes into an argument, or returns something unusable:
    :mod:`dsv4_oracle.outputs`) is recorded in ``Run.failed`` and stood in for exactly like an
    op the adapter lacks; every later stage still runs and is judged, and so are the failed
    op's usable outputs where they are judged one by one (not a joint stage's, ``_JOINT``).
    Only an op that overruns its time limit raises :class:`OpError` (the implementation may
    still be running).
    """
    dev = adapter.device
    lay = case.layout()
    stages = [s for s in STAGES if s.applies(case) and (backward or s.op not in BACKWARD_OPS)]
    use = {s.op: adapter.has(s.op) and (ops is None or s.op in ops) for s in stages}
    wanted: set = set()
    runs = []
    for s in reversed(stages):
        if use[s.op] or wanted & set(s.writes):
            runs.append(s)
            wanted |= {"lengths" if r == "att_lengths" else r for r in s.reads}
    got: dict = {}
    con: dict = {}
    backends: dict = {}
    failed: dict = {}
    order = runs[::-1]
    for i, s in enumerate(order):
        v = {r: _read(case, r, x, con) for r in s.reads}
        if use[s.op]:
            args, kw = s.call(case, lay, _moved(v, dev))
            try:
                named = _call(adapter, backends, s, args, kw)
            except OpError as exc:
                if exc.kind == "timeout":
                    raise
                failed[s.op] = exc
            else:
                error, usable = _unusable_outputs(s, case, lay, v, named)
                got.update(usable)              # judged, even when another output is not
                if error is None:
                    con.update(named)
                    continue
                failed[s.op] = error
            if not any(set(s.writes) & {"lengths" if r == "att_lengths" else r
                                        for r in t.reads} for t in order[i + 1:]):
                continue                 # nothing later reads what the failed op made
        args, kw = s.call(case, lay, _moved(v, "cpu"))
        try:
            res = _fields(s.op, getattr(R, s.op)(*args, **kw), len(s.writes))
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            # an output of the implementation the oracle cannot consume (e.g. NaN scores):
            # the pipeline stops; judge reports that output's failure and the adapter's
            # remaining ops as not judged
            con["not_run"] = {t.op: f"the oracle could not stand in for {s.op} on the "
                                    f"implementation's outputs ({exc})"
                              for t in order[i:] if use[t.op] and t.op not in failed}
            break
        if s.op in failed:
            e = failed[s.op]
            failed[s.op] = OpError(e.op, e.message + _STOOD_IN, e.kind, e.output)
        res = tuple(t.to(_stored(case, d)).to(dev) for t, d in zip(res, s.stored))
        con.update(zip(s.writes, res))
    if backward and use.get("sparse_attention_backward") and \
            "sparse_attention_backward" not in failed:
        conv = _pinned_convention(adapter, "sparse_attention_backward")
        if conv is not None:
            con["backward_convention"] = conv
    return Run(got, con, backends, failed)


LAYER_LEAVES = ("q", "kv_raw", "kv_cmp", "sink", "q_idx", "k_idx", "weights")


def layer_applies(case) -> bool:
    """The packed layer runs on layer cases whose indexer scores it computes itself."""
    return case.is_layer and case.scores == "indexer"


def run_layer(adapter: Adapter, case, x: dict, *, backward: bool = True) -> Run:
    """The packed layer of ``case``: ``adapter.csa_layer`` forward on leaf copies of the inputs
    and, with ``backward``, autograd backward of ``out`` (upstream ``x["dout"]``) and of the
    indexer loss (upstream 1). A leaf that autograd gives no gradient gets zeros (no flow).
    Before that, the loss alone is backpropagated to ``q``, ``kv`` and the sink (contract
    section 8: the teacher is detached, so these are exact zeros): ``got["loss_dq"]``,
    ``["loss_dkv"]``, ``["loss_dsink"]``.

    The forward's outputs are copied (and checked, :mod:`dsv4_oracle.outputs`) when the forward
    returns, before the backward runs: they are judged as the caller saw them. An output that
    is unusable is left out (with the other output of a joint stage: ``_JOINT``), recorded in
    ``Run.failed`` under that stage's op, and a backward that fails leaves out the gradients
    (key ``"csa_layer backward"``); the rest is still judged. A forward that fails raises
    :class:`OpError`."""
    op = "csa_layer"
    lay = case.layout()
    train = backward and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    leaf = {k: x[k].detach().clone().requires_grad_(train) for k in LAYER_LEAVES
            if k in x and not (k == "kv_cmp" and case.ratio == 0)
            and not (k in ("q_idx", "k_idx", "weights") and not case.has_indexer)}
    kw = dict(window=case.window, ratio=case.ratio, v_dim=case.v_dim, coeff=case.coeff,
              order=case.order)
    if case.ratio:
        kw["kv_cmp"] = leaf["kv_cmp"]
    if case.has_indexer:
        kw.update(q_idx=leaf["q_idx"], k_idx=leaf["k_idx"], weights=leaf["weights"],
                  topk=case.topk)
    attention_leaves = [k for k in ("q", "kv_raw", "kv_cmp", "sink") if k in leaf]
    box: dict = {}

    def forward_result(res):
        box["res"] = res
        b = getattr(res, "backends", None)
        box["backends"] = ({text(k): text(v) for k, v in b.items()} if isinstance(b, dict)
                           else {op: adapter.name})
        try:
            named = dict(out=res.out, lse=res.lse, ids=res.ids, lengths=res.lengths)
            if case.has_indexer:
                named.update(scores=res.index_scores, cmp_ids=res.compressed_ids,
                             cmp_lengths=res.compressed_lengths)
                L = getattr(res, "indexer_loss", None)
                if L is not None:
                    named["loss"] = res.loss
                    for k in ("kl", "target", "predict"):
                        named[k] = getattr(L, k)
        except AttributeError as exc:
            raise OpError(op, f"its result lacks a field of the protocol ({text(exc)})",
                          "result") from exc
        for k, v in named.items():
            if not isinstance(v, torch.Tensor):
                raise OpError(op, f"result field {k} is {type(v).__name__}, not a tensor",
                              "result", output=k)
        return named
    # the leaves are private copies already (and must stay autograd leaves): call_op compares
    # them, and the layout it copies, with snapshots around the call
    fwd = call_op(adapter.op(op), op, (leaf["q"], leaf["kv_raw"], leaf["sink"], lay), kw,
                  private=False, result=forward_result)
    got: dict = {}
    failed: dict = {}
    for st in STAGES:                    # each output checked as the op-level output would be
        outs = {w: fwd[w] for w in st.writes if w in fwd}
        if not outs or not st.applies(case):
            continue
        error, usable = _unusable_outputs(st, case, lay,
                                          {r: _read(case, r, x, got) for r in st.reads}, outs)
        got.update(usable)
        if error is not None:
            failed[st.op] = OpError(op, error.message, "result", output=error.output)
    if train:
        loss_only: dict = {}

        def backward_of_layer(*args, **kwargs):
            res = box["res"]
            roots, grads = [res.out], [kwargs["dout"]]
            if isinstance(res.loss, torch.Tensor) and res.loss.requires_grad:
                # section 8: no gradient reaches q, kv or the sink through the loss
                g_l = torch.autograd.grad(res.loss, [leaf[k] for k in attention_leaves],
                                          retain_graph=True, allow_unused=True)
                loss_only.update(zip(attention_leaves, g_l))
                roots.append(res.loss)
                grads.append(torch.ones_like(res.loss))
            torch.autograd.backward(roots, grads)

        def gradients(_):
            g = lambda k: (leaf[k].grad if leaf[k].grad is not None  # noqa: E731
                           else torch.zeros_like(leaf[k]))
            named = {"dq": g("q"), "dsink": g("sink"),
                     "dkv": torch.cat([g("kv_raw")] + ([g("kv_cmp")] if case.ratio else []))}
            if case.has_indexer and "loss" in fwd:
                named.update(dq_idx=g("q_idx"), dw=g("weights"), dk_idx=g("k_idx"))
            if loss_only:
                z = lambda k: (loss_only[k] if loss_only[k] is not None  # noqa: E731
                               else torch.zeros_like(leaf[k]))
                named.update(loss_dq=z("q"), loss_dsink=z("sink"), loss_dkv=torch.cat(
                    [z("kv_raw")] + ([z("kv_cmp")] if case.ratio else [])))
            return named
        rest = {k: v for k, v in leaf.items() if k not in ("q", "kv_raw", "sink")}
        try:
            got.update(call_op(backward_of_layer, op, (leaf["q"], leaf["kv_raw"], leaf["sink"]),
                               dict(rest, dout=x["dout"].detach().clone()), private=False,
                               result=gradients, label=f"the backward of {op}"))
        except OpError as exc:
            if exc.kind == "timeout":
                raise
            failed[f"{op} backward"] = OpError(op, f"in the backward: {exc.message}", exc.kind,
                                               exc.output)
    con = dict(got)
    conv = (_pinned_convention(adapter, op) if train and f"{op} backward" not in failed
            else None)
    if conv is not None:
        con["backward_convention"] = conv
    return Run(got, con, box["backends"], failed)


# ---------------------------------------------------------------------------------------------
# failure hints
# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# judging against the oracle
# ---------------------------------------------------------------------------------------------
def _tagged(res: CheckResult, quantity: str, **extra) -> CheckResult:
    return dataclasses.replace(res, extra={**res.extra, "quantity": quantity, **extra})


def _unusable(res: CheckResult) -> bool:
    """A failed check that leaves its output unusable as an oracle input: a non-finite pattern
    or a shape that differs from the oracle's."""
    return not res.passed and ("nonfinite_mismatches" in res.extra
                               or "expected_shape" in res.extra)


def _on_device(device):
    """``run(fn)``: ``fn()`` with the oracle computing on ``device`` and its results moved to
    the CPU (``None``: the CPU oracle, unchanged)."""
    if device is None:
        return lambda fn: fn()
    dev = as_device(device, "oracle_device")

    def run(fn):
        with compute_on(dev):
            return to_cpu(fn())
    return run


def _comparing_on(device):
    """The scope of the judge's numeric comparisons: on ``device`` when the oracle computes
    there (``compare`` then works on that device: the float64 arithmetic of a production-size
    comparison is the GPU's, the verdict and its numbers the same), else on the CPU."""
    if device is None:
        return contextlib.nullcontext()
    return compute_on(as_device(device, "oracle_device"))


def error_ratio_map(actual, expected, bound) -> torch.Tensor:
    """Per ``(row, head)`` the largest ``|actual - expected| / bound`` over the trailing
    dimensions (0 where equal, ``inf`` where a non-finite value differs or a zero bound is
    broken), float64 ``[T, H]`` (``[T, 1]`` for 1-D tensors). Shapes must match. Computed in
    row chunks, so its float64 temporaries stay small whatever ``T``."""
    actual, expected = actual.detach(), expected.detach()
    bound = torch.broadcast_to(bound.detach(), expected.shape)

    def per_row(rows):
        r = error_ratios(actual[rows], expected[rows], bound[rows])
        if r.dim() <= 2:
            return r.unsqueeze(1) if r.dim() == 1 else r
        return r.flatten(2).amax(dim=2) if math.prod(r.shape[2:]) else \
            torch.zeros(r.shape[:2], dtype=F64, device=r.device)
    parts = [per_row(rows) for rows in row_chunks(expected)]
    return torch.cat(parts) if parts else per_row(slice(0, 0))


class _Judging:
    """The state of judging one run: the consumed inputs (CPU), the oracle's results memoised
    on the content hash of what they read, the precision per op, and the outputs found
    unusable so far (name -> reason)."""

    def __init__(self, case, x, got, con, precision, cache, maps, oracle_device=None):
        self.case, self.lay = case, case.layout()
        self.on = _on_device(oracle_device)
        self.comparing = lambda: _comparing_on(oracle_device)
        self.hashes: dict = {}
        self.x = {k: t.detach().to("cpu") for k, t in x.items() if isinstance(t, torch.Tensor)}
        self.got = got
        self.con = {k: v.detach().to("cpu") for k, v in con.items()
                    if isinstance(v, torch.Tensor)}
        self.precision = precision
        self.cache = cache
        self.maps = maps
        self.blocked: dict = {}
        self.failed: set = set()

    def prec(self, op: str) -> EM.Precision:
        p = self.precision
        if isinstance(p, Mapping):
            if op not in p:
                raise ValueError(f"precision: the mapping has no entry for op {op!r}")
            p = p[op]
            if callable(p) and not isinstance(p, EM.Precision):
                p = p(self.case.torch_dtype)
        if not isinstance(p, EM.Precision):
            raise TypeError(f"precision for op {op!r} must be a reference.error_model.Precision, "
                            f"got {type(p).__name__}")
        return p

    def fingerprint(self, t: torch.Tensor) -> str:
        """:func:`content_hash` of ``t``, computed once per piece of memory this judging reads
        (the tensor is kept alive with its hash, so the address cannot be reused; an in-place
        write bumps the version and is hashed afresh)."""
        k = (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
             t.stride(), t.dtype, t._version)
        if k not in self.hashes:
            self.hashes[k] = (t, content_hash(t))
        return self.hashes[k][1]

    def memo(self, name, fn, *parts):
        if self.cache is None:
            return self.on(fn)
        k = (name,) + tuple(self.fingerprint(p) if isinstance(p, torch.Tensor) else p
                            for p in parts)
        if k not in self.cache:
            self.cache[k] = self.on(fn)
        return self.cache[k]

    def read(self, name: str):
        v = _read(self.case, name, self.x, self.con, self.produced)
        return v.detach().to("cpu") if isinstance(v, torch.Tensor) else v

    def produced(self, name: str):
        """The oracle's (float64, unrounded) output ``name`` on its stage's consumed inputs."""
        st = _PRODUCER[name]
        return dict(zip(st.writes, _fields(st.op, self.oracle(st), len(st.writes))))[name]

    def reads(self, st: Stage, **override) -> dict:
        return {r: (override[r] if r in override else self.read(r)) for r in st.reads}

    def oracle(self, st: Stage, **override):
        """``reference.<op>`` on what the stage consumed (``override`` replaces reads)."""
        v = self.reads(st, **override)
        args, kw = st.call(self.case, self.lay, v)
        return self.memo(("oracle", st.op), lambda: getattr(R, st.op)(*args, **kw),
                         *(v[r] for r in st.reads))

    def numeric(self, name: str, expected, bound) -> CheckResult:
        """:func:`compare_numeric` of ``got[name]``, plus hints when it fails: where the
        over-bound elements concentrate, and whether ``-actual`` would pass (a flipped sign)."""
        actual = self.got[name]
        with self.comparing():
            res = compare_numeric(name, actual, expected, bound)
        if res.passed or res.ratio is None or not math.isfinite(res.ratio) or \
                tuple(actual.shape) != tuple(expected.shape):
            return _tagged(res, name)
        hints, extra = [], {}
        with self.comparing():
            over = (error_ratios(actual.detach(), expected, bound) > 1).to("cpu")
        where_ = concentration_hint(over, AXES.get(name, ()), self.lay) \
            if over.dim() == len(AXES.get(name, ())) else None
        if where_:
            hints.append(where_)
            extra["concentration"] = where_
        with self.comparing():
            flipped = compare_numeric(name, -actual.detach().to("cpu", F64), expected, bound)
        if flipped.passed:
            hints.append("-actual is within the bound everywhere: a flipped sign?")
            extra["hint"] = "sign"
        if hints:
            extra["hints"] = "".join(f"; {h}" for h in hints)
        detail = res.detail + extra.get("hints", "")
        return _tagged(dataclasses.replace(res, detail=detail, extra={**res.extra, **extra}),
                       name)


def _judge_scores(j: _Judging, st: Stage) -> list:
    """Section 7: the scores against the oracle on the case's indexer inputs."""
    s_o, b = _scores_and_bound(j)
    return [j.numeric("scores", s_o, b)]


def _scores_and_bound(j: _Judging) -> tuple:
    """The oracle's indexer scores on the case's inputs and their bound."""
    st = _PRODUCER["scores"]
    v = j.reads(st)
    s_o = j.oracle(st)
    p = j.prec(st.op)
    b = j.memo(("bound", st.op, p), lambda: EM.indexer_scores_bound(
        v["q_idx"], v["k_idx"], v["weights"], j.lay, j.case.ratio, s_o, precision=p),
        v["q_idx"], v["k_idx"], v["weights"])
    return s_o, b


def _judge_topk(j: _Judging, st: Stage) -> list:
    """Section 4: exact sets, lengths and order policy of the Top-K of the consumed scores; and,
    when the implementation computed the scores, the sets of the oracle's own selection with
    near ties (within a few float32 ulps or the scores' bounds) excluded."""
    case, got = j.case, j.got
    t_ids, t_len = j.oracle(st)
    out = [_tagged(compare_topk(got["cmp_ids"], got["cmp_lengths"], t_ids, t_len,
                                order=case.order, name="cmp_ids (consumed scores)"), "cmp_ids")]
    if "scores" in got and case.topk >= 1:
        s_o, b_s = _scores_and_bound(j)
        o_ids, o_len = j.oracle(st, scores=s_o)
        ties = near_tie_rows(s_o, case.topk, bound=b_s)
        out.append(_tagged(compare_topk(got["cmp_ids"], got["cmp_lengths"], o_ids, o_len,
                                        near_tie_rows=ties, name="cmp_ids (oracle scores, sets)"),
                           "cmp_ids"))
    return out


def _judge_rows(j: _Judging, st: Stage) -> list:
    """Section 5: the CSA rows and lengths exactly, from the consumed compressed selection."""
    r_ids, r_len = j.oracle(st)
    return [_tagged(compare_exact("ids", j.got["ids"], r_ids), "ids"),
            _tagged(compare_exact("lengths", j.got["lengths"], r_len), "lengths")]


def _sink_only_rows(j: _Judging) -> torch.Tensor:
    """Rows with no valid key (the oracle's ``lse`` is ``+inf``): bool ``[T]``."""
    _, lse_o = j.oracle(_PRODUCER["out"])
    if lse_o.numel():
        return torch.isinf(lse_o[:, 0])
    return torch.zeros(lse_o.shape[0], dtype=torch.bool)


def _judge_forward(j: _Judging, st: Stage) -> list:
    """Section 6 forward: ``out`` and ``lse`` by error/bound ratio; rows with no key exactly
    (``out == 0``, ``lse == +inf``)."""
    v = j.reads(st)
    out_o, lse_o = j.oracle(st)
    p = j.prec(st.op)
    b_out, b_lse = j.memo(("bound", st.op, p), lambda: EM.attention_forward_bound(
        v["q"], v["kv"], v["ids"], v["sink"], out_o, lse_o, precision=p, v_dim=j.case.v_dim,
        lengths=v["att_lengths"]), *(v[r] for r in st.reads))
    checks = []
    if "out" in j.got:
        checks.append(j.numeric("out", out_o, b_out))
    if "lse" in j.got:
        checks.append(j.numeric("lse", lse_o, b_lse))
    empty = _sink_only_rows(j)
    for name, exp, what in (("out", torch.zeros_like(out_o), "out == 0"),
                            ("lse", lse_o, "lse == +inf")):
        g = j.got.get(name)
        if g is not None and tuple(g.shape) == tuple(exp.shape):
            g = g.detach().to("cpu")
            checks.append(_tagged(compare_exact(f"sink-only rows: {what}", g[empty],
                                                exp[empty].to(g.dtype)), "sink_only"))
            if j.maps is not None:
                with j.comparing():
                    j.maps[name] = error_ratio_map(g, out_o if name == "out" else lse_o,
                                                   b_out if name == "out" else b_lse).cpu()
    return checks


_GRADS = ("dq", "dkv", "dsink")


def _backward_under(j: _Judging, st: Stage, convention: str) -> tuple:
    """The three attention gradients against the oracle's backward with ``Delta`` from the
    ``out``/``lse`` the implementation was given (``"given"``) or from the oracle's own float64
    forward on the consumed ``q``, ``kv``, ids and sink (``"recomputed"``). Returns
    ``(checks, expected, bounds)``."""
    override = {}
    p = j.prec(st.op)
    out_error = None
    if convention == "recomputed":
        out_o, lse_o = j.oracle(_PRODUCER["out"])
        override = {"out": out_o, "lse": lse_o}
    v = j.reads(st, **override)
    if convention == "recomputed":
        # the recomputed out is the backward's own forward: within the forward's bound
        out_error = j.memo(("bound", "recomputed out", p), lambda: EM.attention_forward_bound(
            v["q"], v["kv"], v["ids"], v["sink"], out_o, lse_o, precision=p,
            v_dim=j.case.v_dim, lengths=v["att_lengths"])[0],
            *(v[r] for r in ("q", "kv", "ids", "sink", "att_lengths")))
    g_o = j.oracle(st, **override)
    bounds = j.memo(("bound", st.op, p, convention), lambda: EM.attention_backward_bound(
        v["q"], v["kv"], v["ids"], v["sink"], v["out"], v["lse"], v["dout"], *g_o,
        precision=p, v_dim=j.case.v_dim, lengths=v["att_lengths"], out_error=out_error),
        *(v[r] for r in st.reads))
    checks = [j.numeric(name, e, b) for name, e, b in zip(_GRADS, g_o, bounds) if name in j.got]
    return checks, g_o, bounds


def _worst(checks: list) -> float:
    return max((c.ratio for c in checks if c.ratio is not None and c.judged), default=0.0)


def _with_note(c: CheckResult, note: str) -> CheckResult:
    """``note`` after the check's finding and before its hints."""
    hints = c.extra.get("hints", "")
    base = c.detail[:len(c.detail) - len(hints)] if hints else c.detail
    return dataclasses.replace(c, detail=base + note + hints)


def _judge_backward(j: _Judging, st: Stage, pinned: str | None = None) -> list:
    """Section 6 backward under the two conventions for ``out`` in ``Delta``: the first
    convention (``"given"``, then ``"recomputed"``; only the pinned one when the adapter pins
    one) under which every gradient passes is the one the implementation follows. When none
    holds, the checks of the convention that came closest (fewest failing gradients, then the
    smallest worst ratio) are reported, failing, with both conventions' worst ratios. Rows with no key must have ``dq == 0``."""
    tried: dict = {}
    chosen = None
    for conv in (pinned,) if pinned else BACKWARD_CONVENTIONS:
        tried[conv] = _backward_under(j, st, conv)
        if all(c.passed for c in tried[conv][0]):
            chosen = conv
            break
    closest = chosen or min(tried, key=lambda c: (sum(not r.passed for r in tried[c][0]),
                                                  _worst(tried[c][0])))
    ratios = {c: _worst(t[0]) for c, t in tried.items()}
    extra = {"convention": closest, "convention_pinned": pinned is not None,
             "convention_holds": chosen is not None, "convention_worst_ratios": ratios}
    note = ""
    if chosen is None:
        under = ", ".join(f"{c} {r:.3g}" for c, r in ratios.items())
        note = (f"; fails under the {'pinned ' if pinned else ''}backward convention"
                f"{'' if pinned else 's'} of contract section 6 (worst ratio {under}); "
                f"closest: {closest}")
    results, g_o, bounds = tried[closest]
    checks = [_tagged(c if c.passed else _with_note(c, note), c.extra["quantity"], **extra)
              for c in results]
    if "dq" in j.got:
        dq = j.got["dq"].detach().to("cpu")
        empty = _sink_only_rows(j)
        if tuple(dq.shape) == tuple(g_o[0].shape):
            checks.append(_tagged(compare_exact("sink-only rows: dq == 0", dq[empty],
                                                torch.zeros_like(dq[empty])), "sink_only"))
            if j.maps is not None:
                with j.comparing():
                    j.maps["dq"] = error_ratio_map(dq, g_o[0], bounds[0]).cpu()
    return checks


def _judge_loss(j: _Judging, st: Stage) -> list:
    """Section 8: loss, per-row KL, teacher and student by error/bound ratio, on the consumed
    ``lse``, compressed selection and scores."""
    v = j.reads(st)
    L = j.oracle(st)
    p = j.prec(st.op)
    LB = j.memo(("bound", st.op, p), lambda: EM.indexer_loss_bound(
        v["q"], v["kv_cmp"], v["sink"], v["lse"], v["cmp_ids"], v["scores"], j.lay, L,
        coeff=j.case.coeff, precision=p), *(v[r] for r in st.reads))
    return [j.numeric(n, getattr(L, n), getattr(LB, n)) for n in st.writes if n in j.got]


def _judge_loss_grad(j: _Judging, st: Stage) -> list:
    """Section 8: the indexer gradients by error/bound ratio, on the consumed teacher and
    student."""
    v = j.reads(st)
    g_o = _fields(st.op, j.oracle(st), 3)
    p = j.prec(st.op)
    g_b = j.memo(("bound", st.op, p), lambda: EM.indexer_loss_grad_bound(
        v["q_idx"], v["k_idx"], v["weights"], v["cmp_ids"], v["target"], v["predict"], *g_o,
        coeff=j.case.coeff, num_real=j.lay.num_real, precision=p), *(v[r] for r in st.reads))
    return [j.numeric(n, e, b) for n, e, b in zip(st.writes, g_o, g_b) if n in j.got]


STAGES = (
    Stage("indexer_scores", "7", ("q_idx", "k_idx", "weights"), ("scores",), (torch.float32,),
          _indexer,
          lambda c, lay, v: ((v["q_idx"], v["k_idx"], v["weights"], lay, c.ratio), {}),
          _judge_scores),
    Stage("stable_topk", "4", ("scores",), ("cmp_ids", "cmp_lengths"),
          (torch.int32, torch.int32), _csa,
          lambda c, lay, v: ((v["scores"], c.topk), dict(order=c.order)),
          _judge_topk),
    Stage("build_csa_indices", "5", ("cmp_ids",), ("ids", "lengths"), (torch.int32, torch.int32),
          lambda c: c.is_layer,
          lambda c, lay, v: ((lay,), dict(window=c.window, ratio=c.ratio,
                                          compressed_ids=v["cmp_ids"])),
          _judge_rows),
    Stage("sparse_attention_forward", "6", ("q", "kv", "ids", "sink", "att_lengths"),
          ("out", "lse"), (IO, torch.float32), lambda c: True,
          lambda c, lay, v: ((v["q"], v["kv"], v["ids"], v["sink"]),
                             dict(v_dim=c.v_dim, lengths=v["att_lengths"])),
          _judge_forward),
    Stage("sparse_attention_backward", "6",
          ("q", "kv", "ids", "sink", "out", "lse", "dout", "att_lengths"), _GRADS,
          (IO, IO, torch.float32), lambda c: True,
          lambda c, lay, v: ((v["q"], v["kv"], v["ids"], v["sink"], v["out"], v["lse"],
                              v["dout"]), dict(v_dim=c.v_dim, lengths=v["att_lengths"])),
          _judge_backward),
    Stage("sparse_indexer_loss", "8", ("q", "kv_cmp", "sink", "lse", "cmp_ids", "scores"),
          ("loss", "kl", "target", "predict"),
          (torch.float32, torch.float32, torch.float32, torch.float32), _loss,
          lambda c, lay, v: ((v["q"], v["kv_cmp"], v["sink"], v["lse"], v["cmp_ids"],
                              v["scores"], lay), dict(coeff=c.coeff)),
          _judge_loss),
    Stage("sparse_indexer_loss_grad", "8",
          ("q_idx", "k_idx", "weights", "cmp_ids", "target", "predict"),
          ("dq_idx", "dw", "dk_idx"), (IO, IO, IO), lambda c: _indexer(c) and _loss(c),
          lambda c, lay, v: ((v["q_idx"], v["k_idx"], v["weights"], v["cmp_ids"], v["target"],
                              v["predict"]), dict(coeff=c.coeff, num_real=lay.num_real)),
          _judge_loss_grad),
)
_PRODUCER = {w: s for s in STAGES for w in s.writes}
_STAGE = {s.op: s for s in STAGES}


def applies(op: str, case) -> bool:
    """Whether the stage ``op`` of :data:`STAGES` exists for ``case`` (e.g. ``"indexer_scores"``:
    the case has an indexer; ``"stable_topk"``: a compressed selection). The one copy of these
    predicates; raises ``ValueError`` for an op that is not a stage."""
    if op not in _STAGE:
        raise ValueError(f"op must be one of {tuple(_STAGE)}, got {op!r}")
    return bool(_STAGE[op].applies(case))


def oracle_stage(case, stage: Stage, x: dict, done: dict) -> dict:
    """The oracle's outputs of one stage, name -> tensor (the stage's ``writes``), on what it
    reads: the outputs of earlier stages in ``done``, else the case's inputs ``x`` (see
    :func:`_read`). float64/int64 as ``reference`` returns them, unrounded."""
    v = {r: _read(case, r, x, done) for r in stage.reads}
    args, kw = stage.call(case, case.layout(), v)
    res = _fields(stage.op, getattr(R, stage.op)(*args, **kw), len(stage.writes))
    return dict(zip(stage.writes, res))


def oracle_outputs(case, x: dict, *, backward: bool = True) -> dict:
    """Every stage of :data:`STAGES` that applies to ``case``, in order, evaluated by the oracle
    on the inputs ``x`` and its own earlier outputs (no adapter, nothing rounded): a dict named
    as the stages' ``writes`` (``scores``, ``cmp_ids``, ``cmp_lengths``, ``ids``, ``lengths``,
    ``out``, ``lse``, ``dq``, ``dkv``, ``dsink``, ``loss``, ``kl``, ``target``, ``predict``,
    ``dq_idx``, ``dw``, ``dk_idx``; those of the stages that apply). ``backward=False`` skips
    :data:`BACKWARD_OPS`."""
    done: dict = {}
    for st in STAGES:
        if st.applies(case) and (backward or st.op not in BACKWARD_OPS):
            done.update(oracle_stage(case, st, x, done))
    return done

# the quantities each stage's checks carry, for "not judged" rows
_CHECKED = {"indexer_scores": (("scores", "numeric"),),
            "stable_topk": (("cmp_ids", "topk"),),
            "build_csa_indices": (("ids", "exact"), ("lengths", "exact")),
            "sparse_attention_forward": (("out", "numeric"), ("lse", "numeric")),
            "sparse_attention_backward": (("dq", "numeric"), ("dkv", "numeric"),
                                          ("dsink", "numeric")),
            "sparse_indexer_loss": (("loss", "numeric"), ("kl", "numeric"),
                                    ("target", "numeric"), ("predict", "numeric")),
            "sparse_indexer_loss_grad": (("dq_idx", "numeric"), ("dw", "numeric"),
                                         ("dk_idx", "numeric"))}


LOSS_DETACHED = ("loss_dq", "loss_dkv", "loss_dsink")


def _judge_loss_detached(got: dict) -> list:
    """Section 8: the gradients of the indexer loss alone wrt ``q``, ``kv`` and the sink (the
    packed layer's, :func:`run_layer`) are exact zeros: the teacher is detached."""
    return [_tagged(compare_exact(f"loss alone: {n[5:]} == 0", got[n].detach().to("cpu"),
                                  torch.zeros(got[n].shape, dtype=got[n].dtype)),
                    "loss_detached") for n in LOSS_DETACHED if n in got]


def _not_judged_stage(j: _Judging, st: Stage, reason: str) -> list:
    return [_tagged(not_judged(q, kind, reason), q, blocked=True) for q, kind in _CHECKED[st.op]
            if q in j.got]


def _judge_stage(j: _Judging, st: Stage, pinned: str | None) -> list:
    """One stage's checks, or its "not judged" rows when it reads an output the oracle cannot
    consume (that output's own check failed on its non-finite pattern or shape)."""
    reads = [_QUANTITY_OF.get(r, r) for r in st.reads]
    blocked = [r for r in reads if r in j.blocked]
    if blocked:
        r = blocked[0]
        return _not_judged_stage(j, st, f"it consumed {r}, which the oracle cannot take as an "
                                        f"input ({j.blocked[r]})")
    try:
        if st.op == "sparse_attention_backward":
            return _judge_backward(j, st, pinned)
        return st.judge(j, st)
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        failed_up = [r for r in reads if r in j.failed]
        if failed_up:
            return _not_judged_stage(j, st, f"the oracle rejects the consumed {failed_up[0]}, "
                                            f"which failed its own check ({exc})")
        q = next((q for q, _ in _CHECKED[st.op] if q in j.got), st.writes[0])
        return [_tagged(CheckResult(f"judge: {st.op}", "error", False, None, None,
                                    f"the oracle cannot evaluate {st.op} on the inputs it "
                                    f"consumed: {type(exc).__name__}: {exc}"), q)]


def judge(case, x: dict, got: dict, *, precision, consumed: dict | None = None,
          cache: dict | None = None, maps: dict | None = None,
          convention: str | None = None, oracle_device=None) -> list[CheckResult]:
    """Every check of ``got`` against the oracle on the consumed inputs (section 12).

    ``x``: the case's inputs as the implementation received them; ``got``: its outputs (only
    the quantities present are judged); ``consumed``: what each op was fed (defaults to
    ``got``; intermediates missing from both come from ``x`` or the oracle, unrounded);
    ``precision``: the implementation's working precision for the error model, one
    :class:`~reference.error_model.Precision` or a mapping op -> ``Precision`` (or op ->
    callable ``dtype -> Precision``). ``convention``: judge the attention backward under this
    convention only (``"given"`` or ``"recomputed"``; default: ``consumed["backward_convention"]``
    when the adapter pins one, else both). ``cache`` (a dict, per case) memoises oracle
    evaluations on identical consumed inputs (op and layer levels of one case). ``maps``, when a
    dict, receives per ``(row, head)`` error/bound maps of ``out``, ``lse``, ``dq`` and the row
    flags ``padding`` and ``sink_only`` (for the report's heat map). ``oracle_device`` (default:
    the CPU, the oracle's definition) runs the memoised oracle and error-model evaluations on
    that device (``reference._checks.compute_on``); their results come back to the CPU.

    Stages are judged in pipeline order; a stage that reads an output whose own check found it
    unusable (non-finite pattern or shape) reports its checks as not judged.
    """
    if not isinstance(precision, (EM.Precision, Mapping)):
        raise TypeError(f"precision must be a reference.error_model.Precision or a mapping op -> "
                        f"Precision, got {type(precision).__name__}")
    con = dict(got if consumed is None else consumed)
    declared = con.pop("backward_convention", None)
    not_run = con.pop("not_run", {})
    pinned = convention if convention is not None else declared
    if pinned is not None and pinned not in BACKWARD_CONVENTIONS:
        raise ValueError(f"convention must be one of {BACKWARD_CONVENTIONS} or None, got "
                         f"{pinned!r}")
    j = _Judging(case, x, got, con, precision, cache, maps, oracle_device)
    stages = [st for st in STAGES if st.applies(case) and any(w in got for w in st.writes)]
    for st in stages:                    # a usage error, not a verdict: raise before judging
        j.prec(st.op)
    v: list[CheckResult] = []
    for st in stages:
        for c in _judge_stage(j, st, pinned):
            q = c.extra.get("quantity")
            if not c.passed:
                j.failed.add(q)
            if _unusable(c):
                j.blocked.setdefault(q, c.detail)
            elif c.extra.get("blocked"):
                j.blocked.setdefault(q, c.extra["not_judged"])
            v.append(c)
    v += _judge_loss_detached(got)
    for st in STAGES:
        if st.op in not_run:
            v += [_tagged(not_judged(q, kind, f"{st.op} did not run: {not_run[st.op]}"), q)
                  for q, kind in _CHECKED[st.op]]
    if maps is not None:
        maps["padding"] = ~j.lay.is_real
        try:
            maps["sink_only"] = _sink_only_rows(j)
        except (ValueError, TypeError, IndexError, RuntimeError):
            pass                         # the ids are unusable: their failure is reported
    return v
