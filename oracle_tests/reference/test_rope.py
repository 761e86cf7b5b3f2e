"""RoPE (contract section 13) and the Walsh-Hadamard rotation (section 14): known rotations,
orthogonality, norm preservation, the YaRN frequencies of the DSv4-Flash checkpoint, the table
form, and bad parameters."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4_oracle import reference as R
from dsv4_oracle.reference.hadamard import hadamard_matrix

F64 = torch.float64


def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_a_known_rotation_of_interleaved_pairs():
    """Pair i of the last dim channels turns by p f_i; f_0 = 1, so p = pi/2 turns pair 0 a
    quarter: (a, b) -> (-b, a); the channels before the last dim are unchanged."""
    x = torch.tensor([[7.0, 1.0, 2.0, 3.0, 4.0]], dtype=F64)
    spec = R.RopeSpec(dim=4, base=1e12)                  # f_1 = 1e-6: pair 1 barely moves
    y = R.rope_rotate(x, torch.tensor([0]), spec)
    assert torch.equal(y, x)
    table = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]], dtype=F64)        # p=0: pair 0 quarter
    y = R.rope_rotate(x, torch.tensor([0]), table)
    assert y.tolist() == [[7.0, -2.0, 1.0, 3.0, 4.0]]


def test_rotation_is_orthogonal_and_inverted_by_its_transpose():
    x = rnd(20, 12, seed=1)
    pos = torch.arange(20) * 7
    spec = R.RopeSpec(dim=8, base=100.0, factor=8.0, original_seq_len=32)
    y = R.rope_rotate(x, pos, spec)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-14, atol=0)
    torch.testing.assert_close(R.rope_rotate(y, pos, spec, inverse=True), x, rtol=1e-13, atol=1e-13)
    # per pair: the rotation of (a, b) by theta has the pair's norm
    pairs, rpairs = x[:, 4:].reshape(20, 4, 2), y[:, 4:].reshape(20, 4, 2)
    torch.testing.assert_close(rpairs.norm(dim=2), pairs.norm(dim=2), rtol=1e-14, atol=1e-15)


def test_interleaved_pairs_differ_from_rotate_half():
    x = rnd(3, 8, seed=2)
    pos = torch.tensor([1, 2, 3])
    spec = R.RopeSpec(dim=8, base=10.0)
    f = R.rope_frequencies(spec)
    th = pos.to(F64).unsqueeze(1) * f
    a, b = x[:, :4], x[:, 4:]                          # rotate-half pairs x[i] with x[i + 4]
    half = torch.cat([a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()], dim=1)
    assert not torch.allclose(R.rope_rotate(x, pos, spec), half)


def test_the_table_form_equals_the_parameters():
    spec = R.RopeSpec(dim=6, base=300.0, factor=4.0, original_seq_len=20)
    pos = torch.arange(0, 40, 4)
    th = torch.arange(40, dtype=F64).unsqueeze(1) * R.rope_frequencies(spec)
    table = torch.stack([th.cos(), th.sin()], -1)
    x = rnd(pos.numel(), 10, seed=3)
    assert torch.equal(R.rope_rotate(x, pos, table), R.rope_rotate(x, pos, spec))


def test_yarn_frequencies_of_the_dsv4_flash_checkpoint():
    """The worked frequencies of section 13: low = 15, high = 25 for d_r 64, base 160000,
    factor 16, original_seq_len 65536."""
    f = R.rope_frequencies(R.RopeSpec(64, 160000.0, 16.0, 65536))
    plain = R.rope_frequencies(R.RopeSpec(64, 160000.0))
    assert torch.equal(f[:16], plain[:16])
    torch.testing.assert_close(f[25:], plain[25:] / 16, rtol=1e-15, atol=0)
    torch.testing.assert_close(f[20], plain[20] * (0.5 / 16 + 0.5), rtol=1e-15, atol=0)
    for i, want in ((0, 1.0), (15, 3.6355e-3), (20, 2.9698e-4), (25, 5.3723e-6)):
        assert abs(float(f[i]) / want - 1) < 1e-4
    assert torch.equal(plain, 160000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64))


def test_equal_correction_bounds_do_not_divide_by_zero():
    spec = R.RopeSpec(dim=2, base=10.0, factor=2.0, original_seq_len=1000)
    f = R.rope_frequencies(spec)
    assert bool(torch.isfinite(f).all())


@pytest.mark.parametrize("spec,name", [
    (R.RopeSpec(dim=0), "dim"), (R.RopeSpec(dim=5), "dim"), (R.RopeSpec(base=0.5), "base"),
    (R.RopeSpec(factor=0.0), "factor"), (R.RopeSpec(original_seq_len=-1), "original_seq_len"),
    (R.RopeSpec(beta_fast=1.0, beta_slow=2.0), "beta"), (R.RopeSpec(base=math.nan), "base"),
    (R.RopeSpec(dim=2.0), "dim")])
def test_bad_parameters_are_named(spec, name):
    with pytest.raises((TypeError, ValueError), match=name):
        R.rope_frequencies(spec)


def test_hadamard_matches_its_definition_and_is_orthogonal():
    for d in (1, 2, 8, 64):
        H = hadamard_matrix(d)
        torch.testing.assert_close(H @ H, torch.eye(d, dtype=F64), rtol=0, atol=1e-14)
        assert torch.equal(H, H.T)
        x = rnd(5, d, seed=d)
        torch.testing.assert_close(R.hadamard(x), x @ H, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(R.hadamard(x).norm(dim=1), x.norm(dim=1), rtol=1e-14, atol=0)
        torch.testing.assert_close(R.hadamard(R.hadamard(x)), x, rtol=1e-13, atol=1e-14)
    assert hadamard_matrix(4).mul(2).tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1],
                                                   [1, -1, -1, 1]]
    y = R.hadamard(torch.tensor([3 * 5 ** -0.5, 5 ** -0.5], dtype=F64))
    torch.testing.assert_close(y, torch.tensor([4 * 10 ** -0.5, 2 * 10 ** -0.5], dtype=F64))


def test_hadamard_rejects_a_width_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        R.hadamard(torch.zeros(2, 6, dtype=F64))
