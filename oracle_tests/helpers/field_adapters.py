"""Small adapters written here in the styles that public DSv4 references use (conventions tests).

Public pure-PyTorch references of DSv4 sparse attention (cuDNN-frontend's DSA test reference,
FlashMLA's test reference, Megatron-LM's unfused CSA attention) share a few conventions that
differ from the contract's argument forms but not from its mathematics. Each adapter below
writes one such convention in a few lines of our own code, and maps the contract's arguments
onto it, so that the suite (``oracle_tests/conformance/test_field_conventions.py``) can show which of them
the checker accepts ("must pass" controls) and which realistic mistakes it catches ("must fail"
controls).

Must pass:

- :class:`AutogradBackwardAdapter`: the backward recomputes the forward in float32 under torch
  autograd and calls ``torch.autograd.grad`` (``Delta`` from its own unrounded ``out``: the
  "recomputed" convention of contract section 6);
- :class:`MinusOnePaddedAdapter`: ids use ``-1`` for an unused slot and nothing else, plus a
  ``topk_length`` argument clamped to ``[0, K]``;
- :class:`Float32Adapter`: float32 inputs, accumulation, statistics and outputs;
- :class:`FiniteSinkAdapter`: a softmax that takes the sink into its running maximum and so
  cannot take a ``-inf`` or ``+inf`` sink; it declares ``sinks = "finite"`` and raises
  ``ValueError`` on any other sink; :class:`FiniteSinkMappedAdapter` maps ``+-inf`` onto the
  largest finite float32 of the same sign instead and takes every case;
- :class:`FieldRowsAdapter`: CSA key rows built per row from the document position (the
  compressed part, then the window part, ``-1`` padded), the way training codebases build them;
- :class:`FieldIndexerLossAdapter`: the indexer loss with the teacher written as the field
  writes it, ``exp(s - LSEf)`` in float32 (absolute, not per-head offsets); it declares
  ``sinks = "not-huge"`` (a ``2.4e38`` sink on every head underflows its whole teacher).

Must fail (each a mistake seen in real code, each caught by a named quantity):

- :class:`ValueDimScaleAdapter`: softmax scale ``v_dim ** -0.5`` instead of ``D ** -0.5``
  (wrong whenever ``v_dim < D``: ``out``, ``lse``);
- :class:`DroppedSinkAdapter`: the sink left out of the normaliser (``out``);
- :class:`IgnoredLengthsAdapter`: ``topk_length`` not passed on (``out``, ``lse``);
- :class:`WindowOffByOneAdapter`: the window part ``p-W .. p-1`` (a strict ``<`` where ``<=``
  belongs: the row misses itself; ``ids``);
- :class:`LseWithSinkAdapter`: returns the log-sum-exp *with* the sink (cuDNN classic SDPA's
  ``Stats``) where the contract's ``lse`` excludes it (``lse``);
- :class:`RadixOrderTopkAdapter`: Top-K on radix-ordered float keys, where ``+0.0`` ranks
  above ``-0.0`` (cuDNN's Top-K kernel and its reference); the contract ranks them equal and
  breaks the tie by id, so this is a documented semantic difference that must show on the
  signed-zero case and nowhere else.
"""
from __future__ import annotations

import torch

from dsv4_oracle.examples.megatron_style_adapter import MegatronStyleAdapter
from dsv4_oracle.reference.indices import compact_rows
from dsv4_oracle.reference.error_model import Precision

F32 = torch.float32
F32_MAX = torch.finfo(F32).max


# ---------------------------------------------------------------------------------------------
# field-style building blocks ("their" code: what a reference of the field does)
# ---------------------------------------------------------------------------------------------
def minus_one_ids(ids, num_keys, lengths=None):
    """Contract ids (any invalid id: negative, ``>= S``; slots at or past ``lengths``) -> the
    field's form, ``-1`` for every unused slot (the worked example's mapping)."""
    return MegatronStyleAdapter._their_ids(ids, num_keys, lengths)


