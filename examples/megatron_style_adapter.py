"""A worked example: wrapping a training codebase's attention for ``dsv4-oracle check``.

Scenario: a training codebase (Megatron-style) has its own DSv4 sparse-attention pair, the
forward ``dsa_sink_attention_fwd`` and the backward ``dsa_sink_attention_bwd`` below (plain
PyTorch, float32 math on bf16 tensors; in real life, calls into fused kernels), with the
codebase's own conventions:

- ``topk_idxs`` uses ``-1`` for an unused slot and nothing else (no ``lengths`` argument);
- ``lse = -inf`` for a row without keys (the contract says ``+inf``);
- no ``+inf`` sink (a head whose sink takes all the mass);
- the backward takes ``out`` and ``lse`` saved by the forward, as flash-attention kernels do.

The adapter maps the contract's arguments onto those conventions and back; nothing in it is
specific to this checker beyond the op names and argument order (those of ``reference``). Run
it from the repository root with::

    dsv4-oracle check --impl dsv4_oracle.examples.megatron_style_adapter:MegatronStyleAdapter

It implements the attention forward and backward only: the runner feeds it the oracle's key ids
(Top-K, CSA rows) and judges just these two ops. To check your own kernels, copy this file and
replace the two functions' bodies with calls into your code.

Note: a backward that ignores the saved ``out`` and recomputes the forward under autograd
(``torch.autograd.grad`` through the float32 forward) computes ``Delta = <dO, out>`` from the
unrounded float32 output instead of the bf16 ``out`` it was given. Contract section 6 allows
both conventions; the checker measures which one a backward follows (it calls the backward once
more with a moved ``out`` and sees whether the gradients follow it) and judges it under that one
only. An adapter may declare its convention with the attribute ``backward_convention``; a
declaration the measurement contradicts fails.

The two argument checks (``_checked``) are the values contract section 6 says an op must
refuse: ``check`` hands them to the ops on a few cases (quantity ``rejects``).
"""
from __future__ import annotations

import torch

from dsv4_oracle.reference.error_model import Precision


# ---------------------------------------------------------------------------------------------
# "their" functions: what a training codebase already has
# ---------------------------------------------------------------------------------------------
def _gather(q, kv, topk_idxs, softmax_scale):
    used = topk_idxs >= 0
    k = kv[topk_idxs.clamp_min(0).long()].float()                      # [T, K, D]
    # unused slots read row 0, which may hold NaN: zero them, since 0 * NaN is NaN in the
    # products below (the catalog's nan-poison-* cases check this)
    k = torch.where(used[..., None], k, torch.zeros_like(k))
    logits = torch.einsum("thd,tkd->thk", q.float(), k) * softmax_scale
    return used, k, logits.masked_fill(~used[:, None, :], float("-inf"))


def dsa_sink_attention_fwd(q, kv, topk_idxs, attn_sink, softmax_scale, v_dim):
    """Sparse attention with a per-head sink over gathered key rows.

    q [T, H, D] bf16, kv [S, D] bf16 (keys = values, the first ``v_dim`` columns are the
    value), topk_idxs [T, K] int (``-1`` = unused), attn_sink [H] float32 (finite or ``-inf``),
    softmax_scale float. Returns ``out [T, H, v_dim]`` (q's dtype) and ``lse [T, H]`` float32,
    the log-sum-exp of the key logits without the sink (``-inf`` for rows without keys).
    """
    used, k, logits = _gather(q, kv, topk_idxs, softmax_scale)
    m = logits.amax(dim=-1)                                            # max over the keys only
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)        # no key: avoid NaN
    lse = m + torch.log(torch.exp(logits - m[..., None]).sum(dim=-1))  # -inf without keys
    # the sink enters the normaliser through logaddexp, never exp(sink): a sink of 2.4e38
    # must not turn every key's weight (and the lse) into 0 / -inf
    lse_f = torch.logaddexp(lse, attn_sink.float()[None, :])
    p = torch.where(used[:, None, :], torch.exp(logits - lse_f[..., None]),
                    torch.zeros_like(logits))
    out = torch.einsum("thk,tkd->thd", p, k[..., :v_dim])
    return out.to(q.dtype), lse


