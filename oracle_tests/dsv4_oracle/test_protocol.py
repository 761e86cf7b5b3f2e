"""The op protocol (``dsv4_oracle.protocol``) is the one list of ops: the stage table, the
adapter loader, the dispatching API and the packed layer follow it, and every op of the oracle,
of ``gpu_impl.api`` and of the built-in adapter accepts the call its ``typing.Protocol`` shows."""
from __future__ import annotations

import inspect

import pytest

from dsv4_oracle import reference as R
from dsv4_oracle import adapters, conformance, protocol
from dsv4_oracle.gpu_impl import api, layer


def test_everything_lists_the_protocols_ops_in_pipeline_order():
    assert tuple(s.op for s in conformance.STAGES) == protocol.OPS
    assert tuple(conformance._CHECKED) == protocol.OPS
    assert {s.op: s.section for s in conformance.STAGES} == \
        {op: protocol.SECTIONS[op] for op in protocol.OPS}
    assert adapters.OPS is protocol.OPS and adapters.ALL_OPS is protocol.ALL_OPS
    assert api.OPS[:len(protocol.OPS)] == protocol.OPS and api.OPS[len(protocol.OPS):] == \
        ("q_rms_norm",)
    assert tuple(layer._backend_map("torch")) == protocol.OPS
    assert set(protocol.PROTOCOLS) == set(protocol.ALL_OPS) == set(protocol.SECTIONS)


def _call_of(proto) -> tuple[list, list]:
    """The positional and keyword parameter names of a protocol's ``__call__``."""
    params = list(inspect.signature(proto.__call__).parameters.values())[1:]
    pos = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    kw = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    return pos, kw


@pytest.mark.parametrize("op", protocol.OPS)
def test_the_oracle_the_api_and_the_builtin_adapter_accept_the_protocols_call(op):
    pos, kw = _call_of(protocol.PROTOCOLS[op])
    args, kwargs = [object()] * len(pos), {k: object() for k in kw}
    for fn in (getattr(R, op), getattr(api, op), getattr(adapters.GpuImplAdapter(), op)):
        inspect.signature(fn).bind(*args, **kwargs)         # raises TypeError on a mismatch
        assert isinstance(fn, protocol.PROTOCOLS[op])


def test_the_packed_layer_accepts_the_protocols_call():
    pos, kw = _call_of(protocol.CsaLayerOp)
    params = inspect.signature(protocol.CsaLayerOp.__call__).parameters
    optional = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is None]
    inspect.signature(layer.csa_layer).bind(*[object()] * len(pos),
                                            **{k: object() for k in kw + optional})