def attention_fwd_f32(q, kv, topk_idxs, attn_sink, softmax_scale, v_dim, topk_length=None,
                      *, sink_in_lse=False, dtype=F32):
    """Gather attention with a per-head sink in ``dtype`` arithmetic (float32: the field's
    references). ``topk_idxs`` uses ``-1`` for an unused slot; ``topk_length`` (optional) is
    clamped to ``[0, K]``. Returns ``(out [T,H,v_dim], lse [T,H])`` in ``dtype``, ``lse`` the
    natural-log sum without the sink (with it when ``sink_in_lse``), ``-inf`` for a row
    without keys. Differentiable wrt ``q``, ``kv`` and ``attn_sink``."""
    K = topk_idxs.shape[1]
    used = topk_idxs >= 0
    if topk_length is not None:
        n = topk_length.long().clamp(0, K)
        used = used & (torch.arange(K, device=topk_idxs.device)[None, :] < n[:, None])
    k = kv[topk_idxs.clamp_min(0).long()].to(dtype)                          # [T, K, D]
    k = torch.where(used[..., None], k, torch.zeros_like(k))
    logits = torch.einsum("thd,tkd->thk", q.to(dtype), k) * softmax_scale
    logits = logits.masked_fill(~used[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                    # -inf: no key
    has = used.any(dim=-1)[:, None]
    # the sink enters through logaddexp (never exp(sink)); rows without keys get a finite
    # stand-in normaliser so that no -inf - -inf reaches autograd
    lse_f = torch.logaddexp(torch.where(has, lse, torch.zeros_like(lse)),
                            attn_sink.to(dtype)[None, :])
    p = torch.exp(logits - lse_f[..., None]).masked_fill(~used[:, None, :], 0.0)
    out = torch.einsum("thk,tkd->thd", p, k[..., :v_dim])
    if sink_in_lse:
        lse = torch.where(has, lse_f, torch.logaddexp(lse, attn_sink.to(dtype)[None, :]))
    return out, lse


def attention_bwd_given(q, kv, topk_idxs, attn_sink, out, lse, dout, softmax_scale, v_dim,
                        topk_length=None, *, dtype=F32):
    """The closed-form backward (contract section 6) from the ``out`` and ``lse`` it is handed
    (kernel style), in ``dtype``. ``lse = -inf`` marks a row without keys."""
    K = topk_idxs.shape[1]
    used = topk_idxs >= 0
    if topk_length is not None:
        n = topk_length.long().clamp(0, K)
        used = used & (torch.arange(K, device=topk_idxs.device)[None, :] < n[:, None])
    k = kv[topk_idxs.clamp_min(0).long()].to(dtype)
    k = torch.where(used[..., None], k, torch.zeros_like(k))
    logits = torch.einsum("thd,tkd->thk", q.to(dtype), k) * softmax_scale
    sink = attn_sink.to(dtype)[None, :]
    has = torch.isfinite(lse) | (lse > 0)
    lse_f = torch.logaddexp(torch.where(torch.isneginf(lse), torch.zeros_like(lse),
                                        lse.to(dtype)), sink)
    p = torch.exp(logits - lse_f[..., None]).masked_fill(~used[:, None, :], 0.0)
    do = dout.to(dtype)
    delta = (do * out.to(dtype)).sum(dim=-1)
    dp = torch.einsum("thd,tkd->thk", do, k[..., :v_dim])
    ds = p * (dp - delta[..., None])
    dq = softmax_scale * torch.einsum("thk,tkd->thd", ds, k)
    dk = softmax_scale * torch.einsum("thk,thd->tkd", ds, q.to(dtype))
    dk[..., :v_dim] += torch.einsum("thk,thd->tkd", p, do)
    dk = torch.where(used[..., None], dk, torch.zeros_like(dk))
    dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
    dkv.index_add_(0, topk_idxs.clamp_min(0).long().reshape(-1), dk.reshape(-1, kv.shape[1]))
    p_sink = torch.exp(sink - lse_f)
    p_sink = torch.where(torch.isnan(p_sink) | ~has, torch.zeros_like(p_sink), p_sink)
    dsink = -(p_sink * delta).sum(dim=0)
    return dq, dkv, dsink


def attention_fwd_running_max(q, kv, topk_idxs, attn_sink, softmax_scale, v_dim):
    """Megatron-style softmax: the sink joins the running maximum, ``exp(sink - max)`` joins
    the denominator. Exact for finite sinks (up to 2.4e38); a ``+inf`` sink gives
    ``inf - inf``, and a ``-inf`` sink on a row without keys gives ``-inf - -inf``: NaN.
    ``topk_idxs``: ``-1`` = unused. Returns ``(out, lse)`` in float32 (``lse``: ``-inf`` for a
    row without keys)."""
    used = topk_idxs >= 0
    k = kv[topk_idxs.clamp_min(0).long()].float()
    logits = (torch.einsum("thd,tkd->thk", q.float(), k) * softmax_scale).masked_fill(
        ~used[:, None, :], float("-inf"))
    sink = attn_sink.float().view(1, -1, 1)
    m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    e = torch.exp(logits - m)
    w = e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - m))
    out = torch.einsum("thk,tkd->thd", w, k[..., :v_dim])
    return out, torch.logsumexp(logits, dim=-1)


