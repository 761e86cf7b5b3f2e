"""``dsv4-oracle selfcheck``: prove the float64 oracle against itself on catalog cases.

The cases are catalog cases (:data:`SELFCHECK_CASES`, ``fixtures/generators.py``): the
worked example of contract section 4 (``public-det-topk-ties``: 4 rows, ratio 2, K 5, every
visible score 0) and the ``selfcheck`` category (a float64 CSA layer with padding, an empty
document, capacity rows and ``v_dim < D``; an HCA layer; a window-only layer). Each goes
through the oracle, and each check compares the oracle with an independent formulation or with
itself under a change that must not matter:

- exact checks (``torch.equal``): Top-K against a brute-force selection, CSA rows against the
  dense visibility of section 3, sink-only rows, per-rank CP rows, chunking-independent
  reductions, unmodified inputs;
- numeric checks, judged by :func:`dsv4_oracle.compare.compare_numeric` with the bounds of
  the one error model (``reference/error_model.py``, contract section 12): gather attention
  against the dense-mask form (``reference/dense.py``, differentiated by autograd), the
  closed-form backward against autograd of the gather forward, the indexer loss against its
  definition and the clipped indexer-loss gradient against its autograd form. A ratio above 1
  fails; a quantity whose every element is ill-conditioned is not judged, never a pass.

Every result is a :class:`dsv4_oracle.compare.CheckResult` (its contract sections in
``extra["section"]``). The exhaustive versions of these checks are the
``oracle_tests/reference/test_*.py`` files, which use the same cases (:func:`case_tensors`).
"""
from __future__ import annotations

import math
import time
from typing import Callable, NamedTuple

import torch

from dsv4_oracle import reference as R
from dsv4_oracle.compare import CheckResult, compare_numeric, content_hash
from dsv4_oracle.wording import plural
from dsv4_oracle.reference.constants import FLT_MIN

__all__ = ["SELFCHECK_CASES", "WORKED_EXAMPLE", "GRADCHECK_CASE", "CaseTensors", "CHECKS",
           "selfcheck_cases", "case_tensors", "selfcheck_results", "format_table",
           "run_selfcheck"]

WORKED_EXAMPLE = "public-det-topk-ties"
GRADCHECK_CASE = "selfcheck-csa-padded"
# catalog ids, in the order the table lists them
SELFCHECK_CASES = (WORKED_EXAMPLE, GRADCHECK_CASE, "selfcheck-hca", "selfcheck-window-only")


def selfcheck_cases() -> tuple:
    """The :class:`fixtures.Case` objects of :data:`SELFCHECK_CASES`."""
    from dsv4_oracle.fixtures import get
    return tuple(get(i) for i in SELFCHECK_CASES)


class CaseTensors(NamedTuple):
    """Every input of one layer case as float64 CPU tensors, plus the oracle's index rows."""

    layout: R.PackedLayout
    q: torch.Tensor             # [T, H, D]
    kv: torch.Tensor            # [T + C, D]: the logical key buffer (raw rows, then compressed)
    sink: torch.Tensor          # [H]
    dout: torch.Tensor          # [T, H, Dv]
    q_idx: torch.Tensor | None      # [T, H_I, D_I] (CSA only)
    k_idx: torch.Tensor | None      # [C, D_I] (CSA only)
    weights: torch.Tensor | None    # [T, H_I] (CSA only)
    scores: torch.Tensor | None     # [T, C] indexer scores, or the case's explicit ones (CSA)
    cmp_ids: torch.Tensor | None    # [T, topk] Top-K compressed ids (CSA only)
    ids: torch.Tensor           # [T, K] key ids in the logical key space
    lengths: torch.Tensor       # [T]


def case_tensors(case) -> CaseTensors:
    """A layer case's inputs (``case.materialize()``: seeded, rounded once to the case's dtype)
    as float64 CPU tensors, with the oracle's scores, Top-K and CSA rows."""
    if not case.is_layer:
        raise ValueError(f"case {case.id} is an op-level case; the self-check needs a layer case")
    x = case.materialize()
    f64 = lambda k: x[k].to(torch.float64) if k in x else None  # noqa: E731
    layout = case.layout()
    scores = cmp_ids = None
    if case.layer == "csa":
        scores = (R.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], layout, case.ratio)
                  if case.scores == "indexer" else f64("index_scores"))
        cmp_ids, _ = R.stable_topk(scores, case.topk, order=case.order)
    ids, lengths = R.build_csa_indices(layout, window=case.window, ratio=case.ratio,
                                       compressed_ids=cmp_ids)
    return CaseTensors(layout, f64("q"), f64("kv"), f64("sink"), f64("dout"), f64("q_idx"),
                       f64("k_idx"), f64("weights"), scores, cmp_ids, ids, lengths)


