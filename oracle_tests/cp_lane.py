"""Shared pieces of the context-parallel test lane (``test_cp_*.py``): small CP cases, the
cp=1 oracle pipeline on them, and a spawner that runs a function on ``cp`` processes of a
``torch.distributed`` group with a hard deadline (a hang becomes a failure, never a stuck CI).

Cases are tiny on purpose (the whole CP lane must stay well under a minute on 2 cores) but
exercise what broke CP in practice: documents crossing rank boundaries, padding and empty
documents at a boundary, a document longer than a rank slice, capacity rows, compressed groups
owned by one rank and selected by another.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass

import torch

import reference as R

__all__ = ["CPCase", "CASES", "make_inputs", "oracle_cp1", "spawn"]


@dataclass(frozen=True)
class CPCase:
    """A small CP layer case: layout, shapes and layer kind (``ratio`` 0 / 4 / 128)."""

    name: str
    cu_seqlens: tuple
    cu_seqlens_padded: tuple
    num_rows: int
    ratio: int = 4
    window: int = 4
    topk: int = 3
    heads: int = 2
    head_dim: int = 8
    v_dim: int | None = 6
    index_heads: int = 2
    index_dim: int = 4
    coeff: float = 0.3
    seed: int = 0

    def layout(self) -> R.PackedLayout:
        return R.PackedLayout(list(self.cu_seqlens), list(self.cu_seqlens_padded), self.num_rows)


# T = 64: rank boundaries at 32 (cp 2) and 16/32/48 (cp 4). Document 0 crosses 16 and ends
# in padding; an empty document sits at row 20; document 2's padding (rows 31..33) straddles
# 32; document 4 (26 rows) is longer than a cp-4 slice and crosses 48; rows 60..63 are
# capacity rows.
_BOUNDARY = dict(cu_seqlens=(0, 18, 18, 29, 29, 55), cu_seqlens_padded=(0, 20, 20, 34, 34, 60),
                 num_rows=64)
CASES = {
    "csa": CPCase("csa", **_BOUNDARY, ratio=4, seed=1),
    "hca": CPCase("hca", **_BOUNDARY, ratio=8, window=4, seed=2),
    "window": CPCase("window", **_BOUNDARY, ratio=0, seed=3),
    # zigzag-able: every segment (16, 0, 24, 16, capacity 8) divides by 2*cp = 8.
    "csa_zigzag": CPCase("csa_zigzag", cu_seqlens=(0, 13, 13, 37, 50),
                         cu_seqlens_padded=(0, 16, 16, 40, 56), num_rows=64, ratio=4, seed=4),
}


def make_inputs(case: CPCase, dtype=torch.float32):
    """Global inputs of a case, deterministic from its seed (identical bits in every process),
    generated in float64 and rounded once to ``dtype``."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    lay = case.layout()
    T, H, D = lay.num_rows, case.heads, case.head_dim
    C = lay.num_compressed(case.ratio) if case.ratio else 0
    dv = case.v_dim or D

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    x = {"q": rnd(T, H, D), "kv": rnd(T, D), "kv_cmp": rnd(C, D), "sink": rnd(H),
         "dout": rnd(T, H, dv)}
    if case.ratio == 4:
        x.update(q_idx=rnd(T, case.index_heads, case.index_dim), k_idx=rnd(C, case.index_dim),
                 weights=rnd(T, case.index_heads))
    return x


def oracle_cp1(case: CPCase, x):
    """The cp=1 oracle pipeline on the (rounded) inputs ``x``: indexer scores -> stable Top-K
    -> compressed-first rows -> attention forward/backward -> indexer loss and its gradient."""
    lay = case.layout()
    T = lay.num_rows
    res = {}
    cids = scores = None
    if case.ratio == 4:
        scores = R.indexer_scores(x["q_idx"], x["k_idx"], x["weights"], lay, case.ratio)
        cids, _ = R.stable_topk(scores, case.topk)
        res.update(scores=scores, compressed_ids=cids)
    if case.ratio:
        ids, lengths = R.build_csa_indices(lay, window=case.window, ratio=case.ratio,
                                           compressed_ids=cids)
    else:
        ids, lengths = R.build_csa_indices(lay, window=case.window, ratio=0)
    keys = torch.cat([x["kv"].double(), x["kv_cmp"].double()])
    out, lse = R.sparse_attention_forward(x["q"], keys, ids, x["sink"], v_dim=case.v_dim,
                                          lengths=lengths)
    dq, dkv, dsink = R.sparse_attention_backward(x["q"], keys, ids, x["sink"], out, lse,
                                                 x["dout"], v_dim=case.v_dim, lengths=lengths)
    res.update(ids=ids, lengths=lengths, keys=keys, out=out, lse=lse, dq=dq, dkv=dkv[:T],
               dkv_cmp=dkv[T:], dkv_all=dkv, dsink=dsink)
    if case.ratio == 4:
        loss = R.sparse_indexer_loss(x["q"], x["kv_cmp"], x["sink"], lse, cids, scores, lay,
                                     coeff=case.coeff)
        dq_idx, dw, dk_idx = R.sparse_indexer_loss_grad(
            x["q_idx"], x["k_idx"], x["weights"], cids, loss.target, loss.predict,
            coeff=case.coeff, num_real=lay.num_real)
        res.update(loss=loss.loss, kl=loss.kl, target=loss.target, predict=loss.predict,
                   dq_idx=dq_idx, dw=dw, dk_idx=dk_idx)
    return res


# -- spawner ---------------------------------------------------------------------------------
def _entry(rank, world, fn, args, init_file, result_dir, backend, timeout_s):
    import torch.distributed as dist
    torch.set_num_threads(1)
    status = {"rank": rank}
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            status["result"] = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        status["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(status, f)


def spawn(fn, world, *args, backend="gloo", deadline_s=60.0, collective_timeout_s=30.0):
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes joined in one process group;
    return the list of per-rank results (picklable). Any rank's exception is raised here with
    its traceback; if the group has not finished after ``deadline_s`` seconds the processes are
    terminated and ``TimeoutError`` is raised (a hang becomes a failure)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="cp_lane_") as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world, fn, args, init_file, tmp, backend,
                                               collective_timeout_s),
                                 nprocs=world, join=False, start_method="spawn")
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