def field_csa_rows(layout, window, ratio, compressed_ids=None, *, window_shift=0):
    """CSA key rows built per row the way training codebases do: for a real row at document
    position ``p`` of a document starting at physical row ``s``, the compressed part (the Top-K
    ids, or every visible group for HCA) then the window rows ``s + j`` for
    ``j = p-W+1+window_shift .. p+window_shift`` clipped to ``[0, p]``; ``-1`` elsewhere, then
    compacted. ``window_shift=-1`` is the off-by-one of a strict ``<``."""
    T = layout.num_rows
    pos, real, start = layout.pos, layout.is_real, layout.doc_start()
    j = pos[:, None] - window + 1 + window_shift + torch.arange(window)[None, :]
    ok = real[:, None] & (j >= 0) & (j <= pos[:, None])
    win = torch.where(ok, start[:, None] + j, torch.full_like(j, -1))
    if ratio == 0:
        cmp = win[:, :0]
    else:
        base = layout.compressed_offsets(ratio)[layout.doc.clamp_min(0)]
        vis = layout.visible_compressed(ratio)
        if compressed_ids is None:
            width = int(layout.compressed_counts(ratio).max()) if layout.num_docs else 0
            g = torch.arange(width)[None, :]
            cmp = torch.where((g < vis[:, None]) & real[:, None], base[:, None] + g,
                              torch.full_like(g.expand(T, width), -1))
        else:
            c = compressed_ids.to("cpu").long()
            cmp = torch.where((c >= 0) & real[:, None], c, torch.full_like(c, -1))
        cmp = torch.where(cmp >= 0, cmp + T, cmp)
    return compact_rows(torch.cat([cmp, win], dim=1))


def radix_keys(values):
    """Float32 values as int64 keys in radix order (``+0.0`` above ``-0.0``), as cuDNN's Top-K
    kernel and its reference order them."""
    bits = values.to(F32).view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, ~bits, bits ^ 0x80000000)


# ---------------------------------------------------------------------------------------------
# the adapters
# ---------------------------------------------------------------------------------------------
def _vdim(kv, v_dim):
    return kv.shape[1] if v_dim is None else v_dim


def _contract_lse(lse):
    """The field's ``-inf`` for a row without keys -> the contract's ``+inf``."""
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)


class MinusOnePaddedAdapter:
    """``-1``-padded ids plus ``topk_length`` (cuDNN DSA / FlashMLA style); float32 math on the
    input dtype, ``out`` and the gradients stored in the input dtype; backward from the given
    ``out`` and ``lse``."""

    name = "field: -1 padded ids + topk_length"
    ops = ("sparse_attention_forward", "sparse_attention_backward")
    pass_lengths = True

    def _ids(self, ids, kv):
        return minus_one_ids(ids, kv.shape[0])           # lengths travel as topk_length

    def _len(self, lengths):
        return lengths if self.pass_lengths else None

    def _scale(self, q, v_dim):
        return q.shape[-1] ** -0.5

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = attention_fwd_f32(q, kv, self._ids(ids, kv), sink.float(),
                                     self._scale(q, v_dim), _vdim(kv, v_dim), self._len(lengths))
        return out.to(q.dtype), _contract_lse(lse)

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
        dq, dkv, dsink = attention_bwd_given(q, kv, self._ids(ids, kv), sink.float(), out, lse,
                                             dout, self._scale(q, v_dim), _vdim(kv, v_dim),
                                             self._len(lengths))
        return dq.to(q.dtype), dkv.to(kv.dtype), dsink


class IgnoredLengthsAdapter(MinusOnePaddedAdapter):
    """Must fail: ``topk_length`` is not passed on (slots past it are attended)."""

    name = "field (must fail): topk_length ignored"
    pass_lengths = False


class ValueDimScaleAdapter(MinusOnePaddedAdapter):
    """Must fail where ``v_dim < D``: softmax scale ``v_dim ** -0.5``."""

    name = "field (must fail): scale from v_dim"

    def _scale(self, q, v_dim):
        return (q.shape[-1] if v_dim is None else v_dim) ** -0.5