# ---------------------------------------------------------------------------------------------
# Checks. Each returns ``(passed, detail)`` (an exact check) or a list of
# :func:`compare_numeric` results (a numeric check); a check that raises fails with the
# exception's text.
# ---------------------------------------------------------------------------------------------

def _attention(case, x, **kw):
    out, lse = R.sparse_attention_forward(x.q, x.kv, x.ids, x.sink, v_dim=case.v_dim,
                                          lengths=x.lengths, **kw)
    grads = R.sparse_attention_backward(x.q, x.kv, x.ids, x.sink, out, lse, x.dout,
                                        v_dim=case.v_dim, lengths=x.lengths, **kw)
    return (out, lse), grads


def check_rows_vs_visibility(case, x):
    from dsv4_oracle.reference.dense import dense_visibility, slot_counts
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
    from dsv4_oracle.reference.dense import dense_attention, slot_counts
    from dsv4_oracle.reference.error_model import ORACLE_PRECISION, attention_forward_bound
    (out, lse), _ = _attention(case, x)
    D = x.q.shape[-1]
    counts = slot_counts(x.ids, x.kv.shape[0], x.lengths)
    d_out, d_lse = dense_attention(x.q, x.kv, counts, x.sink, D ** -0.5, case.v_dim or D)
    b_out, b_lse = attention_forward_bound(x.q, x.kv, x.ids, x.sink, out, lse,
                                           precision=ORACLE_PRECISION, v_dim=case.v_dim,
                                           lengths=x.lengths)
    return [compare_numeric("out", d_out, out, b_out), compare_numeric("lse", d_lse, lse, b_lse)]


def _backward_verdict(case, x, fwd, grads, other):
    from dsv4_oracle.reference.error_model import ORACLE_PRECISION, attention_backward_bound
    bounds = attention_backward_bound(x.q, x.kv, x.ids, x.sink, *fwd, x.dout, *grads,
                                      precision=ORACLE_PRECISION, v_dim=case.v_dim,
                                      lengths=x.lengths)
    return [compare_numeric(name, o, g, b) for name, o, g, b
            in zip(("dq", "dkv", "dsink"), other, grads, bounds)]


def check_backward_vs_dense(case, x):
    from dsv4_oracle.reference.dense import dense_attention, slot_counts
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
    from dsv4_oracle.reference.error_model import ORACLE_PRECISION, indexer_loss_bound
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
        tau = (a.sum(0) / a.sum()).clamp_min(FLT_MIN)
        p = torch.softmax(scores[t, c], dim=0).clamp_min(FLT_MIN)
        kl[t] = (tau * (tau.log() - p.log())).sum()
    loss = case.coeff * kl.sum() / layout.num_real
    return [compare_numeric("kl", kl, res.kl, bound.kl),
            compare_numeric("loss", loss, res.loss, bound.loss)]


def check_loss_grad_clipped_vs_autograd(case, x):
    from dsv4_oracle.reference.error_model import ORACLE_PRECISION, indexer_loss_grad_bound
    args = _loss_inputs(case, x)
    res = R.sparse_indexer_loss(*args, coeff=case.coeff)
    common = (x.q_idx, x.k_idx, x.weights, x.cmp_ids, res.target, res.predict)
    kw = dict(coeff=case.coeff, num_real=res.num_real)
    clipped = R.sparse_indexer_loss_grad(*common, mode="clipped", **kw)
    auto = R.sparse_indexer_loss_grad(*common, mode="autograd", **kw)
    sel = x.cmp_ids >= 0
    if not (bool((res.target[sel] > FLT_MIN).all()) and bool((res.predict[sel] > FLT_MIN).all())):
        return False, "a clamp is hit: the two modes legitimately differ on this case"
    bounds = indexer_loss_grad_bound(*common, *auto, precision=ORACLE_PRECISION, mode="autograd", **kw)
    return [compare_numeric(n, c, a, b) for n, c, a, b
            in zip(("dq_idx", "dw", "dk_idx"), clipped, auto, bounds)]


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


