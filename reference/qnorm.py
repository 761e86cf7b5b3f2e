"""Query RMS norm (contract section 9)."""
from __future__ import annotations

import torch

from ._checks import as_float64, as_real, head_dim
from .constants import QNORM_EPS

__all__ = ["q_rms_norm", "q_rms_norm_bf16"]


def row_scale(x: torch.Tensor) -> torch.Tensor:
    """Per row (last dimension) of ``x``, a power of two ``s >= 1`` with ``|x| <= s`` (``s = 1``
    where ``max |x| <= 1``). Dividing by it is exact and keeps ``(x / s)**2`` from overflowing."""
    a = x.abs().amax(dim=-1, keepdim=True)
    e = torch.frexp(torch.where(a > 1, a, torch.ones_like(a))).exponent
    return torch.ldexp(torch.ones_like(a), torch.where(a > 1, e, torch.zeros_like(e)))


def q_rms_norm(q, eps: float = QNORM_EPS) -> torch.Tensor:
    """Section 9 in float64: ``q * rsqrt(mean_d(q^2) + eps)`` over the last dimension.

    Evaluated as ``y * rsqrt(mean_d(y^2) + eps / s^2)`` with ``y = q / s`` and ``s`` the row's
    power-of-two scale (:func:`row_scale`), the same value without overflow: ``q = 1e200``
    gives 1, not 0. Rows with ``max |q| <= 1`` have ``s = 1`` (the plain formula, bit for bit).
    """
    x = as_float64(q, "q")
    if x.dim() < 1:
        raise ValueError("q must have at least one dimension (the head dimension)")
    head_dim(x, "q")
    eps = as_real(eps, "eps", positive=True)
    s = row_scale(x)
    y = x / s
    return y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + eps / s.square())


def q_rms_norm_bf16(q, eps: float = QNORM_EPS) -> torch.Tensor:
    """Section 9, the bf16 emulation: float32 compute from the bf16 input, one final bf16 rounding.

    Defined bit for bit, independent of memory layout: the mean of squares is accumulated in
    float64 (exact for bf16 inputs of ordinary range) and rounded once to float32; ``+ eps``,
    ``rsqrt`` and the product are each correctly rounded float32 operations; the result is
    rounded once to bf16. Returns a bf16 CPU tensor.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be a bfloat16 tensor for the bf16 emulation, got {q.dtype}")
    if q.dim() < 1:
        raise ValueError("q must have at least one dimension (the head dimension)")
    if q.is_meta:
        raise ValueError("q is a meta tensor (it holds no data); the oracle needs values")
    head_dim(q, "q")
    eps = as_real(eps, "eps", positive=True)
    x32 = q.detach().to("cpu").contiguous().to(torch.float32)
    x64 = x32.to(torch.float64)
    ms = x64.square().mean(dim=-1, keepdim=True).to(torch.float32)
    denom = ms + torch.tensor(eps, dtype=torch.float32)
    inv = torch.rsqrt(denom.to(torch.float64)).to(torch.float32)
    return (x32 * inv).to(torch.bfloat16)
