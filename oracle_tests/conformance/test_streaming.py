"""The streaming judge (``conformance.Streaming``): the attention stages judged block of rows by
block of rows give every field of every check of the whole-tensor judge.

Catalog cases are small, so their bounds use one row chunk and the judge one block; here the
bounds' chunks (``bound_rows``) and the blocks (``block_rows``) are made a few rows long, so
that every case crosses many blocks, and the streamed judge is compared with the whole judge
on the same bound chunks, field by field: for an implementation that passes under the "given"
convention, for one measured "recomputed" (its backward recomputes the forward), and for one
that fails (a flipped ``dq``: re-judged whole for its hints), at the op and the layer level.
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from dsv4_oracle import conformance as K
from dsv4_oracle import fixtures
from dsv4_oracle.adapters import LAYER_OP, Adapter, load_adapter
from dsv4_oracle.autograd_adapter import from_autograd
from dsv4_oracle.examples.megatron_style_adapter import MegatronStyleAdapter
from dsv4_oracle.runner import level_precision
from oracle_tests.helpers.check_adapters import SignFlipAdapter

WHOLE = K.Streaming(enabled=False, bound_rows=2)
STREAMED = K.Streaming(block_rows=3, bound_rows=2)     # blocks of 4 rows: 2 chunks each


def _configs(case) -> tuple:
    """``(whole, streamed)``: blocks of 4 rows up to 128 rows, of 48 rows (chunks of 16) above,
    so that a case of thousands of rows still crosses many blocks in reasonable time."""
    if case.T <= 128:
        return WHOLE, STREAMED
    return K.Streaming(enabled=False, bound_rows=16), K.Streaming(block_rows=48, bound_rows=16)


def _adapters():
    return {"torch": load_adapter("gpu_impl:torch", "cpu"),
            "recomputing": Adapter(from_autograd(MegatronStyleAdapter().sparse_attention_forward),
                                   name="recomputing", device="cpu"),
            "sign-flip": load_adapter(f"{SignFlipAdapter.__module__}:SignFlipAdapter", "cpu")}


def _fields(c) -> dict:
    d = dataclasses.asdict(c)
    return {k: (repr(v) if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _judged(adapter, case, x, streaming) -> list:
    """Every check of both levels of ``case`` under ``streaming`` (one cache, as the runner)."""
    cache, maps, out = {}, {}, []
    run = K.run_ops(adapter, case, x, policies=adapter.policies, probe=True)
    out += K.judge(case, x, run.got, consumed=run.consumed, cache=cache, maps=maps,
                   precision=level_precision(adapter, case.torch_dtype, "op"),
                   policies=adapter.policies, streaming=streaming)
    if adapter.has(LAYER_OP) and K.layer_applies(case):
        run = K.run_layer(adapter, case, x)
        out += K.judge(case, x, run.got, consumed=run.consumed, cache=cache,
                       precision=level_precision(adapter, case.torch_dtype, "layer"),
                       policies=adapter.policies, streaming=streaming)
    return [_fields(c) for c in out], {k: v.clone() for k, v in maps.items()}


CASES = [c for c in fixtures.catalog() if c.T > 4 * 4]
# In the CPU lane: every other case up to 64 rows with the torch backend, every sixth with the
# other two; DSV4_STREAMING_ALL=1 takes every case above 16 rows (up to 4200) with all three.
ALL = os.environ.get("DSV4_STREAMING_ALL") == "1"
PAIRS = [(c, n) for i, c in enumerate(CASES) for n in ("torch", "recomputing", "sign-flip")
         if ALL or (c.T <= 64 and i % (2 if n == "torch" else 6) == 0)]


@pytest.mark.parametrize("case,name", PAIRS, ids=lambda v: getattr(v, "id", v))
def test_streamed_judge_is_the_whole_judge(case, name):
    adapter = _adapters()[name]
    x = case.materialize(device="cpu")
    w, st = _configs(case)
    whole, maps_w = _judged(adapter, case, x, w)
    streamed, maps_s = _judged(adapter, case, x, st)
    assert streamed == whole
    assert maps_s.keys() == maps_w.keys()
    assert all(torch.equal(maps_s[k], maps_w[k]) for k in maps_w)


def test_the_three_implementations_take_the_three_paths():
    """The comparison above covers a measured "recomputed" backward and a failing one."""
    case = next(c for c in CASES if c.id == "lengths-above-width")
    x = case.materialize(device="cpu")
    checks = {n: _judged(a, case, x, STREAMED)[0] for n, a in _adapters().items()}
    conv = {n: {c["extra"].get("convention") for c in v} - {None} for n, v in checks.items()}
    assert conv["torch"] == {"given"} and conv["recomputing"] == {"recomputed"}
    assert all(c["passed"] for c in checks["torch"] + checks["recomputing"])
    assert not all(c["passed"] for c in checks["sign-flip"])


def _judging(case, streaming=None):
    """A judging of the torch backend's run of ``case`` (op level)."""
    x = case.materialize(device="cpu")
    adapter = _adapters()["torch"]
    run = K.run_ops(adapter, case, x)
    return K._Judging(case, x, run.got, run.consumed,
                      level_precision(adapter, case.torch_dtype, "op"), {}, None,
                      streaming=streaming)


def test_the_blocks_are_whole_bound_chunks_and_cover_the_rows():
    case = next(c for c in CASES if c.T >= 40)
    j = _judging(case, K.Streaming(block_rows=5, bound_rows=3))
    blocks = K._blocks(j, K._STAGE["sparse_attention_backward"])
    assert blocks and all((b.stop - b.start) % 3 == 0 for b in blocks[:-1])
    assert blocks[0].start == 0 and blocks[-1].stop == case.T
    assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
    j = _judging(case)
    assert K._blocks(j, K._STAGE["sparse_attention_backward"]) is None   # one block: whole