def compressor_worked_example():
    """The worked example of contract section 15: ``(inputs, layout, rope table, kv_cmp)``:
    ``inputs`` holds ``kv``, ``score``, ``ape``, ``norm_weight`` (float64; every element the
    compressor does not read is NaN), ``kv_cmp`` the expected output in closed form."""
    lay = R.PackedLayout([0, 5, 7], [0, 7, 9], 10)
    kv = torch.full((10, 4), math.nan, dtype=torch.float64)
    for row, vals in {0: [8, 0, 4, 0], 1: [0, 8, 0, 4], 2: [8, 8, 0, 8], 3: [-8, 8, 8, 0]}.items():
        kv[row] = torch.tensor(vals, dtype=torch.float64)
    for row, vals in {4: [8, -8], 5: [8, 8], 7: [4, 4], 8: [-4, 4]}.items():
        kv[row, 2:] = torch.tensor(vals, dtype=torch.float64)
    score = torch.where(torch.isnan(kv), kv, torch.zeros_like(kv))
    ape = torch.zeros(2, 4, dtype=torch.float64)
    ape[0] = math.log(3)
    theta = torch.arange(8, dtype=torch.float64) * math.pi / 4
    table = torch.stack([torch.cos(theta), torch.sin(theta)], -1).unsqueeze(1)     # [8, 1, 2]
    s5, s10 = 5 ** -0.5, 10 ** -0.5
    want = torch.tensor([[3 * s5, s5], [-1, 1], [-3 * s5, -s5], [2 * s10, 4 * s10]],
                        dtype=torch.float64)
    return (dict(kv=kv, score=score, ape=ape, norm_weight=torch.ones(2, dtype=torch.float64)),
            lay, table, want)


def check_compressor_worked_example(case, x):
    inp, lay, table, want = compressor_worked_example()
    got = R.compressor_forward(*inp.values(), lay, 2, rope=table, overlap=True)
    err = float((got - want).abs().max())
    return err <= 1e-6, f"kv_cmp of section 15's example, max |error| {err:.2g} (eps 1e-6)"


def check_compressor_vs_autograd(case, x):
    """The compressor's closed-form backward against autograd of its forward, on raw inputs
    drawn for the case's layout (ratio 4 with the overlap, the indexer's Hadamard rotation)."""
    from dsv4_oracle.reference.error_model import ORACLE_PRECISION, compressor_backward_bound
    g = torch.Generator().manual_seed(15)
    T, d = x.layout.num_rows, 8
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True)
              for s in ((T, 2 * d), (T, 2 * d), (4, 2 * d), (d,))]
    rope = R.RopeSpec(dim=4, base=100.0, factor=4.0, original_seq_len=8)
    out = R.indexer_compressor_forward(*leaves, x.layout, 4, rope=rope)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    auto = torch.autograd.grad(out, leaves, dout)
    args = [t.detach() for t in leaves]
    closed = R.indexer_compressor_backward(*args, x.layout, 4, dout, rope=rope)
    bounds = compressor_backward_bound(*args, x.layout, 4, dout, closed, rope=rope,
                                       precision=ORACLE_PRECISION, rotate=True)
    return [compare_numeric(n, c, a, b) for n, c, a, b in
            zip(("dkv", "dscore", "dape", "dnorm_weight"), closed, auto, bounds)]


