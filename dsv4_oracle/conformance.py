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
from dsv4_oracle.reference.contract_policies import DEFAULT_POLICIES, resolve_policies
from dsv4_oracle.reference._checks import as_device, compute_on, to_cpu
from dsv4_oracle.reference.attention import AttentionGradSums

from .adapters import Adapter
from .hints import (AXES, PRECISION_VARIANTS, SINK_VARIANTS, concentration_hint,
                    looser_precision, nonfinite_pattern, what_is_wrong)
from .invoke import OpError, call_op, text
from .outputs import unusable
from .compare import (CheckResult, NumericComparison, compare_exact, compare_numeric,
                      compare_topk, content_hash, error_ratios, near_tie_rows, not_judged,
                      row_chunks)

__all__ = ["QUANTITIES", "FORWARD_OUTPUTS", "BACKWARD_OPS", "BACKWARD_CONVENTIONS", "STAGES",
           "Stage", "Run", "OpError", "applies", "oracle_stage", "oracle_outputs", "run_ops",
           "run_layer", "layer_applies", "judge", "tensors_of", "error_ratio_map",
           "concentration_hint", "not_applicable"]

F64 = torch.float64

# quantity -> (contract section, what it is); the report's rows, in pipeline order
QUANTITIES = {
    "kv_cmp": ("15", "compressed keys [C, D] from the compressor"),
    "k_idx": ("14, 15", "indexer keys [C, D_I] from the indexer's compressor"),
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
    "d_cmp_kv": ("15", "gradient wrt the compressor's kv projection"),
    "d_cmp_score": ("15", "gradient wrt the compressor's gate scores"),
    "d_cmp_ape": ("15", "gradient wrt the compressor's ape"),
    "d_cmp_norm": ("15", "gradient wrt the compressor's RMSNorm weight"),
    "loss": ("8", "indexer KL loss"),
    "kl": ("8", "per-row KL"),
    "target": ("8", "teacher distribution"),
    "predict": ("8", "student distribution"),
    "dq_idx": ("8", "gradient wrt q_idx"),
    "dw": ("8", "gradient wrt the indexer weights"),
    "dk_idx": ("8", "gradient wrt k_idx"),
    "d_idx_kv": ("15", "gradient wrt the indexer compressor's kv projection"),
    "d_idx_score": ("15", "gradient wrt the indexer compressor's gate scores"),
    "d_idx_ape": ("15", "gradient wrt the indexer compressor's ape"),
    "d_idx_norm": ("15", "gradient wrt the indexer compressor's RMSNorm weight"),
    "loss_detached": ("8", "the indexer loss alone backpropagates exact zeros to q, kv, sink"),
    "convention": ("6", "the backward's Delta convention: as declared (measured by a probe)"),
    "rejects": ("4, 6, 8", "inputs the contract says an op must refuse raise the named error"),
    "replays": ("11", "bitwise identical replays"),
    "grad_modes": ("11", "identical bits in no_grad / inference_mode / grad-enabled"),
    "no_mutation": ("11", "no input modified"),
    "outputs_stable": ("11", "returned tensors keep their bits after they are returned"),
    "run": ("-", "the implementation ran without raising"),
}

# the outputs of the forward pipeline (what section 11's grad-mode parity compares)
FORWARD_OUTPUTS = ("scores", "cmp_ids", "cmp_lengths", "ids", "lengths", "out", "lse", "loss",
                   "kl", "target", "predict", "kv_cmp", "k_idx")
BACKWARD_OPS = ("sparse_attention_backward", "sparse_indexer_loss_grad", "compressor_backward",
                "indexer_compressor_backward")
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
    ``policy_kw``: ``(case, policies) -> kwargs`` the oracle (and its bound) takes on top of
    ``call`` under the policies of section 5.2. ``told``: ``(case, policies) -> kwargs`` the
    adapter's op is told on top of ``call`` under them (what an implementation cannot know
    from its arguments: which rows count, under a per-row loss normaliser).
    """

    op: str
    section: str
    reads: tuple
    writes: tuple
    stored: tuple
    applies: Callable
    call: Callable
    judge: Callable
    policy_kw: Callable = lambda case, pol: {}
    told: Callable = lambda case, pol: {}


def _csa(case) -> bool:
    """The case has an indexer stage (a CSA layer, or DeepSeek-V3.2 DSA)."""
    return case.is_layer and case.has_indexer


def _indexer(case) -> bool:
    return _csa(case) and case.scores == "indexer"


def _loss(case) -> bool:
    return _csa(case) and case.layout().num_real > 0


# which quantity's checks vouch for a read (cmp_lengths is judged with cmp_ids)
_QUANTITY_OF = {"cmp_lengths": "cmp_ids", "att_lengths": "lengths", "loss_ids": "cmp_ids",
                "loss_lse": "lse", "teacher_ids": "cmp_ids", "kv": "kv_cmp", "dkv_cmp": "dkv"}
# the indexer loss's key set and normaliser (section 8): the Top-K selection and the
# attention's lse under the sparse teacher; under the dense teacher (section 5.2) every visible
# compressed key and each head's log-sum-exp over them. The loss op is handed the selection
# and the lse either way (a dense teacher finds its keys and normalisers itself: handed the
# dense ones, a sparse implementation would pass); the oracle reads the policy's, and the
# gradient op is handed the key set its target and predict are laid out on ("teacher_ids").
_LOSS_READS = {"loss_ids": "cmp_ids", "loss_lse": "lse", "teacher_ids": "cmp_ids"}
_HANDED = ("loss_ids", "loss_lse")


def oracle_layout(case, policies=None):
    """The layout the oracle evaluates ``case`` on: the case's own, or under the policy
    ``padding_rows="attend"`` (section 5.2) the same with every padding row real."""
    lay = case.layout()
    pol = DEFAULT_POLICIES if policies is None else policies
    return lay.padding_as_real() if pol["padding_rows"] == "attend" else lay


def not_applicable(case, policies=None) -> str | None:
    """Why ``case`` cannot be judged under ``policies`` (section 5.2), or ``None``. A layer
    case whose NaN poison (key rows that no real row selects, section 6) lies in documents with
    padding rows does not apply under ``padding_rows="attend"``: those padding rows then see
    the poisoned keys, and the oracle's outputs there are NaN."""
    pol = resolve_policies(policies)
    if pol["padding_rows"] == "attend" and case.poison and case.is_layer:
        lay = case.layout()
        if int(lay.cu_seqlens_padded[-1]) > lay.num_real:
            return ("its NaN key rows are visible to padding rows under padding_rows=attend "
                    "(the case keeps them unselectable by real rows only)")
    return None


def _dense_read(case, name: str, x: dict, con: dict, produced, pol):
    """``loss_ids`` / ``loss_lse`` under the dense teacher (section 5.2): every compressed key
    visible to a row (``[T, C]``, slot ``c`` = id ``c``), and each head's log-sum-exp over them
    (the oracle's, float64, rounded to float32 as a kernel stores statistics)."""
    ids = oracle_layout(case, pol).visible_compressed_ids(case.ratio)
    if name in ("loss_ids", "teacher_ids"):
        return ids
    q, kc, sink = (_read(case, r, x, con, produced, pol) for r in ("q", "kv_cmp", "sink"))
    q, kc, sink = (t.detach().to("cpu") for t in (q, kc, sink))
    _, lse = R.sparse_attention_forward(q, kc, ids, sink, scale=case.scale)
    return lse.to(torch.float32)


def _read(case, name: str, x: dict, con: dict, produced: Callable | None = None,
          pol: dict | None = None, oracle: bool = True):
    """The value a stage reads under ``name``: what the pipeline consumed (``con``), else the
    oracle's output for a name an applicable stage produces (``produced``), else the case's
    inputs (``index_scores`` for a layer case with given scores; ``None`` for the compressed
    selection of a layer without one). ``loss_ids`` / ``loss_lse`` / ``teacher_ids``: the
    indexer loss's key set and normaliser under the teacher policy of ``pol`` (default: the
    contract's); ``oracle=False``: what the adapter's loss op is handed (:data:`_HANDED`)."""
    if name in _LOSS_READS:
        dense = pol is not None and pol["teacher"] == "dense"
        if dense and (oracle or name not in _HANDED):
            return _dense_read(case, name, x, con, produced, pol)
        return _read(case, _LOSS_READS[name], x, con, produced, pol)
    if name == "att_lengths":
        if not case.is_layer:
            return x.get("lengths")
        return _read(case, "lengths", x, con, produced, pol) if case.lengths == "layer" \
            else None
    if name in _DERIVED and _compressed(case):
        return _DERIVED[name](case, lambda n: _read(case, n, x, con, produced, pol))
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


def _compressed(case) -> bool:
    """``kv_cmp`` (and ``k_idx``) come from the compressor stages (section 15)."""
    return bool(getattr(case, "compressor", False)) and case.is_layer


def _key_buffer(kv_raw: torch.Tensor, kv_cmp: torch.Tensor) -> torch.Tensor:
    """``[kv_raw; kv_cmp]`` in the raw rows' dtype, on the device ``kv_cmp`` was produced on
    (the oracle's compute device, or the implementation's)."""
    return torch.cat([kv_raw.to(kv_cmp.device), kv_cmp.to(kv_raw.dtype)])