def test_score_blocks_sit_on_the_bound_chunks_of_every_document():
    case = next(c for c in CASES if "dsa_v32" in c.categories and c.T >= 40)
    j = _judging(case, K.Streaming(block_rows=5, bound_rows=3))
    blocks = K._score_blocks(j)
    assert len(blocks) > 2 and blocks[0].start == 0 and blocks[-1].stop == case.T
    assert all(a.stop == b.start and a.start < a.stop for a, b in zip(blocks, blocks[1:]))
    lay = j.olay
    for d in range(lay.num_docs):
        r0, real = int(lay.cu_seqlens_padded[d]), int(lay.doc_lengths[d])
        inside = [b.start for b in blocks if r0 < b.start < r0 + real]
        assert all((e - r0) % 3 == 0 for e in inside)


def _attention_inputs(T=37, H=16, D=64, S=50, K=24):
    g = torch.Generator().manual_seed(0)
    f = dict(generator=g, dtype=torch.float64)
    q, kv = torch.randn(T, H, D, **f), torch.randn(S, D, **f)
    ids = torch.randint(-3, S, (T, K), generator=g)
    sink, dout = torch.randn(H, **f), torch.randn(T, H, D, **f)
    lengths = torch.randint(0, K + 1, (T,), generator=g)
    return q, kv, ids, sink, dout, lengths


def test_attention_folds_in_row_blocks_are_the_whole_backward_bitwise():
    from dsv4_oracle import reference as R
    from dsv4_oracle.reference import error_model as EM
    from dsv4_oracle.reference.attention import AttentionGradSums
    q, kv, ids, sink, dout, lengths = _attention_inputs()
    T, H, D = q.shape
    S = kv.shape[0]
    out, lse = R.sparse_attention_forward(q, kv, ids, sink, lengths=lengths)
    dq, dkv, dsink = R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                 lengths=lengths)
    p = EM.Precision.of(torch.bfloat16)
    whole = EM.attention_backward_bound(q, kv, ids, sink, out, lse, dout, dq, dkv, dsink,
                                        precision=p, lengths=lengths, chunk_rows=3)
    sums, bsums = AttentionGradSums.zeros(S, D, H), EM.AttentionBoundSums.zeros(S, D, H)
    parts, bparts = [], []
    for r0 in range(0, T, 6):
        r = slice(r0, min(r0 + 6, T))
        parts.append(R.sparse_attention_backward(q[r], kv, ids[r], sink, out[r], lse[r], dout[r],
                                                 lengths=lengths[r], sums=sums)[0])
        bparts.append(EM.attention_backward_bound(
            q[r], kv, ids[r], sink, out[r], lse[r], dout[r], dq[r], None, None, precision=p,
            lengths=lengths[r], chunk_rows=3, sums=bsums)[0])
    assert torch.equal(torch.cat(parts), dq)
    assert all(torch.equal(a, b) for a, b in zip(sums.result(), (dkv, dsink)))
    assert torch.equal(torch.cat(bparts), whole[0])
    assert all(torch.equal(a, b) for a, b in zip(bsums.bounds(p, dkv, dsink), whole[1:]))
    with pytest.raises(ValueError, match="sums must hold"):
        R.sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                    sums=AttentionGradSums.zeros(S + 1, D, H))


def test_indexer_scores_and_bound_of_a_row_range_are_those_rows_bitwise():
    from dsv4_oracle import reference as R
    from dsv4_oracle.reference import error_model as EM
    case = next(c for c in CASES if "dsa_v32" in c.categories and c.T >= 40)
    x = case.materialize(device="cpu")
    args = (x["q_idx"], x["k_idx"], x["weights"], case.layout(), case.ratio)
    p = EM.Precision.of(torch.bfloat16)
    s = R.indexer_scores(*args)
    b = EM.indexer_scores_bound(*args, s, precision=p, chunk_rows=1)
    for a, z in ((0, 5), (5, 6), (7, case.T)):
        assert torch.equal(R.indexer_scores(*args, rows=(a, z)), s[a:z])
        assert torch.equal(EM.indexer_scores_bound(*args, s[a:z], precision=p, chunk_rows=1,
                                                   rows=(a, z)), b[a:z])
    with pytest.raises(ValueError, match="rows must satisfy"):
        R.indexer_scores(*args, rows=(3, 2))


@pytest.mark.parametrize("shape", [(3, 5), (1 << 24,), (5, 1 << 22)])
def test_content_hash_piece_by_piece_is_the_same_value(shape, monkeypatch):
    """Off the CPU a tensor is hashed one piece at a time (bounded host memory); the value is
    the one of the whole-copy path (forced here on the CPU, with 4 MiB pieces)."""
    from dsv4_oracle import compare
    monkeypatch.setattr(compare, "_HASH_CHUNK", 1 << 22)
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    for x in (t, t.t() if t.dim() == 2 else t[::2]):
        assert compare.content_hash(x, piecewise=True) == compare.content_hash(x)


def test_an_empty_block_adds_nothing():
    from dsv4_oracle.compare import NumericComparison, compare_numeric
    c = NumericComparison("scores", torch.zeros(4, 0), (4, 0))
    c.add(slice(0, 4), torch.zeros(4, 0), torch.zeros(4, 0))
    assert c.result() == compare_numeric("scores", torch.zeros(4, 0), torch.zeros(4, 0),
                                         torch.zeros(4, 0))
    assert not c.result().judged
