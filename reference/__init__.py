"""dsv4-oracle float64 reference: the definition of the contract (``docs/contract.md``).

Every function converts its inputs to float64 CPU tensors (any float dtype or device is
accepted), validates them before computing, never modifies them, sets no global torch state,
and names the contract section it implements. The CPU is the definition; only inside an
explicit ``reference._checks.compute_on(device)`` scope (``fixtures.run_oracle(...,
compute_device=...)``, ``dsv4-oracle check --oracle-device``) does the same float64 code run
on a CUDA device.
"""
from .attention import sparse_attention_backward, sparse_attention_forward
from .compressor import (CompressorGrads, CompressorInputs, compressor_backward,
                         compressor_forward, compressor_groups, compressor_halo,
                         compressor_owned_groups, indexer_compressor_backward,
                         indexer_compressor_forward)
from .cp import cp_partition
from .cp_plan import (CPRankExpected, CPRankPartial, CPRankPlan, cp_halo_width, cp_plans,
                      cp_rank_expected, cp_reduce_partials)
from .indexer import indexer_scores
from .indexer_loss import IndexerLoss, sparse_indexer_loss, sparse_indexer_loss_grad
from .indices import build_csa_indices
from .layout import PackedLayout
from .hadamard import hadamard
from .qnorm import q_rms_norm, q_rms_norm_bf16
from .rope import RopeSpec, rope_frequencies, rope_rotate
from .topk import stable_topk

ORACLE_VERSION = "0.1.0"

__all__ = [
    "ORACLE_VERSION",
    "CPRankExpected",
    "CPRankPartial",
    "CPRankPlan",
    "CompressorGrads",
    "CompressorInputs",
    "RopeSpec",
    "IndexerLoss",
    "PackedLayout",
    "build_csa_indices",
    "compressor_backward",
    "compressor_forward",
    "compressor_groups",
    "compressor_halo",
    "compressor_owned_groups",
    "cp_halo_width",
    "cp_partition",
    "cp_plans",
    "cp_rank_expected",
    "cp_reduce_partials",
    "hadamard",
    "indexer_compressor_backward",
    "indexer_compressor_forward",
    "indexer_scores",
    "q_rms_norm",
    "q_rms_norm_bf16",
    "rope_frequencies",
    "rope_rotate",
    "sparse_attention_backward",
    "sparse_attention_forward",
    "sparse_indexer_loss",
    "sparse_indexer_loss_grad",
    "stable_topk",
]
