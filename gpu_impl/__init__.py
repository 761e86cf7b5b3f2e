"""gpu_impl: implementations of the contract (``docs/contract.md``) in working precision.

- :mod:`gpu_impl.api`: the op-level functions with ``backend="auto"|"torch"|"cudnn"`` and
  ``deterministic``; every result names the backend that ran (a ``backend`` field).
- :mod:`gpu_impl.torch_backend`: the portable backend (any device, CPU included; deterministic).
- :mod:`gpu_impl.cudnn_backend`: cuDNN frontend kernels (SM90/SM100), imported lazily.
- :mod:`gpu_impl.layer`: one packed CSA / HCA / window layer with autograd.

Importing this package never needs cuDNN or a GPU.
"""
from . import api
from .api import (BACKENDS, OPS, BackendUnavailable, build_csa_indices, indexer_scores,
                  q_rms_norm, resolve_backend, sparse_attention_backward,
                  sparse_attention_forward, sparse_indexer_loss, sparse_indexer_loss_grad,
                  stable_topk)

__all__ = [
    "BACKENDS", "OPS", "BackendUnavailable", "api", "build_csa_indices", "indexer_scores",
    "q_rms_norm", "resolve_backend", "sparse_attention_backward", "sparse_attention_forward",
    "sparse_indexer_loss", "sparse_indexer_loss_grad", "stable_topk",
]
