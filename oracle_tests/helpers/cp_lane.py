"""Shared pieces of the context-parallel test lane (``cp/test_*.py``): small CP cases (their
cp=1 reference is ``dsv4_oracle.conformance.oracle_outputs``, the conformance stage table), the
gathering of the ranks' results into the cp=1 form, and a spawner that runs a function on ``cp``
processes of a ``torch.distributed`` group with a hard deadline (a hang becomes a failure,
never a stuck CI).

Cases are tiny on purpose (the whole CP lane must stay well under a minute on 2 cores) but
exercise what broke CP in practice: documents crossing rank boundaries, padding and empty
documents at a boundary, a document longer than a rank slice, capacity rows, compressed groups
owned by one rank and selected by another.
"""
from __future__ import annotations

import datetime
import math
import os
import pickle
import tempfile
import traceback

import torch

from dsv4_oracle import reference as R
from dsv4_oracle.conformance import applies
from dsv4_oracle.fixtures.case import Case

__all__ = ["CASES", "gather_ranks", "make_inputs", "spawn", "local_inputs",
           "rank_main"]


def _case(name, ratio, seed, layout=None, **kw):
    layer = "window" if ratio == 0 else ("csa" if ratio == 4 else "hca")
    lay = dict(_BOUNDARY if layout is None else layout)
    shape = dict(heads=2, head_dim=8, v_dim=6, window=4, topk=3, index_heads=2, index_dim=4,
                 coeff=0.3, dtype="float32")
    shape.update(kw)
    return Case(name=name, seed=seed, **lay, ratio=ratio, layer=layer, categories=("cp",),
                **shape)


# T = 64: rank boundaries at 32 (cp 2) and 16/32/48 (cp 4). Document 0 crosses 16 and ends
# in padding; an empty document sits at row 20; document 2's padding (rows 31..33) straddles
# 32; document 4 (26 rows) is longer than a cp-4 slice and crosses 48; rows 60..63 are
# capacity rows.
_BOUNDARY = dict(cu_seqlens=(0, 18, 18, 29, 29, 55), cu_seqlens_padded=(0, 20, 20, 34, 34, 60),
                 num_rows=64)
# Every segment (16, 0, 24, 16, capacity 8) divides by 2*cp = 8: usable in zigzag mode too.
_ZIGZAG = dict(cu_seqlens=(0, 13, 13, 37, 50), cu_seqlens_padded=(0, 16, 16, 40, 56),
               num_rows=64)
CASES = {
    "csa": _case("cp-csa", 4, 1),
    "hca": _case("cp-hca", 8, 2),
    "window": _case("cp-window", 0, 3),
    "csa_zigzag": _case("cp-csa-zigzag", 4, 4, _ZIGZAG),
    "csa_bf16": _case("cp-csa-bf16", 4, 5, dtype="bfloat16"),
    # Documents shorter than the ratio: no complete compressed group anywhere (C = 0), so the
    # indexer, Top-K and loss see empty key sets (a hypothesis-found corner of the CP plans).
    "csa_no_groups": _case("cp-csa-no-groups", 4, 7, dict(cu_seqlens=(0, 1, 1, 3, 6),
                                                          cu_seqlens_padded=(0, 2, 2, 5, 8),
                                                          num_rows=32)),
    # DSv4-Flash head shapes at T = 1024 (GPU lane): the cp-2 boundary (row 512) lies inside
    # document 2, so the 128-row halo is used; an empty document and tail padding.
    "flash_1k": _case("cp-flash-1k", 4, 6, dict(cu_seqlens=(0, 300, 300, 800, 990),
                                                 cu_seqlens_padded=(0, 320, 320, 832, 1024),
                                                 num_rows=1024),
                      heads=64, head_dim=512, v_dim=512, window=128, topk=64, index_heads=64,
                      index_dim=128, coeff=0.01, dtype="bfloat16"),
}


def make_inputs(case: Case):
    """Global inputs of a case (``Case.materialize``: identical bits in every process)."""
    return case.materialize()


