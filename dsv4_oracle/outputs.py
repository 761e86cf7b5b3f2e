"""What each op must return, checked the moment it returns, before anything reads it.

The protocol (:mod:`dsv4_oracle.protocol`) lets an op return any dtype on any device, but each
output has a kind (floating point, or signed integer for ids and lengths), a shape that follows
from the op's arguments, and must hold values (not a ``meta`` tensor, not a sparse one). Where
the contract makes the pattern of non-finite values exact, and a later op reads the output, the
pattern is part of what the op must return:

- ``scores`` (section 7): ``-inf`` exactly where the group is not visible to the row (section
  3), finite where it is and the row's and the group's inputs are finite;
- ``cmp_ids`` (sections 3 and 5): every id a real row selects is a group visible to that row
  (the CSA rows of section 5 refuse any other);
- ``out``, ``lse`` (section 6): ``lse = +inf`` exactly on rows with no valid slot; ``lse``
  finite on the other rows and ``out`` finite on every row, wherever the row's query and the
  keys its valid slots select are finite;
- ``target``, ``predict`` (section 8): finite and non-negative.

:func:`unusable` is the one copy of these rules; :mod:`dsv4_oracle.conformance` calls it for
every op the adapter runs and for the packed layer's outputs. An op whose output breaks one
fails (naming the op, the output and what was expected), and the oracle stands in for it
downstream, so that a bad output is charged to the op that made it, never to the op that read
it. Everything else (values within the error model, exact ids and lengths) is judged against
the oracle afterwards.
"""
from __future__ import annotations

import math

import torch

from dsv4_oracle.reference.attention import valid_slots

from .compare import row_chunks

__all__ = ["unusable", "SIGNED_INTEGERS"]

SIGNED_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT, _INT = "float", "int"


def _size(v: dict, name: str, axis: int):
    """``v[name].shape[axis]``, or ``None`` (a free size) when that read is unknown."""
    t = v.get(name)
    return t.shape[axis] if isinstance(t, torch.Tensor) and t.dim() > axis else None


def _shape(v: dict, name: str):
    t = v.get(name)
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _spec(op: str, case, lay, v: dict) -> dict:
    """name -> (kind, shape with ``None`` for a free size, the shape in the protocol's words).
    ``T`` is the layout's row count; the other sizes come from what the op read."""
    T = lay.num_rows
    if op == "indexer_scores":
        return {"scores": (_FLOAT, (T, _size(v, "k_idx", 0)), "[T, C]")}
    if op == "stable_topk":
        return {"cmp_ids": (_INT, (T, None), "[T, K]"), "cmp_lengths": (_INT, (T,), "[T]")}
    if op == "build_csa_indices":
        cmp = v.get("cmp_ids")
        if not case.ratio:
            width, words = case.window, "[T, window]"
        elif isinstance(cmp, torch.Tensor):
            width, words = cmp.shape[-1] + case.window, "[T, K + window]"
        else:
            groups = int(lay.compressed_counts(case.ratio).max()) if lay.num_docs else 0
            width, words = groups + case.window, "[T, largest group count + window]"
        return {"ids": (_INT, (T, width), words), "lengths": (_INT, (T,), "[T]")}
    if op == "sparse_attention_forward":
        H, D = _size(v, "q", 1), _size(v, "q", 2)
        return {"out": (_FLOAT, (T, H, case.v_dim or D), "[T, H, v_dim]"),
                "lse": (_FLOAT, (T, H), "[T, H]")}
    if op == "sparse_attention_backward":
        return {"dq": (_FLOAT, _shape(v, "q"), "q's shape [T, H, D]"),
                "dkv": (_FLOAT, _shape(v, "kv"), "kv's shape [S, D]"),
                "dsink": (_FLOAT, _shape(v, "sink"), "sink's shape [H]")}
    if op == "sparse_indexer_loss":
        K = _size(v, "loss_ids", 1) if "loss_ids" in v else _size(v, "cmp_ids", 1)
        return {"loss": (_FLOAT, (), "[] (0-dim)"), "kl": (_FLOAT, (T,), "[T]"),
                "target": (_FLOAT, (T, K), "[T, K]"), "predict": (_FLOAT, (T, K), "[T, K]")}
    if op == "sparse_indexer_loss_grad":
        return {"dq_idx": (_FLOAT, _shape(v, "q_idx"), "q_idx's shape [T, H_I, D_I]"),
                "dw": (_FLOAT, _shape(v, "weights"), "weights' shape [T, H_I]"),
                "dk_idx": (_FLOAT, _shape(v, "k_idx"), "k_idx's shape [C, D_I]")}
    if op in ("compressor_forward", "indexer_compressor_forward"):
        pre = "cmp" if op == "compressor_forward" else "idx"
        name = "kv_cmp" if op == "compressor_forward" else "k_idx"
        C = lay.num_compressed(case.ratio) if case.ratio else 0
        return {name: (_FLOAT, (C, _size(v, f"{pre}_norm", 0)), "[C, d]")}
    if op in ("compressor_backward", "indexer_compressor_backward"):
        pre = "cmp" if op == "compressor_backward" else "idx"
        return {f"d_{pre}_{k}": (_FLOAT, _shape(v, f"{pre}_{k}"), f"{pre}_{k}'s shape")
                for k in ("kv", "score", "ape", "norm")}
    raise ValueError(f"no output rules for op {op!r}")


