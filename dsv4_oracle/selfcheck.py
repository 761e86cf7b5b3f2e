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
from dsv4_oracle.compare import content_hash

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


# ---------------------------------------------------------------------------------------------
# Checks. Each returns (passed, detail); a check that raises fails with the exception's text.
# ---------------------------------------------------------------------------------------------

class CheckResult(NamedTuple):
    check: str
    section: str
    passed: bool
    detail: str


def _ratio(actual, expected, bound) -> float:
    """``max |actual - expected| / bound``; exact where the bound is 0 or ``expected`` is not
    finite (any difference there, or a NaN, gives ``inf``)."""
    a, e, b = (t.detach().to(torch.float64) for t in (actual, expected, bound))
    exact = (b <= 0) | ~torch.isfinite(e)
    if not torch.equal(a[exact], e[exact]) or bool(torch.isnan(a).any()):
        return math.inf
    if bool(exact.all()):
        return 0.0
    return float(((a - e).abs()[~exact] / b[~exact]).max())


def _ratio_verdict(named_ratios: dict) -> tuple[bool, str]:
    worst = max(named_ratios.values())
    detail = "error/bound " + ", ".join(f"{k} {v:.2g}" for k, v in named_ratios.items())
    return worst <= 1.0, detail


def _attention(case, x, **kw):
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, v_dim=case.v_dim,
                                          lengths=x.lengths, **kw)
    grads = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, out, lse, x.dout,
                                        v_dim=case.v_dim, lengths=x.lengths, **kw)
    return (out, lse), grads


def check_rows_vs_visibility(case, x):
    from reference.dense import dense_visibility, slot_counts
    vis = dense_visibility(x.layout, case.window, case.ratio).to(torch.float64)
    counts = slot_counts(x.ids, x.kv.shape[0], x.lengths)
    T = x.layout.num_rows
    if case.layer == "csa":           # every key visible, once; the whole window present
        ok = bool((counts <= vis).all()) and torch.equal(counts[:, :T], vis[:, :T])
    else:                             # HCA / window-only: exactly the visible keys
        ok = torch.equal(counts, vis)
    return ok, f"{T} rows, {int(x.lengths.sum())} keys"


def _topk_by_definition(row: list, k: int, order: str) -> list:
    ranked = sorted((-v, j) for j, v in enumerate(row) if v != -math.inf)   # -0.0 == +0.0
    chosen = [j for _, j in ranked[:k]]
    chosen = sorted(chosen) if order == "id" else chosen
    return chosen + [-1] * (k - len(chosen))