# reads derived from other reads when the compressed keys come from the compressor: the
# attention's key buffer (raw rows, then the compressor's kv_cmp in the raw rows' dtype) and
# the compressor backward's upstream (the compressed rows of the attention's dkv)
_DERIVED = {
    "kv": lambda case, r: _key_buffer(r("kv_raw"), r("kv_cmp")),
    "dkv_cmp": lambda case, r: r("dkv")[case.T:],
}
_DERIVED_FROM = {"kv": ("kv_raw", "kv_cmp"), "dkv_cmp": ("dkv",)}


def _needs(case, name: str) -> tuple:
    """The names a stage's read ``name`` takes from earlier stages or the inputs."""
    if name == "att_lengths":
        return ("lengths",)
    if name in _DERIVED_FROM and _compressed(case):
        return _DERIVED_FROM[name]
    return (name,)


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


def run_ops(adapter: Adapter, case, x: dict, *, ops=None, backward: bool = True,
            policies=None, probe: bool = False) -> Run:
    """The op-level pipeline of ``case`` on the inputs ``x`` (on ``adapter.device``).

    ``ops``: restrict to these op names (default: every op the adapter provides);
    ``backward=False`` skips the gradient ops (the forward of section 11's grad-mode parity).
    ``probe``: also call the attention backward once more with an ``out`` moved by ``dout``
    (:func:`convention_probe`), so that :func:`judge` can measure its section 6 convention.
    A stage runs when the adapter provides it, or (as the oracle, rounded per
    :attr:`Stage.stored`, under ``policies``: the policies of section 5.2 the adapter follows)
    when a later stage that runs reads one of its outputs.

    An op that fails (raises, exits, writes into an argument, or returns something unusable:
    :mod:`dsv4_oracle.outputs`) is recorded in ``Run.failed`` and stood in for exactly like an
    op the adapter lacks; every later stage still runs and is judged, and so are the failed
    op's usable outputs where they are judged one by one (not a joint stage's, ``_JOINT``).
    Only an op that overruns its time limit raises :class:`OpError` (the implementation may
    still be running).
    """
    dev = adapter.device
    lay = case.layout()
    pol = resolve_policies(policies)
    olay = oracle_layout(case, pol)
    stages = [s for s in STAGES if s.applies(case) and (backward or s.op not in BACKWARD_OPS)]
    use = {s.op: adapter.has(s.op) and (ops is None or s.op in ops) for s in stages}
    needs = lambda s: {n for r in s.reads for n in _needs(case, _LOSS_READS.get(r, r))}  # noqa: E731
    wanted: set = set()
    runs = []
    for s in reversed(stages):
        if use[s.op] or wanted & set(s.writes):
            runs.append(s)
            wanted |= needs(s)
    got: dict = {}
    con: dict = {}
    backends: dict = {}
    failed: dict = {}
    order = runs[::-1]
    for i, s in enumerate(order):
        v = {r: _read(case, r, x, con, pol=pol) for r in s.reads}
        if use[s.op]:
            # the adapter reads what it is handed (the loss: the Top-K selection and the
            # attention's lse, whatever its teacher); the oracle reads under the policies
            va = {r: _read(case, r, x, con, pol=pol, oracle=False) if r in _HANDED else v[r]
                  for r in s.reads}
            args, kw = s.call(case, lay, _moved(va, dev))
            kw.update(_moved(s.told(case, pol), dev))
            try:
                named = _call(adapter, backends, s, args, kw)
            except OpError as exc:
                if exc.kind == "timeout":
                    raise
                failed[s.op] = exc
            else:
                error, usable = _unusable_outputs(s, case, olay, v, named)
                got.update(usable)              # judged, even when another output is not
                if error is None:
                    con.update(named)
                    continue
                failed[s.op] = error
            if not any(set(s.writes) & needs(t) for t in order[i + 1:]):
                continue                 # nothing later reads what the failed op made
        args, kw = s.call(case, olay, _moved(v, "cpu"))
        kw.update(s.policy_kw(case, pol))
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
        if probe and "dq" in got:
            try:
                con[PROBE] = convention_probe(adapter, case, x, con, pol)
            except OpError as exc:       # no probe: the judge falls back on the nearer one
                if exc.kind == "timeout":
                    raise
    return Run(got, con, backends, failed)


PROBE = "convention_probe"


def convention_probe(adapter: Adapter, case, x: dict, con: dict, pol: dict) -> dict:
    """Section 6: the attention backward called on the inputs it consumed, but with
    ``out' = out + dout`` (rounded to ``out``'s dtype): ``Delta`` moves by ``|dout|^2`` per row
    and head, far outside any rounding. A backward that forms ``Delta`` from the ``out`` it is
    handed ("given") follows it; one that recomputes its forward ("recomputed") does not.
    Returns ``{"out": out', "dq", "dkv", "dsink"}`` (what the backward returned)."""
    st = _STAGE["sparse_attention_backward"]
    v = {r: _read(case, r, x, con, pol=pol) for r in st.reads}
    moved = (v["out"].detach().to(torch.float32) + v["dout"].detach().to(torch.float32))
    v["out"] = moved.to(v["out"].dtype)
    args, kw = st.call(case, case.layout(), _moved(v, adapter.device))
    return {"out": v["out"], **_call(adapter, {}, st, args, kw)}


LAYER_LEAVES = ("q", "kv_raw", "kv_cmp", "sink", "q_idx", "k_idx", "weights")


def _layer_compressor(adapter: Adapter, case, x: dict):
    """How the packed layer of a case whose compressed keys come from the compressor (section
    15) is run: ``(raw leaves, inputs, stand-ins)``. A ``csa_layer`` that names the keyword
    ``compressor`` takes the raw inputs (their names are leaves); any other gets ``kv_cmp`` and
    ``k_idx`` as inputs, the oracle's compressor outputs stored in the case's dtype (the
    stand-ins, recorded as consumed)."""
    if not _compressed(case):
        return (), x, {}
    import inspect
    try:
        takes_raw = "compressor" in inspect.signature(adapter.op("csa_layer")).parameters
    except (TypeError, ValueError):
        takes_raw = False
    if takes_raw:
        return _CMP_IN + (_IDX_IN if case.has_indexer else ()), x, {}
    done: dict = {}
    for st in STAGES[:2]:
        if st.applies(case):
            done.update(oracle_stage(case, st, {k: v.to("cpu") for k, v in x.items()}, done))
    standins = {k: v.to(case.torch_dtype).to(x["q"].device) for k, v in done.items()}
    return (), dict(x, **standins), standins


def layer_applies(case) -> bool:
    """The packed layer runs on layer cases whose indexer scores it computes itself."""
    return case.is_layer and case.scores == "indexer"


