"""Adapters for the conformance engine's tests (``dsv4_oracle/test_conformance.py``): implementations with one
known property each, built on the worked example's plain-PyTorch attention
(``examples/megatron_style_adapter.py``).

- :class:`RecomputedBackward`: the backward is autograd through the example's forward (float32
  math on the bf16 inputs), so ``Delta = <dO, out>`` uses the unrounded ``out`` (contract
  section 6, the "recomputed" convention), as every public reference computes it;
- :class:`WrongBackward`: the same, with ``dq`` scaled by 1.0625: wrong under both conventions;
- :class:`NaNForward`: the example's forward with one NaN written into ``out``, and its backward;
- :class:`PerturbedHead`: the example's forward with head 1 of ``out`` scaled by 1.03;
- :class:`Bf16DeltaBackward`, :class:`Bf16DsinkBackward`: the example's kernel-style backward
  with ``Delta`` kept in bf16, or ``dsink`` accumulated row by row in bf16 (16-bit defects that
  only the "given" convention's tight bound catches).
"""
from __future__ import annotations

import math

import torch

from dsv4_oracle.examples import megatron_style_adapter as E
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


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _given_backward(q, kv, ids, sink, out, lse, dout, sc, dv, delta):
    """The example's kernel-style backward (``dsa_sink_attention_bwd``) with ``Delta`` made by
    ``delta(dout, out)``."""
    used, k, logits = E._gather(q, kv, ids, sc)
    sink = sink.float()[None, :]
    lse_f = torch.logaddexp(lse.float(), sink)
    p = torch.where(used[:, None, :], torch.exp(logits - lse_f[..., None]),
                    torch.zeros_like(logits))
    do = dout.float()
    dl = delta(dout, out)
    ds = p * (torch.einsum("thd,tkd->thk", do, k[..., :dv]) - dl[..., None])
    dq = sc * torch.einsum("thk,tkd->thd", ds, k)
    dk = sc * torch.einsum("thk,thd->tkd", ds, q.float())
    dk[..., :dv] += torch.einsum("thk,thd->tkd", p, do)
    dkv = torch.zeros(kv.shape, dtype=torch.float32)
    dkv.index_add_(0, ids.clamp_min(0).long().reshape(-1),
                   torch.where(used[..., None], dk, torch.zeros_like(dk)).reshape(-1, kv.shape[1]))
    p_sink = torch.exp(sink - lse_f).nan_to_num(nan=0.0)
    dsink = -(p_sink * dl).sum(dim=0)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsink


def _bf16_delta(dout, out):
    """``<dO, out>`` with every product and partial sum rounded to bf16."""
    acc = torch.zeros(out.shape[:2], dtype=torch.float32)
    for d in range(out.shape[-1]):
        acc = _bf16(acc + _bf16(dout[..., d].float() * out[..., d].float()))
    return acc


class Bf16DeltaBackward(MegatronStyleAdapter):
    """The example's kernel-style backward (``Delta`` from the ``out`` it is handed) with
    ``Delta`` kept in bf16: products and their row sum rounded to bf16."""

    name = "Delta in bf16 (test fixture)"

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None, scale=None):
        self._checked(ids, lse)
        lse = torch.where(torch.isposinf(lse), torch.full_like(lse, -math.inf), lse)
        return _given_backward(q, kv, self._their_ids(ids, kv.shape[0], lengths),
                               self._their_sink(sink), out, lse, dout,
                               q.shape[-1] ** -0.5 if scale is None else scale,
                               kv.shape[1] if v_dim is None else v_dim, _bf16_delta)


class Bf16DsinkBackward(MegatronStyleAdapter):
    """The example's kernel-style backward with ``dsink`` accumulated row by row in bf16."""

    name = "dsink accumulated in bf16 (test fixture)"

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None, scale=None):
        dq, dkv, _ = super().sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                       v_dim=v_dim, lengths=lengths,
                                                       scale=scale)
        sink32 = self._their_sink(sink)
        lse_f = torch.logaddexp(lse.float(), sink32[None, :])
        p_sink = torch.exp(sink32[None, :] - lse_f).nan_to_num(nan=0.0)
        p_sink = torch.where(torch.isposinf(lse), torch.zeros_like(p_sink), p_sink)
        delta = (dout.float() * out.float()).sum(dim=-1)
        dsink = torch.zeros(q.shape[1], dtype=torch.float32)
        for t in range(q.shape[0]):
            dsink = _bf16(dsink - p_sink[t] * delta[t])
        return dq, dkv, dsink
