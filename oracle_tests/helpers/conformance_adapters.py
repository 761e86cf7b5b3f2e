"""Adapters for the conformance engine's tests (``dsv4_oracle/test_conformance.py``): implementations with one
known property each, built on the worked example's plain-PyTorch attention
(``examples/megatron_style_adapter.py``).

- :class:`RecomputedBackward`: the backward is autograd through the example's forward (float32
  math on the bf16 inputs), so ``Delta = <dO, out>`` uses the unrounded ``out`` (contract
  section 6, the "recomputed" convention), as every public reference computes it;
- :class:`WrongBackward`: the same, with ``dq`` scaled by 1.0625: wrong under both conventions;
- :class:`NaNForward`: the example's forward with one NaN written into ``out``, and its backward;
- :class:`PerturbedHead`: the example's forward with head 1 of ``out`` scaled by 1.03.
"""
from __future__ import annotations

import torch

from dsv4_oracle.examples.megatron_style_adapter import MegatronStyleAdapter


class RecomputedBackward(MegatronStyleAdapter):
    """Forward as the example; backward by autograd through a recomputed forward."""

    name = "autograd backward through the forward (test fixture)"

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_() for t in (q, kv, sink)]
            o, _ = self.sparse_attention_forward(*leaves[:2], ids, leaves[2], v_dim=v_dim,
                                                 lengths=lengths)
            dq, dkv, dsink = torch.autograd.grad(o, leaves, dout.float(), allow_unused=True)
        # rows without keys under a -inf sink give 0 * NaN in autograd: they contribute nothing
        dq, dkv, dsink = (torch.zeros_like(t) if g is None else torch.nan_to_num(g, nan=0.0)
                          for g, t in zip((dq, dkv, dsink), leaves))
        return self.gradients(q, kv, dq, dkv, dsink)

    def gradients(self, q, kv, dq, dkv, dsink):
        return dq.to(q.dtype), dkv.to(kv.dtype), dsink


class WrongBackward(RecomputedBackward):
    """:class:`RecomputedBackward` with ``dq`` 6.25 % too large."""

    name = "dq scaled by 1.0625 (test fixture)"

    def gradients(self, q, kv, dq, dkv, dsink):
        return (dq * 1.0625).to(q.dtype), dkv.to(kv.dtype), dsink


class NaNForward(MegatronStyleAdapter):
    """The example with a NaN at ``out[0, 0, 0]``."""

    name = "NaN in out (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)
        out = out.clone()
        out[0, 0, 0] = float("nan")
        return out, lse


class PerturbedHead(MegatronStyleAdapter):
    """The example with head 1 of ``out`` scaled by 1.03 (forward only)."""

    name = "head 1 of out perturbed (test fixture)"
    ops = ("sparse_attention_forward",)

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)
        out = out.clone()
        out[:, 1] *= 1.03
        return out, lse
