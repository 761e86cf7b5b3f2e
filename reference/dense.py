"""An independent dense-mask formulation, for cross-checking the gather oracle (sections 3-8).

This is *not* the contract's implementation: it is the textbook approach of the public
anchors (build a key-count matrix over the whole logical key buffer, run full softmax
attention, differentiate with autograd). It is O(T*S) in memory and time, so it is only for
small cases in the self-tests and for the dense-vs-gather benchmark. It shares no code with the
gather oracle beyond argument conversion.
"""
from __future__ import annotations

import math

import torch

INF = math.inf


def slot_counts(ids: torch.Tensor, num_keys: int, lengths=None) -> torch.Tensor:
    """``M[t, s]`` = how many valid slots of row ``t`` hold key ``s`` (duplicates count per slot)."""
    ids = ids.to(torch.int64)
    T, K = ids.shape
    ok = (ids >= 0) & (ids < num_keys)
    if lengths is not None:
        ok &= torch.arange(K).unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
    counts = torch.zeros((T, num_keys), dtype=torch.float64)
    rows = torch.arange(T).unsqueeze(1).expand(T, K)
    counts.index_put_((rows[ok], ids[ok]), torch.ones(int(ok.sum()), dtype=torch.float64),
                      accumulate=True)
    return counts


def dense_attention(q, kv, counts, sink, scale, v_dim, heads_per_step=None):
    """Full softmax attention over every key with log-count bias: returns ``(out, lse)``.

    Differentiable (autograd gives the dense backward). ``counts [T, S]`` from :func:`slot_counts`.
    Heads are processed ``heads_per_step`` at a time to bound memory.
    """
    T, H, D = q.shape
    bias = torch.log(counts)                        # -inf where a key is not selected
    has = counts.sum(dim=1) > 0                     # rows with at least one valid slot
    step = H if heads_per_step is None else heads_per_step
    outs, lses = [], []
    for h0 in range(0, H, step):
        h1 = min(h0 + step, H)
        s = scale * torch.einsum("thd,sd->ths", q[:, h0:h1], kv) + bias.unsqueeze(1)
        s_safe = torch.where(has[:, None, None], s, torch.zeros_like(s))
        lse = torch.logsumexp(s_safe, dim=-1)
        lse = torch.where(has[:, None], lse, torch.full_like(lse, INF))
        lse_safe = torch.where(has[:, None], lse, torch.zeros_like(lse))
        denom = torch.logaddexp(lse_safe, sink[h0:h1].unsqueeze(0))
        p = torch.exp(s_safe - denom.unsqueeze(-1)) * has[:, None, None]
        outs.append(torch.einsum("ths,sd->thd", p, kv[:, :v_dim]))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def dense_visibility(layout, window: int, ratio: int):
    """Boolean ``[T, T + C]`` visibility of section 3 over the logical key buffer (raw, then
    compressed), built directly from the definitions with broadcasting."""
    doc, pos, real = layout.doc, layout.pos, layout.is_real
    same = (doc.unsqueeze(1) == doc.unsqueeze(0)) & real.unsqueeze(1)
    dp = pos.unsqueeze(1) - pos.unsqueeze(0)
    raw = same & (dp >= 0) & (dp < window)
    if ratio == 0:
        return raw
    counts = layout.compressed_counts(ratio)
    cdoc = torch.repeat_interleave(torch.arange(layout.num_docs), counts)
    cg = torch.arange(int(counts.sum())) - layout.compressed_offsets(ratio)[cdoc]
    cmp = (doc.unsqueeze(1) == cdoc.unsqueeze(0)) & real.unsqueeze(1) & \
          ((cg.unsqueeze(0) + 1) * ratio - 1 <= pos.unsqueeze(1))
    return torch.cat([raw, cmp], dim=1)
