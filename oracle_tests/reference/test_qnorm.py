"""Query RMS norm (contract section 9): the float64 form against the definition and the bf16
emulation against the float64 form, both within the error model (section 12); the emulation's
bits do not depend on memory layout or grad mode."""
from __future__ import annotations

import pytest
import torch

from dsv4_oracle import reference as R
from oracle_tests import content_hashes, error_ratio
from dsv4_oracle.reference.error_model import ORACLE_PRECISION, Precision, q_rms_norm_bound

F64 = torch.float64
BF16_KERNEL = Precision(acc=torch.float32, io=torch.bfloat16)


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def rms_norm_by_definition(q, eps=1e-6):
    rows = q.reshape(-1, q.shape[-1]).tolist()
    out = []
    for row in rows:
        ms = sum(v * v for v in row) / len(row)
        out.append([v / (ms + eps) ** 0.5 for v in row])
    return torch.tensor(out, dtype=F64).reshape(q.shape)


@pytest.mark.parametrize("scale", [1e-4, 1.0, 300.0])
def test_float64_form_matches_the_definition(scale):
    q = randn(4, 3, 16, seed=1, scale=scale)
    got = R.q_rms_norm(q)
    assert got.dtype == F64
    bound = q_rms_norm_bound(q, got, precision=ORACLE_PRECISION)
    assert error_ratio(rms_norm_by_definition(q), got, bound) <= 1


def test_eps_keeps_a_zero_head_finite():
    q = torch.zeros(2, 1, 8, dtype=F64)
    assert torch.equal(R.q_rms_norm(q), q)
    assert torch.equal(R.q_rms_norm_bf16(q.to(torch.bfloat16)), q.to(torch.bfloat16))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_bf16_emulation_is_within_the_bf16_kernel_bound_of_float64(scale):
    q = randn(8, 4, 64, seed=2, scale=scale).to(torch.bfloat16)
    got = R.q_rms_norm_bf16(q)
    assert got.dtype == torch.bfloat16
    want = R.q_rms_norm(q)                           # float64 on the same bf16 inputs
    bound = q_rms_norm_bound(q, want, precision=BF16_KERNEL)
    assert error_ratio(got, want, bound) <= 1


def test_bf16_emulation_bits_do_not_depend_on_layout_or_grad_mode():
    q = randn(6, 4, 32, seed=3).to(torch.bfloat16)
    ref = R.q_rms_norm_bf16(q)
    transposed = q.transpose(0, 1).contiguous().transpose(0, 1)    # same values, other strides
    assert not transposed.is_contiguous()
    assert torch.equal(R.q_rms_norm_bf16(transposed), ref)
    with torch.no_grad():
        assert torch.equal(R.q_rms_norm_bf16(q), ref)
    with torch.inference_mode():
        assert torch.equal(R.q_rms_norm_bf16(q), ref)
    assert torch.equal(R.q_rms_norm_bf16(q.float().requires_grad_(True).to(torch.bfloat16)), ref)


def test_inputs_are_not_modified():
    q = randn(3, 2, 8, seed=4).to(torch.bfloat16)
    q64 = randn(3, 2, 8, seed=5)
    before = content_hashes(q, q64)
    R.q_rms_norm_bf16(q)
    R.q_rms_norm(q64)
    R.q_rms_norm(q)
    assert content_hashes(q, q64) == before
