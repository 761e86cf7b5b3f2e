"""The compressor of contract section 15 (with RoPE, section 13, and the Hadamard rotation,
section 14) against itself: the worked example, gradchecks, the closed-form backward against
autograd, an independent dense form, closed forms at r = 1, document isolation, unread elements,
chunking, CP ownership and bad inputs."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.reference.error_model import (ORACLE_PRECISION, compressor_backward_bound,
                                               compressor_forward_bound)
from dsv4_oracle.reference.hadamard import hadamard_matrix
from dsv4_oracle.selfcheck import compressor_worked_example
from oracle_tests import content_hash

F64 = torch.float64
NAN = math.nan

# documents of 5 real tokens in 7 rows (a tail), none, 8 in 8, 2 in 4 (padding inside a
# group), 1 in 1 (no group), then capacity rows
LAYOUT = R.PackedLayout([0, 5, 5, 13, 15, 16], [0, 7, 7, 15, 19, 20], 23)
ROPE = R.RopeSpec(dim=4, base=50.0, factor=4.0, original_seq_len=16)


def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def inputs(ratio=2, d=8, overlap=True, seed=0, layout=LAYOUT):
    c = 2 if overlap else 1
    T = layout.num_rows
    return dict(kv=rnd(T, c * d, seed=seed), score=rnd(T, c * d, seed=seed + 1),
                ape=rnd(ratio, c * d, seed=seed + 2), norm_weight=1 + 0.3 * rnd(d, seed=seed + 3))


def fwd(x, ratio=2, overlap=True, rotate=False, layout=LAYOUT, rope=ROPE, **kw):
    return R.compressor_forward(x["kv"], x["score"], x["ape"], x["norm_weight"], layout, ratio,
                                rope=rope, overlap=overlap, rotate=rotate, **kw)


def bwd(x, dout, ratio=2, overlap=True, rotate=False, layout=LAYOUT, rope=ROPE, **kw):
    return R.compressor_backward(x["kv"], x["score"], x["ape"], x["norm_weight"], layout, ratio,
                                 dout, rope=rope, overlap=overlap, rotate=rotate, **kw)


# ---------------------------------------------------------------------------------------------
# the worked example of section 15
# ---------------------------------------------------------------------------------------------
def worked_example():
    x, lay, table, _ = compressor_worked_example()
    return x, lay, table


def test_the_worked_example():
    x, lay, table = worked_example()
    s5, s10 = 5 ** -0.5, 10 ** -0.5
    out = fwd(x, layout=lay, rope=table)
    want = torch.tensor([[3 * s5, s5], [-1, 1], [-3 * s5, -s5], [2 * s10, 4 * s10]], dtype=F64)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)     # eps = 1e-6 shifts 1e-7
    k_idx = R.indexer_compressor_forward(x["kv"], x["score"], x["ape"], x["norm_weight"], lay, 2,
                                         rope=table, overlap=True)
    torch.testing.assert_close(k_idx, want @ hadamard_matrix(2), rtol=1e-6, atol=1e-6)
    dout = torch.zeros(4, 2, dtype=F64)
    dout[0, 0] = 1
    g = bwd(x, dout, layout=lay, rope=table)
    dc = s5 * (torch.tensor([1.0, 0.0]) - 0.3 * torch.tensor([3.0, 1.0])).to(F64)
    dkv = torch.zeros(10, 4, dtype=F64)
    dkv[0, 2:], dkv[1, 2:] = 0.75 * dc, 0.25 * dc
    dscore = torch.zeros(10, 4, dtype=F64)
    dscore[0, 2:] = 0.75 * torch.tensor([1.0, -1.0], dtype=F64) * dc
    dscore[1, 2:] = 0.25 * torch.tensor([-3.0, 3.0], dtype=F64) * dc
    dape = torch.zeros(2, 4, dtype=F64)
    dape[0], dape[1] = dscore[0], dscore[1]
    for got, exp in zip(g, (dkv, dscore, dape, torch.tensor([3 * s5, 0.0], dtype=F64))):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-7)
    assert torch.equal(g.dkv[2:] == 0, torch.ones_like(g.dkv[2:], dtype=torch.bool))


def test_ape_follows_the_document_position_not_the_packed_row():
    """The second document starts at packed row 7 (odd): offset 0 in its group is row 7."""
    x, lay, table = worked_example()
    out = fwd(x, layout=lay, rope=table)
    swapped = torch.tensor([-2.0, 4.0], dtype=F64)
    assert not torch.allclose(out[3], swapped / swapped.square().mean().sqrt())


# ---------------------------------------------------------------------------------------------
# calculus
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio,overlap,rotate", [(2, True, False), (2, True, True),
                                                   (3, False, False), (1, True, True)])
def test_gradcheck(ratio, overlap, rotate):
    lay = R.PackedLayout([0, 5, 5, 9], [0, 7, 7, 12], 13)
    x = inputs(ratio=ratio, d=4, overlap=overlap, seed=ratio, layout=lay)
    rope = R.RopeSpec(dim=2, base=20.0)
    leaves = [x[k].clone().requires_grad_(True) for k in ("kv", "score", "ape", "norm_weight")]

    def f(kv, score, ape, w):
        return R.compressor_forward(kv, score, ape, w, lay, ratio, rope=rope, overlap=overlap,
                                    rotate=rotate)
    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("rotate", [False, True])
def test_closed_form_backward_is_the_derivative(rotate):
    x = inputs()
    leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    out = fwd(leaves, rotate=rotate)
    dout = rnd(*out.shape, seed=9)
    auto = torch.autograd.grad(out, [leaves[k] for k in ("kv", "score", "ape", "norm_weight")],
                               dout)
    closed = bwd(x, dout, rotate=rotate)
    bounds = compressor_backward_bound(x["kv"], x["score"], x["ape"], x["norm_weight"], LAYOUT,
                                       2, dout, closed, rope=ROPE, precision=ORACLE_PRECISION,
                                       overlap=True, rotate=rotate)
    for a, c, b in zip(auto, closed, bounds):
        assert bool(((a - c).abs() <= 2 * b).all())


# ---------------------------------------------------------------------------------------------
# an independent dense form
# ---------------------------------------------------------------------------------------------
def dense_compressor(kv, score, ape, w, layout, ratio, rope, overlap, rotate, eps=1e-6):
    """Section 15 from the definitions with broadcasting over every (group, token, half):
    complex-number RoPE, the Hadamard matrix; shares nothing with the gather oracle."""
    c = 2 if overlap else 1
    T, d = kv.shape[0], kv.shape[1] // c
    groups = [(b, g) for b in range(layout.num_docs)
              for g in range(int(layout.doc_padded_lengths[b]) // ratio)]
    pos = layout.pos
    doc = layout.doc
    out = []
    for b, g in groups:
        tok_doc = doc == b
        own = tok_doc & (pos >= g * ratio) & (pos < (g + 1) * ratio)
        prev = tok_doc & (pos >= (g - 1) * ratio) & (pos < g * ratio) & torch.tensor(overlap)
        # [T, c] membership: half 0 of the previous group's tokens, the last half of own tokens
        member = torch.stack([prev, own], 1) if overlap else own.unsqueeze(1)
        offs = (pos % ratio).clamp_min(0)
        z = score.view(T, c, d) + ape.view(ratio, c, d)[offs]
        z = torch.where(member.unsqueeze(-1), z, torch.full_like(z, -math.inf))
        alpha = torch.softmax(z.reshape(T * c, d), dim=0)
        vals = torch.where(member.unsqueeze(-1), kv.view(T, c, d), torch.zeros_like(z))
        ctil = (alpha * vals.reshape(T * c, d)).sum(0)
        n = w * ctil / torch.sqrt(ctil.square().mean() + eps)
        p = g * ratio
        f = R.rope_frequencies(rope)
        zc = torch.view_as_complex(n[d - rope.dim:].reshape(-1, 2).contiguous())
        n = torch.cat([n[:d - rope.dim], torch.view_as_real(zc * torch.polar(
            torch.ones_like(f), p * f)).reshape(-1)])
        out.append(n @ hadamard_matrix(d) if rotate else n)
    return torch.stack(out) if out else torch.zeros(0, d, dtype=F64)


@pytest.mark.parametrize("ratio,overlap,rotate", [(2, True, False), (2, True, True),
                                                   (4, True, True), (3, False, False)])
def test_gather_oracle_matches_the_dense_form(ratio, overlap, rotate):
    x = inputs(ratio=ratio, overlap=overlap, seed=ratio + 10)
    got = fwd(x, ratio=ratio, overlap=overlap, rotate=rotate)
    want = dense_compressor(x["kv"], x["score"], x["ape"], x["norm_weight"], LAYOUT, ratio, ROPE,
                            overlap, rotate)
    bound = compressor_forward_bound(x["kv"], x["score"], x["ape"], x["norm_weight"], LAYOUT,
                                     ratio, got, rope=ROPE, precision=ORACLE_PRECISION,
                                     overlap=overlap, rotate=rotate)
    assert got.shape == want.shape == (LAYOUT.num_compressed(ratio), 8)
    assert bool(((got - want).abs() <= 2 * bound).all())


# ---------------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------------
def test_ratio_one_without_overlap_is_rmsnorm_and_rope_of_each_row():
    """r = 1, c = 1: one slot, softmax 1 whatever the scores: every padded row is a group."""
    x = inputs(ratio=1, overlap=False, seed=20)
    got = fwd(x, ratio=1, overlap=False)
    rows = torch.nonzero(LAYOUT.doc >= 0).flatten()
    kv = x["kv"][rows]
    n = x["norm_weight"] * kv / torch.sqrt(kv.square().mean(-1, keepdim=True) + 1e-6)
    want = R.rope_rotate(n, LAYOUT.pos[rows], ROPE)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_ratio_one_with_overlap_is_a_two_slot_sigmoid():
    """r = 1, c = 2: slot 0 is the previous token's first half, slot 1 the token's second half;
    alpha_1 = sigmoid(z_1 - z_0); at a document start only slot 1 (alpha = 1)."""
    x = inputs(ratio=1, overlap=True, seed=21)
    got = fwd(x, ratio=1, overlap=True, rope=R.RopeSpec(dim=2, base=1e9))
    rows = torch.nonzero(LAYOUT.doc >= 0).flatten()
    d = 8
    ctil = []
    for t in rows.tolist():
        z1 = x["score"][t, d:] + x["ape"][0, d:]
        v1 = x["kv"][t, d:]
        if LAYOUT.pos[t] == 0:
            ctil.append(v1)
            continue
        z0 = x["score"][t - 1, :d] + x["ape"][0, :d]
        a1 = torch.sigmoid(z1 - z0)
        ctil.append(a1 * v1 + (1 - a1) * x["kv"][t - 1, :d])
    ctil = torch.stack(ctil)
    n = x["norm_weight"] * ctil / torch.sqrt(ctil.square().mean(-1, keepdim=True) + 1e-6)
    want = R.rope_rotate(n, LAYOUT.pos[rows], R.RopeSpec(dim=2, base=1e9))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_saturated_gate_picks_one_slot():
    """A gate score far above the others gives that slot weight 1 (to float64 rounding)."""
    x = inputs(ratio=2, overlap=False, seed=22)
    x["score"] = torch.zeros_like(x["score"])
    x["score"][LAYOUT.pos % 2 == 1] = 800.0                   # offset 1 of every group wins
    x["ape"] = torch.zeros_like(x["ape"])
    got = fwd(x, ratio=2, overlap=False, rope=R.RopeSpec(dim=2, base=1e9))
    grp = R.compressor_groups(LAYOUT, 2, overlap=False)
    kv = x["kv"][grp.element[:, 1]]
    n = x["norm_weight"] * kv / torch.sqrt(kv.square().mean(-1, keepdim=True) + 1e-6)
    want = R.rope_rotate(n, grp.position, R.RopeSpec(dim=2, base=1e9))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# layout facts: groups, resets, tails, isolation
# ---------------------------------------------------------------------------------------------
def test_groups_are_counted_over_physical_lengths_and_reset_at_every_document_start():
    grp = R.compressor_groups(LAYOUT, 2, overlap=True)
    # P = 7, 0, 8, 4, 1: 3 + 0 + 4 + 2 + 0 groups
    assert grp.doc.tolist() == [0, 0, 0, 2, 2, 2, 2, 3, 3]
    assert grp.position.tolist() == [0, 2, 4, 0, 2, 4, 6, 0, 2]
    first = grp.index == 0
    assert bool((grp.element[first, :2] == -1).all()) and bool((grp.element[~first] >= 0).all())
    # document 3 (rows 15..18) reads rows 17, 18 (padding) in its second group
    assert (grp.element[8, 2:] // 2).tolist() == [17, 18]


def test_unread_elements_never_leak():
    """Tail tokens, capacity rows and the first half of each document's last group: NaN there
    changes nothing, forward or backward."""
    x = inputs(seed=30)
    ref = fwd(x)
    dout = rnd(*ref.shape, seed=31)
    g_ref = bwd(x, dout)
    grp = R.compressor_groups(LAYOUT, 2, overlap=True)
    read = torch.zeros(LAYOUT.num_rows * 2, dtype=torch.bool)
    read[grp.element[grp.element >= 0]] = True
    poisoned = {k: v.clone() for k, v in x.items()}
    for k in ("kv", "score"):
        poisoned[k].view(-1, 8)[~read] = NAN
    assert torch.equal(fwd(poisoned), ref)
    g = bwd(poisoned, dout)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)
    assert bool((g.dkv.reshape(-1, 8)[~read] == 0).all())


def test_documents_are_isolated():
    x = inputs(seed=40)
    ref = fwd(x)
    y = {k: v.clone() for k, v in x.items()}
    y["kv"][:7] += 5.0                                   # document 0 only
    y["score"][:7] -= 3.0
    out = fwd(y)
    assert torch.equal(out[3:], ref[3:]) and not torch.equal(out[:3], ref[:3])


def test_chunking_and_group_subsets_give_the_same_bits():
    x = inputs(seed=50)
    ref = fwd(x, rotate=True)
    assert torch.equal(fwd(x, rotate=True, chunk_rows=1), ref)
    sub = torch.tensor([1, 4, 8])
    assert torch.equal(fwd(x, rotate=True, groups=sub), ref[sub])
    dout = rnd(*ref.shape, seed=51)
    g_ref = bwd(x, dout, rotate=True)
    for a, b in zip(bwd(x, dout, rotate=True, chunk_rows=2), g_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_ranks_compute_their_groups_from_their_rows_and_the_halo(cp):
    """Section 15 (CP): a group belongs to the rank holding its last token; with every row
    outside [first - halo, last] of the rank set to NaN, its groups are bitwise those of cp=1."""
    lay = R.PackedLayout([0, 5, 5, 13, 15, 16], [0, 7, 7, 15, 19, 20], 24)
    for ratio, overlap in ((2, True), (4, True), (3, False)):
        x = inputs(ratio=ratio, overlap=overlap, seed=60, layout=lay)
        ref = fwd(x, ratio=ratio, overlap=overlap, layout=lay)
        halo = R.compressor_halo(ratio, overlap)
        owned_all = []
        for rows in R.cp_partition(lay, cp):
            owned = R.compressor_owned_groups(lay, ratio, rows)
            owned_all.append(owned)
            keep = torch.zeros(lay.num_rows, dtype=torch.bool)
            keep[max(0, int(rows[0]) - halo):int(rows[-1]) + 1] = True
            y = {k: v.clone() for k, v in x.items()}
            y["kv"][~keep] = NAN
            y["score"][~keep] = NAN
            got = fwd(y, ratio=ratio, overlap=overlap, layout=lay, groups=owned)
            assert torch.equal(got, ref[owned])
        assert torch.equal(torch.cat(owned_all), torch.arange(ref.shape[0]))


def test_inputs_are_never_modified():
    x = inputs(seed=70)
    before = {k: content_hash(v) for k, v in x.items()}
    out = fwd(x, rotate=True)
    bwd(x, torch.ones_like(out), rotate=True)
    assert {k: content_hash(v) for k, v in x.items()} == before


# ---------------------------------------------------------------------------------------------
# bad inputs: TypeError / ValueError naming the argument
# ---------------------------------------------------------------------------------------------
def _bad(name, **change):
    x = inputs(seed=80)
    args = dict(x, layout=LAYOUT, ratio=2, rope=ROPE, overlap=True, rotate=False)
    args.update(change)
    return name, args


BAD = [
    _bad("kv", kv=torch.zeros(23, 16, dtype=torch.int32)),
    _bad("kv", kv=torch.zeros(22, 16, dtype=F64)),
    _bad("kv", kv=torch.zeros(23, 15, dtype=F64)),
    _bad("score", score=torch.zeros(23, 8, dtype=F64)),
    _bad("ape", ape=torch.zeros(3, 16, dtype=F64)),
    _bad("ape", ape=torch.full((2, 16), NAN, dtype=F64)),
    _bad("norm_weight", norm_weight=torch.ones(4, dtype=F64)),
    _bad("norm_weight", norm_weight=torch.full((8,), math.inf, dtype=F64)),
    _bad("layout", layout=[0, 5]),
    _bad("ratio", ratio=0),
    _bad("ratio", ratio=2.0),
    _bad("rope", rope=(4, 50.0)),
    _bad("rope.dim", rope=R.RopeSpec(dim=3)),
    _bad("rope.dim", rope=R.RopeSpec(dim=16)),
    _bad("rope.base", rope=R.RopeSpec(dim=4, base=1.0)),
    _bad("rope", rope=torch.zeros(4, 2, 3, dtype=F64)),
    _bad("rope table", rope=torch.zeros(3, 2, 2, dtype=F64)),
    _bad("overlap", overlap=1),
    _bad("rotate", rotate="yes"),
    _bad("eps", eps=0.0),
    _bad("groups", groups=torch.tensor([3, 1])),
    _bad("groups", groups=torch.tensor([99])),
    _bad("rotate", kv=torch.zeros(23, 12, dtype=F64), score=torch.zeros(23, 12, dtype=F64),
         ape=torch.zeros(2, 12, dtype=F64), norm_weight=torch.ones(6, dtype=F64), rotate=True),
]


def _poison_read(name):
    x = inputs(seed=81)
    x[name] = x[name].clone()
    x[name][2, 9] = NAN                       # row 2, second half: read by group (0, 1)
    return name, dict(x, layout=LAYOUT, ratio=2, rope=ROPE, overlap=True, rotate=False)


BAD += [_poison_read("kv"), _poison_read("score")]


@pytest.mark.parametrize("name,args", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_inputs_raise_naming_the_argument(name, args):
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    before = {k: content_hash(v) for k, v in tensors.items()}
    a = dict(args)
    pos = [a.pop(k) for k in ("kv", "score", "ape", "norm_weight", "layout", "ratio")]
    with pytest.raises((TypeError, ValueError), match=name.split(" ")[0].split(".")[0]):
        R.compressor_forward(*pos, **a)
    assert {k: content_hash(v) for k, v in tensors.items()} == before


def test_backward_rejects_a_dout_of_the_wrong_shape():
    x = inputs(seed=82)
    with pytest.raises(ValueError, match="dout"):
        bwd(x, torch.zeros(8, 8, dtype=F64))
    with pytest.raises(ValueError, match="dout"):
        bwd(x, torch.full((9, 8), NAN, dtype=F64))