def _form(name: str, t, kind: str, shape: tuple, words: str) -> str | None:
    """What is wrong with the type, layout, device, dtype or shape of one output."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}, expected a tensor {words}"
    if t.layout != torch.strided:
        return f"a {str(t.layout).replace('torch.', '')} tensor, expected a dense one"
    if t.device.type == "meta":
        return "a tensor on the meta device, which holds no values"
    if kind == _FLOAT and not t.is_floating_point():
        return f"dtype {t.dtype}, expected a floating-point dtype"
    if kind == _INT and t.dtype not in SIGNED_INTEGERS:
        return (f"dtype {t.dtype}, expected a signed integer dtype (int32 or int64): ids and "
                f"lengths are integers (contract section 5)")
    if shape is None:
        return None
    want = tuple(shape)
    if len(t.shape) != len(want) or any(w is not None and s != w
                                        for s, w in zip(t.shape, want)):
        shown = tuple("*" if w is None else w for w in want)
        return f"shape {tuple(t.shape)}, expected {shown} = {words}"
    return None


def _at(mask: torch.Tensor, offset: int) -> tuple:
    """The first ``True`` index of ``mask`` (rows offset by ``offset``)."""
    i = [int(x) for x in torch.nonzero(mask)[0].tolist()]
    return tuple([i[0] + offset] + i[1:])


def _value(t: torch.Tensor, idx: tuple) -> str:
    x = t[idx].item()
    return repr(float(x)) if isinstance(x, float) else repr(x)


def _row_offsets(lay, ratio: int) -> tuple:
    """Per row: the id of its document's first group and how many groups it sees (section 3)."""
    vis = lay.visible_compressed(ratio)
    base = (lay.compressed_offsets(ratio)[lay.doc.clamp_min(0)] if lay.num_docs
            else torch.zeros_like(vis))
    return base, vis


def _finite_rows(t: torch.Tensor, dims: int) -> torch.Tensor:
    """Per leading index, whether every element of the trailing ``dims`` dimensions is finite."""
    ok = torch.isfinite(t) if t.is_floating_point() else torch.ones_like(t, dtype=torch.bool)
    for _ in range(dims):
        ok = ok.all(dim=-1)
    return ok


def _scores_pattern(case, lay, v: dict, got: dict) -> tuple | None:
    if "scores" not in got:
        return None
    s = got["scores"].detach()
    if not s.numel():
        return None
    base, vis = (x.to(s.device) for x in _row_offsets(lay, case.ratio))
    cols = torch.arange(s.shape[1], device=s.device).unsqueeze(0)
    clean_rows = clean_cols = None
    for rows in row_chunks(s):
        r0 = rows.start
        local = cols - base[rows].unsqueeze(1)
        seen = (local >= 0) & (local < vis[rows].unsqueeze(1))
        piece = s[rows]
        hidden = ~seen & (piece != -math.inf)
        if bool(hidden.any()):
            t, c = _at(hidden, r0)
            return ("scores", f"scores[{t}, {c}] = {_value(s, (t, c))}, but group {c} is not "
                              f"visible to row {t}: the contract's score there is -inf "
                              f"(sections 3 and 7)")
        bad = seen & ~torch.isfinite(piece)
        if not bool(bad.any()):
            continue
        if clean_rows is None:           # the inputs' finiteness, read only when needed
            clean_rows = (_finite_rows(v["q_idx"].to(s.device), 2)
                          & _finite_rows(v["weights"].to(s.device), 1))
            clean_cols = _finite_rows(v["k_idx"].to(s.device), 1)
        bad &= clean_rows[rows].unsqueeze(1) & clean_cols.unsqueeze(0)
        if bool(bad.any()):
            t, c = _at(bad, r0)
            return ("scores", f"scores[{t}, {c}] = {_value(s, (t, c))} for a visible group "
                              f"with finite inputs (section 7: a finite score)")
    return None


