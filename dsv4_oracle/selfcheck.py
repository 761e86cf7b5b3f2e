"""``dsv4-oracle selfcheck``: prove the float64 oracle against itself on built-in cases.

Four small packed cases (the worked example of the issue; a CSA layer with padding, an empty
document and capacity rows; an HCA layer; a window-only layer) go through the oracle, and each
check compares the oracle with an independent formulation or with itself under a change that
must not matter:

- exact checks (``torch.equal``): Top-K against a brute-force selection, CSA rows against the
  dense visibility of section 3, sink-only rows, per-rank CP rows, chunking-independent
  reductions, unmodified inputs;
- numeric checks, reported as the largest ``|error| / bound`` of the one error model
  (``reference/error_model.py``, contract section 12): gather attention against the dense-mask
  form (``reference/dense.py``, differentiated by autograd), the closed-form backward against
  autograd of the gather forward, and the clipped indexer-loss gradient against its autograd
  form. A ratio above 1 fails.

The exhaustive versions of these checks are the ``oracle_tests/test_reference_*.py`` files.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

import reference as R

__all__ = ["BuiltinCase", "CaseTensors", "BUILTIN_CASES", "build_case", "run_selfcheck"]


@dataclass(frozen=True)
class BuiltinCase:
    """A small packed case, by description; :func:`build_case` makes its tensors from ``seed``.

    ``ratio == 0`` is a window-only layer; ``ratio > 0`` with ``topk is None`` an HCA layer
    (every visible group); with ``topk`` a CSA layer whose compressed ids come from the
    lightning indexer and the stable Top-K (``zero_weights`` makes every visible score 0).
    """

    name: str
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...] | None
    num_rows: int | None
    window: int
    ratio: int
    topk: int | None
    heads: int = 2
    head_dim: int = 8
    v_dim: int | None = None
    index_heads: int = 2
    index_dim: int = 4
    zero_weights: bool = False
    coeff: float = 0.25
    seed: int = 0

    @property
    def layer(self) -> str:
        return "window" if self.ratio == 0 else ("hca" if self.topk is None else "csa")

    def layout(self) -> R.PackedLayout:
        return R.PackedLayout(list(self.cu_seqlens),
                              None if self.cu_seqlens_padded is None else list(self.cu_seqlens_padded),
                              self.num_rows)


BUILTIN_CASES = (
    # The worked example: 4 rows of one document, ratio 2, k 5, all-zero scores.
    BuiltinCase("worked-example", (0, 4), None, None, window=2, ratio=2, topk=5,
                zero_weights=True, seed=1),
    # CSA: document 0 has 7 real tokens in 8 rows, document 1 is empty, document 2 has 11 real
    # tokens in 16 rows, then 8 capacity rows; v_dim < head_dim (the 512-of-576 shape in small).
    BuiltinCase("csa-padded", (0, 7, 7, 18), (0, 8, 8, 24), 32, window=3, ratio=4, topk=2,
                v_dim=6, seed=2),
    BuiltinCase("hca", (0, 9, 14), (0, 16, 24), 32, window=3, ratio=4, topk=None, seed=3),
    BuiltinCase("window-only", (0, 5, 7), (0, 8, 16), 16, window=4, ratio=0, topk=None, seed=4),
)


class CaseTensors(NamedTuple):
    """Every input of one case (float64 CPU) plus the oracle's index rows."""

    layout: R.PackedLayout
    q: torch.Tensor             # [T, H, D]
    kv: torch.Tensor            # [T + C, D]: the logical key buffer (raw rows, then compressed)
    sink: torch.Tensor          # [H]
    dout: torch.Tensor          # [T, H, Dv]
    q_idx: torch.Tensor         # [T, H_I, D_I]
    k_idx: torch.Tensor         # [C, D_I]
    weights: torch.Tensor       # [T, H_I]
    scores: torch.Tensor | None     # [T, C] indexer scores (CSA only)
    cmp_ids: torch.Tensor | None    # [T, topk] Top-K compressed ids (CSA only)
    ids: torch.Tensor           # [T, K] key ids in the logical key space
    lengths: torch.Tensor       # [T]


def build_case(case: BuiltinCase) -> CaseTensors:
    """The case's tensors, drawn from a generator seeded by ``case.seed`` (same bits every run)."""
    g = torch.Generator().manual_seed(case.seed)
    layout = case.layout()
    T = layout.num_rows
    C = layout.num_compressed(case.ratio) if case.ratio else 0
    H, D, HI, DI = case.heads, case.head_dim, case.index_heads, case.index_dim
    dv = D if case.v_dim is None else case.v_dim
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, kv, sink, dout = rnd(T, H, D), rnd(T + C, D), rnd(H), rnd(T, H, dv)
    q_idx, k_idx, weights = rnd(T, HI, DI), rnd(C, DI), rnd(T, HI)
    if case.zero_weights:
        weights = torch.zeros_like(weights)
    scores = cmp_ids = None
    if case.layer == "csa":
        scores = R.indexer_scores(q_idx, k_idx, weights, layout, case.ratio)
        cmp_ids, _ = R.stable_topk(scores, case.topk)
    ids, lengths = R.build_csa_indices(layout, window=case.window, ratio=case.ratio,
                                       compressed_ids=cmp_ids)
    return CaseTensors(layout, q, kv, sink, dout, q_idx, k_idx, weights, scores, cmp_ids, ids,
                       lengths)