class DroppedSinkAdapter(MinusOnePaddedAdapter):
    """Must fail: the sink is left out of the normaliser (forward only)."""

    name = "field (must fail): sink dropped"
    ops = ("sparse_attention_forward",)

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        return super().sparse_attention_forward(q, kv, ids, torch.full_like(sink, -float("inf")),
                                                v_dim=v_dim, lengths=lengths)


class LseWithSinkAdapter(MinusOnePaddedAdapter):
    """Must fail: returns the log-sum-exp including the sink (forward only)."""

    name = "field (must fail): lse includes the sink"
    ops = ("sparse_attention_forward",)

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = attention_fwd_f32(q, kv, self._ids(ids, kv), sink.float(), q.shape[-1] ** -0.5,
                                     _vdim(kv, v_dim), lengths, sink_in_lse=True)
        return out.to(q.dtype), _contract_lse(lse)


class Float32Adapter(MinusOnePaddedAdapter):
    """A float32 reference: inputs upcast to float32, float32 accumulation and statistics, every
    output float32 (``precision``: io float32)."""

    name = "field: float32 reference"

    def precision(self, dtype):
        return Precision(acc=F32, io=F32, stats=F32)

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = attention_fwd_f32(q.float(), kv.float(), self._ids(ids, kv), sink.float(),
                                     q.shape[-1] ** -0.5, _vdim(kv, v_dim), lengths)
        return out, _contract_lse(lse)

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
        return attention_bwd_given(q.float(), kv.float(), self._ids(ids, kv), sink.float(),
                                   out.float(), lse, dout.float(), q.shape[-1] ** -0.5,
                                   _vdim(kv, v_dim), lengths)