# -- gathering the ranks' results into the cp=1 form ------------------------------------------
def gather_ranks(case, cp, runs):
    """The ranks' results (one dict per rank, rank order) as one cp=1 result dict."""
    lay = case.layout()
    plans = R.cp_plans(lay, cp, window=case.window, ratio=case.ratio)
    got = {}
    ids = []
    for r in runs:
        phys = r["ids"].to(torch.int64)
        ids.append(torch.where(phys >= 0, r["key_ids"][phys.clamp_min(0)], -1))
    got["ids"] = torch.cat(ids)
    for k in ("lengths", "out", "lse", "dq"):
        got[k] = torch.cat([r[k] for r in runs])
    dkv = [torch.cat([r["dkv"] for r in runs])]
    if case.ratio:
        dkv.append(torch.cat([r["dkv_cmp"] for r in runs]))
    got["dkv"] = torch.cat(dkv)
    got["dsink"] = runs[0]["dsink"]
    if applies("stable_topk", case):
        slot_to_cid = torch.full((cp * plans[0].cmp_capacity,), -1, dtype=torch.int64)
        slot_to_cid[plans[0].group_slot] = torch.arange(lay.num_compressed(case.ratio))
        cmp_ids = []
        for r in runs:
            s = r["compressed_ids"].to(torch.int64)
            cmp_ids.append(torch.where(s >= 0, slot_to_cid[s.clamp_min(0)], -1))
        got["cmp_ids"] = torch.cat(cmp_ids).to(torch.int32)
        got["cmp_lengths"] = (got["cmp_ids"] >= 0).sum(dim=1).to(torch.int32)
        got["scores"] = torch.cat([r["index_scores"][:, plans[0].group_slot] for r in runs])
        got["loss"] = runs[0]["loss"]
        for k in ("kl", "target", "predict", "dq_idx", "dweights"):
            got[k.replace("dweights", "dw")] = torch.cat([r[k] for r in runs])
        got["dk_idx"] = torch.cat([r["dk_idx"] for r in runs])
    return got, plans


# -- spawner ---------------------------------------------------------------------------------
def _entry(rank, world, fn, args, init_file, result_dir, backend, timeout_s):
    import torch.distributed as dist
    torch.set_num_threads(1)
    status = {"rank": rank}
    try:
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kw)
        try:
            status["result"] = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        status["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(status, f)


def spawn(fn, world, *args, backend="gloo", deadline_s=60.0, collective_timeout_s=30.0,
          start_method="fork"):
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes joined in one process group;
    return the list of per-rank results (picklable). Any rank's exception is raised here with
    its traceback; if the group has not finished after ``deadline_s`` seconds the processes are
    terminated and ``TimeoutError`` is raised (a hang becomes a failure)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="cp_lane_") as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world, fn, args, init_file, tmp, backend,
                                               collective_timeout_s),
                                 nprocs=world, join=False, start_method=start_method)
        import time
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, end - time.monotonic()))):
                if time.monotonic() > end:
                    raise TimeoutError(f"CP group of {world} ranks did not finish within "
                                       f"{deadline_s:.0f} s (hang?)")
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a CP rank crashed: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited without a result (exit codes "
                                   f"{[p.exitcode for p in ctx.processes]})")
            with open(path, "rb") as f:
                st = pickle.load(f)
            results.append(st)
        errors = [st for st in results if "error" in st]
        if errors:
            raise RuntimeError("\n".join(f"rank {st['rank']}: {st['error']}" for st in errors))
        return [st["result"] for st in results]


# -- the rank side of the CP lane -------------------------------------------------------------
def local_inputs(case: Case, x, cp: int, rank: int):
    """Rank ``rank``'s slice of the global inputs ``x`` (contiguous partition): its rows and
    its owned compressed groups, as :func:`gpu_impl.cp.cp_csa_layer` takes them."""
    from dsv4_oracle.gpu_impl.cp import owned_group_counts
    lay = case.layout()
    L = lay.num_rows // cp
    rows = slice(rank * L, (rank + 1) * L)
    loc = {"kv": x["kv_raw"][rows]}
    loc.update({k: x[k][rows] for k in ("q", "dout")})
    loc.update({k: x[k][rows] for k in ("q_idx", "weights") if k in x})
    if case.ratio:
        counts = owned_group_counts(lay, cp, ratio=case.ratio)
        g0 = sum(counts[:rank])
        own = slice(g0, g0 + counts[rank])
        loc["kv_cmp"] = x["kv_cmp"][own]
        if "k_idx" in x:
            loc["k_idx"] = x["k_idx"][own]
    loc["sink"] = x["sink"]
    return loc


