"""Packed THD layout and compressed groups (contract sections 1 and 2)."""
from __future__ import annotations

import operator

import torch

from ._checks import CPU, allocated, as_index, as_int, compute_device

__all__ = ["PackedLayout"]


def _cumulative(x, name: str) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        try:                             # ints, and integers such as numpy.int64 (not bools)
            if any(isinstance(v, bool) for v in x):
                raise TypeError
            x = torch.tensor([operator.index(v) for v in x], dtype=torch.int64)
        except (TypeError, OverflowError, RuntimeError):
            raise TypeError(f"{name} must hold ints (int64 values)") from None
    t = as_index(x, name, ndim=1)
    if t.numel() < 1:
        raise ValueError(f"{name} must have at least one entry (B+1 >= 1)")
    if int(t[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(t[0])}")
    if bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {t.tolist()}")
    return t.clone()


class PackedLayout:
    """Rows of a packed THD micro-batch (contract section 1).

    ``cu_seqlens`` holds the cumulative *real* lengths, ``cu_seqlens_padded`` the cumulative
    physical lengths (default: no padding), ``num_rows`` the declared total ``T`` (default
    ``cu_seqlens_padded[-1]``; rows past it are capacity rows). Per-row tensors:

    - ``doc[t]``: the document of row ``t``, -1 for capacity rows;
    - ``pos[t]``: the document position ``t - cu_seqlens_padded[doc]`` (-1 for capacity rows);
    - ``is_real[t]``: ``pos < L_doc``.

    The layout is immutable: its tensors are private copies and must not be written to. They
    are kept on the CPU and read on the oracle's compute device (a copy per device, made once,
    inside ``reference._checks.compute_on``); the layout itself holds no state about devices.
    """

    # the tensors that define a layout and what it derives from them (each a property)
    TENSORS = ("cu_seqlens", "cu_seqlens_padded", "doc_lengths", "doc_padded_lengths", "doc",
                "pos", "is_real")

    def __init__(self, cu_seqlens, cu_seqlens_padded=None, num_rows=None):
        with torch.device(CPU):
            self._build(cu_seqlens, cu_seqlens_padded, num_rows)
        self._copies: dict = {}

    def _build(self, cu_seqlens, cu_seqlens_padded, num_rows):
        cu = _cumulative(cu_seqlens, "cu_seqlens").to(CPU)
        cu_pad = cu.clone() if cu_seqlens_padded is None else _cumulative(
            cu_seqlens_padded, "cu_seqlens_padded").to(CPU)
        if cu_pad.numel() != cu.numel():
            raise ValueError(
                f"cu_seqlens_padded has {cu_pad.numel()} entries, cu_seqlens has {cu.numel()}; "
                "they must have the same length B+1")
        real = cu[1:] - cu[:-1]
        padded = cu_pad[1:] - cu_pad[:-1]
        bad = torch.nonzero(real > padded).flatten()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"cu_seqlens_padded: document {b} has {int(real[b])} real tokens but only "
                f"{int(padded[b])} padded rows")
        total = int(cu_pad[-1])
        if num_rows is None:
            num_rows = total
            sized_by = "cu_seqlens" if cu_seqlens_padded is None else "cu_seqlens_padded"
        else:
            sized_by = "num_rows"
        num_rows = as_int(num_rows, "num_rows", minimum=0)
        if num_rows < total:
            raise ValueError(f"num_rows={num_rows} is smaller than cu_seqlens_padded[-1]={total}")
        self._cpu = {"cu_seqlens": cu, "cu_seqlens_padded": cu_pad, "doc_lengths": real,
                     "doc_padded_lengths": padded}
        self.num_rows = num_rows
        allocated(lambda: self._rows(num_rows, total, cu_pad, real), sized_by,
                  f"a layout of {num_rows} rows (its per-row tensors)")

    def _rows(self, num_rows: int, total: int, cu_pad, real) -> None:
        rows = torch.arange(num_rows, dtype=torch.int64)
        # doc[t] = b with cu_pad[b] <= t < cu_pad[b+1]; right-bisection skips empty documents.
        doc = torch.searchsorted(cu_pad, rows, right=True) - 1
        capacity = rows >= total
        doc = torch.where(capacity, torch.full_like(doc, -1), doc)
        safe_doc = doc.clamp_min(0)
        pos = torch.where(capacity, torch.full_like(rows, -1), rows - cu_pad[safe_doc])
        self._cpu.update(doc=doc, pos=pos, is_real=(~capacity) & (
            pos < real[safe_doc] if real.numel() else capacity))

    def _tensor(self, name: str) -> torch.Tensor:
        dev = compute_device()
        if dev == CPU:
            return self._cpu[name]
        key = (name, dev)
        if key not in self._copies:
            self._copies[key] = self._cpu[name].to(dev)
        return self._copies[key]

    cu_seqlens = property(lambda self: self._tensor("cu_seqlens"),
                          doc="``cu_seqlens`` (int64, length B+1)")
    cu_seqlens_padded = property(lambda self: self._tensor("cu_seqlens_padded"),
                                 doc="``cu_seqlens_padded`` (int64, length B+1)")
    doc_lengths = property(lambda self: self._tensor("doc_lengths"), doc="``L_b`` per document")
    doc_padded_lengths = property(lambda self: self._tensor("doc_padded_lengths"),
                                  doc="``P_b`` per document")
    doc = property(lambda self: self._tensor("doc"), doc="per row: its document, -1 for capacity")
    pos = property(lambda self: self._tensor("pos"), doc="per row: its document position")
    is_real = property(lambda self: self._tensor("is_real"), doc="per row: a real token")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_real(self) -> int:
        """N of contract section 8: total real tokens, ``cu_seqlens[-1]``."""
        return int(self.cu_seqlens[-1])

    # -- compressed groups (section 2) -------------------------------------------------------
    def compressed_counts(self, ratio: int) -> torch.Tensor:
        """``n_b = P_b // ratio`` complete groups per document."""
        ratio = as_int(ratio, "ratio", minimum=1)
        return self.doc_padded_lengths // ratio

    def compressed_offsets(self, ratio: int) -> torch.Tensor:
        """``cu_comp``: prefix sums of ``n_b`` (length B+1); group ``(b, g)`` has id ``cu_comp[b]+g``."""
        n = self.compressed_counts(ratio)
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(n, 0)])

    def num_compressed(self, ratio: int) -> int:
        return int(self.compressed_offsets(ratio)[-1])

    def visible_compressed(self, ratio: int) -> torch.Tensor:
        """Per row, the number of visible groups ``min((p+1)//ratio, n_b)`` (0 for non-real rows)."""
        n = self.compressed_counts(ratio)
        safe_doc = self.doc.clamp_min(0)
        vis = torch.minimum((self.pos + 1) // ratio, n[safe_doc] if n.numel() else self.pos * 0)
        return torch.where(self.is_real, vis, torch.zeros_like(vis))

    def visible_compressed_ids(self, ratio: int) -> torch.Tensor:
        """Section 3: int64 ``[T, C]``, entry ``[t, c] = c`` when compressed group ``c`` is
        visible to row ``t``, else ``-1`` (the key set of the dense teacher, policy ``teacher``
        of section 5.2: slot ``c`` is compressed id ``c``)."""
        C = self.num_compressed(ratio)
        cu_comp = self.compressed_offsets(ratio)
        first = cu_comp[self.doc.clamp_min(0)] if cu_comp.numel() > 1 else self.doc * 0
        cols = torch.arange(C).unsqueeze(0)
        lo = first.unsqueeze(1)
        seen = (cols >= lo) & (cols < lo + self.visible_compressed(ratio).unsqueeze(1))
        return torch.where(seen, cols.expand(self.num_rows, C), torch.full_like(seen, -1,
                                                                                dtype=torch.int64))

    def clone(self) -> "PackedLayout":
        """The same layout over private copies of its tensors (what an implementation is handed:
        nothing it writes reaches this one), without building it again."""
        new = object.__new__(type(self))
        new._cpu = {k: v.clone() for k, v in self._cpu.items()}
        new.num_rows = self.num_rows
        new._copies = {}
        return new

    def padding_as_real(self) -> "PackedLayout":
        """The layout with every padding row real (``cu_seqlens = cu_seqlens_padded``): what a
        padding row sees under the policy ``padding_rows="attend"`` (section 5.2). Capacity rows
        stay outside every document."""
        return PackedLayout(self._cpu["cu_seqlens_padded"], self._cpu["cu_seqlens_padded"],
                            self.num_rows)

    def doc_start(self) -> torch.Tensor:
        """Per row, the first physical row of its document (the row itself for capacity rows)."""
        rows = torch.arange(self.num_rows, device=self.doc.device)
        return torch.where(self.doc >= 0, rows - self.pos, rows)

    def __repr__(self) -> str:
        return (f"PackedLayout(cu_seqlens={self.cu_seqlens.tolist()}, "
                f"cu_seqlens_padded={self.cu_seqlens_padded.tolist()}, num_rows={self.num_rows})")

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackedLayout) and self.num_rows == other.num_rows
                and torch.equal(self._cpu["cu_seqlens"], other._cpu["cu_seqlens"])
                and torch.equal(self._cpu["cu_seqlens_padded"], other._cpu["cu_seqlens_padded"]))

    def __hash__(self) -> int:
        return hash((tuple(self._cpu["cu_seqlens"].tolist()),
                     tuple(self._cpu["cu_seqlens_padded"].tolist()), self.num_rows))