def _selection_pattern(case, lay, v: dict, got: dict) -> tuple | None:
    if "cmp_ids" not in got:
        return None
    ids = got["cmp_ids"].detach()
    if not ids.numel() or not case.ratio:
        return None
    base, vis = (x.to(ids.device) for x in _row_offsets(lay, case.ratio))
    real = lay.is_real.to(ids.device)
    for rows in row_chunks(ids):
        piece = ids[rows].to(torch.int64)
        local = piece - base[rows].unsqueeze(1)
        bad = (piece >= 0) & real[rows].unsqueeze(1) & (
            (local < 0) | (local >= vis[rows].unsqueeze(1)))
        if bool(bad.any()):
            t, j = _at(bad, rows.start)
            b, n = int(base[t]), int(vis[t])
            return ("cmp_ids", f"cmp_ids[{t}, {j}] = {int(ids[t, j])} is not a compressed "
                               f"group visible to row {t} (its visible ids are "
                               f"{f'{b}..{b + n - 1}' if n else 'none'}; sections 3 and 5)")
    return None


def _attention_pattern(case, lay, v: dict, got: dict) -> tuple | None:
    q, kv, ids, lengths = v["q"], v["kv"], v.get("ids"), v.get("att_lengths")
    if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or \
            ids.shape[0] != q.shape[0] or ids.is_floating_point():
        return None
    out, lse = got.get("out"), got.get("lse")
    dev = (out if out is not None else lse).device
    S = kv.shape[0]
    kv_bad = None
    for rows in row_chunks(q):
        r0 = rows.start
        idc = ids[rows].to(dev, torch.int64)
        ln = None if lengths is None else lengths[rows].to(dev, torch.int64)
        with torch.device(dev):          # the oracle's rule, on the outputs' device
            valid = valid_slots(idc, S, ln) if idc.numel() else \
                torch.zeros(idc.shape, dtype=torch.bool)
        empty = (~valid.any(dim=1) if valid.shape[1] else
                 torch.ones(idc.shape[0], dtype=torch.bool, device=dev)).unsqueeze(1)
        if lse is not None:
            piece = lse[rows].detach()
            bad = empty & (piece != math.inf)
            if bool(bad.any()):
                t, h = _at(bad, r0)
                return ("lse", f"lse[{t}, {h}] = {_value(lse, (t, h))} on a row with no valid "
                               f"slot: the contract's lse there is +inf (section 6)")
            bad_lse = ~empty & ~torch.isfinite(piece)
        bad_out = None if out is None else ~_finite_rows(out[rows].detach(), 1)
        if not ((lse is not None and bool(bad_lse.any())) or
                (bad_out is not None and bool(bad_out.any()))):
            continue
        # a non-finite value: allowed only where the query or a selected key is not finite
        if kv_bad is None:
            kv_bad = ~_finite_rows(kv.to(dev), 1)
        touched = (valid & kv_bad[idc.clamp(0, max(S - 1, 0))]).any(dim=1) if S else \
            torch.zeros(idc.shape[0], dtype=torch.bool, device=dev)
        clean = _finite_rows(q[rows].to(dev), 1) & ~touched.unsqueeze(1)
        if lse is not None:
            bad = clean & bad_lse
            if bool(bad.any()):
                t, h = _at(bad, r0)
                return ("lse", f"lse[{t}, {h}] = {_value(lse, (t, h))} on a row whose query "
                               f"and selected keys are finite (section 6: a finite lse)")
        if bad_out is not None:
            bad = (clean | empty) & bad_out
            if bool(bad.any()):
                t, h = _at(bad, r0)
                return ("out", f"out[{t}, {h}] holds a non-finite value on a row whose query "
                               f"and selected keys are finite (section 6: a finite out)")
    return None


def _distribution_pattern(case, lay, v: dict, got: dict) -> tuple | None:
    for name in ("target", "predict"):
        t = got.get(name)
        if t is None or not t.numel():
            continue
        for rows in row_chunks(t):
            piece = t[rows].detach()
            bad = ~torch.isfinite(piece) | (piece < 0)
            if bool(bad.any()):
                idx = _at(bad, rows.start)
                return (name, f"{name}{list(idx)} = {_value(t, idx)}: a distribution is finite "
                              f"and non-negative (section 8)")
    return None


# the ops whose outputs a later op reads, with the rule for their exact non-finite pattern
_PATTERN = {"indexer_scores": _scores_pattern, "stable_topk": _selection_pattern,
            "sparse_attention_forward": _attention_pattern,
            "sparse_indexer_loss": _distribution_pattern}


def unusable(op: str, case, layout, reads: dict, outputs: dict) -> tuple[str, str] | None:
    """The first output of ``op`` that breaks the rules above, as ``(name, why)``, or ``None``.

    ``reads``: what the op consumed, by the stage's read names (``q``, ``kv``, ``ids``,
    ``att_lengths``, ...; ``None`` or absent where unknown: those checks are skipped);
    ``outputs``: its returned outputs by name (those present are checked)."""
    spec = _spec(op, case, layout, reads)
    for name, (kind, shape, words) in spec.items():
        if name in outputs:
            why = _form(name, outputs[name], kind, shape, words)
            if why:
                return name, why
    pattern = _PATTERN.get(op)
    if pattern is None or not any(n in outputs for n in spec):
        return None
    return pattern(case, layout, reads, outputs)