def run_layer(case: Case, loc, *, dtype_backward=True, deterministic=True, backend="torch",
              layout=None, window=None, **overrides):
    """Forward (and backward with ``dout`` and ``grad_loss = 1``) of the CP layer on this rank;
    returns a dict of CPU tensors."""
    from dsv4_oracle.gpu_impl.cp import cp_csa_layer
    leaves = {k: loc[k].detach().clone().requires_grad_(True)
              for k in ("q", "kv", "sink", "kv_cmp", "q_idx", "weights", "k_idx") if k in loc}
    csa = applies("indexer_scores", case)
    kwargs = dict(window=window or case.window, ratio=case.ratio,
                  kv_cmp=leaves.get("kv_cmp"), q_idx=leaves.get("q_idx"),
                  k_idx=leaves.get("k_idx"), weights=leaves.get("weights"),
                  topk=case.topk if csa else None, coeff=case.coeff if csa else 0.0,
                  v_dim=case.v_dim, backend=backend, deterministic=deterministic)
    kwargs.update(overrides)
    res = cp_csa_layer(leaves["q"], leaves["kv"], leaves["sink"], layout or case.layout(),
                       **kwargs)
    out = {f: getattr(res, f) for f in ("out", "lse", "ids", "lengths", "compressed_ids", "kl",
                                         "target", "predict", "index_scores", "key_ids")}
    out["loss"] = res.loss
    out["backends"] = res.backends
    if dtype_backward:
        outs, grads = [res.out], [loc["dout"].to(res.out.dtype)]
        if csa:
            outs.append(res.loss)
            grads.append(torch.ones((), dtype=res.loss.dtype, device=res.loss.device))
        torch.autograd.backward(outs, grads)
        for k, t in leaves.items():
            out["d" + k] = t.grad
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _sha(t: torch.Tensor) -> str:
    from dsv4_oracle.compare import content_hash
    return content_hash(t)


def rank_main(rank, world, jobs):
    """Run the listed jobs on this rank; ``jobs`` is a list of (name, kind, params). Kinds:
    ``layer`` (forward + backward, replayed ``replays`` times, inputs hashed before/after),
    ``grad_modes`` (forward under no_grad / inference_mode / grad), ``invalid`` (a call that
    must raise on every rank: returns the exception type and message)."""
    import torch.distributed as dist
    results = {}
    for name, kind, p in jobs:
        case = CASES[p["case"]]
        x = make_inputs(case)
        device = p.get("device", "cpu")
        device = f"cuda:{rank}" if device == "cuda" else device
        backend = p.get("backend", "torch")
        loc = {k: v.to(device) for k, v in local_inputs(case, x, world, rank).items()}
        if kind == "layer":
            before = {k: _sha(v) for k, v in loc.items()}
            runs = [run_layer(case, loc, deterministic=p.get("deterministic", True),
                              backend=backend)
                    for _ in range(p.get("replays", 1))]
            after = {k: _sha(v) for k, v in loc.items()}
            results[name] = dict(runs=runs, mutated=[k for k in before if before[k] != after[k]])
        elif kind == "grad_modes":
            modes = {}
            for mode in ("grad", "no_grad", "inference_mode"):
                ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
                       "inference_mode": torch.inference_mode}[mode]
                with ctx():
                    modes[mode] = run_layer(case, loc, dtype_backward=False, backend=backend)
            results[name] = modes
        elif kind == "invalid":
            bad = dict(loc)
            kwargs = {}
            what = p["what"]
            if what == "rows_on_one_rank" and rank == world - 1:
                bad["q"] = loc["q"][:-1]
            elif what == "layout_disagrees" and rank == 0:
                lay = case.layout()          # one real token fewer: same shapes, other layout
                cu = lay.cu_seqlens.tolist()
                cu[-1] -= 1
                kwargs["layout"] = R.PackedLayout(cu, lay.cu_seqlens_padded.tolist(), lay.num_rows)
            elif what == "declared_cp":
                kwargs["cp"] = world + 1
            elif what == "halo_longer_than_slice":
                kwargs["window"] = lay_rows(case) // world + 1
            elif what == "rows_not_divisible":
                lay = case.layout()
                kwargs["layout"] = R.PackedLayout(lay.cu_seqlens.tolist(),
                                                  lay.cu_seqlens_padded.tolist(),
                                                  lay.num_rows + 1)
            elif what == "kv_cmp_rows" and rank == 0:
                bad["kv_cmp"] = loc["kv_cmp"][:-1]
            elif rank == world - 1:
                bad, kwargs = _fault_on_last_rank(what, loc, kwargs)
            try:
                run_layer(case, bad, backend=backend, **kwargs)
                results[name] = None
            except (TypeError, ValueError) as exc:
                results[name] = (type(exc).__name__, str(exc))
            # the group must still be usable afterwards
            t = torch.ones(1, device=device)
            dist.all_reduce(t)
            assert int(t) == world
    return results