def dsa_sink_attention_bwd(q, kv, topk_idxs, attn_sink, out, lse, dout, softmax_scale, v_dim):
    """Gradients of :func:`dsa_sink_attention_fwd` from the saved ``out`` and ``lse``:
    ``dq [T,H,D]`` (q's dtype), ``dkv [S,D]`` (kv's dtype), ``dsink [H]`` float32."""
    used, k, logits = _gather(q, kv, topk_idxs, softmax_scale)
    sink = attn_sink.float()[None, :]
    lse_f = torch.logaddexp(lse.float(), sink)                         # full normaliser [T, H]
    p = torch.where(used[:, None, :], torch.exp(logits - lse_f[..., None]),
                    torch.zeros_like(logits))
    do = dout.float()
    delta = (do * out.float()).sum(dim=-1)                             # [T, H]
    dp = torch.einsum("thd,tkd->thk", do, k[..., :v_dim])
    ds = p * (dp - delta[..., None])
    dq = softmax_scale * torch.einsum("thk,tkd->thd", ds, k)
    dk = softmax_scale * torch.einsum("thk,thd->tkd", ds, q.float())
    dk[..., :v_dim] += torch.einsum("thk,thd->tkd", p, do)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dkv.index_add_(0, topk_idxs.clamp_min(0).long().reshape(-1),
                   torch.where(used[..., None], dk, torch.zeros_like(dk)).reshape(-1, kv.shape[1]))
    p_sink = torch.exp(sink - lse_f)
    p_sink = torch.where(torch.isnan(p_sink), torch.zeros_like(p_sink), p_sink)
    dsink = -(p_sink * delta).sum(dim=0)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsink


# ---------------------------------------------------------------------------------------------
# the adapter: the contract's ops in terms of those functions
# ---------------------------------------------------------------------------------------------
class MegatronStyleAdapter:
    """``sparse_attention_forward`` / ``sparse_attention_backward`` of the contract (section 6)
    on top of :func:`dsa_sink_attention`."""

    name = "megatron-style dsa_sink_attention (example)"
    device = "cpu"                     # where the checker puts the inputs ("cuda" for a kernel)

    def precision(self, dtype):
        """What the error model assumes of this code: float32 accumulation and statistics,
        operands and outputs in the input dtype (bf16)."""
        io = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        return Precision(acc=torch.float32, io=io, stats=torch.float32)

    # -- argument mapping ---------------------------------------------------------------------
    @staticmethod
    def _their_ids(ids, num_keys, lengths):
        """Contract ids (any invalid id: negative, >= S, INT_MAX; slots at or past ``lengths``)
        -> their convention (``-1`` = unused)."""
        ids = ids.long()
        ok = (ids >= 0) & (ids < num_keys)
        if lengths is not None:
            slot = torch.arange(ids.shape[1], device=ids.device)
            ok &= slot[None, :] < lengths.long()[:, None]
        return torch.where(ok, ids, torch.full_like(ids, -1))

    @staticmethod
    def _checked(ids, lse=None):
        """The values the contract says an op must refuse (section 6), before any work: an
        unsigned 64-bit id has no signed value (wrapping it would turn an invalid id into "no
        selection"), and a NaN ``lse`` makes every probability of its row undefined."""
        if ids.dtype == getattr(torch, "uint64", None):
            raise TypeError("ids: unsigned 64-bit ids are not accepted (contract section 6); "
                            "pass int32 or int64")
        if lse is not None and bool(torch.isnan(lse).any()):
            raise ValueError("lse holds NaN; the backward needs the forward's lse (contract "
                             "section 6)")

    @staticmethod
    def _their_sink(sink):
        """A +inf sink takes all the mass: the largest finite float32 does the same (every
        key's weight underflows to exactly 0) without the inf - inf of a softmax."""
        return sink.float().clamp(max=torch.finfo(torch.float32).max)

    @staticmethod
    def _scale(q, scale):
        """The attention scale: the case's own when it carries one, else ``D ** -0.5``."""
        return q.shape[-1] ** -0.5 if scale is None else scale

    # -- the protocol's ops (argument names and order of the oracle, ``reference``) -----------
    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None,
                                 scale=None):
        self._checked(ids)
        out, lse = dsa_sink_attention_fwd(q, kv, self._their_ids(ids, kv.shape[0], lengths),
                                          self._their_sink(sink), self._scale(q, scale),
                                          kv.shape[1] if v_dim is None else v_dim)
        inf = torch.full_like(lse, float("inf"))
        return out, torch.where(torch.isneginf(lse), inf, lse)   # contract: +inf without keys

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None, scale=None):
        self._checked(ids, lse)
        ninf = torch.full_like(lse, float("-inf"))
        lse = torch.where(torch.isposinf(lse), ninf, lse)       # back to their convention
        return dsa_sink_attention_bwd(q, kv, self._their_ids(ids, kv.shape[0], lengths),
                                      self._their_sink(sink), out, lse, dout,
                                      self._scale(q, scale),
                                      kv.shape[1] if v_dim is None else v_dim)
