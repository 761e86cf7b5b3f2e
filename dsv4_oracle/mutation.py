"""Mutation testing of the checker: plant one semantic bug at a time in the portable torch
backend and show which check of the quick catalog catches it (``dsv4-oracle mutate``).

"Every check must be able to fail": a checker that passes a broken implementation is broken
itself. A *mutant* is a named source edit of :mod:`gpu_impl.torch_backend` (or of
:mod:`gpu_impl.layer`): an exact snippet that must occur exactly once in the file and its
replacement. :func:`build_adapter` applies the edits to the source text, executes the result
under a private module name (``gpu_impl._mutant_<name>_torch_backend``: never inserted into
``sys.modules``, the real modules are never touched) and wraps it as an
:class:`dsv4_oracle.adapters.Adapter` whose ops and packed layer all run the mutated code.
:func:`run_mutant` then runs :func:`dsv4_oracle.runner.check_case` over the quick catalog, the
mutant's likely killers first, and stops at the first case with a failing check: the mutant is
*killed* by that (case, level, quantity), or it *survived*.

A mutant whose snippet no longer occurs exactly once is reported ``STALE`` (the backend moved
on; the mutant must be updated), never silently skipped, and the command fails.

Three kinds of mutant (``Mutant.expect``):

- ``"killed"``: a bug; the quick catalog must kill it;
- ``"survives"``: a variant the contract allows (e.g. contract section 6's two conventions for
  ``out`` in ``Delta``): a checker that kills it raises a false alarm;
- ``"equivalent"``: an edit that cannot change any result the contract judges (the reason is
  recorded); it documents a place where a mutation is not a bug.

*Lane* mutants edit code that the single-device catalog does not run (the CP layer
:mod:`gpu_impl.cp`, the oracle's CP partition): they name the test that kills them and, with
``--lanes``, are checked by running that test on a temporary copy of the repository with the
edit applied (``python -m pytest``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

from .wording import plural

__all__ = ["Mutant", "MUTANTS", "StaleMutant", "MutantResult", "mutant_source", "build_adapter",
           "case_order", "run_mutant", "run_mutation", "format_table", "main"]

ROOT = Path(__file__).resolve().parent.parent
TB = "gpu_impl/torch_backend.py"
LAYER = "gpu_impl/layer.py"
API = "gpu_impl/api.py"
CP = "gpu_impl/cp.py"
REF_CP = "reference/cp.py"
IN_PROCESS_FILES = (TB, LAYER)


@dataclass(frozen=True)
class Mutant:
    """One planted bug. ``edits``: ``(file, snippet, replacement)``; each snippet must occur
    exactly once in its file (relative to the repository root). ``first``: case ids tried first
    (its likely killers). ``replays``: bitwise replays per case (2 unless a mutant needs more).
    ``expect``: ``"killed"``, ``"survives"`` or ``"equivalent"`` (see the module docstring);
    ``reason``: why it survives or is equivalent. ``lane``: for mutants outside the catalog's
    reach, the pytest node ids that kill them."""

    name: str
    description: str
    edits: tuple
    first: tuple = ()
    replays: int = 2
    expect: str = "killed"
    reason: str = ""
    lane: tuple = ()

    @property
    def files(self) -> tuple:
        return tuple(dict.fromkeys(f for f, _, _ in self.edits))


class StaleMutant(ValueError):
    """A mutant's snippet does not occur exactly once in its file."""


def _m(name, description, *edits, **kw) -> Mutant:
    return Mutant(name, description, tuple(edits), **{k: tuple(v) if isinstance(v, list) else v
                                                      for k, v in kw.items()})


# ---------------------------------------------------------------------------------------------
# the mutants (snippets are exact text of the files; keep them short but unique)
# ---------------------------------------------------------------------------------------------
_BF16_PV = """        acc = torch.zeros((r1 - r0, H, dv), dtype=torch.bfloat16, device=dev)
        pb = _operand(p, kv)
        for j in range(K):                   # every partial sum rounded to bf16
            acc = (acc.to(F32) + pb[:, :, j:j + 1].to(F32) * kg[:, j:j + 1, :dv].to(F32)
                   ).to(torch.bfloat16)
        out[r0:r1] = acc.to(q.dtype)
"""

_LENGTH_MASK = ("        ok &= torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < "
                "lengths.unsqueeze(1)\n")
_DEDUP = _LENGTH_MASK + """    same = (ids.unsqueeze(2) == ids.unsqueeze(1)) & ok.unsqueeze(1) & ok.unsqueeze(2)
    earlier = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril(-1)
    ok = ok & ~(same & earlier).any(dim=2)          # a repeated id counts once
"""

_LAYER_LOSS = ("        loss = _IndexerLoss.apply(q_idx, k_idx, weights, res.loss, res.target, "
               "res.predict,\n                                  cmp_ids, lcfg)\n")
_TEACHER_ATTACHED = _LAYER_LOSS + """        # the teacher recomputed with autograd on the attached q, kv_cmp and sink
        sel = (cmp_ids >= 0) & layout.is_real.to(dev).unsqueeze(1)
        kvc = kv_cmp[cmp_ids.clamp_min(0).long()].float()                      # [T, K, D]
        s_t = torch.einsum("thd,tkd->thk", q.float(), kvc) * (
            q.shape[-1] ** -0.5 if scale is None else scale)
        lsef = torch.logaddexp(lse, sink.float().unsqueeze(0))
        live = torch.isfinite(lsef).all(dim=1, keepdim=True)
        a_t = torch.exp(s_t - torch.where(live, lsef, 0.0).unsqueeze(-1)).sum(dim=1)
        ok = sel & live
        a_t = torch.where(ok, a_t, torch.zeros_like(a_t))
        tau_t = a_t / a_t.sum(dim=1, keepdim=True).clamp_min(1e-30)
        log_p = torch.log(res.predict.clamp_min(1e-30))
        kl_t = torch.where(ok, tau_t * (torch.log(tau_t.clamp_min(1e-30)) - log_p), 0.0)
        kl_t = kl_t.sum() * coeff / n_real
        loss = loss + (kl_t - kl_t.detach())          # same value, gradient reaches q, kv, sink
"""

_CHUNK_R = "            parts[r].append(torch.arange(s + r * c, s + (r + 1) * c))\n"
_CHUNK_MIRROR = ("            parts[r].append(torch.arange(s + (2 * cp - 1 - r) * c, "
                 "s + (2 * cp - r) * c))\n")

