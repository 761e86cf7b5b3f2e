"""Stable Top-K (contract section 4)."""
from __future__ import annotations

import torch

from ._checks import allocated, as_float64, as_int, choice

__all__ = ["stable_topk"]

_NO_ID = -1


def stable_topk(scores, k, *, order: str = "id", align: int | None = None):
    """Contract section 4: per row, the ``min(k, #candidates)`` best columns.

    Candidates are the columns whose score is not ``-inf``. Selection order is (score
    descending as exact values, then column id ascending); ``-0.0`` equals ``+0.0``.
    ``order="id"`` emits the selected ids ascending, ``order="score"`` in selection order.
    The width is ``k`` rounded up to a multiple of ``align`` (if given); unused slots are -1.

    Returns ``(ids, lengths)``: int64 ``[T, width]`` and int64 ``[T]``.
    """
    s = as_float64(scores, "scores", ndim=2)
    if bool(torch.isnan(s).any()):
        bad = torch.nonzero(torch.isnan(s))[0].tolist()
        raise ValueError(f"scores contains NaN (first at row {bad[0]}, column {bad[1]}); "
                         "Top-K selection is undefined")
    k = as_int(k, "k", minimum=0)
    order = choice(order, "order", ("id", "score"))
    width = k
    if align is not None:
        align = as_int(align, "align", minimum=1)
        width = -(-k // align) * align
    rows, cols = s.shape
    # Ascending stable sort of the negated scores = descending scores, ties by column id.
    # -(+0.0) and -(-0.0) compare equal, so signed zeros tie; -inf scores sort last.
    neg = -s
    take = min(k, cols)
    ids = allocated(lambda: torch.full((rows, width), _NO_ID, dtype=torch.int64), "k",
                    f"the ids [T, width] = [{rows}, {width}] (k={k})")
    lengths = torch.clamp((s > float("-inf")).sum(dim=1), max=take).to(torch.int64)
    if take == 0 or rows == 0:
        return ids, lengths
    _, perm = torch.sort(neg, dim=1, stable=True)
    chosen = perm[:, :take]
    used = torch.arange(take).unsqueeze(0) < lengths.unsqueeze(1)
    chosen = torch.where(used, chosen, torch.full_like(chosen, _NO_ID))
    if order == "id":
        big = torch.full_like(chosen, cols)  # unused slots sort after every real id
        chosen, _ = torch.sort(torch.where(used, chosen, big), dim=1)
        chosen = torch.where(used, chosen, torch.full_like(chosen, _NO_ID))
    ids[:, :take] = chosen
    return ids, lengths
