"""Deliberately broken adapters for the ``dsv4-oracle check`` tests (negative controls).

- :class:`SignFlipAdapter`: the portable torch backend with one sign flipped: the sink
  gradient comes back as ``+sum_t P_sink * Delta`` instead of ``-sum_t ...`` (contract section
  6). Everything else is the real implementation, so exactly one quantity must fail.
- :class:`RaisingAdapter`: the attention forward raises (a kernel that rejects a shape).
- :class:`MutatingAdapter`: the attention forward writes into its ``q`` argument.

Used as ``--impl oracle_tests.check_adapters:SignFlipAdapter`` from the repository root.
"""
from __future__ import annotations

from dsv4_oracle.adapters import OPS, GpuImplAdapter


class SignFlipAdapter(GpuImplAdapter):
    """gpu_impl:torch on the CPU, op level only, with ``dsink`` negated."""

    ops = OPS
    name = "sign-flipped dsink (test fixture)"

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = SignFlipAdapter.name

    def sparse_attention_backward(self, *args, **kwargs):
        dq, dkv, dsink, _ = super().sparse_attention_backward(*args, **kwargs)
        return dq, dkv, -dsink


class RaisingAdapter:
    """Only the attention forward, which raises."""

    name = "raising forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        raise RuntimeError(f"unsupported head dim {q.shape[-1]} (test fixture)")


class MutatingAdapter(GpuImplAdapter):
    """gpu_impl:torch whose attention forward scales its ``q`` argument in place first."""

    ops = ("sparse_attention_forward",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "mutating forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        q[0].zero_()                   # the caller's tensor: section 11 forbids this
        return super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths)
