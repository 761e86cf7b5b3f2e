"""The cuDNN graph-SDPA route to a sparse forward on SM90 (contract section 6), kept to measure.

cuDNN 1.32 has no DSA sparse-attention forward on SM90. Its classic graph SDPA can be run on
*gathered* keys (the recipe in ``shared/notes/cudnn-1.32-dsa-api.md`` section 4): every query
row is its own batch entry whose keys are its compacted selected rows of ``kv`` (a gathered
copy, ``T*K*D`` elements), ``seq_len_kv`` = the row's length, a padding mask and the per-head
sink token; Q is padded to two rows with ``seq_len_q = 1`` (one row with a sink is refused).
cuDNN's ``Stats`` include the sink, so the KV-only ``lse`` is recovered as
``Stats + log1p(-exp(sink - Stats))`` (ill-conditioned where the sink dominates; that is one
reason the Triton forward is the default). Rows with no valid slot get ``out = 0``,
``lse = +inf`` here (the kernel is given a length of 1 for them and its result is replaced).

This goes through ``torch.ops.cudnn.sdpa_fwd`` (registered by ``cudnn.sdpa.fwd.torch_op``),
which builds and caches one cuDNN graph per shape.
"""
from __future__ import annotations

import importlib
import math

import torch

__all__ = ["sdpa_gathered_forward"]


def sdpa_gathered_forward(q, kv, ids, lengths, sink, scale, dv):
    """``q [T,H,D]``, ``kv [S,D]``, compacted int32 ``ids [T,K]`` (valid first, -1 after) with
    ``lengths [T]``, float32 ``sink [H]``. Returns ``out [T,H,dv]`` (q's dtype) and float32
    ``lse [T,H]``."""
    importlib.import_module("cudnn.sdpa.fwd.torch_op")        # registers torch.ops.cudnn.sdpa_fwd
    T, H, D = q.shape
    K = ids.shape[1]
    dev = q.device
    if T == 0 or K == 0:
        return (torch.zeros((T, H, dv), dtype=q.dtype, device=dev),
                torch.full((T, H), math.inf, dtype=torch.float32, device=dev))
    safe = ids.clamp_min(0).to(torch.int64)
    kg = kv.index_select(0, safe.reshape(-1)).view(T, 1, K, D)       # gathered copy
    v = kg[..., :dv]
    qb = torch.zeros((T, 2, H, D), dtype=q.dtype, device=dev)
    qb[:, 0] = q
    q4 = qb.permute(0, 2, 1, 3)                                       # (T, H, 2, D)
    seq_q = torch.ones(T, dtype=torch.int32, device=dev)
    seq_kv = lengths.to(torch.int32).clamp_min(1).contiguous()
    o, stats = torch.ops.cudnn.sdpa_fwd(q4, kg, v, float(scale), sinks=sink.contiguous(),
                                        seq_len_q=seq_q, seq_len_kv=seq_kv, return_lse=True)
    out = o[:, :, 0, :]
    st = stats[:, :, 0, 0].to(torch.float32)
    lse = st + torch.log1p(-torch.exp(sink.unsqueeze(0) - st))
    empty = (lengths <= 0).unsqueeze(1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=dev), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out.contiguous(), lse.contiguous()
