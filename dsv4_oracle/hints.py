"""Where a failed numeric check's error concentrates: one head, one document, padding rows, the
last slots or columns (a hint printed after the check's finding, never part of the verdict)."""
from __future__ import annotations

import torch

__all__ = ["AXES", "concentration_hint"]

# per numeric quantity, what each dimension indexes: "row" packed query rows, "key" the logical
# key buffer (raw rows first, then compressed groups), "cmp" compressed ids, "head", "col"
# feature columns, "slot" Top-K slots
AXES = {"scores": ("row", "cmp"), "out": ("row", "head", "col"), "lse": ("row", "head"),
        "dq": ("row", "head", "col"), "dkv": ("key", "col"), "dsink": ("head",), "loss": (),
        "kl": ("row",), "target": ("row", "slot"), "predict": ("row", "slot"),
        "dq_idx": ("row", "head", "col"), "dw": ("row", "head"), "dk_idx": ("cmp", "col")}
_TRAILING = {"col": "columns", "slot": "slots", "cmp": "compressed ids"}


def concentration_hint(over: torch.Tensor, axes: tuple, layout=None) -> str | None:
    """Where the over-bound elements of a failed numeric check concentrate, or ``None``.

    ``over``: bool mask of the elements over their bound; ``axes``: what each dimension indexes
    (see :data:`AXES`); ``layout``: the case's :class:`reference.PackedLayout` (for rows and
    raw key rows). Reported when there are at least two over-bound elements and they all lie in
    one head (of several), one document (of several), only padding or capacity rows (of a
    layout that has real rows too), or the last half of the slots or columns. Returns a phrase
    such as ``"all 12 over-bound elements in head 3, in padding/capacity rows"``.
    """
    if over.dim() != len(axes):
        raise ValueError(f"over has {over.dim()} dimensions, axes names {len(axes)}")
    idx = torch.nonzero(over.to("cpu"))
    n = idx.shape[0]
    if n < 2:
        return None
    parts = []
    for d, ax in enumerate(axes):
        size = over.shape[d]
        vals = torch.unique(idx[:, d])
        if ax == "head" and size > 1 and vals.numel() == 1:
            parts.append(f"head {int(vals[0])}")
        elif ax in ("row", "key") and layout is not None:
            rows = vals[vals < layout.num_rows]
            if rows.numel() < vals.numel():
                if rows.numel() == 0:
                    parts.append("compressed key rows")
                continue
            real = layout.is_real[rows]
            if not bool(real.any()) and bool(layout.is_real.any()):
                parts.append("padding/capacity rows")
                continue
            docs = torch.unique(layout.doc[rows])
            used = int((layout.doc_padded_lengths > 0).sum())
            if docs.numel() == 1 and int(docs[0]) >= 0 and used > 1:
                b = int(docs[0])
                lo, hi = int(layout.cu_seqlens_padded[b]), int(layout.cu_seqlens_padded[b + 1])
                parts.append(f"document {b} (rows {lo}..{hi - 1})")
        elif ax in _TRAILING and size > 1:
            lo = int(vals.min())
            if lo >= size / 2:
                parts.append(f"the last {size - lo} of {size} {_TRAILING[ax]}")
    if not parts:
        return None
    return f"all {n} over-bound elements in " + ", in ".join(parts)
