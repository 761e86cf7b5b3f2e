"""Query RMS norm (contract section 9)."""
from __future__ import annotations

import torch

from ._checks import as_float64, as_real

__all__ = ["q_rms_norm", "q_rms_norm_bf16"]


def q_rms_norm(q, eps: float = 1e-6) -> torch.Tensor:
    """Section 9 in float64: ``q * rsqrt(mean_d(q^2) + eps)`` over the last dimension."""
    x = as_float64(q, "q")
    if x.dim() < 1:
        raise ValueError("q must have at least one dimension (the head dimension)")
    eps = as_real(eps, "eps", positive=True)
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)


def q_rms_norm_bf16(q, eps: float = 1e-6) -> torch.Tensor:
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
    eps = as_real(eps, "eps", positive=True)
    x32 = q.detach().to("cpu").contiguous().to(torch.float32)
    x64 = x32.to(torch.float64)
    ms = x64.square().mean(dim=-1, keepdim=True).to(torch.float32)
    denom = ms + torch.tensor(eps, dtype=torch.float32)
    inv = torch.rsqrt(denom.to(torch.float64)).to(torch.float32)
    return (x32 * inv).to(torch.bfloat16)