class AutogradBackwardAdapter(MinusOnePaddedAdapter):
    """The backward of the field's references: recompute the float32 forward with autograd and
    call ``torch.autograd.grad`` (the ``out`` and ``lse`` handed in are not used; ``Delta``
    comes from the recomputed, unrounded ``out``). A ``+inf`` sink is mapped to the largest
    finite float32 first (``logaddexp``'s gradient at ``+inf`` is ``inf - inf``)."""

    name = "field: autograd-recomputed backward"

    def recompute(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        """The float32 forward the backward differentiates: ``(out, lse, leaves)``."""
        leaves = (q.detach().float().requires_grad_(True),
                  kv.detach().float().requires_grad_(True),
                  sink.detach().float().clamp(max=F32_MAX).requires_grad_(True))
        with torch.enable_grad():
            out, lse = attention_fwd_f32(leaves[0], leaves[1], self._ids(ids, kv), leaves[2],
                                         q.shape[-1] ** -0.5, _vdim(kv, v_dim), lengths)
        return out, lse, leaves

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        o, _, leaves = self.recompute(q, kv, ids, sink, v_dim=v_dim, lengths=lengths)
        dq, dkv, dsink = torch.autograd.grad(o, leaves, grad_outputs=dout.float())
        return dq.to(q.dtype), dkv.to(kv.dtype), dsink


class FiniteSinkAdapter:
    """A Megatron-style forward (the sink joins the running maximum) that cannot take a
    non-finite sink. It declares ``sinks = "finite"`` and raises ``ValueError`` otherwise; the
    suite runs it only on cases whose sinks are finite."""

    name = "field: finite-only sink"
    ops = ("sparse_attention_forward",)
    sinks = "finite"

    def _sink(self, sink):
        if not bool(torch.isfinite(sink).all()):
            raise ValueError("sink: this implementation takes finite sinks only")
        return sink

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = attention_fwd_running_max(q, kv, minus_one_ids(ids, kv.shape[0], lengths),
                                             self._sink(sink), q.shape[-1] ** -0.5,
                                             _vdim(kv, v_dim))
        return out.to(q.dtype), _contract_lse(lse)


class FiniteSinkMappedAdapter(FiniteSinkAdapter):
    """The same forward with ``-inf``/``+inf`` sinks mapped to ``-/+`` the largest finite
    float32 (``exp(sink - max)`` is then exactly 0 or takes all the mass)."""

    name = "field: finite-only sink, mapped"
    sinks = "any"

    def _sink(self, sink):
        return sink.float().clamp(-F32_MAX, F32_MAX)


class FieldRowsAdapter:
    """CSA key rows built per row from the document position (:func:`field_csa_rows`)."""

    name = "field: per-row CSA key rows"
    ops = ("build_csa_indices",)
    window_shift = 0

    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        return field_csa_rows(layout, window, ratio, compressed_ids,
                              window_shift=self.window_shift)


class WindowOffByOneAdapter(FieldRowsAdapter):
    """Must fail: the window part is ``p-W .. p-1`` (the row misses itself)."""

    name = "field (must fail): window off by one"
    window_shift = -1


class RadixOrderTopkAdapter:
    """Top-K on radix-ordered keys (``+0.0`` above ``-0.0``), ties to the smaller column, ids
    emitted ascending (the contract's ``order="id"``) or in selection order (``"score"``);
    ``-inf`` columns never selected."""

    name = "field (semantic difference): +0 before -0 Top-K"
    ops = ("stable_topk",)

    def stable_topk(self, scores, k, *, order="id"):
        T, N = scores.shape
        keys = radix_keys(scores)
        cand = ~torch.isneginf(scores)
        keys = keys.masked_fill(~cand, -1)
        sel = torch.argsort(keys, dim=1, descending=True, stable=True)[:, :min(k, N)]
        n = cand.sum(dim=1).clamp(max=k)
        slot = torch.arange(sel.shape[1])[None, :]
        sel = torch.where(slot < n[:, None], sel, torch.full_like(sel, -1))
        if order == "id":
            big = torch.where(sel >= 0, sel, torch.full_like(sel, N + 1))
            sel = torch.sort(big, dim=1).values
            sel = torch.where(sel > N, torch.full_like(sel, -1), sel)
        ids = torch.full((T, k), -1, dtype=torch.int64)
        ids[:, :sel.shape[1]] = sel
        return ids, n


class FieldIndexerLossAdapter:
    """The sparse indexer loss the way the field's references write its teacher (cuDNN's
    ``ref_sparse_attn_score_recompute`` given the full normaliser, Megatron's CSA teacher):
    in float32, ``A[t,h,c] = exp(scale * <q, kv_cmp[c]> - LSEf[t,h])`` with
    ``LSEf = logaddexp(lse, sink)`` (a ``+inf`` sink silences its head: ``A = 0``), the teacher
    ``sum_h A / sum_{c,h} A``, the student the softmax of the selected index scores, the KL with
    the ``2**-126`` floor, a row without teacher mass counted 0, ``loss = coeff * sum KL / N``.
    It computes ``s - LSEf`` in absolute terms, so a sink as large as ``2.4e38`` on every head
    underflows the whole teacher: it does not take ``sink-large`` (``sinks = "not-huge"``)."""

    name = "field: float32 indexer loss (absolute teacher)"
    ops = ("sparse_indexer_loss",)
    sinks = "not-huge"

    def precision(self, dtype):
        return Precision(acc=F32, io=F32, stats=F32)

    def sparse_indexer_loss(self, q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *,
                            coeff):
        T, H, D = q.shape
        C = kv_cmp.shape[0]
        ids = compressed_ids.long()
        valid = (ids >= 0) & (ids < C) & layout.is_real.to(ids.device)[:, None]
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        k = kv_cmp.float()[safe] if C else torch.zeros((*ids.shape, D))
        lse_f = torch.logaddexp(lse.float(), sink.float()[None, :])                # [T, H]
        s = torch.einsum("thd,tkd->thk", q.float(), k) * D ** -0.5
        a = torch.exp(s - lse_f[..., None]).masked_fill(~valid[:, None, :], 0.0)
        a = torch.where(torch.isposinf(lse_f)[..., None], torch.zeros_like(a), a)
        mass = a.sum(dim=1)                                                       # [T, K]
        total = mass.sum(dim=1, keepdim=True)
        has = total > 0
        target = torch.where(has, mass / torch.where(has, total, torch.ones_like(total)), 0.0)
        sc = torch.gather(index_scores.float(), 1, safe) if C else torch.zeros(ids.shape)
        sc = sc.masked_fill(~valid, float("-inf"))
        any_valid = valid.any(dim=1, keepdim=True)
        predict = torch.softmax(torch.where(any_valid, sc, torch.zeros_like(sc)), dim=1)
        predict = predict.masked_fill(~valid, 0.0)
        f = 2.0 ** -126
        tc, pc = target.clamp(min=f), predict.clamp(min=f)
        kl = (tc * (tc.log() - pc.log())).masked_fill(~valid, 0.0).sum(dim=1)
        kl = torch.where(has[:, 0], kl, torch.zeros_like(kl))
        n = layout.num_real
        loss = coeff * kl.sum() / n if n else kl.sum() * 0
        return loss, kl, target, predict
