"""``from_autograd``: a differentiable attention forward as the protocol's two attention ops.

- a ``torch.autograd.Function`` pair (forward and backward kernels; here the torch backend's,
  the backward using the output its forward saved) passes on a layer case and an op-level case
  with hostile lengths, and the checker reports the "given" convention of contract section 6;
- plain autograd code (the worked example's float32 forward) passes and is reported
  "recomputed"; pinned with ``backward_convention="recomputed"`` only that one is judged;
- a Function whose backward is wrong (``dq`` 6.25 % too large) fails on ``dq``;
- a forward computed under ``no_grad`` fails the run check, saying why;
- bad arguments raise ``TypeError``/``ValueError`` naming the argument.
"""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle.autograd_adapter import AutogradAdapter, from_autograd
from dsv4_oracle.pytest_plugin import ConformanceError, assert_conforms
from dsv4_oracle.examples.megatron_style_adapter import MegatronStyleAdapter
from dsv4_oracle.gpu_impl import api


class TorchAttention(torch.autograd.Function):
    """A forward/backward kernel pair, as training code wraps one (torch backend kernels)."""

    @staticmethod
    def forward(ctx, q, kv, ids, sink, v_dim, lengths):
        f = api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                         backend="torch")
        ctx.save_for_backward(q, kv, ids, sink, f.out, f.lse)
        ctx.v_dim, ctx.lengths = v_dim, lengths
        ctx.mark_non_differentiable(f.lse)
        return f.out, f.lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _backward(ctx, dout, dq_scale=1.0)


def _backward(ctx, dout, *, dq_scale):
    q, kv, ids, sink, out, lse = ctx.saved_tensors
    b = api.sparse_attention_backward(q, kv, ids, sink, out, lse, dout.contiguous(),
                                      v_dim=ctx.v_dim, lengths=ctx.lengths, backend="torch")
    return b.dq * dq_scale, b.dkv, None, b.dsink.to(sink.dtype), None, None


class WrongDq(TorchAttention):
    """The same pair with ``dq`` 6.25 % too large."""

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _backward(ctx, dout, dq_scale=1.0625)


def _conventions(outcome):
    return {(c.extra["convention"], c.extra["convention_pinned"]) for c in outcome.checks
            if "convention" in c.extra}


@pytest.mark.parametrize("case", ["capacity-rows", "lengths-above-width"])
def test_a_function_pair_passes_under_the_given_convention(case):
    adapter = from_autograd(TorchAttention)
    assert adapter.name == "autograd(TorchAttention)" and adapter.backward_convention is None
    outcome = assert_conforms(adapter, case)
    assert _conventions(outcome) == {("given", False)}
    assert {c.extra["quantity"] for c in outcome.checks} >= {"out", "dq", "dkv", "dsink"}


def test_plain_autograd_code_passes_under_the_recomputed_convention():
    fwd = MegatronStyleAdapter().sparse_attention_forward
    outcome = assert_conforms(from_autograd(fwd, name="example"), "capacity-rows", replays=0)
    assert _conventions(outcome) == {("recomputed", False)}
    pinned = from_autograd(fwd, backward_convention="recomputed")
    outcome = assert_conforms(pinned, "capacity-rows", replays=0)
    assert _conventions(outcome) == {("recomputed", True)}


def test_a_wrong_backward_fails_on_dq():
    with pytest.raises(ConformanceError) as e:
        assert_conforms(from_autograd(WrongDq), "lengths-above-width", replays=0)
    assert [c.extra["quantity"] for c in e.value.outcome.failed_checks] == ["dq"]


def test_a_forward_without_autograd_fails_the_run_check():
    def forward(q, kv, ids, sink, *, v_dim=None, lengths=None):
        with torch.no_grad():
            return TorchAttention.apply(q, kv, ids, sink, v_dim, lengths)
    with pytest.raises(ConformanceError) as e:
        assert_conforms(from_autograd(forward), "lengths-above-width", replays=0)
    (failed,) = e.value.outcome.failed_checks
    assert failed.extra["quantity"] == "run"
    assert "returned an out that autograd cannot differentiate" in failed.detail


@pytest.mark.parametrize("args,kwargs,error,needle", [
    ((3,), {}, TypeError, "forward must be a callable or a torch.autograd.Function"),
    ((TorchAttention,), dict(backward_convention="kernel"), ValueError,
     "backward_convention must be None, 'given' or 'recomputed'"),
    ((TorchAttention,), dict(device="gpu0"), ValueError, "device 'gpu0' is not a torch device"),
    ((TorchAttention,), dict(device=0), TypeError, "device must be a str"),
    ((TorchAttention,), dict(name=1), TypeError, "name must be a str"),
])
def test_bad_arguments(args, kwargs, error, needle):
    with pytest.raises(error) as e:
        from_autograd(*args, **kwargs)
    assert needle in str(e.value)


def test_the_adapter_has_the_two_attention_ops_and_the_attributes():
    a = from_autograd(TorchAttention, name="mine", device="cpu", backward_convention="given")
    assert isinstance(a, AutogradAdapter)
    assert a.ops == ("sparse_attention_forward", "sparse_attention_backward")
    assert (a.name, a.device, a.precision, a.backward_convention) == ("mine", "cpu", None,
                                                                        "given")
