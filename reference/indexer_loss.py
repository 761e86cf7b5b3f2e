"""Sparse indexer KL loss and its gradients (contract section 8)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import as_float64, as_index, as_int, as_real, check_dim, choice, head_dim
from ._checks import chunk_rows as rows_per_chunk
from ._pointwise import logaddexp
from ._reduce import (_round_up, carve, fold_slot_rows_into, ordered_sum, row_bmm,
                      row_bmm_buffer, row_extents, row_runs)
from .constants import CHUNK_BYTES, GRAD_FLOOR, LOSS_FLOOR, SLOT_MULTIPLE
from .layout import PackedLayout

__all__ = ["IndexerLoss", "KL_FORMS", "GRAD_MODES", "head_normalisers", "loss_normalisers",
           "sparse_indexer_loss", "sparse_indexer_loss_grad"]

INF = math.inf
# section 8 and its policies (5.2): the per-row KL and the gradient wrt the indexer logits
KL_FORMS = ("clipped", "log_softmax")
GRAD_MODES = ("clipped", "autograd", "exact")
# the teacher floor of the "log_softmax" KL form: tau (log max(tau, 1e-10) - log_softmax)
LOG_SOFTMAX_TEACHER_FLOOR = 1e-10


class IndexerLoss(NamedTuple):
    """Result of :func:`sparse_indexer_loss` (all float64 CPU tensors)."""

    loss: torch.Tensor      # 0-dim: coeff * sum_t KL[t] / N
    kl: torch.Tensor        # [T]: per-row KL (0 on padding rows and rows with no selection)
    target: torch.Tensor    # [T, Kc]: teacher tau on valid slots, 0 elsewhere
    predict: torch.Tensor   # [T, Kc]: student p on valid slots, 0 elsewhere
    num_real: object        # N used for the normalisation: an int, or per-row divisors [T]


def _slot_mask(ids: torch.Tensor, num: int) -> torch.Tensor:
    return (ids >= 0) & (ids < num)


def _masked_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``mask``; 0 off the mask and on rows whose masked
    entries are all ``-inf`` (an empty last dimension: no slot, nothing to normalise)."""
    if not x.shape[-1]:
        return x.clone()
    x = x.masked_fill(~mask, -INF)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(x - m)
    z = e.sum(dim=-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def head_normalisers(lse: torch.Tensor, sink: torch.Tensor):
    """Section 8: each row's per-head teacher normalisers ``LSEf[t,h] = logaddexp(lse, sink)``
    shifted by one per-row constant, ``(norm [T,H], has_mass [T])``. The teacher depends only
    on ``s`` and on the differences ``LSEf[t,h] - LSEf[t,h']`` (the constant cancels in the
    normalisation), so ``log A[t,h,c] = s[t,h,c] - norm[t,h]`` gives the same ``tau``.

    ``norm = (LSEf - m) + r`` with ``m = min_h LSEf`` over the row's finite heads (the
    differences are exact even at ``sink = 2.4e38``, where ``s - LSEf`` would absorb ``s``) and
    ``r = max_h (lse - (LSEf - m))`` (then ``norm >= lse`` on every head, with equality on one:
    ``exp(s - norm)`` stays at most about 1 and as large as the inputs allow, for linear-domain
    kernels). Silenced heads (``LSEf = +inf``) get ``norm = +inf`` (``A = 0``); ``has_mass`` is
    False on rows whose every head is silenced (teacher mass exactly zero). Works in the dtype
    of ``lse`` (shared with the error model and, in float32, with the backends' teacher).
    ``lse`` must not hold ``-inf`` (callers reject it)."""
    full = logaddexp(lse, sink.unsqueeze(0))
    fin = torch.isfinite(full)
    has = fin.any(dim=1, keepdim=True)
    zero = torch.zeros_like(full[:, :1])
    m = torch.where(fin, full, torch.full_like(full, INF)).amin(dim=1, keepdim=True)
    off = full - torch.where(has, m, zero)
    r = torch.where(fin, lse - off, torch.full_like(full, -INF)).amax(dim=1, keepdim=True)
    norm = torch.where(fin, off + torch.where(has, r, zero), torch.full_like(full, INF))
    return norm, has.squeeze(1)


def _kl(tau, p, mask, floor, form="clipped", log_p=None):
    """Per-row KL over ``mask``: ``form="clipped"``: ``sum max(tau, f) (log max(tau, f) -
    log max(p, f))``; ``"log_softmax"``: ``sum tau (log max(tau, 1e-10) - log_p)`` with the
    student's exact log-softmax ``log_p``."""
    if form == "log_softmax":
        terms = tau * (torch.log(torch.clamp_min(tau, LOG_SOFTMAX_TEACHER_FLOOR)) - log_p)
    else:
        a = torch.clamp_min(tau, floor)
        terms = a * (torch.log(a) - torch.log(torch.clamp_min(p, floor)))
    return torch.where(mask, terms, torch.zeros_like(terms)).sum(dim=-1)


def _masked_log_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim restricted to ``mask`` (exact in the log domain, never
    ``log`` of an underflowed ``p``); 0 off the mask and on rows with no finite entry."""
    x = x.masked_fill(~mask, -INF)
    lam = torch.logsumexp(x, dim=-1, keepdim=True)
    lam = torch.where(torch.isfinite(lam), lam, torch.zeros_like(lam))
    return torch.where(mask, x - lam, torch.zeros_like(x))


def _normaliser(num_real, layout_real: int | None, T: int):
    """Section 8 (and policy ``loss_norm``, 5.2): ``N`` as an int >= 1 (every row's KL divided
    by it), or per-row divisors, a 1-D tensor of ``T`` positive values (``+inf``: the row does
    not count). ``None``: ``layout_real`` (the layout's real tokens)."""
    if isinstance(num_real, torch.Tensor) and num_real.dim() == 1:
        d = as_float64(num_real, "num_real", ndim=1, allow_nan=False)
        check_dim(d, "num_real", 0, T, "rows T")
        if bool((d <= 0).any()):
            raise ValueError("num_real: per-row divisors must be > 0 (+inf: the row does not "
                             "count)")
        return d
    if num_real is None:
        if layout_real is None or layout_real < 1:
            raise ValueError("num_real: the layout has no real tokens; N must be >= 1")
        return layout_real
    return as_int(num_real, "num_real", minimum=1)


def _divided(x: torch.Tensor, n) -> torch.Tensor:
    """``x [T, ...] / N`` per row (``N`` an int or per-row divisors ``[T]``)."""
    if isinstance(n, torch.Tensor):
        return x / n.view((-1,) + (1,) * (x.dim() - 1))
    return x / n


def loss_normalisers(layout, loss_norm: str = "real", *, padding_rows: str = "sink_only",
                     cp: int = 1, cp_mode: str = "contiguous"):
    """Section 8 and its policies ``loss_norm`` and ``padding_rows`` (5.2): the ``num_real``
    argument of :func:`sparse_indexer_loss` and :func:`sparse_indexer_loss_grad` for
    ``layout`` (the batch's own layout, whose padding rows are not real).

    - ``"real"``: the real tokens ``N`` (an int); with ``padding_rows="attend"`` (padding rows
      then carry a KL) per-row divisors, ``N`` on real rows and ``+inf`` (not counted) elsewhere;
    - ``"rows"``: every row of the micro-batch, ``T`` (an int);
    - ``"rank_mean"``: the mean over the ``cp`` ranks (:func:`reference.cp_partition`) of each
      rank's KL sum over its real rows divided by its real tokens: per-row divisors
      ``cp * N_r`` on the real rows of rank ``r``, ``+inf`` elsewhere.
    """
    from .cp import cp_partition
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    loss_norm = choice(loss_norm, "loss_norm", ("real", "rows", "rank_mean"))
    padding_rows = choice(padding_rows, "padding_rows", ("sink_only", "attend"))
    T, real = layout.num_rows, layout.is_real
    if loss_norm == "rows":
        return max(T, 1)
    if loss_norm == "real":
        if padding_rows == "sink_only":
            return _normaliser(None, layout.num_real, T)
        n = _normaliser(None, layout.num_real, T)
        return torch.where(real, torch.full((T,), float(n), dtype=torch.float64),
                           torch.full((T,), INF, dtype=torch.float64))
    d = torch.full((T,), INF, dtype=torch.float64)
    parts = cp_partition(layout, cp, mode=cp_mode)
    for rows in parts:
        n_r = int(real[rows].sum())
        if n_r:
            d[rows] = torch.where(real[rows], torch.full((rows.numel(),), float(len(parts) * n_r),
                                                         dtype=torch.float64), d[rows])
    if not bool(torch.isfinite(d).any()):
        raise ValueError("num_real: the layout has no real tokens; N must be >= 1")
    return d


def _loss_inputs(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, coeff, scale,
                 num_real, loss_floor, kl_form="clipped"):
    """Section 8 loss arguments, validated and converted (shared with the section 12 bound)."""
    if not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
    q = as_float64(q, "q", ndim=3)
    kc = as_float64(kv_cmp, "kv_cmp", ndim=2)
    sink = as_float64(sink, "sink", ndim=1, allow_nan=False)
    lse = as_float64(lse, "lse", ndim=2, allow_nan=False)
    ids = as_index(compressed_ids, "compressed_ids", ndim=2)
    scores = as_float64(index_scores, "index_scores", ndim=2, allow_nan=False)
    T, H, D = q.shape
    C = kc.shape[0]
    head_dim(q, "q")
    check_dim(q, "q", 0, layout.num_rows, "layout.num_rows")
    check_dim(kc, "kv_cmp", 1, D, "q head dim D")
    check_dim(sink, "sink", 0, H, "q heads H")
    check_dim(lse, "lse", 0, T, "rows T")
    check_dim(lse, "lse", 1, H, "heads H")
    check_dim(ids, "compressed_ids", 0, T, "rows T")
    check_dim(scores, "index_scores", 0, T, "rows T")
    check_dim(scores, "index_scores", 1, C, "compressed keys C (rows of kv_cmp)")
    coeff = as_real(coeff, "coeff")
    scale = D ** -0.5 if scale is None else as_real(scale, "scale")
    floor = as_real(loss_floor, "loss_floor", positive=True)
    choice(kl_form, "kl_form", KL_FORMS)
    n_real = _normaliser(num_real, layout.num_real, T)
    if bool((lse == -INF).any()):
        raise ValueError("lse contains -inf; a KV-only lse (section 6) is the log of a positive "
                         "sum, or +inf on a row without keys")
    selected = _slot_mask(ids, C) & layout.is_real.unsqueeze(1)
    sc = scores if C else scores.new_zeros((T, 1))
    picked = torch.gather(sc, 1, torch.where(selected, ids, torch.zeros_like(ids)))
    if bool((selected & (picked == INF)).any()):
        t, j = torch.nonzero(selected & (picked == INF))[0].tolist()
        raise ValueError(f"index_scores is +inf at a selected slot (row {t}, compressed id "
                         f"{int(ids[t, j])}); the student softmax is undefined there (section 8)")
    return q, kc, sink, lse, ids, scores, coeff, scale, floor, n_real


def sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *, coeff,
                        scale=None, num_real=None, loss_floor=LOSS_FLOOR, kl_form="clipped",
                        chunk_rows=None):
    """Section 8: the sparse indexer KL loss.

    ``q [T,H,D]`` and ``lse [T,H]`` (KV-only, natural log, from the attention forward over all
    of a row's keys), ``kv_cmp [C,D]`` compressed keys, ``sink [H]``, ``compressed_ids [T,Kc]``
    indexing ``kv_cmp`` and the columns of ``index_scores [T,C]`` (negative or ``>= C`` =
    invalid slot). The teacher is computed in log space with per-head offsets,
    ``log tau[c] = LSE_h(s[h,c] - norm[h]) - LSE_{h,c'}(s[h,c'] - norm[h])`` with ``norm`` of
    :func:`head_normalisers` (``LSEf`` up to a per-row constant), so that it never underflows
    and huge finite sinks are exact. Heads are silenced one by one: a head with
    ``LSEf = +inf`` (a ``+inf`` sink) has ``A = 0`` and the other heads carry the teacher; a
    row whose every head is silenced has teacher mass zero: ``tau = 0``, ``KL = 0``, and its
    ``predict`` is the student softmax as on any other row. Padding rows count 0; ``N``
    defaults to ``layout.num_real`` (``num_real``: an int, or per-row divisors ``[T]`` from
    :func:`loss_normalisers` for the ``loss_norm`` policies of section 5.2). ``kl_form``:
    ``"clipped"`` (section 8) or ``"log_softmax"`` (policy ``kl_form``: ``tau (log max(tau,
    1e-10) - log_softmax(I))``, the student's log exact). The row sum is a left fold in row
    order.

    Raises ``ValueError`` for NaN in ``sink``, ``lse`` or ``index_scores``, ``-inf`` in ``lse``
    and ``+inf`` index scores at selected slots (the student is undefined there).
    """
    # The teacher is detached (section 8): no gradient reaches q, kv_cmp, the sink or lse.
    q, kc, sink, lse, ids, scores, coeff, scale, floor, n_real = _loss_inputs(
        q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, coeff, scale, num_real,
        loss_floor, kl_form)
    q, kc, sink, lse = (t.detach() for t in (q, kc, sink, lse))
    T, H, D = q.shape
    C, Kc = kc.shape[0], ids.shape[1]

    valid = _slot_mask(ids, C) & layout.is_real.unsqueeze(1)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    lsef, has_mass = head_normalisers(lse, sink)                         # LSEf + const [T, H]
    target = torch.zeros((T, Kc), dtype=torch.float64)
    # The teacher is detached: per row over its own slot extent (a multiple of 64 covering its
    # last valid slot, so its bits never depend on the caller's width or on other rows), in work
    # buffers reused across chunks. Invalid slots gather a zero row (even NaN rows never leak).
    width = _round_up(max(Kc, 1), SLOT_MULTIPLE)
    vpad = torch.cat([valid, valid.new_zeros((T, width - Kc))], dim=1)
    rows = torch.cat([torch.where(valid, ids, torch.full_like(ids, C)),
                      ids.new_full((T, width - Kc), C)], dim=1)
    table = torch.cat([kc, kc.new_zeros((1, D))])
    step = rows_per_chunk(chunk_rows, 8 * width * (D + 3 * H), CHUNK_BYTES)
    m_rows = min(step, T)
    kg_buf = torch.empty(m_rows * width * D, dtype=torch.float64)
    a_mm, a_buf = (torch.empty(m_rows * H * width, dtype=torch.float64) for _ in range(2))
    row_mass = has_mass.unsqueeze(1)                                      # rows with teacher mass
    for r0, r1, w in row_runs(row_extents(vpad, SLOT_MULTIPLE), step):
        n = r1 - r0
        massive = vpad[r0:r1, :w] & row_mass[r0:r1]
        kg = torch.index_select(table, 0, rows[r0:r1, :w].reshape(-1),
                                out=carve(kg_buf, n * w, D)).view(n, w, D)
        log_a = torch.mul(row_bmm(q[r0:r1], kg.transpose(1, 2), out=carve(a_mm, n, H, w)),
                          scale, out=carve(a_buf, n, H, w)).sub_(lsef[r0:r1].unsqueeze(-1))
        log_a.masked_fill_(~massive.unsqueeze(1), -INF)                  # [n, H, w]
        per_c = torch.logsumexp(log_a, dim=1)                              # [n, w]
        norm = torch.logsumexp(per_c, dim=1, keepdim=True)
        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
        tau = torch.where(massive, torch.exp(per_c - norm), torch.zeros_like(per_c))
        target[r0:r1, : min(w, Kc)] = tau[:, :Kc]
    # The student (differentiable wrt index_scores) and the KL, per row over the Kc slots.
    # The student is the softmax over every selected slot, with or without teacher mass.
    sc = scores if C else scores.new_zeros((T, 1))  # C = 0: every slot is invalid
    logits = torch.gather(sc, 1, safe)
    predict = _masked_softmax(logits, valid)
    log_p = _masked_log_softmax(logits, valid) if kl_form == "log_softmax" else None
    kl = _kl(target, predict, valid & row_mass, floor, kl_form, log_p)
    loss = coeff * (ordered_sum(_divided(kl, n_real)) if isinstance(n_real, torch.Tensor)
                    else ordered_sum(kl) / n_real)
    return IndexerLoss(loss, kl, target, predict, n_real)


def _indexer_logits(q, k, w, ids, valid, scale):
    """Per-slot indexer logits and pre-activations: ``z [T,H_I,Kc]``, ``I [T,Kc]`` (0 on invalid)."""
    T, HI, DI = q.shape
    Kc = ids.shape[1]
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    src = k if k.shape[0] else k.new_zeros((1, DI))  # no compressed key: every slot is invalid
    kg = src.index_select(0, safe.reshape(-1)).view(T, Kc, DI)
    kg = kg.masked_fill(~valid.unsqueeze(-1), 0.0)  # unselected rows (even NaN) never leak
    z = row_bmm(q, kg.transpose(1, 2))
    logits = scale * row_bmm(w.unsqueeze(1), torch.relu(z)).squeeze(1)
    return z, kg, logits


def _loss_grad_inputs(q_idx, k_idx, weights, compressed_ids, target, predict):
    """Section 8 gradient tensors, validated and converted (shared with the section 12 bound)."""
    q = as_float64(q_idx, "q_idx", ndim=3)
    k = as_float64(k_idx, "k_idx", ndim=2)
    w = as_float64(weights, "weights", ndim=2)
    ids = as_index(compressed_ids, "compressed_ids", ndim=2)
    tau = as_float64(target, "target", ndim=2, allow_nan=False)
    p_in = as_float64(predict, "predict", ndim=2, allow_nan=False)
    T, HI, DI = q.shape
    Kc = ids.shape[1]
    head_dim(q, "q_idx")
    check_dim(k, "k_idx", 1, DI, "q_idx head dim D_I")
    check_dim(w, "weights", 0, T, "rows T")
    check_dim(w, "weights", 1, HI, "indexer heads H_I")
    check_dim(ids, "compressed_ids", 0, T, "rows T")
    for name, t in (("target", tau), ("predict", p_in)):
        if tuple(t.shape) != (T, Kc):
            raise ValueError(f"{name} must have shape {(T, Kc)} like compressed_ids, got {tuple(t.shape)}")
        if bool((t < 0).any()):
            raise ValueError(f"{name} holds a negative value ({float(t.min())}); it is a "
                             "probability distribution over the selected slots (section 8)")
    return q, k, w, ids, tau, p_in


def teacher_rows(target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Section 8: rows whose teacher carries mass, ``[T, 1]``: a row whose ``target`` is 0 on
    every valid slot is a row with teacher mass zero (every head silenced), which gets zero
    gradients in both gradient forms (shared with the section 12 bound)."""
    return (valid & (target > 0)).any(dim=1, keepdim=True)


def _loss_grad_options(coeff, num_real, grad_loss, scale, grad_floor, loss_floor, mode, DI, T,
                       kl_form="clipped"):
    """Section 8 gradient options, checked by name (shared with the section 12 bound):
    ``(coeff, num_real, grad_loss, scale, grad_floor, loss_floor, mode, kl_form)``, ``scale``
    defaulting to ``D_I^-1/2``, ``num_real`` an int or per-row divisors ``[T]``."""
    return (as_real(coeff, "coeff"), _normaliser(num_real, None, T),
            as_real(grad_loss, "grad_loss"),
            DI ** -0.5 if scale is None else as_real(scale, "scale"),
            as_real(grad_floor, "grad_floor", positive=True),
            as_real(loss_floor, "loss_floor", positive=True),
            choice(mode, "mode", GRAD_MODES), choice(kl_form, "kl_form", KL_FORMS))


def _row_gs(coeff, n_real, grad_loss, T):
    """``gs = coeff / N * grad_loss``: a float, or per row ``[T, 1]`` for per-row divisors."""
    if isinstance(n_real, torch.Tensor):
        return (coeff * grad_loss / n_real).view(T, 1)
    return coeff / n_real * grad_loss


def sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target, predict, *, coeff,
                             num_real, grad_loss=1.0, scale=None, grad_floor=GRAD_FLOOR,
                             mode="clipped", loss_floor=LOSS_FLOOR, kl_form="clipped",
                             chunk_rows=None):
    """Section 8: gradients of the indexer loss wrt ``q_idx [T,H_I,D_I]``, ``weights [T,H_I]``
    and ``k_idx [C,D_I]``. Returns float64 ``(dq_idx, dw, dk_idx)``.

    ``mode="clipped"`` (the cuDNN kernels' form): with ``gs = coeff/N * grad_loss``,
    ``tau~ = max(tau, e)``, ``m_c = 1[p_c >= e]``,
    ``gI = gs * (p * sum_c' tau~_c' m_c' - tau~ * m)`` on valid slots, from the given ``target``
    and ``predict``. ``mode="exact"`` (policy ``index_grad``, 5.2): the same with no floor,
    ``gI = gs (p sum_c' tau_c' - tau_c)`` (``p - tau`` on rows with teacher mass).
    ``mode="autograd"``: the exact derivative of the loss of :func:`sparse_indexer_loss`
    (floor ``loss_floor``, KL form ``kl_form``), by torch autograd through the indexer logits
    recomputed from ``q_idx``, ``k_idx`` and ``weights`` (``predict`` is not used).
    ``num_real``: ``N`` (an int) or per-row divisors ``[T]`` (:func:`loss_normalisers`).
    Both chain through the indexer with the strict gate ``z > 0``; ``dk_idx`` is a left fold in
    (row, slot) order. A row whose ``target`` is 0 on every valid slot (teacher mass zero:
    every head silenced) gets zero gradients. ``target`` and ``predict`` must be >= 0 (else
    ``ValueError``).
    """
    q, k, w, ids, tau, p_in = _loss_grad_inputs(q_idx, k_idx, weights, compressed_ids, target,
                                                predict)
    T, HI, DI = q.shape
    C, Kc = k.shape[0], ids.shape[1]
    coeff, n_real, grad_loss, scale, e, floor, mode, kl_form = _loss_grad_options(
        coeff, num_real, grad_loss, scale, grad_floor, loss_floor, mode, DI, T, kl_form)
    valid = _slot_mask(ids, C)
    valid = valid & teacher_rows(tau, valid)         # rows without teacher mass: no gradient
    gs = _row_gs(coeff, n_real, grad_loss, T)

    if mode == "autograd":
        with torch.enable_grad():
            qa, wa, ka = (x.detach().requires_grad_(True) for x in (q, w, k))
            _, _, logits = _indexer_logits(qa, ka, wa, ids, valid, scale)
            p = _masked_softmax(logits, valid)
            log_p = _masked_log_softmax(logits, valid) if kl_form == "log_softmax" else None
            kl = _kl(tau, p, valid, floor, kl_form, log_p)
            loss = (coeff * _divided(kl, n_real).sum() * grad_loss
                    if isinstance(n_real, torch.Tensor) else
                    coeff * kl.sum() / n_real * grad_loss)
            grads = torch.autograd.grad(loss, (qa, wa, ka), allow_unused=True)
        # an input the loss does not reach (no compressed key, no slot) gets zeros
        return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, w, k)))

    if mode == "exact":
        tt, m = tau, valid
    else:
        tt = torch.clamp_min(tau, e)
        m = valid & (p_in >= e)
    tm = torch.where(m, tt, torch.zeros_like(tt))
    g = gs * (p_in * tm.sum(dim=1, keepdim=True) - tm)
    g = torch.where(valid, g, torch.zeros_like(g))                        # gI [T, Kc]
    q, k, w = q.detach(), k.detach(), w.detach()
    dq = torch.zeros_like(q)
    dw = torch.zeros_like(w)
    dk = torch.zeros((C + 1, DI), dtype=torch.float64)   # row C: discard row of the fold
    # _indexer_logits' z and the chain below, per row over its own slot extent (see
    # sparse_indexer_loss), in work buffers reused across chunks; invalid slots gather a zero
    # row (unselected rows, even NaN, never leak) and fold into the discard row.
    width = _round_up(max(Kc, 1), SLOT_MULTIPLE)
    vpad = torch.cat([valid, valid.new_zeros((T, width - Kc))], dim=1)
    rows = torch.cat([torch.where(valid, ids, torch.full_like(ids, C)),
                      ids.new_full((T, width - Kc), C)], dim=1)
    g = torch.cat([g, g.new_zeros((T, width - Kc))], dim=1)
    table = torch.cat([k, k.new_zeros((1, DI))])
    step = rows_per_chunk(chunk_rows, 8 * width * (2 * DI + 4 * HI), CHUNK_BYTES)
    m_rows = min(step, T)
    kg_buf = torch.empty(m_rows * width * DI, dtype=torch.float64)
    z_mm, relu_buf, gate_buf = (torch.empty(m_rows * HI * width, dtype=torch.float64)
                                for _ in range(3))
    c_mm = torch.empty(m_rows * width * _round_up(DI, 8), dtype=torch.float64)
    dw_mm, dq_mm = row_bmm_buffer(m_rows, HI, 1), row_bmm_buffer(m_rows, HI, DI)
    for r0, r1, ext in row_runs(row_extents(vpad, SLOT_MULTIPLE), step):
        n = r1 - r0
        kg = torch.index_select(table, 0, rows[r0:r1, :ext].reshape(-1),
                                out=carve(kg_buf, n * ext, DI)).view(n, ext, DI)
        z = row_bmm(q[r0:r1], kg.transpose(1, 2), out=carve(z_mm, n, HI, ext))  # [n, H_I, ext]
        gc = g[r0:r1, :ext]
        relu_z = carve(relu_buf, n, HI, ext).copy_(z).relu_()
        torch.mul(row_bmm(relu_z, gc.unsqueeze(-1), out=dw_mm[:n]).squeeze(-1), scale,
                  out=dw[r0:r1])
        gate = carve(gate_buf, n, HI, ext).copy_(z > 0)
        gate.mul_((scale * w[r0:r1]).unsqueeze(-1)).mul_(gc.unsqueeze(1))
        dq[r0:r1] = row_bmm(gate, kg, out=dq_mm[:n])                      # [n, H_I, D_I]
        contrib = row_bmm(gate.transpose(1, 2), q[r0:r1],
                          out=carve(c_mm, n, ext, _round_up(DI, 8)))        # [n, ext, D_I]
        fold_slot_rows_into(dk, rows[r0:r1, :ext], contrib)
    return dq, dw, dk[:C]
