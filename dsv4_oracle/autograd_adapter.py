"""An adapter from a differentiable attention forward: :func:`from_autograd`.

Training code often has the sparse attention as a ``torch.autograd.Function`` (a forward kernel
and a backward kernel) or as plain differentiable torch code, and no separate backward entry
point with the protocol's signature. :func:`from_autograd` turns such a forward into the two
attention ops of the adapter protocol (:mod:`dsv4_oracle.adapters`, contract section 6):

- ``sparse_attention_forward(q, kv, ids, sink, *, v_dim, lengths) -> (out, lse)``: the forward,
  outputs detached;
- ``sparse_attention_backward(q, kv, ids, sink, out, lse, dout, *, v_dim, lengths) ->
  (dq, dkv, dsink)``: the forward run again on leaf copies of ``q``, ``kv`` and ``sink``, then
  ``torch.autograd.grad(out, (q, kv, sink), dout)``; a leaf that autograd gives no gradient gets
  zeros. The ``out`` and ``lse`` the backward is handed are not used: its ``Delta = <dO, out>``
  comes from the recomputed forward. For a ``Function`` whose backward uses the output its
  forward saved (stored in the input dtype), that is the same ``out`` the checker handed it
  (contract section 6, convention ``"given"``); for plain float32 autograd code it is the
  unrounded output (convention ``"recomputed"``). The checker finds which holds and reports it;
  ``backward_convention=`` pins one.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["AutogradAdapter", "from_autograd"]

_CONVENTIONS = ("given", "recomputed")


class AutogradAdapter:
    """The attention forward and its autograd backward as adapter ops (see the module
    docstring); made by :func:`from_autograd`."""

    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def __init__(self, forward: Callable, *, name: str, device: str, precision,
                 backward_convention: str | None):
        self._forward = forward
        self.name = name
        self.device = device
        self.precision = precision
        self.backward_convention = backward_convention

    def _run(self, q, kv, ids, sink, v_dim, lengths) -> tuple:
        res = self._forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths)
        if not (isinstance(res, (tuple, list)) and len(res) >= 2
                and all(isinstance(t, torch.Tensor) for t in res[:2])):
            raise TypeError(f"the forward of {self.name} returned {type(res).__name__}; it must "
                            "return (out, lse) tensors")
        return res[0], res[1]

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = self._run(q, kv, ids, sink, v_dim, lengths)
        return out.detach(), lse.detach()

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        leaves = [t.detach().requires_grad_(True) for t in (q, kv, sink)]
        with torch.enable_grad():
            o, _ = self._run(leaves[0], leaves[1], ids, leaves[2], v_dim, lengths)
            if not o.requires_grad:
                raise RuntimeError(f"the forward of {self.name} returned an out that autograd "
                                   "cannot differentiate (computed under torch.no_grad(), or "
                                   "detached?)")
            grads = torch.autograd.grad(o, leaves, dout.to(o.dtype), allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


def from_autograd(forward, *, name: str | None = None, device: str = "cpu", precision=None,
                  backward_convention: str | None = None) -> AutogradAdapter:
    """An adapter whose attention forward is ``forward`` and whose backward is autograd
    through it.

    ``forward``: a callable ``forward(q, kv, ids, sink, *, v_dim, lengths) -> (out, lse)``
    (contract section 6: ``q [T, H, D]``, ``kv [S, D]``, ``ids [T, W]`` in the logical key space,
    ``sink [H]``, ``v_dim`` the value width, ``lengths [T]`` or ``None``; ``out [T, H, v_dim]``,
    ``lse [T, H]`` without the sink, ``+inf`` on rows with no key), differentiable in ``q``,
    ``kv`` and ``sink``; or a ``torch.autograd.Function`` subclass, called as
    ``forward.apply(q, kv, ids, sink, v_dim, lengths)``. Map your own argument order and
    conventions in a small function (see ``examples/megatron_style_adapter.py``).
    ``name``, ``device`` (where the checker puts the inputs), ``precision`` (as an adapter's,
    :mod:`dsv4_oracle.adapters`) and ``backward_convention`` (``None``: the checker reports the
    one that holds; ``"given"`` or ``"recomputed"`` pins it) become the adapter's attributes.
    """
    if isinstance(forward, type) and issubclass(forward, torch.autograd.Function):
        fn = forward

        def forward(q, kv, ids, sink, *, v_dim=None, lengths=None):
            return fn.apply(q, kv, ids, sink, v_dim, lengths)
        default_name = fn.__name__
    elif callable(forward):
        default_name = getattr(forward, "__qualname__", type(forward).__name__)
    else:
        raise TypeError(f"forward must be a callable or a torch.autograd.Function subclass, got "
                        f"{type(forward).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not isinstance(device, str):
        raise TypeError(f"device must be a str, got {type(device).__name__}")
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device ({exc})") from None
    if backward_convention is not None and backward_convention not in _CONVENTIONS:
        raise ValueError(f"backward_convention must be None, 'given' or 'recomputed' (contract "
                         f"section 6), got {backward_convention!r}")
    return AutogradAdapter(forward, name=name or f"autograd({default_name})", device=device,
                           precision=precision, backward_convention=backward_convention)
