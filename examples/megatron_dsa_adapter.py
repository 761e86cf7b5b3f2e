"""A Megatron-style DeepSeek-V3.2 DSA adapter whose choices are the contract's named policies.

Megatron-Core's DSA module computes DeepSeek-V3.2's sparse attention the way a training
codebase does: full score matrices masked by row-wise ``[start, end)`` bounds, ``torch.topk``,
per-head masked softmaxes. Where its choices differ from the contract's defaults, each is a
named policy of contract section 5.2, and this adapter takes each as a constructor argument
(Megatron-Core's choice is the default) and declares exactly its configuration in ``policies``:

================  ============================================  ===========================
policy            what this adapter does                        Megatron-Core's choice
================  ============================================  ===========================
``loss_norm``     ``"rows"``: sum over every row / T;           ``rows`` (``real`` with a
                  ``"real"``: sum over real rows / N            real-token mask)
``padding_rows``  ``"attend"``: bounds from the padded          ``attend``
                  documents (padding rows score and attend);
                  ``"sink_only"``: only real rows see keys
``topk_ties``     ``"any"``: ``torch.topk`` (no tie rule);      ``any``
                  ``"by_id"``: a stable sort (smaller id wins)
``index_scale``   ``"dim_heads"``: weights times                ``dim_heads``
                  ``(H_I D_I)^-1/2``; ``"dim"``: ``D_I^-1/2``
``index_grad``    ``"exact"``: ``p - tau``; ``"clipped"``: the  ``exact``
                  contract's floored form; ``"autograd"``:
                  autograd through the loss as written
``kl_form``       ``"log_softmax"``: ``tau (log max(tau,        ``log_softmax``
                  1e-10) - log_softmax)``; ``"clipped"``
``teacher``       ``"dense"``: every visible key, each head     ``dense`` (``sparse`` with
                  normalised over them; ``"sparse"``: the       the sparse indexer loss)
                  selected keys, normalised by the
                  attention's own ``lse`` and sink
================  ============================================  ===========================

Run it (Megatron-Core's configuration, then the sparse loss over real tokens)::

    dsv4-oracle check --impl dsv4_oracle.examples.megatron_dsa_adapter:MegatronDSAAdapter \\
        --catalog quick --case 'dsa-*'
    dsv4-oracle check --impl dsv4_oracle.examples.megatron_dsa_adapter:MegatronDSASparseReal \\
        --catalog quick --case 'dsa-*'

Under its declared policies it passes; ``--policy default`` judges it under the contract's
defaults instead, and each policy it departs from then fails the quantities that policy governs.
(The full catalog's ``dsa-nan-poison`` does not apply under ``padding_rows="attend"``: its NaN
key rows are unselectable by real rows only, and padding rows that attend see them.)

It implements the indexer, Top-K, attention forward and backward (those of
``megatron_style_adapter``: gathered slots, float32 statistics), the indexer loss and its
gradient; the CSA rows come from the oracle. It is written in the style of Megatron-Core's
code, not from it. Where Megatron-Core's unfused attention gathers key row 0 for an unused
slot (``0 * NaN`` then leaks a NaN key row into every row), this adapter zeroes unused slots as
the contract requires. ``loss_norm="rank_mean"`` differs from ``"real"`` only under context
parallelism and is not implemented here.
"""
from __future__ import annotations

import torch

from dsv4_oracle.reference.constants import GRAD_FLOOR, LOSS_FLOOR
from dsv4_oracle.reference.contract_policies import resolve_policies

from .megatron_style_adapter import MegatronStyleAdapter

__all__ = ["MEGATRON_POLICIES", "MegatronDSAAdapter", "MegatronDSASparseReal"]

F32 = torch.float32
INF = float("inf")
# Megatron-Core's choices (contract section 5.2), the default configuration
MEGATRON_POLICIES = {"loss_norm": "rows", "padding_rows": "attend", "topk_ties": "any",
                     "index_scale": "dim_heads", "index_grad": "exact",
                     "kl_form": "log_softmax", "teacher": "dense"}
# Megatron-Core's indexer-loss epsilon: log max(tau, eps) in the KL, max(sum, eps) when the
# teacher is L1-normalised
EPS = 1e-10