# (name, contract section, function, applies to the case?)
CHECKS: tuple[tuple[str, str, Callable, Callable], ...] = (
    ("worked example ids/lengths", "4, 7", check_worked_example, lambda c: c.id == WORKED_EXAMPLE),
    ("Top-K == brute force", "4", check_topk_brute_force, lambda c: c.layer == "csa"),
    ("key rows == dense visibility", "3, 5", check_rows_vs_visibility, lambda c: True),
    ("sink-only rows exact", "1, 6", check_sink_only_rows,
     lambda c: not bool(c.layout().is_real.all())),
    ("forward gather == dense mask", "6, 12", check_forward_vs_dense, lambda c: True),
    ("backward gather == dense autograd", "6, 12", check_backward_vs_dense, lambda c: True),
    ("closed-form backward == autograd", "6, 12", check_backward_vs_autograd, lambda c: True),
    ("attention gradcheck", "6", check_attention_gradcheck, lambda c: c.id == GRADCHECK_CASE),
    ("indexer loss == definition", "8, 12", check_loss_vs_definition, lambda c: c.layer == "csa"),
    # the autograd form differentiates the student recomputed from the indexer's inputs: it
    # needs scores that come from them (not a case's explicit scores)
    ("loss grad clipped == autograd", "8, 12", check_loss_grad_clipped_vs_autograd,
     lambda c: c.layer == "csa" and c.scores == "indexer"),
    ("loss gradcheck", "8", check_loss_gradcheck, lambda c: c.id == GRADCHECK_CASE),
    ("CP per-rank rows bitwise", "10", check_cp_rows, lambda c: True),
    ("chunking-independent bits", "10", check_chunking, lambda c: True),
    ("inputs unchanged", "5, 11", check_inputs_unchanged, lambda c: True),
    ("compressor worked example", "13-15", check_compressor_worked_example,
     lambda c: c.id == WORKED_EXAMPLE),
    ("compressor backward == autograd", "13-15, 12", check_compressor_vs_autograd,
     lambda c: c.id == GRADCHECK_CASE),
)


def _result(name: str, section: str, outcome) -> CheckResult:
    """One table row from a check's outcome: ``(passed, detail)`` of an exact check, or the
    :func:`compare_numeric` results of a numeric check (failed if any failed; not judged when
    none could be judged; the ratio is the largest of the judged ones)."""
    if not isinstance(outcome, list):
        passed, detail = outcome
        return CheckResult(name, "exact", bool(passed), detail=detail,
                           extra={"section": section})
    failed = [r for r in outcome if not r.passed]
    judged = [r for r in outcome if r.judged]
    ratio = max((r.ratio for r in judged + failed if r.ratio is not None), default=None)
    parts = [f"{r.name} {r.ratio:.2g}" if r.judged else f"{r.name} not judged"
             for r in outcome]
    detail = "error/bound " + ", ".join(parts)
    if failed:
        detail += f"; {failed[0].name}: {failed[0].detail}"
    return CheckResult(name, "numeric", not failed, ratio,
                       sum(r.mismatches or 0 for r in outcome), detail,
                       {"section": section, "checks": [r.to_dict() for r in outcome]},
                       judged=bool(failed or judged))


def selfcheck_results(cases=None) -> list[CheckResult]:
    """Every applicable check on every case (default: :func:`selfcheck_cases`), no printing."""
    results = []
    for case in selfcheck_cases() if cases is None else cases:
        x = case_tensors(case)
        for name, section, fn, applies in CHECKS:
            if not applies(case):
                continue
            try:
                outcome = fn(case, x)
            except Exception as exc:  # a crashing check is a failing check, with its reason
                results.append(CheckResult(f"{case.id}: {name}", "error", False,
                                           detail=f"{type(exc).__name__}: {exc}",
                                           extra={"section": section}))
                continue
            results.append(_result(f"{case.id}: {name}", section, outcome))
    return results


_STATUS = {"passed": "PASS", "failed": "FAIL", "not_judged": "NOT JUDGED"}


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "contract section", "result", "detail")]
    rows += [(r.name, r.extra.get("section", ""), _STATUS[r.status], r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + " | " + row[3])
        if i == 0:
            lines.append("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)
    return "\n".join(lines)


def run_selfcheck(verbose: bool = False) -> int:
    """Run the self-check, print the table, return 0 iff every check passed (a check that could
    not be judged is not a pass)."""
    start = time.perf_counter()
    cases = selfcheck_cases()
    results = selfcheck_results(cases)
    elapsed = time.perf_counter() - start
    bad = [r for r in results if r.status != "passed"]
    print(f"dsv4-oracle selfcheck: float64 oracle {R.ORACLE_VERSION}, torch {torch.__version__}, "
          f"{plural(len(cases), 'catalog case')}")
    if verbose:
        for case in cases:
            print(f"  {case}")
        print("  numeric checks report max |error| / bound of reference/error_model.py "
              "(dsv4_oracle.compare.compare_numeric: pass iff <= 1); exact checks use "
              "torch.equal")
    print(format_table(results))
    print(f"{len(results) - len(bad)}/{len(results)} checks passed in {elapsed:.1f} s"
          + ("" if not bad else f"; FAILED or NOT JUDGED: {', '.join(r.name for r in bad)}"))
    return 0 if not bad else 1