MUTANTS: tuple[Mutant, ...] = (
    # -- sections 1-3, 5: rows, windows, groups --------------------------------------------
    _m("window-off-by-one-start", "window starts one key early and misses the query itself "
       "(positions p-W .. p-1)",
       (TB, "wpos = torch.clamp(pos - window + 1, min=0)",
        "wpos = torch.clamp(pos - window, min=0)"),
       first=["short-docs"]),
    _m("window-excludes-self", "window keys strictly before the query (p-W+1 .. p-1)",
       (TB, "win_ok = (wpos <= pos.unsqueeze(1))", "win_ok = (wpos < pos.unsqueeze(1))"),
       first=["short-docs"]),
    _m("group-visible-one-early", "HCA rows see the compressed group that ends after the query "
       "(g <= floor((p+1)/r))",
       (TB, "ok = (g < vis.unsqueeze(1)) & real.unsqueeze(1)",
        "ok = (g <= vis.unsqueeze(1)) & real.unsqueeze(1)"),
       first=["hca-ratio128"]),
    _m("indexer-group-visible-one-early", "indexer scores are finite for the group ending after "
       "the query",
       (TB, "torch.where(cols < vis[s0:s1].unsqueeze(1), sc,",
        "torch.where(cols <= vis[s0:s1].unsqueeze(1), sc,"),
       first=["short-docs"]),
    _m("padding-rows-see-window", "padding and capacity rows get window keys (padded positions "
       "treated as real)",
       (TB, "win_ok = (wpos <= pos.unsqueeze(1)) & real.unsqueeze(1)",
        "win_ok = (wpos <= pos.unsqueeze(1))"),
       first=["padding-edge-layout"]),
    _m("padding-rows-scored", "the indexer scores padding rows (loops to the padded end of the "
       "document instead of the real one)",
       (TB, "for s0 in range(r0, r0 + real[b], step):\n"
        "            s1 = min(s0 + step, r0 + real[b])",
        "for s0 in range(r0, cu_pad[b + 1], step):\n"
        "            s1 = min(s0 + step, cu_pad[b + 1])"),
       (TB, "    vis = layout.visible_compressed(ratio).to(dev)\n    wf = w.to(F32) * scale\n",
        "    vis = torch.minimum((layout.pos + 1) // ratio, layout.compressed_counts(ratio)["
        "layout.doc.clamp_min(0)]).to(dev)\n    wf = w.to(F32) * scale\n"),
       first=["padding-edge-layout"]),
    _m("compressed-last", "key rows are [window part | compressed part] instead of "
       "compressed-first",
       (TB, "torch.cat([cmp, win], dim=1)", "torch.cat([win, cmp], dim=1)"),
       first=["padding-edge-layout"]),
    _m("compressed-id-offset", "compressed ids placed at T - 1 + c instead of T + c in the "
       "logical key space",
       (TB, "cmp = torch.where(cmp >= 0, cmp + T, cmp)",
        "cmp = torch.where(cmp >= 0, cmp + T - 1, cmp)"),
       first=["padding-edge-layout"]),
    # -- section 4: stable Top-K -------------------------------------------------------------
    _m("ties-id-descending", "equal scores: the larger column id wins",
       (TB, "_, perm = torch.sort(canon, dim=1, descending=True, stable=True)",
        "_, perm = torch.sort(canon.flip(1), dim=1, descending=True, stable=True)\n"
        "    perm = cols - 1 - perm"),
       first=["zero-score-ties", "public-det-topk-ties"]),
    _m("negative-zero-below-positive", "-0.0 ranks below +0.0 (a radix sort over the raw float "
       "bits)",
       (TB, "canon = s + 0.0", "canon = torch.where((s == 0) & torch.signbit(s), "
        "torch.full_like(s, -1e-45), s)"),
       first=["signed-zero-ties"]),
    _m("neg-inf-selectable", "-inf scores count as candidates (rows select K ids even with "
       "fewer visible groups)",
       (TB, "lengths = torch.clamp((s > -INF).sum(dim=1), max=take)",
        "lengths = torch.clamp((s >= -INF).sum(dim=1), max=take)"),
       first=["short-docs"]),
    _m("topk-length-unclamped", "lengths count every candidate, not min(k, #candidates)",
       (TB, "lengths = torch.clamp((s > -INF).sum(dim=1), max=take)",
        "lengths = (s > -INF).sum(dim=1)"),
       first=["short-docs"]),
    _m("order-policy-swapped", "emit order 'id' and 'score' swapped",
       (TB, 'if order == "id":\n        chosen, _', 'if order == "score":\n        chosen, _'),
       first=["short-docs"]),
    # -- section 6: slots ----------------------------------------------------------------------
    _m("lengths-ignored", "topk_length is ignored: slots past a row's length count",
       (TB, "    if lengths is not None:\n        ok &=", "    if False:\n        ok &="),
       first=["hostile-ids-mixed-lengths"]),
    _m("lengths-unsigned", "negative lengths read as unsigned 32-bit (every slot valid)",
       (TB, "unsqueeze(0) < lengths.unsqueeze(1)\n    safe",
        "unsqueeze(0) < lengths.to(torch.int64).remainder(2 ** 32).unsqueeze(1)\n    safe"),
       first=["lengths-negative"]),
    _m("id-S-valid", "id == S (one past the key buffer) is accepted as a valid slot",
       (TB, "ok = (ids >= 0) & (ids < num_keys)", "ok = (ids >= 0) & (ids <= num_keys)"),
       first=["hostile-ids-no-lengths"]),
    _m("duplicates-once", "a key id repeated in a row counts once instead of once per slot",
       (TB, _LENGTH_MASK, _DEDUP),
       first=["duplicate-ids"]),
    _m("invalid-slots-gather-last-key", "invalid slots gather the last key row and rely on the "
       "-inf mask alone (0 * NaN leaks)",
       (TB, "safe = torch.where(ok, ids, torch.full_like(ids, num_keys)).to(torch.int64)",
        "safe = torch.where(ok, ids, torch.full_like(ids, max(num_keys - 1, 0))).to(torch.int64)"),
       first=["nan-poison-hostile-ids", "nan-poison-layer"]),
    # -- section 6: forward ----------------------------------------------------------------------
    _m("lse-log2", "lse returned in log2 instead of the natural log",
       (TB, "        lse[r0:r1] = l\n", "        lse[r0:r1] = l / math.log(2)\n"),
       first=["padding-edge-layout"]),
    _m("lse-includes-sink", "lse includes the sink (returns LSEf)",
       (TB, "        lse[r0:r1] = l\n",
        "        lse[r0:r1] = torch.logaddexp(l, sink32.unsqueeze(0))\n"),
       first=["padding-edge-layout"]),
    _m("lse-bf16", "lse rounded to bfloat16 (statistics must stay float32)",
       (TB, "        lse[r0:r1] = l\n", "        lse[r0:r1] = l.to(torch.bfloat16).to(F32)\n"),
       first=["padding-edge-layout"]),
    _m("empty-row-lse-neg-inf", "rows with no valid slot report lse = -inf instead of +inf",
       (TB, "l = torch.where(has, torch.log(e.sum(dim=-1)) + m, torch.full_like(m, INF))",
        "l = torch.where(has, torch.log(e.sum(dim=-1)) + m, torch.full_like(m, -INF))"),
       first=["padding-edge-layout"]),
    _m("sink-sign-flipped", "the denominator uses -sink",
       (TB, "torch.where(has, l, torch.zeros_like(l)), sink32.unsqueeze(0))",
        "torch.where(has, l, torch.zeros_like(l)), -sink32.unsqueeze(0))"),
       first=["padding-edge-layout"]),
    _m("sink-omitted", "the sink is left out of the forward denominator",
       (TB, "full = torch.logaddexp(torch.where(has, l, torch.zeros_like(l)), sink32.unsqueeze(0))",
        "full = torch.where(has, l, torch.zeros_like(l))"),
       first=["padding-edge-layout"]),
    _m("sink-in-numerator", "the sink's probability is added to every key's weight "
       "(P_j * (1 + P_sink))",
       (TB, "c = torch.where(has, torch.exp(m - full), torch.zeros_like(m))",
        "c = torch.where(has, torch.exp(m - full) * (1 + torch.exp(sink32.unsqueeze(0) - full)), "
        "torch.zeros_like(m))"),
       first=["padding-edge-layout"]),
    _m("scale-from-dv", "default scale Dv**-0.5 instead of D**-0.5 (v_dim < D)",
       (TB, "validate_attention_forward(\n        q, kv, ids, sink, scale, v_dim,",
        "validate_attention_forward(\n        q, kv, ids, sink, "
        "scale if scale is not None or v_dim is None else v_dim ** -0.5, v_dim,"),
       first=["v-dim-smaller"]),
    _m("v-dim-ignored", "out uses all D columns of the key rows as values (v_dim ignored)",
       (TB, "out = torch.empty((T, H, dv), dtype=q.dtype, device=dev)",
        "out = torch.empty((T, H, D), dtype=q.dtype, device=dev)"),
       (TB, "out[r0:r1] = _mm(_operand(p, kv), kg[:, :, :dv]).to(q.dtype)",
        "out[r0:r1] = _mm(_operand(p, kv), kg).to(q.dtype)"),
       first=["v-dim-smaller"]),
    _m("bf16-accumulation", "P @ V accumulated in bfloat16 (every partial sum rounded)",
       (TB, "        out[r0:r1] = _mm(_operand(p, kv), kg[:, :, :dv]).to(q.dtype)\n", _BF16_PV),
       first=["padding-edge-layout"]),
    _m("no-max-subtraction", "softmax without subtracting the row maximum (exp(s) overflows "
       "for logits above 88)",
       (TB, "e = torch.exp(s - m.unsqueeze(-1))", "m = torch.zeros_like(m)\n"
        "        e = torch.exp(s - m.unsqueeze(-1))"),
       first=["large-logits"]),
    _m("row-chunks-of-7", "every chunked op works in chunks of 7 rows instead of its memory "
       "budget",
       (TB, "    budget = _CHUNK_BUDGET.get(device.type, _CHUNK_BUDGET[\"cpu\"])\n"
        "    return max(1, budget // max(1, per_row_bytes))",
        "    return 7"),
       first=["padding-edge-layout"], expect="equivalent",
       reason="every per-row result is computed from that row alone, and the cross-row sums "
              "(dkv, dk_idx) fold in a fixed order whatever the chunking: the bits may change, "
              "the values stay within the bounds and every replay repeats them"),
    _m("p-unrounded", "P is not rounded to the operand dtype before P @ V",
       (TB, "out[r0:r1] = _mm(_operand(p, kv), kg[:, :, :dv])",
        "out[r0:r1] = _mm(p, kg[:, :, :dv])"),
       first=["padding-edge-layout"],
       expect="survives",
       reason="more accurate than the documented precision; the error model bounds a kernel "
              "that rounds P once, so one that does not is within it"),
    _m("grad-mode-dependent-forward", "under torch.inference_mode() the forward skips rounding "
       "P (a different fast path)",
       (TB, "out[r0:r1] = _mm(_operand(p, kv), kg[:, :, :dv])",
        "out[r0:r1] = _mm(p if torch.is_inference_mode_enabled() else _operand(p, kv), "
        "kg[:, :, :dv])"),
       first=["padding-edge-layout"]),
    # -- section 6: backward ---------------------------------------------------------------------
    _m("dkv-without-value-part", "dkv misses the P^T dO term on the first Dv columns",
       (TB, "        contrib[:, :, :dv] += _mm(_operand(p, kv).transpose(1, 2), do)\n", ""),
       first=["padding-edge-layout"]),
    _m("dsink-sign", "dsink with the wrong sign",
       (TB, "dsink += -(p_sink * delta).sum(dim=0)", "dsink += (p_sink * delta).sum(dim=0)"),
       first=["padding-edge-layout"]),
    _m("backward-scale-missing", "dS not multiplied by the softmax scale",
       (TB, "ds = _operand(p * (dp - delta.unsqueeze(-1)) * scale, kv)",
        "ds = _operand(p * (dp - delta.unsqueeze(-1)), kv)"),
       first=["padding-edge-layout"]),
    _m("dsink-empty-rows-unmasked", "dsink does not mask rows with no valid slot (for a +inf "
       "sink, sigmoid(sink - lse) = sigmoid(inf - inf) = NaN there)",
       (TB, "p_sink = torch.sigmoid(sink32.unsqueeze(0) - l).masked_fill(empty, 0.0)",
        "p_sink = torch.sigmoid(sink32.unsqueeze(0) - l)"),
       first=["sink-mixed"]),
    _m("delta-recomputed", "Delta from the backward's own unrounded float32 out instead of "
       "the out it is handed (autograd style)",
       (TB, "delta = (dout[r0:r1].to(F32) * out[r0:r1].to(F32)).sum(dim=-1)       # [n, H]",
        "o32 = _mm(p, kg[:, :, :dv])\n"
        "        delta = (dout[r0:r1].to(F32) * o32).sum(dim=-1)"),
       first=["padding-edge-layout"],
       expect="survives",
       reason="contract section 6 allows both conventions for out in Delta; this one is the "
              "\"recomputed\" convention, which the checker judges next to \"given\""),
    _m("delta-bf16", "Delta = <dO, out> kept in bfloat16 (a kernel-style backward that rounds "
       "its row statistic to the operand dtype)",
       (TB, "delta = (dout[r0:r1].to(F32) * out[r0:r1].to(F32)).sum(dim=-1)       # [n, H]",
        "delta = (dout[r0:r1].to(F32) * out[r0:r1].to(F32)).sum(dim=-1).to(torch.bfloat16)"
        ".to(F32)"),
       first=["padding-edge-layout", "sink-mixed"]),
    _m("dsink-bf16-rows", "dsink accumulated row by row in bfloat16",
       (TB, "        dsink += -(p_sink * delta).sum(dim=0)\n",
        "        for row in -(p_sink * delta):\n"
        "            dsink = (dsink.to(torch.bfloat16) + row.to(torch.bfloat16)).to(F32)\n"),
       first=["padding-edge-layout", "sink-mixed"]),
    _m("backward-lse-bf16", "the backward rebuilds P from an lse rounded to bfloat16",
       (TB, "        l = lse[r0:r1].to(F32)\n        s = (_mm(q[r0:r1], kg.transpose(1, 2)) * scale)"
        ".masked_fill(~valid.unsqueeze(1), -INF)\n        p, empty = _row_probabilities(s, l, "
        "sink32)",
        "        l = lse[r0:r1].to(torch.bfloat16).to(F32)\n        s = (_mm(q[r0:r1], "
        "kg.transpose(1, 2)) * scale).masked_fill(~valid.unsqueeze(1), -INF)\n        p, empty "
        "= _row_probabilities(s, l, sink32)"),
       first=["large-logits", "padding-edge-layout"]),
    _m("sink-bf16", "the forward uses the sink rounded to bfloat16",
       (TB, "    reject_nan(sink=sink)\n    T, H, D = q.shape\n    S, K = kv.shape[0], "
        "ids.shape[1]\n    dev = q.device\n    sink32 = sink.to(F32)",
        "    reject_nan(sink=sink)\n    T, H, D = q.shape\n    S, K = kv.shape[0], "
        "ids.shape[1]\n    dev = q.device\n    sink32 = sink.to(torch.bfloat16).to(F32)"),
       first=["dtype-float32", "dtype-float64"]),
    _m("topk-nan-first", "NaN scores are ranked first instead of raising ValueError",
       (TB, "    s, k, order, align, width, _ = validate_stable_topk(scores, k, order, align, "
        "deterministic)",
        "    if isinstance(scores, torch.Tensor) and scores.is_floating_point():\n"
        "        scores = torch.nan_to_num(scores, nan=INF)\n"
        "    s, k, order, align, width, _ = validate_stable_topk(scores, k, order, align, "
        "deterministic)"),
       first=["padding-edge-layout", "dsa-padded"]),
    _m("ids-wrap-at-2p17", "the gather wraps key ids at 2^17 (17-bit index packing)",
       (TB, "    safe = torch.where(ok, ids, torch.full_like(ids, num_keys)).to(torch.int64)",
        "    safe = torch.where(ok, ids % (1 << 17), torch.full_like(ids, num_keys))"
        ".to(torch.int64)"),
       first=["hazard-large-key-buffer"]),
    _m("lengths-int32", "topk_length narrowed to int32 before use",
       (TB, "        ok &= torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < "
        "lengths.unsqueeze(1)",
        "        ok &= torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < "
        "lengths.to(torch.int32).unsqueeze(1)"),
       first=["hazard-int64-lengths"]),
    _m("input-mutated-in-place", "the backward zeroes dout of rows with no valid slot in the "
       "caller's tensor (results stay right)",
       (TB, "        p = p.masked_fill(empty.unsqueeze(-1), 0.0)\n",
        "        p = p.masked_fill(empty.unsqueeze(-1), 0.0)\n"
        "        dout[r0:r1].masked_fill_(empty.unsqueeze(-1), 0.0)\n"),
       first=["padding-edge-layout"]),
    _m("nondeterministic-reduction", "the dkv / dk_idx scatter folds each destination's terms "
       "in a random order (as float atomics do)",
       (TB, "    order = torch.argsort(dest, stable=True)\n",
        "    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(7), 'little'))\n"
        "    perm = torch.randperm(dest.numel(), generator=gen)\n"
        "    dest, values = dest[perm], values[perm]\n"
        "    order = torch.argsort(dest, stable=True)\n"),
       (TB, "import contextlib\n", "import contextlib\nimport os\n"),
       first=["near-ties", "dtype-float64"], replays=3),
    # -- section 7: indexer --------------------------------------------------------------------
    _m("indexer-weights-unscaled", "indexer weights not multiplied by the indexer scale",
       (TB, "    wf = w.to(F32) * scale\n    for b in range(layout.num_docs):",
        "    wf = w.to(F32)\n    for b in range(layout.num_docs):"),
       first=["padding-edge-layout"]),
    _m("indexer-relu-missing", "indexer scores without the ReLU",
       (TB, "sc = (torch.relu(z) * wf[s0:s1].unsqueeze(-1)).sum(dim=1)",
        "sc = (z * wf[s0:s1].unsqueeze(-1)).sum(dim=1)"),
       first=["padding-edge-layout"]),
    _m("indexer-bf16-head-sum", "indexer head sum accumulated in bfloat16",
       (TB, "sc = (torch.relu(z) * wf[s0:s1].unsqueeze(-1)).sum(dim=1)",
        "sc = (torch.relu(z) * wf[s0:s1].unsqueeze(-1)).to(torch.bfloat16)\n"
        "            sc = functools.reduce(lambda a, b: (a + b).to(torch.bfloat16), "
        "sc.unbind(1)).to(F32)"),
       first=["public-det-parity", "padding-edge-layout"]),
    # -- section 8: loss ------------------------------------------------------------------------
    _m("kl-arguments-swapped", "KL(p || tau) instead of KL(tau || p)",
       (TB, "kl[r0:r1] = _kl(tau, p, massive, floor)", "kl[r0:r1] = _kl(p, tau, massive, floor)"),
       first=["padding-edge-layout"]),
    _m("n-from-padded-rows", "N counts every packed row (padding and capacity included)",
       (TB, "loss = coeff * kl.sum() / n_real", "loss = coeff * kl.sum() / layout.num_rows"),
       first=["padding-edge-layout"]),
    _m("teacher-per-head-normalised", "each head's teacher normalised over C_t before the head "
       "sum (ignores the LSEf differences between heads)",
       (TB, "per_c = torch.logsumexp(log_a, dim=1)",
        "per_c = torch.logsumexp(log_a - torch.logsumexp(log_a, dim=2, keepdim=True)"
        ".nan_to_num(neginf=0.0), dim=1)"),
       first=["padding-edge-layout"]),
    _m("teacher-lsef-without-sink", "the teacher's normaliser LSEf leaves out the sink",
       (TB, "full = torch.logaddexp(lse, sink.to(lse.dtype).unsqueeze(0))",
        "full = lse.clone()"),
       first=["sink-mixed", "padding-edge-layout"]),
    _m("teacher-row-silenced-by-one-head", "one head with LSEf = +inf (a +inf sink) silences "
       "the whole row's teacher instead of that head alone",
       (TB, "any_live = live.any(dim=1, keepdim=True)", "any_live = live.all(dim=1, keepdim=True)"),
       first=["sink-mixed"]),
    _m("teacher-linear-domain", "the teacher computed in the linear domain from the full "
       "normaliser, exp(s - LSEf) summed (every head underflows to 0 at a huge sink)",
       (TB, "    lsef, has_mass = teacher_normalisers(lse.to(F32), sink.to(F32))",
        "    lsef = torch.logaddexp(lse.to(F32), sink.to(F32).unsqueeze(0))\n"
        "    has_mass = torch.isfinite(lsef).any(dim=1)"),
       (TB, "        per_c = torch.logsumexp(log_a, dim=1)                                 # [n, Kc]\n"
        "        norm = torch.logsumexp(per_c, dim=1, keepdim=True)\n"
        "        norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))\n"
        "        tau = torch.where(massive, torch.exp(per_c - norm), torch.zeros_like(per_c))",
        "        a_lin = torch.exp(log_a).sum(dim=1)\n"
        "        z_lin = a_lin.sum(dim=1, keepdim=True)\n"
        "        tau = torch.where(massive & (z_lin > 0), a_lin / z_lin.clamp_min(1e-38), "
        "torch.zeros_like(a_lin))"),
       first=["sink-large", "short-docs-sink-large"]),
    _m("student-log-unclipped", "the KL takes log p without the floor (a student that "
       "underflows to 0 gives an infinite KL)",
       (TB, "    terms = a * (torch.log(a) - torch.log(torch.clamp_min(p, floor)))",
        "    terms = a * (torch.log(a) - torch.log(p))"),
       first=["indexer-score-spread"]),
    _m("loss-floor-wrong", "loss clip floor 1e-6 (a common eps) instead of FLT_MIN",
       (TB, "kl[r0:r1] = _kl(tau, p, massive, floor)", "kl[r0:r1] = _kl(tau, p, massive, 1e-6)"),
       first=["indexer-score-spread"]),
    _m("grad-floor-wrong", "gradient floor e = 1e-6 (a common eps) instead of exp(-100)",
       (TB, "p, fl = p_in[r0:r1].to(F32), e", "p, fl = p_in[r0:r1].to(F32), 1e-6"),
       first=["indexer-score-spread"]),
    _m("grad-floor-mask-dropped", "the clipped gradient ignores the mask m_c = 1[p_c >= e]",
       (TB, "tm = torch.where(v & (p >= fl), torch.clamp_min(t32, fl), torch.zeros_like(t32))",
        "tm = torch.where(v, torch.clamp_min(t32, fl), torch.zeros_like(t32))"),
       first=["indexer-score-spread"]),
    _m("relu-gate-ge", "indexer gradient gate 1[z >= 0] instead of 1[z > 0]",
       (TB, "gate = _operand((z > 0).to(F32)", "gate = _operand((z >= 0).to(F32)"),
       first=["indexer-zero-dots"]),
    _m("grad-sign-flipped", "indexer logit gradient gI with the wrong sign",
       (TB, "g = gs * (p * tm.sum(dim=1, keepdim=True) - tm)",
        "g = gs * (tm - p * tm.sum(dim=1, keepdim=True))"),
       first=["padding-edge-layout"]),
    _m("dw-missing-scale", "dw not multiplied by the indexer scale",
       (TB, ".sum(dim=-1).mul_(scale).to(w.dtype)", ".sum(dim=-1).to(w.dtype)"),
       first=["padding-edge-layout"]),
    # -- the packed layer ---------------------------------------------------------------------
    _m("teacher-not-detached", "the layer's indexer loss lets gradient reach q, kv_cmp and the "
       "sink through the teacher",
       (LAYER, _LAYER_LOSS, _TEACHER_ATTACHED),
       first=["padding-edge-layout"]),
    _m("layer-n-from-padded-rows", "the layer normalises the loss by the packed row count",
       (LAYER, "n_real = layout.num_real if num_real is None",
        "n_real = layout.num_rows if num_real is None"),
       first=["padding-edge-layout"]),
    _m("layer-rows-depend-on-grad-mode", "without grad the layer builds HCA-style rows (every "
       "visible group) instead of the Top-K rows",
       (LAYER, "rows = api.build_csa_indices(layout, window=window, ratio=ratio, "
        "compressed_ids=cmp_ids,",
        "rows = api.build_csa_indices(layout, window=window, ratio=ratio, "
        "compressed_ids=cmp_ids if torch.is_grad_enabled() else None,"),
       first=["padding-edge-layout"]),
    _m("layer-dsink-dropped", "the layer returns no sink gradient",
       (LAYER, "bwd.dsink.to(sink.dtype)", "torch.zeros_like(sink)"),
       first=["padding-edge-layout"]),
    # -- sections 13-15: the compressor ---------------------------------------------------------
    _m("compressor-overlap-not-reset", "the overlap slots of a document's first group read the "
       "previous document's last tokens (no reset at a document start)",
       (TB, "prev = torch.where((g > 0).unsqueeze(1), prev, torch.full_like(prev, -1))",
        "prev = torch.where(prev >= 0, prev, torch.full_like(prev, -1))"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("compressor-logical-lengths", "groups counted over the real length L_b instead of the "
       "physical length P_b",
       (TB, "counts = layout.doc_padded_lengths // ratio\n    cu_pad",
        "counts = layout.doc_lengths // ratio\n    cu_pad"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("compressor-ape-global-position", "ape indexed by the packed row mod r instead of the "
       "token's offset in its group",
       (TB, "ape_row = ((tok - doc_start) % ratio) * c + half",
        "ape_row = (tok % ratio) * c + half"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("compressor-rope-last-token", "the compressed key rotated at its group's last token "
       "(g*r + r - 1) instead of its first (g*r)",
       (TB, "return _Slots(element.to(dev), ape_row.to(dev), (g * ratio).to(dev))",
        "return _Slots(element.to(dev), ape_row.to(dev), (g * ratio + ratio - 1).to(dev))"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("compressor-rope-rotate-half", "RoPE pairs channel i with i + d_r/2 (rotate-half) instead "
       "of the interleaved pairs (2i, 2i+1)",
       (TB, "a, b = tail[:, 0::2], tail[:, 1::2]", "a, b = tail[:, :dim // 2], tail[:, dim // 2:]"),
       (TB, "torch.stack([a * cos - b * sin, a * sin + b * cos], dim=2).reshape(n, dim)",
        "torch.cat([a * cos - b * sin, a * sin + b * cos], dim=1)"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("hadamard-unnormalised", "the indexer compressor's Hadamard rotation without the scale "
       "d**-0.5",
       (TB, "    return y * d ** -0.5\n", "    return y\n"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("hadamard-before-norm", "the Hadamard rotation applied to the pooled row before the "
       "RMSNorm and RoPE instead of after them",
       (TB, "    ctil = _store(ctil, like)\n    n = _store(",
        "    ctil = _store(_hadamard32(ctil) if rotate else ctil, like)\n    n = _store("),
       (TB, "    if rotate:\n        y = _hadamard32(y)\n    return y\n",
        "    return y\n"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("compressor-tail-forms-group", "the P_b mod r tail tokens form one more (short) group",
       (TB, "counts = layout.doc_padded_lengths // ratio\n    cu_pad",
        "counts = (layout.doc_padded_lengths + ratio - 1) // ratio\n    cu_pad"),
       first=["compressor-edges", "compressor-cp2-saturated"]),
    _m("dape-timing-order", "d_ape's terms folded in a different order on every call (as float "
       "atomics do)",
       (TB, "        fixed_order_scatter_add(dape, slots.ape_row[g0:g1].reshape(-1), dz.reshape(-1, d),",
        "        perm = torch.randperm(dz.shape[0] * S, generator=torch.Generator().manual_seed("
        "int.from_bytes(os.urandom(7), 'little')))\n"
        "        fixed_order_scatter_add(dape, slots.ape_row[g0:g1].reshape(-1)[perm], "
        "dz.reshape(-1, d)[perm],"),
       (TB, "import contextlib\n", "import contextlib\nimport os\n"),
       first=["compressor-edges", "compressor-cp2-saturated"], replays=4),
    # -- lane mutants: code the single-device catalog does not run ------------------------------
    _m("cp-n-per-rank", "the CP layer normalises the loss by N / cp (a per-rank count) instead "
       "of the global N",
       (CP, "cfg.update(num_real=max(1, layout.num_real),",
        "cfg.update(num_real=max(1, layout.num_real // dist.get_world_size(group)),"),
       lane=["oracle_tests/cp/test_gloo.py::test_gathered_results_match_cp1_oracle"]),
    _m("zigzag-chunk-order-swapped", "zigzag CP: rank r lists chunk 2cp-1-r before chunk r",
       (REF_CP, _CHUNK_R + _CHUNK_MIRROR, _CHUNK_MIRROR + _CHUNK_R),
       lane=["oracle_tests/reference/test_cp.py::"
             "test_partition_is_an_exact_cover_of_the_documented_shape"]),
)

# the unmutated backend, run first: every kill is meaningful only if it survives
BASELINE = Mutant("unmutated", "the backend as it is (baseline)", (), expect="survives",
                  reason="the baseline")

_BY_NAME = {m.name: m for m in MUTANTS}
assert len(_BY_NAME) == len(MUTANTS), "mutant names must be unique"


# ---------------------------------------------------------------------------------------------
# building a mutant
# ---------------------------------------------------------------------------------------------
def _source_path(rel: str) -> Path:
    """Where the package file ``rel`` (``gpu_impl/torch_backend.py``: a path in the repository)
    lives: found through the installed package ``dsv4_oracle.gpu_impl`` (a source checkout and
    a wheel alike)."""
    top, _, rest = rel.partition("/")
    pkg = importlib.import_module(f"dsv4_oracle.{top}")
    return Path(pkg.__file__).resolve().parent / rest


def _read(rel: str, root: Path | None = None) -> str:
    return ((root / rel) if root is not None else _source_path(rel)).read_text()


def mutant_source(mutant: Mutant, rel: str, text: str | None = None) -> str:
    """The text of ``rel`` with ``mutant``'s edits to it applied. Raises :class:`StaleMutant`
    when a snippet does not occur exactly once."""
    src = _read(rel) if text is None else text
    for f, old, new in mutant.edits:
        if f != rel:
            continue
        n = src.count(old)
        if n != 1:
            first_line = old.strip().splitlines()[0] if old.strip() else repr(old)
            raise StaleMutant(f"mutant {mutant.name}: its snippet occurs {n} times in {rel} "
                              f"(must be exactly once): {first_line!r}")
        src = src.replace(old, new)
    return src


def _module(name: str, rel: str, source: str, package: str):
    """Execute ``source`` as a fresh module object named ``name`` (not put in ``sys.modules``);
    relative imports resolve against the real ``package``."""
    mod = types.ModuleType(name)
    mod.__package__ = package
    mod.__file__ = str(_source_path(rel))
    exec(compile(source, f"{rel} [{name}]", "exec"), mod.__dict__)
    return mod


def build_adapter(mutant: Mutant | None):
    """An :class:`~dsv4_oracle.adapters.Adapter` running the mutated backend (``None``: the
    unmutated backend, loaded the same private way). Every op of the adapter and its packed
    layer run private copies of :mod:`gpu_impl.torch_backend`, :mod:`gpu_impl.api` and
    :mod:`gpu_impl.layer`; the imported modules are never modified."""
    from .adapters import Adapter, GpuImplAdapter

    if mutant is not None and any(f not in IN_PROCESS_FILES for f in mutant.files):
        raise ValueError(f"mutant {mutant.name} edits {', '.join(mutant.files)}: a lane mutant "
                         "(run with --lanes)")
    tag = "unmutated" if mutant is None else mutant.name.replace("-", "_")
    texts = {rel: _read(rel) if mutant is None else mutant_source(mutant, rel)
             for rel in IN_PROCESS_FILES}
    tb = _module(f"dsv4_oracle.gpu_impl._mutant_{tag}_torch_backend", TB, texts[TB], "dsv4_oracle.gpu_impl")
    api = _module(f"dsv4_oracle.gpu_impl._mutant_{tag}_api", API, _read(API), "dsv4_oracle.gpu_impl")
    api.torch_backend = tb               # the private api dispatches "torch" to the mutant
    layer = _module(f"dsv4_oracle.gpu_impl._mutant_{tag}_layer", LAYER, texts[LAYER], "dsv4_oracle.gpu_impl")
    layer.api = api

    class _MutantImpl(GpuImplAdapter):
        def __init__(self):
            super().__init__("torch", "cpu")
            self._api = api
            self.name = f"mutant:{tag}"

        def csa_layer(self, q, kv, sink, layout, *, compressor=None, **kwargs):
            kwargs.setdefault("backend", self.request)
            kwargs.setdefault("deterministic", self.deterministic)
            return layer.csa_layer(q, kv, sink, layout, compressor=compressor, **kwargs)

    impl = _MutantImpl()
    return Adapter(impl, name=impl.name, device="cpu", spec=impl.name)


# ---------------------------------------------------------------------------------------------
# running mutants
# ---------------------------------------------------------------------------------------------
# cheap cases that touch most of the contract first; the one large DSv4-shape case last
_LEADERS = ("padding-edge-layout", "hostile-ids-mixed-lengths", "short-docs", "sink-mixed",
            "duplicate-ids", "v-dim-smaller", "signed-zero-ties", "zero-score-ties")
_LAST = ("public-det-parity",)


def case_order(mutant: Mutant, cases) -> list:
    """``cases`` reordered: the mutant's own likely killers, the leaders, the rest in catalog
    order, the large DSv4-shape case last."""
    by_id = {c.id: c for c in cases}
    head = [i for i in tuple(mutant.first) + _LEADERS if i in by_id]
    head = list(dict.fromkeys(head))
    tail = [i for i in _LAST if i in by_id and i not in head]
    mid = [c.id for c in cases if c.id not in head and c.id not in tail]
    return [by_id[i] for i in head + mid + tail]


@dataclass
class MutantResult:
    """``status``: ``"killed"``, ``"survived"``, ``"stale"`` or ``"error"``; ``killer``: the
    first failing check (case, level, quantity, check, detail) when killed."""

    mutant: Mutant
    status: str
    killer: dict | None = None
    cases_run: int = 0
    elapsed_s: float = 0.0
    detail: str = ""
    killers: list | None = None      # with ``depth``: every killing case's first failure

    @property
    def depth(self) -> int | None:
        """How many cases kill the mutant (``None`` unless run with ``depth``)."""
        return None if self.killers is None else len(self.killers)

    @property
    def categories(self) -> list:
        """The primary catalog categories (each case's first) of the killing cases (``depth``
        runs): two killers of one category are one kind of input."""
        return sorted({k["categories"][0] for k in (self.killers or []) if k.get("categories")})

    @property
    def shallow(self) -> bool:
        """A bug mutant that fewer than :data:`MIN_DEPTH` cases, or cases of a single category,
        kill: one edited case and its defect class is unguarded."""
        return (self.killers is not None and self.mutant.expect == "killed" and
                self.status == "killed" and (self.depth < MIN_DEPTH or
                                             len(self.categories) < MIN_DEPTH))

    @property
    def as_expected(self) -> bool:
        if self.status in ("stale", "error"):
            return False
        want_killed = self.mutant.expect == "killed"
        return (self.status == "killed") == want_killed and not self.shallow

    def to_dict(self) -> dict:
        return {"mutant": self.mutant.name, "description": self.mutant.description,
                "files": list(self.mutant.files), "expect": self.mutant.expect,
                "reason": self.mutant.reason, "status": self.status, "killer": self.killer,
                "cases_run": self.cases_run, "elapsed_s": round(self.elapsed_s, 2),
                "as_expected": self.as_expected, "detail": self.detail,
                "kill_depth": self.depth, "killers": self.killers,
                "killer_categories": self.categories if self.killers is not None else None}


def _killer(outcome) -> dict:
    cats = list(outcome.case.categories)
    if outcome.error is not None:
        return {"case": outcome.case.id, "level": "-", "quantity": "materialize",
                "check": "materialize", "detail": outcome.error, "categories": cats}
    c = outcome.failed_checks[0]
    return {"case": outcome.case.id, "level": c.extra.get("level", "?"),
            "quantity": c.extra.get("quantity", "?"), "check": c.name,
            "detail": c.detail[:300], "categories": cats}


# a bug mutant must be killed by at least this many quick cases, of at least this many
# different categories (``--depth``)
MIN_DEPTH = 2


def run_mutant(mutant: Mutant | None, cases, *, replays: int | None = None,
               progress=None, depth: bool = False,
               oracle_caches: dict | None = None) -> MutantResult:
    """Run one in-process mutant (``None``: the unmutated backend) over ``cases`` in
    :func:`case_order`, stopping at the first case with a failing check (``depth``: running
    every case, and recording every killing case in ``killers``). ``oracle_caches``: case id
    -> the judge's oracle cache, kept across mutants (the oracle's results on identical
    consumed inputs are computed once)."""
    from .runner import check_case

    m = mutant if mutant is not None else BASELINE
    t0 = time.perf_counter()
    try:
        adapter = build_adapter(mutant)
    except StaleMutant as exc:
        return MutantResult(m, "stale", detail=str(exc))
    except Exception as exc:          # the mutated source does not even load
        return MutantResult(m, "killed", {"case": "-", "level": "-", "quantity": "import",
                                          "check": "import",
                                          "detail": f"{type(exc).__name__}: {exc}"},
                            elapsed_s=time.perf_counter() - t0)
    n = 0
    killers: list = []
    for case in case_order(m, cases):
        n += 1
        if progress:
            progress(m, case)
        cache = None if oracle_caches is None else oracle_caches.setdefault(case.id, {})
        reps = replays or m.replays
        if depth and reps <= 2 and mutant is not None:
            reps = 0            # the depth of a bug that replays do not reveal: no replays
        outcome = check_case(adapter, case, replays=reps, oracle_cache=cache)
        if not outcome.passed:
            killers.append(_killer(outcome))
            if not depth:
                break
    status = "killed" if killers else "survived"
    return MutantResult(m, status, killers[0] if killers else None, n,
                        time.perf_counter() - t0, killers=killers if depth else None)


def _lane_copy(root: Path, dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the repository, copied to ``dest``."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_lane_mutant(mutant: Mutant, *, timeout_s: float = 600.0) -> MutantResult:
    """Apply ``mutant`` to a temporary copy of the repository and run its lane tests there
    (``python -m pytest -x``): killed iff a test fails. The repository itself is untouched."""
    t0 = time.perf_counter()
    if not (ROOT / "oracle_tests").is_dir():
        raise ValueError("lane mutants run the repository's own test suite: run --lanes from a "
                         "source checkout of dsv4-oracle")
    try:
        texts = {rel: mutant_source(mutant, rel) for rel in mutant.files}
    except StaleMutant as exc:
        return MutantResult(mutant, "stale", detail=str(exc))
    with tempfile.TemporaryDirectory(prefix="dsv4-mutant-") as tmp:
        dest = Path(tmp)
        _lane_copy(ROOT, dest)
        for rel, text in texts.items():
            (dest / rel).write_text(text)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *mutant.lane]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        try:
            proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, env=env,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return MutantResult(mutant, "error", detail=f"lane timed out after {timeout_s} s",
                                elapsed_s=time.perf_counter() - t0)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 1:
        failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in proc.stdout.splitlines()
                  if ln.startswith("FAILED ")]
        return MutantResult(mutant, "killed",
                            {"case": failed[0] if failed else " ".join(mutant.lane),
                             "level": "lane", "quantity": "pytest", "check": "pytest",
                             "detail": tail}, 1, time.perf_counter() - t0)
    if proc.returncode == 0:
        return MutantResult(mutant, "survived", None, 1, time.perf_counter() - t0, tail)
    return MutantResult(mutant, "error", None, 1, time.perf_counter() - t0,
                        f"pytest exit {proc.returncode}: {tail or proc.stderr.strip()[-300:]}")


def select_mutants(names=()) -> list:
    """The named mutants, source edits and policy mutants (``policy:NAME=VALUE``,
    :mod:`dsv4_oracle.mutation_policies`); all when ``names`` is empty. Unknown names raise
    ``ValueError``."""
    from .mutation_policies import POLICY_MUTANTS
    every = {**_BY_NAME, **{m.name: m for m in POLICY_MUTANTS}}
    if not names:
        return list(every.values())
    unknown = [n for n in names if n not in every]
    if unknown:
        raise ValueError(f"unknown mutant {unknown[0]!r}; see --list")
    return [every[n] for n in names]


def run_mutation(mutants, *, quick: bool = False, lanes: bool = False, baseline: bool = True,
                 progress=None, on_result=None, depth: bool = False) -> list:
    """Every mutant of ``mutants`` (plus the unmutated backend first, when ``baseline``) over
    the quick catalog (``quick``: only each mutant's own likely killers). Lane mutants run
    only with ``lanes``; otherwise they are reported with their lane and status ``"lane"``.
    Policy mutants run under the defaults and under their declaration
    (:func:`dsv4_oracle.mutation_policies.run_policy_mutant`).
    ``on_result(result)`` is called as each mutant finishes. ``depth``: every mutant runs on
    every quick case, and a bug mutant killed by fewer than :data:`MIN_DEPTH` cases or
    categories is not as expected."""
    from .mutation_policies import PolicyMutant, run_policy_mutant
    from .runner import select_cases

    cases, _ = select_cases("quick")
    results = []
    caches: dict = {}                   # the oracle's results per case, shared by the mutants

    def add(r):
        results.append(r)
        if on_result:
            on_result(r)

    if baseline:
        add(run_mutant(None, cases, progress=progress, oracle_caches=caches))
    for m in mutants:
        if isinstance(m, PolicyMutant):
            pool = [c for c in cases if c.id in set(m.first)] if quick else cases
            add(run_policy_mutant(m, pool, progress=progress))
            continue
        if m.lane:
            if lanes:
                add(run_lane_mutant(m))
            else:
                try:
                    for rel in m.files:
                        mutant_source(m, rel)
                    add(MutantResult(m, "lane", {"case": " ".join(m.lane), "level": "lane",
                                                 "quantity": "-", "check": "-", "detail": ""}))
                except StaleMutant as exc:
                    add(MutantResult(m, "stale", detail=str(exc)))
            continue
        pool = cases
        if quick:
            want = set(m.first) or {cases[0].id}
            pool = [c for c in cases if c.id in want]
        add(run_mutant(m, pool, progress=progress, depth=depth, oracle_caches=caches))
    return results


def _status(r: MutantResult) -> str:
    if hasattr(r, "declared"):
        from .mutation_policies import status_text
        return status_text(r)
    if r.status == "killed":
        k = r.killer
        deep = (f"; by {r.depth} case(s) of {len(r.categories)} categor"
                f"{'y' if len(r.categories) == 1 else 'ies'}" if r.killers is not None else "")
        return f"killed by {k['case']} / {k['level']} / {k['quantity']}{deep}"
    if r.status == "survived":
        return "SURVIVED"
    if r.status == "lane":
        return "lane (not run here; --lanes)"
    return r.status.upper()


def format_table(results, *, markdown: bool = False, width: int | None = None) -> str:
    """One line per mutant: name, status (killer case / level / quantity), expectation, time.
    ``width``: the name column's width (default: the longest name in ``results``)."""
    rows = []
    for r in results:
        mark = "" if r.as_expected or r.status == "lane" else "  <-- UNEXPECTED"
        exp = ("(baseline)" if r.mutant is BASELINE else
               {"killed": "", "survives": "(allowed variant)", "equivalent": "(equivalent)"}[
                   r.mutant.expect])
        rows.append((r.mutant.name, r.mutant.description, _status(r), exp, r.cases_run,
                     r.elapsed_s, mark, r))
    if markdown:
        deep = any(r.killers is not None for r in results)
        out = ["| mutant | what it changes | result |"
               + (" kill depth (cases / categories) |" if deep else "")
               + " cases run | time (s) |",
               "|---|---|---|" + ("---:|" if deep else "") + "---:|---:|"]
        for name, desc, st, exp, n, t, mark, r in rows:
            note = f" {exp}" if exp else ""
            if hasattr(r, "declared"):
                from .mutation_policies import status_text
                st = status_text(r, markdown=True)
            elif r.status == "killed" and r.killer:
                st = (f"killed by `{r.killer['case']}` / {r.killer['level']} / "
                      f"{r.killer['quantity']}")
            d = (f" {r.depth} / {len(r.categories)} |" if r.killers is not None else
                 " - |") if deep else ""
            out.append(f"| `{name}` | {desc} | {st}{note}{mark} |{d} {n} | {t:.1f} |")
        return "\n".join(out)
    w = width or (max(len(x[0]) for x in rows) if rows else 10)
    out = []
    for name, desc, st, exp, n, t, mark, r in rows:
        out.append(f"{name:{w}s}  {st}{(' ' + exp) if exp else ''}  [{plural(n, 'case')}, {t:.1f} s]"
                   f"{mark}")
        if r.status in ("stale", "error") or (mark and r.detail):
            out.append(f"{'':{w}s}  {r.detail}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--quick", action="store_true",
                   help="run each mutant only on its own likely-killer cases")
    p.add_argument("--mutant", metavar="NAME", action="append", default=[],
                   help="run only this mutant (repeatable)")
    p.add_argument("--lanes", action="store_true",
                   help="also run the lane mutants (CP layer, oracle CP partition) through "
                        "their pytest lane on a temporary copy of the repository")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unmutated backend's run")
    p.add_argument("--depth", action="store_true",
                   help="run every mutant on every quick case and report its kill depth (the "
                        "cases and categories that kill it); a bug mutant killed by fewer than "
                        f"{MIN_DEPTH} cases or {MIN_DEPTH} categories is unexpected")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON")
    p.add_argument("--markdown", metavar="FILE", default=None,
                   help="write the result table as Markdown")
    p.set_defaults(func=main_mutate)
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("mutate", help="mutation testing: plant bugs in the torch backend and "
                                      "show which check kills each",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    return add_arguments(p)


def main_mutate(args) -> int:
    try:
        mutants = select_mutants(args.mutant)
    except ValueError as exc:
        print(f"dsv4-oracle mutate: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            where = "lane" if m.lane else ", ".join(m.files) or "policy"
            print(f"{m.name:36s} [{m.expect}; {where}] {m.description}")
        print(plural(len(mutants), "mutant"))
        return 0

    def progress(m, case):
        if sys.stderr.isatty():
            print(f"\r\033[K{m.name}: {case.id}", end="", file=sys.stderr, flush=True)

    width = max(len(m.name) for m in mutants + [BASELINE])

    def on_result(r):
        if sys.stderr.isatty():
            print("\r\033[K", end="", file=sys.stderr)
        print(format_table([r], width=width), flush=True)

    t0 = time.perf_counter()
    if args.lanes and not (ROOT / "oracle_tests").is_dir():
        print("dsv4-oracle mutate: error: --lanes runs the repository's own test suite: run it "
              "from a source checkout of dsv4-oracle", file=sys.stderr)
        return 2
    if args.depth and args.quick:
        print("dsv4-oracle mutate: error: --depth runs every quick case; it cannot be combined "
              "with --quick", file=sys.stderr)
        return 2
    results = run_mutation(mutants, quick=args.quick, lanes=args.lanes,
                           baseline=not args.no_baseline, progress=progress,
                           on_result=on_result, depth=args.depth)
    bad = [r for r in results if not r.as_expected and r.status != "lane"]
    stale = [r for r in results if r.status == "stale"]
    killed = sum(r.status == "killed" for r in results if r.mutant.expect == "killed")
    want = sum(1 for r in results if r.mutant.expect == "killed" and r.status != "lane")
    print(f"\n{killed} of {plural(want, 'bug mutant')} killed; {len(bad)} unexpected; "
          f"{time.perf_counter() - t0:.0f} s")
    if stale:
        print(f"STALE: {plural(len(stale), 'mutant')} no longer match the source; update them in "
              "dsv4_oracle/mutation.py", file=sys.stderr)
    try:
        if args.json:
            Path(args.json).write_text(json.dumps([r.to_dict() for r in results], indent=1))
        if args.markdown:
            Path(args.markdown).write_text(format_table(results, markdown=True) + "\n")
    except OSError as exc:
        print(f"dsv4-oracle mutate: error: cannot write: {exc}", file=sys.stderr)
        return 2
    return 0 if not bad else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_oracle.mutation",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
    add_arguments(p)
    return main_mutate(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