class MegatronDSAAdapter(MegatronStyleAdapter):
    """The DSA ops in Megatron-Core's style; keyword arguments select each policy (default:
    Megatron-Core's choice, :data:`MEGATRON_POLICIES`). ``config`` is what the ops do;
    ``policies`` declares it, all seven."""

    def __init__(self, **policies):
        unknown = set(policies) - set(MEGATRON_POLICIES)
        if unknown:
            raise TypeError(f"MegatronDSAAdapter: unknown policy argument {sorted(unknown)[0]!r}; "
                            f"the policies are {', '.join(MEGATRON_POLICIES)}")
        pol = resolve_policies({**MEGATRON_POLICIES, **policies})
        if pol["loss_norm"] == "rank_mean":
            raise ValueError("loss_norm='rank_mean' differs from 'real' only under context "
                             "parallelism; this single-device adapter does not implement it")
        self.config = pol                  # what the ops do
        self.policies = dict(pol)          # what the adapter declares: exactly that
        differs = {k: v for k, v in pol.items() if v != MEGATRON_POLICIES[k]}
        self.name = "megatron-style DSA (example)" + (
            "; " + ", ".join(f"{k}={v}" for k, v in differs.items()) if differs else "")

    # -- contract section 3: what a row sees --------------------------------------------------
    def _sees(self, layout) -> torch.Tensor:
        """Rows with visible keys: real rows, and padding rows under ``padding_rows="attend"``
        (capacity rows never)."""
        if self.config["padding_rows"] == "attend":
            return layout.doc >= 0
        return layout.is_real

    def _bounds(self, layout, ratio: int):
        """Per row the ``[start, end)`` bounds of its visible compressed keys: the first group
        of its padded document, and ``min((pos + 1) // ratio, n_b)`` groups from there."""
        n = layout.compressed_counts(ratio)
        start = layout.compressed_offsets(ratio)[layout.doc.clamp_min(0)]
        vis = torch.minimum((layout.pos + 1) // ratio, n[layout.doc.clamp_min(0)]) \
            if n.numel() else torch.zeros_like(start)
        return start, torch.where(self._sees(layout), start + vis, start)

    def _index_scale(self, heads: int, dim: int) -> float:
        if self.config["index_scale"] == "dim_heads":
            return (heads * dim) ** -0.5
        return dim ** -0.5

    # -- contract section 7: the indexer --------------------------------------------------------
    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        """``[T, C]``: ``sum_h (w scale)[t,h] relu(<q_idx[t,h], k_idx[c]>)`` as a full matrix,
        ``-inf`` outside each row's bounds."""
        T, HI, DI = q_idx.shape
        C = k_idx.shape[0]
        w = weights.to(F32) * self._index_scale(HI, DI)
        z = torch.einsum("thd,cd->thc", q_idx.to(F32), k_idx.to(F32))
        scores = (torch.relu(z) * w.unsqueeze(-1)).sum(dim=1)
        start, end = self._bounds(layout, ratio)
        col = torch.arange(C)
        seen = (col.unsqueeze(0) >= start.unsqueeze(1)) & (col.unsqueeze(0) < end.unsqueeze(1))
        return scores.masked_fill(~seen, -INF)

    # -- contract section 4: Top-K --------------------------------------------------------------
    def stable_topk(self, scores, k, *, order="id"):
        """``torch.topk`` (``topk_ties="any"``) or a stable descending sort (``"by_id"``) of the
        scores, ``-inf`` slots ``-1``; ``order="id"``: the selected ids ascending."""
        if bool(torch.isnan(scores).any()):               # contract section 4: no NaN ranks
            raise ValueError("scores hold NaN: the Top-K selection is undefined")
        T, C = scores.shape
        take = min(k, C)
        s = scores.to(F32) + 0.0                          # -0.0 == +0.0
        if self.config["topk_ties"] == "any":
            top, ids = torch.topk(s, take, dim=1)
        else:
            top, ids = torch.sort(s, dim=1, descending=True, stable=True)
            top, ids = top[:, :take], ids[:, :take]
        ids = ids.masked_fill(top == -INF, -1)
        if order == "id":
            ids = torch.sort(torch.where(ids >= 0, ids, C), dim=1).values
            ids = ids.masked_fill(ids == C, -1)
        ids = torch.cat([ids, ids.new_full((T, k - take), -1)], dim=1)
        return ids.to(torch.int32), (ids >= 0).sum(dim=1).to(torch.int32)

    # -- contract section 8: the indexer loss --------------------------------------------------
    def _keys(self, compressed_ids, index_scores, layout) -> torch.Tensor:
        """bool ``[T, C]``: the keys each row's teacher and student range over: the selected
        ones (sparse teacher), or every visible one, where the scores are finite (dense)."""
        T, C = index_scores.shape
        if self.config["teacher"] == "dense":
            keys = index_scores > -INF
        else:
            ids = compressed_ids.long()
            ok = (ids >= 0) & (ids < C)
            keys = torch.zeros((T, C + 1), dtype=torch.bool).scatter_(
                1, torch.where(ok, ids, C), True)[:, :C]
        return keys & self._sees(layout).unsqueeze(1)

    def _teacher(self, q, kv_cmp, sink, lse, keys, scale) -> torch.Tensor:
        """``[T, C]``: per head ``exp(s - norm_h)`` summed over the heads and L1-normalised, with
        ``norm_h = logaddexp(lse_h, sink_h)``: the attention's ``lse`` (sparse teacher) or each
        head's own log-sum-exp over the keys (dense teacher). In log space, every head shifted by
        one per-row constant (the smallest finite normaliser), so huge sinks stay exact."""
        if not keys.shape[1]:
            return torch.zeros(keys.shape, dtype=F32)
        att = torch.einsum("thd,cd->thc", q.to(F32), kv_cmp.to(F32)) * scale
        att = att.masked_fill(~keys.unsqueeze(1), -INF)
        own = torch.logsumexp(att, dim=-1) if self.config["teacher"] == "dense" else lse.to(F32)
        norm = torch.logaddexp(own, sink.to(F32).unsqueeze(0))            # [T, H]
        live = torch.isfinite(norm)
        low = torch.where(live, norm, torch.full_like(norm, INF)).amin(dim=1, keepdim=True)
        off = torch.where(live, norm - torch.where(torch.isfinite(low), low, 0.0),
                          torch.full_like(norm, INF))
        log_a = (att - off.unsqueeze(-1)).masked_fill(~keys.unsqueeze(1), -INF)
        top = log_a.amax(dim=(1, 2), keepdim=True)
        a = torch.exp(log_a - torch.where(torch.isfinite(top), top, 0.0)).sum(dim=1)
        return a / a.sum(dim=1, keepdim=True).clamp_min(EPS)

    @staticmethod
    def _log_softmax(logits, keys):
        """``log_softmax`` of ``logits`` over ``keys`` per row (0 off the keys)."""
        x = logits.masked_fill(~keys, torch.finfo(logits.dtype).min)
        x = torch.where(keys.any(dim=1, keepdim=True), x, torch.zeros_like(x))
        return torch.log_softmax(x, dim=1).masked_fill(~keys, 0.0)

    def _kl_terms(self, tau, log_p, p, keys):
        """Per key the KL terms under ``kl_form`` (0 off ``keys`` and on rows without teacher
        mass)."""
        if self.config["kl_form"] == "log_softmax":
            terms = tau * (torch.log(tau.clamp_min(EPS)) - log_p)
        else:
            a = tau.clamp_min(LOSS_FLOOR)
            terms = a * (torch.log(a) - torch.log(p.clamp_min(LOSS_FLOOR)))
        mass = (keys & (tau > 0)).any(dim=1, keepdim=True)
        return torch.where(keys & mass, terms, torch.zeros_like(terms))

    def _row_weights(self, layout, num_real):
        """Per row ``1 / N`` (``loss_norm="real"``: real rows, ``N`` real tokens) or ``1 / T``
        (``"rows"``: every row)."""
        T = layout.num_rows
        if self.config["loss_norm"] == "rows":
            return torch.full((T,), 1.0 / max(T, 1))
        return layout.is_real.to(F32) / max(num_real, 1)

    def sparse_indexer_loss(self, q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *,
                            coeff, scale=None):
        """The teacher and the student as full ``[T, C]`` matrices over the keys of
        :meth:`_keys`; ``target`` and ``predict`` by slot of ``compressed_ids`` (sparse teacher)
        or by compressed id (dense)."""
        T, H, D = q.shape
        scale = D ** -0.5 if scale is None else scale
        isc = index_scores.to(F32)
        keys = self._keys(compressed_ids, isc, layout)
        # contract section 8: the values the loss refuses
        if bool((keys & (isc == INF)).any()):
            raise ValueError("index_scores is +inf on a key of the loss: the student is undefined")
        if self.config["teacher"] == "sparse" and bool((lse == -INF).any()):
            raise ValueError("lse holds -inf: the log of an empty sum is +inf, never -inf")
        tau = self._teacher(q, kv_cmp, sink, lse, keys, scale)
        log_p = self._log_softmax(isc, keys)
        p = torch.where(keys, torch.exp(log_p), torch.zeros_like(log_p))
        kl = self._kl_terms(tau, log_p, p, keys).sum(dim=1)
        loss = coeff * (kl * self._row_weights(layout, layout.num_real)).sum()
        if self.config["teacher"] == "dense":
            return loss, kl, tau, p
        ids = compressed_ids.long()
        ok = (ids >= 0) & (ids < isc.shape[1])
        safe = torch.where(ok, ids, 0)
        zero = torch.zeros((), dtype=F32)
        tau, p = (torch.cat([t, t.new_zeros((T, 1))], dim=1) for t in (tau, p))  # C = 0 too
        return (loss, kl, torch.where(ok, tau.gather(1, safe), zero),
                torch.where(ok, p.gather(1, safe), zero))

    # -- contract section 8: its gradient -------------------------------------------------------
    def _logit_grad(self, logits, valid, tau, p, gs):
        """``dL/dI`` per slot ``[T, K]`` under ``index_grad`` (``logits``: the indexer logits of
        the slots, read by the autograd form only)."""
        form = self.config["index_grad"]
        if form == "exact":                       # p - tau on rows with teacher mass
            return gs * (p * tau.sum(dim=1, keepdim=True) - tau)
        if form == "clipped":
            tm = torch.where(valid & (p >= GRAD_FLOOR), tau.clamp_min(GRAD_FLOOR), 0.0)
            return gs * (p * tm.sum(dim=1, keepdim=True) - tm)
        with torch.enable_grad():                 # autograd through the loss as written
            leaf = logits.detach().requires_grad_(True)
            log_p = self._log_softmax(leaf, valid)
            p_a = torch.where(valid, torch.exp(log_p), torch.zeros_like(log_p))
            kl = self._kl_terms(tau, log_p, p_a, valid).sum(dim=1)
            (g,) = torch.autograd.grad((kl * gs.squeeze(1)).sum(), leaf)
        return g

    def sparse_indexer_loss_grad(self, q_idx, k_idx, weights, compressed_ids, target, predict, *,
                                 coeff, num_real):
        """The logit gradient of :meth:`_logit_grad` on the selected slots, chained through the
        ReLU (gate ``z > 0``) and the scaled weights with full ``[T, H_I, C]`` matrices."""
        T, HI, DI = q_idx.shape
        C = k_idx.shape[0]
        ids = compressed_ids.long()
        for name, t in (("target", target), ("predict", predict)):
            if bool((t < 0).any()):                       # contract section 8
                raise ValueError(f"{name} holds a negative value: it is a distribution")
        if tuple(target.shape) != tuple(ids.shape) or tuple(predict.shape) != tuple(ids.shape):
            raise ValueError(f"target {tuple(target.shape)} and predict {tuple(predict.shape)} "
                             f"must have the shape of compressed_ids {tuple(ids.shape)}")
        ok = (ids >= 0) & (ids < C)
        safe = torch.where(ok, ids, C)
        tau = torch.where(ok, target.to(F32), 0.0)
        p = torch.where(ok, predict.to(F32), 0.0)
        valid = ok & (tau > 0).any(dim=1, keepdim=True)
        if self.config["loss_norm"] == "rows":
            gs = torch.full((T, 1), coeff / max(T, 1))
        elif isinstance(num_real, torch.Tensor):  # per-row divisors (+inf: the row does not count)
            gs = (coeff / num_real.to(F32)).view(T, 1)
        else:
            gs = torch.full((T, 1), coeff / max(int(num_real), 1))
        scale = self._index_scale(HI, DI)
        q, k, w = q_idx.to(F32), k_idx.to(F32), weights.to(F32)
        # key rows no slot selects are zeroed: in the full matrices below, 0 * NaN would leak
        # an unselectable NaN key row into every row
        used = torch.zeros(C + 1, dtype=torch.bool).index_fill_(0, safe[ok], True)[:C]
        k = torch.where(used.unsqueeze(1), k, 0.0)
        z = torch.einsum("thd,cd->thc", q, k)                              # [T, H_I, C]
        dense_logits = scale * (torch.relu(z) * w.unsqueeze(-1)).sum(dim=1)
        logits = torch.cat([dense_logits, dense_logits.new_zeros((T, 1))], dim=1).gather(1, safe)
        g = torch.where(valid, self._logit_grad(logits, valid, tau, p, gs), 0.0)
        dense = torch.zeros((T, C + 1), dtype=F32).scatter_add_(
            1, torch.where(valid, ids, C), g)[:, :C]                      # [T, C]
        dw = scale * (torch.relu(z) * dense.unsqueeze(1)).sum(dim=-1)
        gate = (z > 0).to(F32) * (scale * w).unsqueeze(-1) * dense.unsqueeze(1)
        dq = torch.einsum("thc,cd->thd", gate, k)
        dk = torch.einsum("thc,thd->cd", gate, q)
        return dq.to(q_idx.dtype), dw.to(weights.dtype), dk.to(k_idx.dtype)


class MegatronDSASparseReal(MegatronDSAAdapter):
    """Megatron-Core's sparse indexer loss over real tokens (a real-token mask given)."""

    def __init__(self, **policies):
        super().__init__(**{"teacher": "sparse", "loss_norm": "real", **policies})