def run_layer(adapter: Adapter, case, x: dict, *, backward: bool = True) -> Run:
    """The packed layer of ``case``: ``adapter.csa_layer`` forward on leaf copies of the inputs
    and, with ``backward``, autograd backward of ``out`` (upstream ``x["dout"]``) and of the
    indexer loss (upstream 1). A leaf that autograd gives no gradient gets zeros (no flow).
    Before that, the loss alone is backpropagated to ``q``, ``kv`` and the sink (contract
    section 8: the teacher is detached, so these are exact zeros): ``got["loss_dq"]``,
    ``["loss_dkv"]``, ``["loss_dsink"]``. A compressor case (sections 13-15) hands a layer
    that takes them the raw compressor inputs (:func:`_layer_compressor`).

    The forward's outputs are copied (and checked, :mod:`dsv4_oracle.outputs`) when the forward
    returns, before the backward runs: they are judged as the caller saw them. An output that
    is unusable is left out (with the other output of a joint stage: ``_JOINT``), recorded in
    ``Run.failed`` under that stage's op, and a backward that fails leaves out the gradients
    (key ``"csa_layer backward"``); the rest is still judged. A forward that fails raises
    :class:`OpError`."""
    op = "csa_layer"
    lay = case.layout()
    train = backward and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    raw, x, standins = _layer_compressor(adapter, case, x)
    leaf = {k: x[k].detach().clone().requires_grad_(train) for k in LAYER_LEAVES + raw
            if k in x and not (k == "kv_cmp" and case.ratio == 0)
            and not (k in ("q_idx", "k_idx", "weights") and not case.has_indexer)}
    kw = _scaled(case, dict(window=case.window, ratio=case.ratio, v_dim=case.v_dim,
                            coeff=case.coeff, order=case.order))
    if case.ratio and not raw:
        kw["kv_cmp"] = leaf["kv_cmp"]
    if case.has_indexer:
        kw.update(q_idx=leaf["q_idx"], weights=leaf["weights"], topk=case.topk)
        if not raw:
            kw["k_idx"] = leaf["k_idx"]
    if raw:                              # sections 13-15: the layer from raw tokens
        kw.update(compressor=R.CompressorInputs(*(leaf[k] for k in _CMP_IN)), rope=case.rope())
        if case.has_indexer:
            kw["index_compressor"] = R.CompressorInputs(*(leaf[k] for k in _IDX_IN))
    attention_leaves = [k for k in ("q", "kv_raw", "kv_cmp", "sink") + _CMP_IN if k in leaf]
    box: dict = {}

    def forward_result(res):
        box["res"] = res
        for k in ("kv_cmp", "k_idx") if raw else ():
            t = getattr(res, k, None)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.retain_grad()          # its gradient is the compressor backward's upstream
        b = getattr(res, "backends", None)
        box["backends"] = ({text(k): text(v) for k, v in b.items()} if isinstance(b, dict)
                           else {op: adapter.name})
        try:
            named = dict(out=res.out, lse=res.lse, ids=res.ids, lengths=res.lengths)
            if raw:
                named["kv_cmp"] = res.kv_cmp
                if case.has_indexer:
                    named["k_idx"] = res.k_idx
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
    seen = dict(standins)
    for st in STAGES:                    # each output checked as the op-level output would be
        outs = {w: fwd[w] for w in st.writes if w in fwd}
        if not outs or not st.applies(case):
            continue
        error, usable = _unusable_outputs(st, case, lay,
                                          {r: _read(case, r, x, seen) for r in st.reads}, outs)
        got.update(usable)
        seen.update(usable)
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
            res = box["res"]
            g = lambda k: (leaf[k].grad if leaf[k].grad is not None  # noqa: E731
                           else torch.zeros_like(leaf[k]))
            kg = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
            named = {"dq": g("q"), "dsink": g("sink")}
            if raw:
                named["dkv"] = torch.cat([g("kv_raw"), kg(res.kv_cmp)])
                named.update({n: g(k) for n, k in zip(("d_cmp_kv", "d_cmp_score", "d_cmp_ape",
                                                       "d_cmp_norm"), _CMP_IN)})
            else:
                named["dkv"] = torch.cat([g("kv_raw")] + ([g("kv_cmp")] if case.ratio else []))
            if case.has_indexer and "loss" in fwd:
                named.update(dq_idx=g("q_idx"), dw=g("weights"),
                             dk_idx=kg(res.k_idx) if raw else g("k_idx"))
                if raw:
                    named.update({n: g(k) for n, k in zip(("d_idx_kv", "d_idx_score",
                                                           "d_idx_ape", "d_idx_norm"),
                                                          _IDX_IN)})
            if loss_only:
                z = lambda k: (loss_only[k] if loss_only[k] is not None  # noqa: E731
                               else torch.zeros_like(leaf[k]))
                named.update(loss_dq=z("q"), loss_dsink=z("sink"), loss_dkv=torch.cat(
                    [z("kv_raw").reshape(-1)] + [z(k).reshape(-1) for k in ("kv_cmp",) + _CMP_IN
                                                 if k in loss_only]))
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
    con = dict(got, **standins)
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


def _kw_key(kw: dict) -> tuple:
    """A hashable memo key of the policies' oracle arguments (per-row divisors by value)."""
    return tuple(sorted((k, tuple(v.reshape(-1).tolist()) if isinstance(v, torch.Tensor) else v)
                        for k, v in kw.items()))


STREAM_BYTES = 1 << 28          # float64 bytes of one block's [rows, H, D] tensor
WHOLE_BYTES = 1 << 33           # a failed stream is re-judged whole up to these float64 bytes


class Streaming(NamedTuple):
    """How the judge evaluates the indexer scores, their Top-K and the attention stages
    (contract sections 4, 6 and 7) at large ``T``.

    The scores, the forward's ``out``/``lse`` and the backward's ``dq`` are per row; ``dkv``
    and ``dsink`` are sums over rows. A case whose rows exceed one block is judged block of
    rows by block of rows on the oracle device: per block the oracle, its bound and the
    comparison
    (:class:`compare.NumericComparison`), then the block is dropped; the key-side gradients and
    their bounds are folded in row order (``AttentionGradSums``, ``AttentionBoundSums``). Never
    a float64 ``[T, H, D]`` tensor of the whole case; every field of every check is the one of
    the whole-tensor judge (``oracle_tests/conformance/test_streaming.py``): a row's oracle
    bits do not depend on the rows evaluated with it, the folds are left folds in row order,
    and blocks are whole numbers of the bounds' own row chunks. A stage whose streamed checks
    fail is re-judged whole (for the hints that need whole tensors) when that fits
    ``WHOLE_BYTES``.

    ``block_rows``: rows per block (for attention rounded up to a whole number of the bounds'
    chunks, for the scores moved onto each document's chunk grid; default: ``STREAM_BYTES`` of
    float64 ``[rows, H, D]``, or ``[rows, C]`` for the scores); ``bound_rows``: the bounds' rows
    per chunk (default: theirs); ``enabled=False``: always whole."""

    block_rows: int | None = None
    bound_rows: int | None = None
    enabled: bool = True