# Faults of one rank (the last) that every rank must turn into the same clear error before any
# data moves: what -> how the last rank's call differs from the others'.
FAULTS = {
    "sink_differs": lambda loc: (dict(loc, sink=loc["sink"] + 0.125), {}),
    "indexer_dtype_differs": lambda loc: (dict(loc, **{k: loc[k].double() for k in
                                                       ("q_idx", "weights", "k_idx")}), {}),
    "dtype_differs": lambda loc: ({k: (v.double() if v.is_floating_point() else v)
                                  for k, v in loc.items()}, {}),
    "nan_q": lambda loc: (dict(loc, q=_poison(loc["q"], math.nan)), {}),
    "nan_q_idx": lambda loc: (dict(loc, q_idx=_poison(loc["q_idx"], math.nan)), {}),
    "inf_k_idx": lambda loc: (dict(loc, k_idx=_poison(loc["k_idx"], math.inf)), {}),
    "nan_sink": lambda loc: (dict(loc, sink=_poison(loc["sink"], math.nan)), {}),
    "scale_differs": lambda loc: (loc, dict(scale=0.25)),
    "topk_differs": lambda loc: (loc, dict(topk=2)),
    "coeff_differs": lambda loc: (loc, dict(coeff=0.5)),
    "v_dim_differs": lambda loc: (loc, dict(v_dim=4)),
    "window_differs": lambda loc: (loc, dict(window=5)),
    "order_differs": lambda loc: (loc, dict(order="score")),
    "deterministic_differs": lambda loc: (loc, dict(deterministic=False)),
    "bad_timeout": lambda loc: (loc, dict(timeout=-1.0)),
    "bad_chunk": lambda loc: (loc, dict(chunk_elements=0)),
}


def _poison(x, value):
    y = x.clone()
    y.view(-1)[y.numel() // 2] = value
    return y


def _fault_on_last_rank(what, loc, kwargs):
    if what not in FAULTS:
        return loc, kwargs
    bad, extra = FAULTS[what](dict(loc))
    return bad, dict(kwargs, **extra)


def fault_main(rank, world, what, timeout, hold_s=None):
    """A fault that no agreement can catch, with the layer's collectives bounded by
    ``timeout`` (``None``: the layer's default): ``never_joins`` (the last rank never calls the
    layer), ``fails_later`` (the last rank's attention kernel fails after the validation
    exchange, while the others go on to the next collective; the failed rank's process stays
    alive for ``hold_s`` seconds, default ``timeout + 3``), ``fails_and_exits`` (the same, and
    the failed rank's process leaves the group at once) or ``fails_in_backward_and_exits``
    (the last rank's attention backward kernel fails, and its process leaves the group).
    Returns ``(exception type, message)`` or ``None``."""
    import time

    from dsv4_oracle.gpu_impl import api
    case = CASES["csa"]
    loc = local_inputs(case, make_inputs(case), world, rank)
    hold = hold_s if hold_s is not None else (timeout or 0) + 3
    if what == "fails_in_backward_and_exits" and rank != world - 1:
        kernel = api.sparse_attention_backward

        def late(*args, **kwargs):       # the failed rank has left before this rank goes on
            time.sleep(2.0)
            return kernel(*args, **kwargs)
        api.sparse_attention_backward = late
    if rank == world - 1:
        if what == "never_joins":
            time.sleep(hold)
            return None

        def broken(*args, **kwargs):
            raise RuntimeError("simulated kernel failure")
        if what == "fails_in_backward_and_exits":     # this process only (a forked rank)
            api.sparse_attention_backward = broken
        else:
            api.sparse_attention_forward = broken
    try:
        run_layer(case, loc, **({} if timeout is None else {"timeout": timeout}))
    except Exception as exc:  # noqa: BLE001 - the test judges the type and message
        if rank == world - 1 and what == "fails_later":
            time.sleep(hold)
        return type(exc).__name__, str(exc)
    return None


def lay_rows(case):
    return case.layout().num_rows