def _tie_heavy_scores() -> torch.Tensor:
    """Scores from a tiny alphabet: exact ties, signed zeros and -inf in every row."""
    g = torch.Generator().manual_seed(0)
    alphabet = torch.tensor([-math.inf, -1.0, -0.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    return alphabet[torch.randint(0, 6, (16, 9), generator=g)]


def check_topk_brute_force(case, x):
    ok = True
    for scores, k in ((x.scores, case.topk), (_tie_heavy_scores(), 1), (_tie_heavy_scores(), 3)):
        for order in ("id", "score"):
            ids, lengths = R.stable_topk(scores, k, order=order)
            want = [_topk_by_definition(row, k, order) for row in scores.tolist()]
            ok &= ids.tolist() == want
            ok &= lengths.tolist() == [sum(i >= 0 for i in w) for w in want]
    return ok, f"case scores (k {case.topk}) and a tie-heavy matrix (k 1, 3), both orders"


def check_worked_example(case, x):
    want = [[-1] * 5, [0, -1, -1, -1, -1], [0, -1, -1, -1, -1], [0, 1, -1, -1, -1]]
    ids, lengths = R.stable_topk(x.scores, 5)
    ok = ids.tolist() == want and lengths.tolist() == [0, 1, 1, 2]
    return ok, f"ids {ids.tolist()}, lengths {lengths.tolist()}"


def check_sink_only_rows(case, x):
    (out, lse), (dq, _, _) = _attention(case, x)
    fake = ~x.layout.is_real
    ok = (torch.equal(out[fake], torch.zeros_like(out[fake])) and bool((lse[fake] == math.inf).all())
          and torch.equal(dq[fake], torch.zeros_like(dq[fake])))
    return ok, f"{int(fake.sum())} padding/capacity rows: out 0, lse +inf, dq 0"


def check_forward_vs_dense(case, x):
    from reference.dense import dense_attention, slot_counts
    from reference.error_model import ORACLE_PRECISION, attention_forward_bound
    (out, lse), _ = _attention(case, x)
    D = x.q.shape[-1]
    counts = slot_counts(x.ids, x.kv.shape[0], x.lengths)
    d_out, d_lse = dense_attention(x.q, x.kv, counts, x.sink, D ** -0.5, case.v_dim or D)
    b_out, b_lse = attention_forward_bound(x.q, x.kv, x.ids, x.sink, out, lse,
                                           precision=ORACLE_PRECISION, v_dim=case.v_dim,
                                           lengths=x.lengths)
    return _ratio_verdict({"out": _ratio(d_out, out, b_out), "lse": _ratio(d_lse, lse, b_lse)})


def _backward_verdict(case, x, fwd, grads, other):
    from reference.error_model import ORACLE_PRECISION, attention_backward_bound
    bounds = attention_backward_bound(x.q, x.kv, x.ids, x.sink, *fwd, x.dout, *grads,
                                      precision=ORACLE_PRECISION, v_dim=case.v_dim,
                                      lengths=x.lengths)
    return _ratio_verdict({name: _ratio(o, g, b) for name, o, g, b
                           in zip(("dq", "dkv", "dsink"), other, grads, bounds)})


def check_backward_vs_dense(case, x):
    from reference.dense import dense_attention, slot_counts
    fwd, grads = _attention(case, x)
    D = x.q.shape[-1]
    leaves = [t.clone().requires_grad_(True) for t in (x.q, x.kv, x.sink)]
    counts = slot_counts(x.ids, x.kv.shape[0], x.lengths)
    d_out, _ = dense_attention(leaves[0], leaves[1], counts, leaves[2], D ** -0.5, case.v_dim or D)
    other = torch.autograd.grad(d_out, leaves, x.dout)
    return _backward_verdict(case, x, fwd, grads, other)


def check_backward_vs_autograd(case, x):
    fwd, grads = _attention(case, x)
    leaves = [t.clone().requires_grad_(True) for t in (x.q, x.kv, x.sink)]
    out, _ = R.sparse_attention_forward(leaves[0], leaves[1], x.ids, leaves[2], v_dim=case.v_dim,
                                        lengths=x.lengths)
    other = torch.autograd.grad(out, leaves, x.dout)
    return _backward_verdict(case, x, fwd, grads, other)


def check_attention_gradcheck(case, x):
    keyed = torch.isfinite(_attention(case, x)[0][1][:, 0])

    def f(q, kv, sink):
        out, lse = R.sparse_attention_forward(q, kv, x.ids, sink, v_dim=case.v_dim,
                                              lengths=x.lengths)
        return out, lse[keyed]

    leaves = [t.clone().requires_grad_(True) for t in (x.q, x.kv, x.sink)]
    ok = torch.autograd.gradcheck(f, leaves, fast_mode=True, raise_exception=False)
    return ok, "torch.autograd.gradcheck (fast mode) of out, lse wrt q, kv, sink"


def _loss_inputs(case, x):
    (_, lse), _ = _attention(case, x)
    T = x.layout.num_rows
    return (x.q, x.kv[T:], x.sink, lse, x.cmp_ids, x.scores, x.layout)


def check_loss_vs_definition(case, x):
    from reference.error_model import ORACLE_PRECISION, indexer_loss_bound
    args = _loss_inputs(case, x)
    q, kv_cmp, sink, lse, cmp_ids, scores, layout = args
    res = R.sparse_indexer_loss(*args, coeff=case.coeff)
    bound = indexer_loss_bound(*args, res, coeff=case.coeff, precision=ORACLE_PRECISION)
    scale = q.shape[-1] ** -0.5
    kl = torch.zeros_like(res.kl)
    for t in range(layout.num_rows):                       # section 8, row by row
        c = cmp_ids[t][cmp_ids[t] >= 0]
        if not bool(layout.is_real[t]) or c.numel() == 0:
            continue
        a = torch.exp(scale * q[t] @ kv_cmp[c].T - torch.logaddexp(lse[t], sink).unsqueeze(1))
        tau = (a.sum(0) / a.sum()).clamp_min(2.0 ** -126)
        p = torch.softmax(scores[t, c], dim=0).clamp_min(2.0 ** -126)
        kl[t] = (tau * (tau.log() - p.log())).sum()
    loss = case.coeff * kl.sum() / layout.num_real
    return _ratio_verdict({"kl": _ratio(kl, res.kl, bound.kl),
                           "loss": _ratio(loss, res.loss, bound.loss)})


def check_loss_grad_clipped_vs_autograd(case, x):
    from reference.error_model import ORACLE_PRECISION, indexer_loss_grad_bound
    args = _loss_inputs(case, x)
    res = R.sparse_indexer_loss(*args, coeff=case.coeff)
    common = (x.q_idx, x.k_idx, x.weights, x.cmp_ids, res.target, res.predict)
    kw = dict(coeff=case.coeff, num_real=res.num_real)
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw)
    sel = x.cmp_ids >= 0
    if not (bool((res.target[sel] > 2.0 ** -126).all()) and bool((res.predict[sel] > 2.0 ** -126).all())):
        return False, "a clamp is hit: the two modes legitimately differ on this case"
    bounds = indexer_loss_grad_bound(*common, *auto, precision=ORACLE_PRECISION, mode="autograd", **kw)
    return _ratio_verdict({n: _ratio(c, a, b) for n, c, a, b
                           in zip(("dq_idx", "dw", "dk_idx"), clipped, auto, bounds)})


def check_loss_gradcheck(case, x):
    args = _loss_inputs(case, x)
    q, kv_cmp, sink, lse, cmp_ids, _, layout = args

    class LossOf(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q_idx, w, k_idx):
            scores = R.indexer_scores(q_idx, k_idx, w, layout, case.ratio)
            res = R.sparse_indexer_loss(q, kv_cmp, sink, lse, cmp_ids, scores, layout,
                                        coeff=case.coeff)
            ctx.save_for_backward(q_idx, w, k_idx, res.target, res.predict)
            return res.loss

        @staticmethod
        def backward(ctx, grad):
            q_idx, w, k_idx, target, predict = ctx.saved_tensors
            dq, dw, dk = R.sparse_indexer_loss_grad(q_idx, k_idx, w, cmp_ids, target, predict,
                                                    coeff=case.coeff, num_real=layout.num_real,
                                                    grad_loss=float(grad), mode="autograd")
            return dq, dw, dk

    leaves = [t.clone().requires_grad_(True) for t in (x.q_idx, x.weights, x.k_idx)]
    ok = torch.autograd.gradcheck(LossOf.apply, leaves, fast_mode=True, raise_exception=False)
    return ok, "gradcheck (fast mode): mode=autograd is d loss / d(q_idx, weights, k_idx)"


def check_chunking(case, x):
    ref = _attention(case, x)
    ok = True
    for chunk in (1, 3):
        got = _attention(case, x, chunk_rows=chunk)
        ok &= all(torch.equal(a, b) for a, b in zip(got[0] + got[1], ref[0] + ref[1]))
    return ok, "out, lse, dq, dkv, dsink with chunk_rows 1, 3, auto"


def check_cp_rows(case, x):
    (out, lse), (dq, _, _) = _attention(case, x)
    ok, done = True, []
    for mode in ("contiguous", "zigzag"):
        try:
            parts = R.cp_partition(x.layout, 2, mode=mode)
        except ValueError:
            continue
        done.append(mode)
        for rows in parts:
            o, l = R.sparse_attention_forward(x.q[rows], x.kv, x.ids[rows], x.sink,
                                              v_dim=case.v_dim, lengths=x.lengths[rows])
            d = R.sparse_attention_backward(x.q[rows], x.kv, x.ids[rows], x.sink, o, l,
                                            x.dout[rows], v_dim=case.v_dim,
                                            lengths=x.lengths[rows])[0]
            ok &= torch.equal(o, out[rows]) and torch.equal(l, lse[rows]) and torch.equal(d, dq[rows])
            if case.layer == "csa":
                c, _ = R.stable_topk(x.scores[rows], case.topk)
                ok &= torch.equal(c, x.cmp_ids[rows])
    return ok and bool(done), f"cp=2 {'/'.join(done)}: ids, out, lse, dq rows bitwise"


def check_inputs_unchanged(case, x):
    tensors = [t for t in x if isinstance(t, torch.Tensor)]
    before = [content_hash(t) for t in tensors]
    _attention(case, x)
    if case.layer == "csa":
        args = _loss_inputs(case, x)
        res = R.sparse_indexer_loss(*args, coeff=case.coeff)
        R.sparse_indexer_loss_grad(x.q_idx, x.k_idx, x.weights, x.cmp_ids, res.target,
                                   res.predict, coeff=case.coeff, num_real=res.num_real)
    R.build_csa_indices(x.layout, window=case.window, ratio=case.ratio, compressed_ids=x.cmp_ids)
    return [content_hash(t) for t in tensors] == before, f"{len(tensors)} input tensors hashed"


# (name, contract section, function, applies to the case?)
CHECKS: tuple[tuple[str, str, Callable, Callable], ...] = (
    ("worked example ids/lengths", "4, 7", check_worked_example, lambda c: c.name == "worked-example"),
    ("Top-K == brute force", "4", check_topk_brute_force, lambda c: c.layer == "csa"),
    ("key rows == dense visibility", "3, 5", check_rows_vs_visibility, lambda c: True),
    ("sink-only rows exact", "1, 6", check_sink_only_rows,
     lambda c: not bool(c.layout().is_real.all())),
    ("forward gather == dense mask", "6, 12", check_forward_vs_dense, lambda c: True),
    ("backward gather == dense autograd", "6, 12", check_backward_vs_dense, lambda c: True),
    ("closed-form backward == autograd", "6, 12", check_backward_vs_autograd, lambda c: True),
    ("attention gradcheck", "6", check_attention_gradcheck, lambda c: c.name == "csa-padded"),
    ("indexer loss == definition", "8, 12", check_loss_vs_definition, lambda c: c.layer == "csa"),
    ("loss grad clipped == autograd", "8, 12", check_loss_grad_clipped_vs_autograd,
     lambda c: c.layer == "csa"),
    ("loss gradcheck", "8", check_loss_gradcheck, lambda c: c.name == "csa-padded"),
    ("CP per-rank rows bitwise", "10", check_cp_rows, lambda c: True),
    ("chunking-independent bits", "10", check_chunking, lambda c: True),
    ("inputs unchanged", "5, 11", check_inputs_unchanged, lambda c: True),
)


def selfcheck_results(cases=BUILTIN_CASES) -> list[CheckResult]:
    """Every applicable check on every case (no printing)."""
    results = []
    for case in cases:
        x = build_case(case)
        for name, section, fn, applies in CHECKS:
            if not applies(case):
                continue
            try:
                ok, detail = fn(case, x)
            except Exception as exc:  # a crashing check is a failing check, with its reason
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            results.append(CheckResult(f"{case.name}: {name}", section, bool(ok), detail))
    return results


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "contract section", "result", "detail")]
    rows += [(r.check, r.section, "PASS" if r.passed else "FAIL", r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + " | " + row[3])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    return "\n".join(lines)


def run_selfcheck(verbose: bool = False) -> int:
    """Run the self-check, print the table, return 0 iff every check passed."""
    start = time.perf_counter()
    results = selfcheck_results()
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.passed]
    print(f"dsv4-oracle selfcheck: float64 oracle {R.ORACLE_VERSION}, torch {torch.__version__}, "
          f"{len(BUILTIN_CASES)} built-in cases")
    if verbose:
        for case in BUILTIN_CASES:
            print(f"  case {case.name}: layer {case.layer}, cu_seqlens {list(case.cu_seqlens)}, "
                  f"cu_seqlens_padded {list(case.cu_seqlens_padded or case.cu_seqlens)}, "
                  f"num_rows {case.layout().num_rows}, window {case.window}, ratio {case.ratio}, "
                  f"topk {case.topk}, H {case.heads}, D {case.head_dim}, v_dim {case.v_dim}")
        print("  numeric checks report max |error| / bound of reference/error_model.py "
              "(pass iff <= 1); exact checks use torch.equal")
    print(format_table(results))
    print(f"{len(results) - len(failed)}/{len(results)} checks passed in {elapsed:.1f} s"
          + ("" if not failed else f"; FAILED: {', '.join(r.check for r in failed)}"))
    return 0 if not failed else 1