def _blocks(j: "_Judging", st: Stage):
    """The row blocks (slices) in which ``st``, an attention stage, is judged, or ``None``:
    judged whole (one block would hold every row, streaming is off, or a power table records
    the whole expected tensors)."""
    if j.whole or j.record is not None or not j.streaming.enabled:
        return None
    q, ids = j.read("q"), j.read("ids")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(ids, torch.Tensor) \
            or ids.dim() != 2:
        return None
    T, H, D = q.shape
    width, br = ids.shape[1], j.streaming.bound_rows
    unit = math.lcm(EM.forward_bound_rows(q.shape, width, br),
                    EM.backward_bound_rows(q.shape, width, br))
    want = j.streaming.block_rows
    if want is None:
        want = STREAM_BYTES // max(1, 8 * H * max(D, j.case.v_dim or D))
    rows = unit * max(1, -(-want // unit))
    if rows >= T:
        return None
    return [slice(r0, min(r0 + rows, T)) for r0 in range(0, T, rows)]


def _oracle_lse(j: "_Judging") -> torch.Tensor:
    """The oracle's forward ``lse`` on the forward stage's consumed inputs (CPU): from the
    memoised forward when judged whole, else block by block (each block's ``out`` dropped)."""
    st = _PRODUCER["lse"]
    blocks = _blocks(j, st)
    if blocks is None:
        return j.oracle(st)[1]
    v = j.reads(st)
    kw = dict(v_dim=j.case.v_dim, scale=j.case.scale)

    def lse():
        return torch.cat([R.sparse_attention_forward(
            v["q"][r], v["kv"], v["ids"][r], v["sink"], lengths=None if v["att_lengths"] is None
            else v["att_lengths"][r], **kw)[1] for r in blocks])
    return j.memo(("oracle lse", _kw_key(j.kw(st))), lse, *(v[r] for r in st.reads))


def _forward_streamed(j: "_Judging", st: Stage, blocks) -> list:
    """:func:`_judge_forward` block by block (:class:`Streaming`)."""
    v = j.reads(st)
    T, H, _ = v["q"].shape
    dv = j.case.v_dim or v["q"].shape[2]
    shapes = {"out": (T, H, dv), "lse": (T, H)}
    cmp = {n: NumericComparison(n, j.got[n], shapes[n]) for n in ("out", "lse") if n in j.got}
    p, kw, br = j.prec(st.op), dict(v_dim=j.case.v_dim, scale=j.case.scale), j.streaming.bound_rows
    maps = {n: [] for n in cmp}
    with j.comparing():
        for r in blocks:
            b = _block_of(v, r)
            o = R.sparse_attention_forward(b["q"], b["kv"], b["ids"], b["sink"],
                                           lengths=b["att_lengths"], **kw)
            bound = EM.attention_forward_bound(b["q"], b["kv"], b["ids"], b["sink"], *o,
                                               precision=p, lengths=b["att_lengths"],
                                               chunk_rows=br, **kw)
            for n, e, bd in zip(("out", "lse"), o, bound):
                if n in cmp:
                    cmp[n].add(r, e, bd)
                    if j.maps is not None and cmp[n].same_shape:
                        maps[n].append(error_ratio_map(j.got[n][r], e, bd).cpu())
    checks = [_tagged(cmp[n].result(), n) for n in ("out", "lse") if n in cmp]
    return checks + _sink_only_forward(j, _oracle_lse(j), shapes,
                                       lambda name, g: torch.cat(maps[name]))


class _Judging:
    """The state of judging one run: the consumed inputs (CPU), the oracle's results memoised
    on the content hash of what they read, the precision per op, and the outputs found
    unusable so far (name -> reason)."""

    def __init__(self, case, x, got, con, precision, cache, maps, oracle_device=None,
                 policies=None, streaming=None):
        self.case, self.lay = case, case.layout()
        self.streaming = Streaming() if streaming is None else streaming
        self.whole = False              # set while a stage is re-judged whole (its hints)
        self.pol = resolve_policies(policies)
        self.pol_key = tuple(sorted(self.pol.items()))
        self.olay = oracle_layout(case, self.pol)
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
        self.probe: dict | None = None
        self.record: dict | None = None

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
        """``fn()``, memoised in ``cache`` on ``name``, the content of ``parts`` and the
        policies (the layout a padding policy gives, a teacher's key set: a cache shared by
        judgings under other policies never hands one the other's results)."""
        if self.cache is None:
            return self.on(fn)
        k = (name, self.pol_key) + tuple(self.fingerprint(p) if isinstance(p, torch.Tensor)
                                         else p for p in parts)
        if k not in self.cache:
            self.cache[k] = self.on(fn)
        return self.cache[k]

    def read(self, name: str):
        if name == "loss_lse" and self.pol["teacher"] == "dense":
            return self.memo(("dense lse",), lambda: _read(
                self.case, name, self.x, self.con, self.produced, self.pol),
                *(self.read(r) for r in ("q", "kv_cmp", "sink")))
        v = _read(self.case, name, self.x, self.con, self.produced, self.pol)
        return v.detach().to("cpu") if isinstance(v, torch.Tensor) else v

    def kw(self, st: Stage) -> dict:
        """The oracle's (and its bound's) extra arguments for ``st`` under the policies."""
        return st.policy_kw(self.case, self.pol)

    def produced(self, name: str):
        """The oracle's (float64, unrounded) output ``name`` on its stage's consumed inputs."""
        st = _PRODUCER[name]
        return dict(zip(st.writes, _fields(st.op, self.oracle(st), len(st.writes))))[name]

    def reads(self, st: Stage, **override) -> dict:
        return {r: (override[r] if r in override else self.read(r)) for r in st.reads}

    def oracle(self, st: Stage, **override):
        """``reference.<op>`` on what the stage consumed (``override`` replaces reads), on the
        layout and with the arguments of the declared policies."""
        v = self.reads(st, **override)
        args, kw = st.call(self.case, self.olay, v)
        pkw = self.kw(st)
        kw.update(pkw)
        return self.memo(("oracle", st.op, _kw_key(pkw)), lambda: getattr(R, st.op)(*args, **kw),
                         *(v[r] for r in st.reads))

    def numeric(self, name: str, expected, bound) -> CheckResult:
        """:func:`compare_numeric` of ``got[name]``, plus hints when it fails
        (:mod:`dsv4_oracle.hints`): what the error pattern says is wrong (exactly 0, a flipped
        sign, a constant factor, NaN where the oracle is finite, ...) and where the over-bound
        elements concentrate."""
        actual = self.got[name]
        if self.record is not None:
            self.record[name] = (expected, bound)
        with self.comparing():
            res = compare_numeric(name, actual, expected, bound)
        if res.passed or res.ratio is None or tuple(actual.shape) != tuple(expected.shape):
            return _tagged(res, name)
        hints, extra = [], {}
        with self.comparing():
            if "nonfinite_mismatches" in res.extra:
                a64, e64 = actual.detach().to(F64), expected.detach().to(F64)
                over = (torch.isnan(a64) != torch.isnan(e64)) | (
                    torch.isinf(a64) != torch.isinf(e64)) | (
                    torch.isinf(a64) & torch.isinf(e64) & (a64 != e64))
                wrong = nonfinite_pattern(name, actual, expected)
            else:
                over = error_ratios(actual.detach(), expected, bound) > 1
                wrong = what_is_wrong(name, actual, expected, bound)
            over = over.to("cpu")
        if wrong:
            hints.append(wrong.phrase)
            extra.update(pattern=wrong.key, what_is_wrong=wrong.phrase)
            if wrong.key == "sign":
                extra["hint"] = "sign"
        what = "non-finite mismatches" if "nonfinite_mismatches" in res.extra else None
        where_ = concentration_hint(over, AXES.get(name, ()), self.lay,
                                    **({"what": what} if what else {})) \
            if over.dim() == len(AXES.get(name, ())) else None
        if where_:
            hints.append(where_)
            extra["concentration"] = where_
        if hints:
            extra["hints"] = "".join(f"; {h}" for h in hints)
        detail = res.detail + extra.get("hints", "")
        return _tagged(dataclasses.replace(res, detail=detail, extra={**res.extra, **extra}),
                       name)


def _judge_scores(j: _Judging, st: Stage) -> list:
    """Section 7: the scores against the oracle on the case's indexer inputs."""
    blocks = _score_blocks(j)
    if blocks is None:
        s_o, b = _scores_and_bound(j)
        return [j.numeric("scores", s_o, b)]
    T, C = j.read("q_idx").shape[0], j.read("k_idx").shape[0]
    cmp = NumericComparison("scores", j.got["scores"], (T, C))
    with j.comparing():
        for r, s_o, b in _scores_by_block(j, blocks):
            cmp.add(r, s_o, b)
    return [_tagged(cmp.result(), "scores")]


def _scores_and_bound(j: _Judging) -> tuple:
    """The oracle's indexer scores on the case's inputs and their bound."""
    st = _PRODUCER["scores"]
    v = j.reads(st)
    s_o = j.oracle(st)
    p = j.prec(st.op)
    kw = j.kw(st)
    rows = j.streaming.bound_rows
    b = j.memo(("bound", st.op, p, _kw_key(kw), rows), lambda: EM.indexer_scores_bound(
        v["q_idx"], v["k_idx"], v["weights"], j.olay, j.case.ratio, s_o, precision=p,
        chunk_rows=rows, **kw), v["q_idx"], v["k_idx"], v["weights"])
    return s_o, b


def _score_blocks(j: _Judging):
    """The row blocks (slices) in which the indexer scores are judged, or ``None`` (whole): about
    ``STREAM_BYTES`` of float64 ``[rows, C]`` each, every edge inside a document's real rows on
    the chunk grid of the scores' bound there (:func:`reference.error_model.indexer_bound_rows`),
    so that the blocks' bounds are bitwise the rows of the whole one."""
    if j.whole or j.record is not None or not j.streaming.enabled:
        return None
    q, k = j.read("q_idx"), j.read("k_idx")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not isinstance(k, torch.Tensor):
        return None
    T, HI, C = q.shape[0], q.shape[1], k.shape[0]
    want = j.streaming.block_rows or max(1, STREAM_BYTES // max(1, 8 * C))
    if want >= T:
        return None
    lay, ratio, br = j.olay, j.case.ratio, j.streaming.bound_rows
    cu_pad, cu_comp = lay.cu_seqlens_padded, lay.compressed_offsets(ratio)
    grids = []                                  # (first real row, end of real rows, chunk rows)
    for d in range(lay.num_docs):
        r0, real = int(cu_pad[d]), int(lay.doc_lengths[d])
        groups = int(cu_comp[d + 1]) - int(cu_comp[d])
        if real and groups:
            grids.append((r0, r0 + real, EM.indexer_bound_rows(HI, groups, br)))
    edges, x = [0], 0
    while x < T:
        y = min(x + want, T)
        for r0, r1, step in grids:
            if r0 < y < r1:                     # on the document's chunk grid, past x
                y = r0 + (y - r0) // step * step
                if y <= x:
                    y = min(r0 + ((x - r0) // step + 1) * step, r1)
                break
        edges.append(y)
        x = y
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


def _scores_by_block(j: _Judging, blocks):
    """Per block ``(rows, scores, bound)``: the oracle's scores on the case's indexer inputs and
    their bound, on the oracle device (inside ``j.comparing()``)."""
    st = _PRODUCER["scores"]
    v, p, kw = j.reads(st), j.prec(st.op), j.kw(st)
    args = (v["q_idx"], v["k_idx"], v["weights"], j.olay, j.case.ratio)
    for r in blocks:
        s_o = R.indexer_scores(*args, rows=(r.start, r.stop), **kw)
        yield r, s_o, EM.indexer_scores_bound(*args, s_o, precision=p, rows=(r.start, r.stop),
                                              chunk_rows=j.streaming.bound_rows, **kw)


def _judge_topk(j: _Judging, st: Stage) -> list:
    """Section 4: exact sets, lengths and order policy of the Top-K of the consumed scores
    (under the policy ``topk_ties="any"``, a valid Top-K set of them with exact lengths); and,
    when the implementation computed the scores, the sets of the oracle's own selection with
    near ties (within a few float32 ulps or the scores' bounds) excluded."""
    case, got = j.case, j.got
    t_ids, t_len = j.oracle(st)
    ties = j.pol["topk_ties"]
    out = [_tagged(compare_topk(got["cmp_ids"], got["cmp_lengths"], t_ids, t_len,
                                order=case.order, name="cmp_ids (consumed scores)", ties=ties,
                                scores=j.read("scores") if ties == "any" else None),
                   "cmp_ids")]
    if "scores" in got and case.topk >= 1:
        blocks = _score_blocks(j)
        if blocks is None:
            s_o, b_s = _scores_and_bound(j)
            o_ids, o_len = j.oracle(st, scores=s_o)
            ties = near_tie_rows(s_o, case.topk, bound=b_s)
        else:                            # each row's Top-K and near tie are its own
            parts = []
            with j.comparing():
                for _, s_o, b_s in _scores_by_block(j, blocks):
                    args, kw = st.call(case, j.olay, {"scores": s_o})
                    kw.update(j.kw(st))
                    parts.append(to_cpu(getattr(R, st.op)(*args, **kw))
                                 + (near_tie_rows(s_o, case.topk, bound=b_s),))
            o_ids, o_len, ties = (torch.cat(t) for t in zip(*parts))
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
    return _empty_rows(_oracle_lse(j))


def _judge_forward(j: _Judging, st: Stage) -> list:
    """Section 6 forward: ``out`` and ``lse`` by error/bound ratio; rows with no key exactly
    (``out == 0``, ``lse == +inf``)."""
    blocks = _blocks(j, st)
    if blocks is not None:
        return _forward_streamed(j, st, blocks)
    v = j.reads(st)
    out_o, lse_o = j.oracle(st)
    p = j.prec(st.op)
    rows = j.streaming.bound_rows
    b_out, b_lse = j.memo(("bound", st.op, p, rows), lambda: EM.attention_forward_bound(
        v["q"], v["kv"], v["ids"], v["sink"], out_o, lse_o, precision=p, v_dim=j.case.v_dim,
        lengths=v["att_lengths"], scale=j.case.scale, chunk_rows=rows),
        *(v[r] for r in st.reads))
    checks = []
    for name, exp, b in (("out", out_o, b_out), ("lse", lse_o, b_lse)):
        if name in j.got:
            c = j.numeric(name, exp, b)
            if not c.passed and "pattern" not in c.extra:
                c = _forward_variant_hint(j, st, v, c, name)
            checks.append(c)
    expected = {"out": (out_o, b_out), "lse": (lse_o, b_lse)}

    def ratio_map(name, g):
        with j.comparing():
            return error_ratio_map(g, *expected[name]).cpu()
    return checks + _sink_only_forward(j, lse_o, {n: tuple(e.shape) for n, (e, _) in
                                                  expected.items()}, ratio_map)


def _empty_rows(lse_o: torch.Tensor) -> torch.Tensor:
    """Rows with no valid key (the oracle's ``lse`` is ``+inf``): bool ``[T]``."""
    if lse_o.numel():
        return torch.isinf(lse_o[:, 0])
    return torch.zeros(lse_o.shape[0], dtype=torch.bool)


def _sink_only_forward(j: _Judging, lse_o, shapes: dict, ratio_map) -> list:
    """Section 6, rows with no key, exactly: ``out == 0`` and ``lse == +inf`` where the oracle's
    ``lse_o`` is ``+inf``; and, when ``j.maps`` asks, each output's ``(row, head)`` error map
    (``ratio_map(name, got)``)."""
    empty, checks = _empty_rows(lse_o), []
    for name, what in (("out", "out == 0"), ("lse", "lse == +inf")):
        g = j.got.get(name)
        if g is not None and tuple(g.shape) == tuple(shapes[name]):
            g = g.detach().to("cpu")
            exp = torch.zeros((int(empty.sum()),) + tuple(shapes[name][1:]), dtype=g.dtype) \
                if name == "out" else lse_o[empty].to(g.dtype)
            checks.append(_tagged(compare_exact(f"sink-only rows: {what}", g[empty], exp),
                                  "sink_only"))
            if j.maps is not None:
                j.maps[name] = ratio_map(name, g)
    return checks


def _forward_variant_hint(j: _Judging, st: Stage, v: dict, check: CheckResult, name: str):
    """``check``, a failed ``out`` or ``lse``, with the hint of the first variant of the
    forward under which it is within the bound (:mod:`dsv4_oracle.hints`): the sink negated or
    ignored (:data:`hints.SINK_VARIANTS`, ``out`` only: ``lse`` excludes the sink), then a
    looser working precision than the one assumed (:data:`hints.PRECISION_VARIANTS`)."""
    p = j.prec(st.op)
    variants = [(f"sink_{k}", fn(v["sink"]), p, phrase)
                for k, (fn, phrase) in SINK_VARIANTS.items() if name == "out"]
    variants += [(k, v["sink"], fn(p), phrase.format(name=name))
                 for k, (fn, phrase) in PRECISION_VARIANTS.items()
                 if looser_precision(fn(p), p)]
    for key, sink, prec, phrase in variants:
        if prec is p and torch.equal(sink, v["sink"]):
            continue
        w = {**v, "sink": sink}
        alt = j.oracle(st, sink=sink)
        bound = j.memo(("bound", st.op, prec), lambda: EM.attention_forward_bound(
            w["q"], w["kv"], w["ids"], w["sink"], *alt, precision=prec, v_dim=j.case.v_dim,
            lengths=w["att_lengths"]), *(w[r] for r in st.reads))
        with j.comparing():
            if compare_numeric(name, j.got[name], alt[("out", "lse").index(name)],
                               bound[("out", "lse").index(name)]).passed:
                return _tagged(dataclasses.replace(
                    check, detail=f"{check.detail}; {phrase}",
                    extra={**check.extra, "hints": f"{check.extra.get('hints', '')}; {phrase}",
                           "pattern": key, "what_is_wrong": phrase}), name)
    return check


_GRADS = ("dq", "dkv", "dsink")


def _expected_backward(j: _Judging, st: Stage, convention: str, out=None) -> tuple:
    """``(expected, bounds)`` of the three attention gradients: the oracle's backward with
    ``Delta`` from the ``out``/``lse`` the implementation was given (``"given"``; ``out``
    replaces the given ``out``, for the probe) or from the oracle's own float64 forward on the
    consumed ``q``, ``kv``, ids and sink (``"recomputed"``). The recomputed ``out`` is charged
    what a forward errs whose ``P`` and ``out`` stay in the accumulator's precision and are never
    stored (``attention_forward_bound(stored=False)`` at ``io = acc``)."""
    override = {} if out is None else {"out": out}
    p = j.prec(st.op)
    rows = j.streaming.bound_rows
    out_error = None
    if convention == "recomputed":
        out_o, lse_o = j.oracle(_PRODUCER["out"])
        override = {"out": out_o, "lse": lse_o}
    v = j.reads(st, **override)
    if convention == "recomputed":
        # the backward's own forward: P and out stay in the accumulator's precision (a
        # recomputation that rounds its out to io has the out it was handed: "given")
        inner = EM.Precision(acc=p.acc, io=p.acc, stats=p.stats)
        out_error = j.memo(("bound", "recomputed out", p, rows), lambda: EM.attention_forward_bound(
            v["q"], v["kv"], v["ids"], v["sink"], out_o, lse_o, precision=inner,
            v_dim=j.case.v_dim, lengths=v["att_lengths"], scale=j.case.scale,
            stored=False, chunk_rows=rows)[0],
            *(v[r] for r in ("q", "kv", "ids", "sink", "att_lengths")))
    g_o = j.oracle(st, **override)
    bounds = j.memo(("bound", st.op, p, convention, rows), lambda: EM.attention_backward_bound(
        v["q"], v["kv"], v["ids"], v["sink"], v["out"], v["lse"], v["dout"], *g_o,
        precision=p, v_dim=j.case.v_dim, lengths=v["att_lengths"], out_error=out_error,
        scale=j.case.scale, chunk_rows=rows), *(v[r] for r in st.reads))
    return g_o, bounds


def _max_ratio(actual, expected, bound) -> float:
    """``max |actual - expected| / bound`` (:func:`compare.error_ratios`; NaN counts as inf)."""
    r = error_ratios(actual, expected, torch.broadcast_to(bound, expected.shape))
    return float(torch.nan_to_num(r, nan=math.inf).max()) if r.numel() else 0.0


class _Expectation:
    """One expectation of the attention gradients (contract section 6): the oracle's backward
    under ``convention`` (``out`` replacing the given ``out``: the probe's) and, with
    ``bound``, its error bound, by blocks of rows. ``rows()`` yields ``(rows, dq, bound_dq)``
    per block in row order; ``keys()``, after the last block, ``((dkv, dsink), (bound_dkv,
    bound_dsink))``. Judged whole (``blocks is None``) it is one block of the memoised
    :func:`_expected_backward`; streamed, each block is evaluated on the oracle device and
    dropped, the key-side sums folded in row order (bitwise the whole tensors, see
    :class:`Streaming`)."""

    def __init__(self, j: _Judging, st: Stage, convention: str, blocks, *, out=None,
                 bound: bool = True):
        self.j, self.st, self.conv, self.blocks, self.bound = j, st, convention, blocks, bound
        self.out = out
        self._keys = None

    def rows(self):
        j, st = self.j, self.st
        if self.blocks is None:
            if self.bound or self.conv != "given":
                g_o, bounds = _expected_backward(j, st, self.conv, out=self.out)
            else:
                g_o = j.oracle(st, **({} if self.out is None else {"out": self.out}))
                bounds = (None, None, None)
            self._keys = (tuple(g_o[1:]), tuple(bounds[1:]))
            yield slice(0, g_o[0].shape[0]), g_o[0], bounds[0]
            return
        v = j.reads(st, **({} if self.out is None else {"out": self.out}))
        T, H, D = v["q"].shape
        S = v["kv"].shape[0]
        p, c = j.prec(st.op), j.case
        inner = EM.Precision(acc=p.acc, io=p.acc, stats=p.stats)
        kw = dict(v_dim=c.v_dim, scale=c.scale)
        br = j.streaming.bound_rows
        sums = AttentionGradSums.zeros(S, D, H)
        bsums = EM.AttentionBoundSums.zeros(S, D, H) if self.bound else None
        for r in self.blocks:
            b = _block_of(v, r)
            out_error = None
            if self.conv == "recomputed":
                b["out"], b["lse"] = R.sparse_attention_forward(
                    b["q"], b["kv"], b["ids"], b["sink"], lengths=b["att_lengths"], **kw)
                if self.bound:
                    out_error = EM.attention_forward_bound(
                        b["q"], b["kv"], b["ids"], b["sink"], b["out"], b["lse"],
                        precision=inner, lengths=b["att_lengths"], stored=False,
                        chunk_rows=br, **kw)[0]
            dq = R.sparse_attention_backward(
                b["q"], b["kv"], b["ids"], b["sink"], b["out"], b["lse"], b["dout"],
                lengths=b["att_lengths"], sums=sums, **kw)[0]
            b_dq = None if not self.bound else EM.attention_backward_bound(
                b["q"], b["kv"], b["ids"], b["sink"], b["out"], b["lse"], b["dout"], dq, None,
                None, precision=p, lengths=b["att_lengths"], out_error=out_error,
                chunk_rows=br, sums=bsums, **kw)[0]
            yield r, dq, b_dq
        grads = sums.result()
        self._keys = (grads, bsums.bounds(p, *grads) if self.bound else (None, None))

    def keys(self) -> tuple:
        return self._keys


_ROW_READS = ("q", "ids", "att_lengths", "out", "lse", "dout")


def _block_of(v: dict, rows: slice) -> dict:
    """An attention stage's reads for the rows ``rows``: the per-row ones sliced, the keys and
    the sink whole."""
    return {k: (t[rows] if k in _ROW_READS and t is not None else t) for k, t in v.items()}


def _lockstep(*exps: _Expectation):
    """The blocks of several expectations side by side; each ends (its key side) with the last."""
    gens = [e.rows() for e in exps]
    yield from zip(*gens)
    for g in gens[1:]:
        next(g, None)


def _on_block(t: torch.Tensor, rows, like: torch.Tensor) -> torch.Tensor:
    """``t[rows]`` (an implementation's tensor) as float64 where ``like`` (the oracle's) lies."""
    return t.detach()[rows].to(like.device, F64)


def _backward_under(j: _Judging, st: Stage, convention: str) -> tuple:
    """The attention gradients judged under ``convention``: ``(checks, dq_map)``, the
    ``(row, head)`` error map of ``dq`` when ``j.maps`` asks for it."""
    blocks = _blocks(j, st)
    if blocks is None:
        g_o, bounds = _expected_backward(j, st, convention)
        checks = [j.numeric(name, e, b) for name, e, b in zip(_GRADS, g_o, bounds)
                  if name in j.got]
        dq_map = None
        if "dq" in j.got and j.maps is not None \
                and tuple(j.got["dq"].shape) == tuple(g_o[0].shape):
            with j.comparing():
                dq_map = error_ratio_map(j.got["dq"].detach().to("cpu"), g_o[0], bounds[0]).cpu()
        return checks, dq_map
    v = j.reads(st)
    T, H, D = v["q"].shape
    shapes = {"dq": (T, H, D), "dkv": tuple(v["kv"].shape), "dsink": tuple(v["sink"].shape)}
    cmp = {n: NumericComparison(n, j.got[n], shapes[n]) for n in _GRADS if n in j.got}
    maps = []
    with j.comparing():
        e = _Expectation(j, st, convention, blocks)
        for rows, dq, b_dq in e.rows():
            if "dq" in cmp:
                cmp["dq"].add(rows, dq, b_dq)
                if j.maps is not None and cmp["dq"].same_shape:
                    maps.append(error_ratio_map(j.got["dq"][rows], dq, b_dq).cpu())
        grads, bounds = e.keys()
        for n, g, b in zip(_GRADS[1:], grads, bounds):
            if n in cmp:
                cmp[n].add(..., g, b)
        checks = [_tagged(cmp[n].result(), n) for n in _GRADS if n in cmp]
    return checks, (torch.cat(maps) if maps else None)


def _measure_convention(j: _Judging, st: Stage) -> tuple:
    """Section 6, measured: ``(convention or None, detail)``. Between the judged run and the
    probe (:func:`convention_probe`: the same call with ``out`` moved by ``dout``) a backward of
    the "given" convention moves by ``D``, the oracle's own change between the two ``out``s
    (``Delta`` moves by ``|dout|^2``); one of the "recomputed" convention does not move. The
    observed change of ``dq`` and ``dsink`` (both follow ``Delta`` row by row) is compared with
    ``D`` and with 0 in units of the judged run's "given" bound; the closer one is the
    convention, read from the gradient that fits one of the two best (a defect in the other
    cannot mislead it). ``None`` when ``D`` is within twice that bound
    everywhere (the case cannot tell the conventions apart, e.g. no row has keys) or a shape
    differs."""
    probe = j.probe
    names = [n for n in ("dq", "dsink") if n in j.got and n in probe]
    v = j.reads(st)
    T, H, D = v["q"].shape
    shapes = {"dq": (T, H, D), "dsink": tuple(v["sink"].shape)}
    for name in names:
        if tuple(j.got[name].shape) != shapes[name] or tuple(probe[name].shape) != shapes[name]:
            return None, "a gradient has the wrong shape"
    # per gradient the largest: D in units of twice the bound, the observed move's distance
    # from D and from 0 in units of the bound
    far = {n: [0.0, 0.0, 0.0] for n in names}

    def fold(name, rows, e0, e1, b):
        a0, a1 = _on_block(j.got[name], rows, e0), _on_block(probe[name], rows, e0)
        d = e1 - e0
        f = far[name]
        f[0] = max(f[0], _max_ratio(d, torch.zeros_like(d), 2 * b))
        f[1] = max(f[1], _max_ratio(a1 - a0, d, b))
        f[2] = max(f[2], _max_ratio(a1 - a0, torch.zeros_like(d), b))
    blocks = _blocks(j, st)
    with (j.comparing() if blocks is not None else contextlib.nullcontext()):
        main = _Expectation(j, st, "given", blocks)
        moved = _Expectation(j, st, "given", blocks, out=probe["out"], bound=False)
        for (rows, e0, b), (_, e1, _) in _lockstep(main, moved):
            if "dq" in far:
                fold("dq", rows, e0, e1, b)
        if "dsink" in far:
            fold("dsink", ..., main.keys()[0][1], moved.keys()[0][1], main.keys()[1][1])
    apart = max((f[0] for f in far.values()), default=0.0)
    if apart <= 1:
        return None, "the case cannot tell the conventions apart"
    # the gradient whose move fits one of the two expectations best decides: a defect in the
    # other (a flipped dsink moves by -D, neither D nor 0) cannot mislead the measurement
    fits = [(n, far[n][1], far[n][2]) for n in names if far[n][0] > 1]
    name, r_giv, r_rec = min(fits, key=lambda f: min(f[1], f[2]))
    conv = "given" if r_giv <= r_rec else "recomputed"
    return conv, (f"the probe moved {name} {r_giv:.3g} given-bounds away from the "
                  f"'given' expectation and {r_rec:.3g} from 'recomputed'")


def _closest(j: _Judging, st: Stage, convs) -> str:
    """The convention whose expectation the gradients are nearer to, in units of the tighter
    "given" bound for both (never the one whose own bound is wider)."""
    names = [n for n in _GRADS if n in j.got]
    far = {c: {} for c in convs}
    T, H, D = j.reads(st)["q"].shape

    def fold(c, name, rows, e, b):
        r = _max_ratio(_on_block(j.got[name], rows, e), e, b)
        far[c][name] = max(far[c].get(name, -math.inf), r)
    blocks = _blocks(j, st)
    with (j.comparing() if blocks is not None else contextlib.nullcontext()):
        unit = _Expectation(j, st, "given", blocks)
        exps = [_Expectation(j, st, c, blocks, bound=False) for c in convs]
        for (rows, _, b), *got in _lockstep(unit, *exps):
            if "dq" in names and tuple(j.got["dq"].shape) == (T, H, D):
                for c, (_, e, _) in zip(convs, got):
                    fold(c, "dq", rows, e, b)
        for c, e in zip(convs, exps):
            for name, g, b in zip(_GRADS[1:], e.keys()[0], unit.keys()[1]):
                if name in names and tuple(j.got[name].shape) == tuple(g.shape):
                    fold(c, name, ..., g, b)
    worst = {c: max(far[c].values(), default=math.inf) for c in convs}
    return min(convs, key=lambda c: worst[c])


def _worst(checks: list) -> float:
    return max((c.ratio for c in checks if c.ratio is not None and c.judged), default=0.0)


_MEASURED = ("backward convention measured by the probe",)


def forget_measurements(cache: dict) -> None:
    """Drop what a judge cache holds about the implementation (the convention its probe
    measured), keeping the oracle's results: a cache reused for another implementation."""
    cache.pop(_MEASURED, None)


def _judge_backward(j: _Judging, st: Stage, pinned: str | None = None) -> list:
    """Section 6 backward under ONE convention for ``out`` in ``Delta``, never the looser of
    two: the one the adapter declares (``pinned``), else the one measured by the probe
    (:func:`_measure_convention`, op level: a backward that follows the ``out`` it is handed is
    "given"; one that does not recomputes its forward, and ``Delta`` comes from that forward's
    unrounded ``out`` ("recomputed") or from its stored, rounded ``out``, bit for bit the one
    it was handed ("given"): the closer of the two), else, for the packed layer (which takes
    no ``out``), the one the probe measured on the adapter's attention backward op of the same
    case, else the one the gradients are closer to. Each expectation has its own tight bound. A declaration the probe contradicts is a failed ``convention`` check. Rows
    with no key must have ``dq == 0``."""
    usable = not ({"out", "lse"} & set(j.blocked))
    measured, how = _measure_convention(j, st) if j.probe and usable else (None, "no probe")
    checks = []
    if pinned is not None and measured is not None:
        ok = measured == pinned
        checks.append(_tagged(CheckResult(
            "backward convention", "convention", ok, None, None,
            f"declared {pinned!r}, measured {measured!r} ({how})" + (
                "" if ok else ": the backward does not form Delta = <dO, out> the way its "
                "adapter declares (attribute backward_convention)")), "convention"))
    if measured is not None and j.cache is not None:
        j.cache[_MEASURED] = measured           # for the packed layer of the same case

    if pinned is not None:
        conv, source = pinned, "declared"
    elif measured == "given":
        conv, source = measured, "probe"
    elif measured == "recomputed":
        # it recomputes its forward: Delta from that forward's unrounded out, or from its stored
        # (rounded) out, which is the out it was handed: each judged with its own tight bound
        conv, source = _closest(j, st, ("recomputed", "given")), "probe"
    elif j.probe is None and j.cache is not None and _MEASURED in j.cache:
        conv, source = j.cache[_MEASURED], "probe on the op"
        if conv == "recomputed":
            conv = _closest(j, st, ("recomputed", "given"))
    else:
        conv, source = _closest(j, st, BACKWARD_CONVENTIONS), "closest"
    results, dq_map = _backward_under(j, st, conv)
    extra = {"convention": conv, "convention_source": source, "convention_pinned":
             pinned is not None}
    checks += [_tagged(c, c.extra["quantity"], **extra) for c in results]
    if "dq" in j.got:
        dq = j.got["dq"].detach().to("cpu")
        empty = _sink_only_rows(j)
        if tuple(dq.shape) == tuple(j.reads(st)["q"].shape):
            checks.append(_tagged(compare_exact("sink-only rows: dq == 0", dq[empty],
                                                torch.zeros_like(dq[empty])), "sink_only"))
            if dq_map is not None:
                j.maps["dq"] = dq_map
    return checks


def _judge_loss(j: _Judging, st: Stage) -> list:
    """Section 8: loss, per-row KL, teacher and student by error/bound ratio, on the consumed
    ``lse``, compressed selection and scores."""
    v = j.reads(st)
    L = j.oracle(st)
    p = j.prec(st.op)
    kw = j.kw(st)
    if j.pol["teacher"] == "dense":
        # the dense teacher's per-head normaliser is the implementation's own: within the
        # section 6 bound of an lse over the same keys, plus the float32 rounding of the one
        # the oracle is evaluated on (the dense lse handed to the op)
        def dense_lse_error():
            out_d, lse_d = R.sparse_attention_forward(v["q"], v["kv_cmp"], v["loss_ids"],
                                                      v["sink"], scale=j.case.scale)
            b = EM.attention_forward_bound(v["q"], v["kv_cmp"], v["loss_ids"], v["sink"], out_d,
                                           lse_d, precision=p, scale=j.case.scale)[1]
            return b + EM.Precision.unit_roundoff(torch.float32) * torch.where(
                torch.isfinite(lse_d), lse_d.abs(), torch.zeros_like(lse_d))
        kw["lse_error"] = j.memo(("bound", "dense lse", p), dense_lse_error,
                                 v["q"], v["kv_cmp"], v["sink"])
    LB = j.memo(("bound", st.op, p, _kw_key({k: w for k, w in kw.items() if k != "lse_error"})),
                lambda: EM.indexer_loss_bound(
        v["q"], v["kv_cmp"], v["sink"], v["loss_lse"], v["loss_ids"], v["scores"], j.olay, L,
        coeff=j.case.coeff, precision=p, scale=j.case.scale, **kw), *(v[r] for r in st.reads))
    return [j.numeric(n, getattr(L, n), getattr(LB, n)) for n in st.writes if n in j.got]


def _judge_loss_grad(j: _Judging, st: Stage) -> list:
    """Section 8: the indexer gradients by error/bound ratio, on the consumed teacher and
    student."""
    v = j.reads(st)
    g_o = _fields(st.op, j.oracle(st), 3)
    p = j.prec(st.op)
    kw = {"num_real": j.lay.num_real, **j.kw(st)}
    g_b = j.memo(("bound", st.op, p, _kw_key(kw)), lambda: EM.indexer_loss_grad_bound(
        v["q_idx"], v["k_idx"], v["weights"], v["teacher_ids"], v["target"], v["predict"], *g_o,
        coeff=j.case.coeff, precision=p, **kw), *(v[r] for r in st.reads))
    return [j.numeric(n, e, b) for n, e, b in zip(st.writes, g_o, g_b) if n in j.got]


def _scaled(case, kw: dict) -> dict:
    """``kw`` plus ``scale=case.scale`` for a case that carries its own attention scale (the ops
    of sections 6 and 8 take it; without one they use their default ``D ** -0.5``)."""
    return kw if case.scale is None else {**kw, "scale": case.scale}


def index_scale(case, pol) -> float | None:
    """The indexer's scale under the policy ``index_scale`` (section 5.2): ``None`` (the
    default ``D_I ** -0.5``) or ``(D_I H_I) ** -0.5``."""
    return (case.index_dim * case.index_heads) ** -0.5 if pol["index_scale"] == "dim_heads" \
        else None


def loss_normaliser(case, pol):
    """The loss's ``num_real`` under the policies ``loss_norm`` and ``padding_rows`` (section
    5.2; :func:`reference.indexer_loss.loss_normalisers`): an int, or per-row divisors."""
    from dsv4_oracle.reference.indexer_loss import loss_normalisers
    return loss_normalisers(case.layout(), pol["loss_norm"], padding_rows=pol["padding_rows"],
                            cp=case.cp, cp_mode=case.cp_mode)


def _row_divisors(case, pol) -> dict:
    """What the loss gradient's op is told under the policies (section 5.2): ``num_real`` as
    the per-row divisors of :func:`loss_normaliser` when the normaliser is per row (padding rows
    that attend but do not count, per-rank means), else nothing (``N``, as the call says)."""
    n = loss_normaliser(case, pol)
    return {"num_real": n} if isinstance(n, torch.Tensor) else {}


def _index_kw(case, pol) -> dict:
    s = index_scale(case, pol)
    return {} if s is None else {"scale": s}


def _judge_compressor(j: _Judging, st: Stage) -> list:
    """Section 15 forward (RoPE of 13; the Hadamard rotation of 14 for the indexer's
    compressor): ``kv_cmp`` or ``k_idx`` by error/bound ratio on the consumed raw inputs."""
    v = j.reads(st)
    out_o = _fields(st.op, j.oracle(st), 1)[0]
    p = j.prec(st.op)
    b = j.memo(("bound", st.op, p), lambda: EM.compressor_forward_bound(
        *(v[r] for r in st.reads), j.lay, j.case.ratio, out_o, rope=j.case.rope(), precision=p,
        rotate=st.op.startswith("indexer_")), *(v[r] for r in st.reads))
    return [j.numeric(st.writes[0], out_o, b)] if st.writes[0] in j.got else []


def _judge_compressor_backward(j: _Judging, st: Stage) -> list:
    """Section 15 backward: the four gradients by error/bound ratio on the consumed raw inputs
    and upstream gradient (exact zeros on the elements no group reads)."""
    v = j.reads(st)
    g_o = _fields(st.op, j.oracle(st), 4)
    p = j.prec(st.op)
    b = j.memo(("bound", st.op, p), lambda: EM.compressor_backward_bound(
        *(v[r] for r in st.reads[:4]), j.lay, j.case.ratio, v[st.reads[4]], g_o,
        rope=j.case.rope(), precision=p, rotate=st.op.startswith("indexer_")),
        *(v[r] for r in st.reads))
    return [j.numeric(n, e, bb) for n, e, bb in zip(st.writes, g_o, b) if n in j.got]


_CMP_IN = ("cmp_kv", "cmp_score", "cmp_ape", "cmp_norm")
_IDX_IN = ("idx_kv", "idx_score", "idx_ape", "idx_norm")
_CMP_STORED = (IO, IO, torch.float32, torch.float32)


def _compressor_call(names, upstream=None):
    """The call of a compressor op: the four raw inputs, the layout, the ratio (and the
    upstream gradient), ``rope`` the case's parameters."""
    def call(c, lay, v):
        args = tuple(v[n] for n in names) + (lay, c.ratio)
        return (args + ((v[upstream],) if upstream else ()), dict(rope=c.rope()))
    return call


STAGES = (
    Stage("compressor_forward", "15", _CMP_IN, ("kv_cmp",), (IO,), _compressed,
          _compressor_call(_CMP_IN), _judge_compressor),
    Stage("indexer_compressor_forward", "15", _IDX_IN, ("k_idx",), (IO,),
          lambda c: _compressed(c) and _csa(c), _compressor_call(_IDX_IN), _judge_compressor),
    Stage("indexer_scores", "7", ("q_idx", "k_idx", "weights"), ("scores",), (torch.float32,),
          _indexer,
          lambda c, lay, v: ((v["q_idx"], v["k_idx"], v["weights"], lay, c.ratio), {}),
          _judge_scores, _index_kw),
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
                             _scaled(c, dict(v_dim=c.v_dim, lengths=v["att_lengths"]))),
          _judge_forward),
    Stage("sparse_attention_backward", "6",
          ("q", "kv", "ids", "sink", "out", "lse", "dout", "att_lengths"), _GRADS,
          (IO, IO, torch.float32), lambda c: True,
          lambda c, lay, v: ((v["q"], v["kv"], v["ids"], v["sink"], v["out"], v["lse"],
                              v["dout"]),
                             _scaled(c, dict(v_dim=c.v_dim, lengths=v["att_lengths"]))),
          _judge_backward),
    Stage("compressor_backward", "15", _CMP_IN + ("dkv_cmp",),
          ("d_cmp_kv", "d_cmp_score", "d_cmp_ape", "d_cmp_norm"), _CMP_STORED, _compressed,
          _compressor_call(_CMP_IN, "dkv_cmp"), _judge_compressor_backward),
    Stage("sparse_indexer_loss", "8", ("q", "kv_cmp", "sink", "loss_lse", "loss_ids", "scores"),
          ("loss", "kl", "target", "predict"),
          (torch.float32, torch.float32, torch.float32, torch.float32), _loss,
          lambda c, lay, v: ((v["q"], v["kv_cmp"], v["sink"], v["loss_lse"], v["loss_ids"],
                              v["scores"], lay), _scaled(c, dict(coeff=c.coeff))),
          _judge_loss,
          lambda c, pol: dict(num_real=loss_normaliser(c, pol), kl_form=pol["kl_form"])),
    Stage("sparse_indexer_loss_grad", "8",
          ("q_idx", "k_idx", "weights", "teacher_ids", "target", "predict"),
          ("dq_idx", "dw", "dk_idx"), (IO, IO, IO), lambda c: _indexer(c) and _loss(c),
          lambda c, lay, v: ((v["q_idx"], v["k_idx"], v["weights"], v["teacher_ids"],
                              v["target"], v["predict"]),
                             dict(coeff=c.coeff, num_real=lay.num_real)),
          _judge_loss_grad,
          lambda c, pol: dict(num_real=loss_normaliser(c, pol), mode=pol["index_grad"],
                              kl_form=pol["kl_form"], **_index_kw(c, pol)),
          _row_divisors),
    Stage("indexer_compressor_backward", "15", _IDX_IN + ("dk_idx",),
          ("d_idx_kv", "d_idx_score", "d_idx_ape", "d_idx_norm"), _CMP_STORED,
          lambda c: _compressed(c) and _indexer(c) and _loss(c),
          _compressor_call(_IDX_IN, "dk_idx"), _judge_compressor_backward),
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


def oracle_stage(case, stage: Stage, x: dict, done: dict, *, policies=None) -> dict:
    """The oracle's outputs of one stage, name -> tensor (the stage's ``writes``), on what it
    reads: the outputs of earlier stages in ``done``, else the case's inputs ``x`` (see
    :func:`_read`), under ``policies`` (section 5.2; default: the contract's). float64/int64 as
    ``reference`` returns them, unrounded."""
    pol = resolve_policies(policies)
    v = {r: _read(case, r, x, done, pol=pol) for r in stage.reads}
    args, kw = stage.call(case, oracle_layout(case, pol), v)
    kw.update(stage.policy_kw(case, pol))
    res = _fields(stage.op, getattr(R, stage.op)(*args, **kw), len(stage.writes))
    return dict(zip(stage.writes, res))


def oracle_outputs(case, x: dict, *, backward: bool = True, policies=None) -> dict:
    """Every stage of :data:`STAGES` that applies to ``case``, in order, evaluated by the oracle
    on the inputs ``x`` and its own earlier outputs (no adapter, nothing rounded): a dict named
    as the stages' ``writes`` (``scores``, ``cmp_ids``, ``cmp_lengths``, ``ids``, ``lengths``,
    ``out``, ``lse``, ``dq``, ``dkv``, ``dsink``, ``loss``, ``kl``, ``target``, ``predict``,
    ``dq_idx``, ``dw``, ``dk_idx``; those of the stages that apply). ``backward=False`` skips
    :data:`BACKWARD_OPS`. ``policies``: see :func:`oracle_stage`."""
    done: dict = {}
    for st in STAGES:
        if st.applies(case) and (backward or st.op not in BACKWARD_OPS):
            done.update(oracle_stage(case, st, x, done, policies=policies))
    return done

# the quantities each stage's checks carry, for "not judged" rows
_CHECKED = {"compressor_forward": (("kv_cmp", "numeric"),),
            "indexer_compressor_forward": (("k_idx", "numeric"),),
            "indexer_scores": (("scores", "numeric"),),
            "stable_topk": (("cmp_ids", "topk"),),
            "build_csa_indices": (("ids", "exact"), ("lengths", "exact")),
            "sparse_attention_forward": (("out", "numeric"), ("lse", "numeric")),
            "sparse_attention_backward": (("dq", "numeric"), ("dkv", "numeric"),
                                          ("dsink", "numeric")),
            "compressor_backward": tuple((q, "numeric") for q in (
                "d_cmp_kv", "d_cmp_score", "d_cmp_ape", "d_cmp_norm")),
            "sparse_indexer_loss": (("loss", "numeric"), ("kl", "numeric"),
                                    ("target", "numeric"), ("predict", "numeric")),
            "sparse_indexer_loss_grad": (("dq_idx", "numeric"), ("dw", "numeric"),
                                         ("dk_idx", "numeric")),
            "indexer_compressor_backward": tuple((q, "numeric") for q in (
                "d_idx_kv", "d_idx_score", "d_idx_ape", "d_idx_norm"))}


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


_STREAMED = ("indexer_scores", "stable_topk", "sparse_attention_forward",
             "sparse_attention_backward")


def _whole_fits(j: _Judging, st: Stage) -> bool:
    """Whether the whole-tensor judge of a streamed stage fits ``WHOLE_BYTES``: about six
    float64 ``[T, H, D]`` tensors (oracle outputs and bounds of two expectations) or four
    ``[T, C]`` ones (the scores, their bound, and the sort of near ties)."""
    if st.op in _STREAMED[:2]:
        return 8 * 4 * j.read("q_idx").shape[0] * j.read("k_idx").shape[0] <= WHOLE_BYTES
    return 8 * 6 * j.read("q").numel() <= WHOLE_BYTES


def _judge_stage(j: _Judging, st: Stage, pinned: str | None) -> list:
    """One stage's checks, or its "not judged" rows when it reads an output the oracle cannot
    consume (that output's own check failed on its non-finite pattern or shape)."""
    reads = [_QUANTITY_OF.get(r, r) for r in st.reads]
    blocked = [r for r in reads if r in j.blocked]
    if st.op == "sparse_attention_backward" and pinned == "recomputed":
        # a backward that recomputes its forward never reads the out and lse it is handed
        blocked = [r for r in blocked if r not in ("out", "lse")]
    if blocked:
        r = blocked[0]
        return _not_judged_stage(j, st, f"it consumed {r}, which the oracle cannot take as an "
                                        f"input ({j.blocked[r]})")
    try:
        checks = _judge_backward(j, st, pinned) if st.op == "sparse_attention_backward" \
            else st.judge(j, st)
        if st.op in _STREAMED and not all(c.passed for c in checks) and _whole_fits(j, st) \
                and (_score_blocks(j) if st.op in _STREAMED[:2] else _blocks(j, st)) is not None:
            j.whole = True               # the hints of a failed check read whole tensors
            try:
                checks = _judge_backward(j, st, pinned) \
                    if st.op == "sparse_attention_backward" else st.judge(j, st)
            finally:
                j.whole = False
        return checks
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
          convention: str | None = None, oracle_device=None,
          policies=None, record: dict | None = None,
          streaming: Streaming | None = None) -> list[CheckResult]:
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
    ``policies``: the policies of section 5.2 the implementation follows (a mapping policy name
    -> value; unnamed policies and ``None``: the contract's defaults): the oracle is evaluated
    under them (``reference.contract_policies``). ``record``, when a dict, receives per numeric
    quantity judged the ``(expected, bound)`` it was judged against (the power table).
    ``streaming``: how the attention stages are judged at large ``T`` (:class:`Streaming`;
    default: block by block once the rows exceed one block, the same results).

    Stages are judged in pipeline order; a stage that reads an output whose own check found it
    unusable (non-finite pattern or shape) reports its checks as not judged.
    """
    if not isinstance(precision, (EM.Precision, Mapping)):
        raise TypeError(f"precision must be a reference.error_model.Precision or a mapping op -> "
                        f"Precision, got {type(precision).__name__}")
    con = dict(got if consumed is None else consumed)
    declared = con.pop("backward_convention", None)
    probe = con.pop(PROBE, None)
    not_run = con.pop("not_run", {})
    pinned = convention if convention is not None else declared
    if pinned is not None and pinned not in BACKWARD_CONVENTIONS:
        raise ValueError(f"convention must be one of {BACKWARD_CONVENTIONS} or None, got "
                         f"{pinned!r}")
    j = _Judging(case, x, got, con, precision, cache, maps, oracle_device, policies, streaming)
    j.probe = {k: v.detach().to("cpu") for k, v in probe.items()} if probe else None
    j.record = record
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
