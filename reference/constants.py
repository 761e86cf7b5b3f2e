"""The numerical contract's constants, one copy each, with the section that defines them.

The oracle (``reference``), the implementations (``gpu_impl``, which may import constants and
types from ``reference`` but never its computation) and the checker import them from here, so
a default cannot differ between the definition and an implementation.

=====================  ==================  ======================================================
name                   value               meaning (contract section)
=====================  ==================  ======================================================
``FLT_MIN``            ``2**-126``         the smallest normal float32 (section 8)
``LOSS_FLOOR``         ``FLT_MIN``         the indexer loss's clip floor ``f`` (section 8)
``GRAD_FLOOR``         ``exp(-100)``       the clipped gradient's floor ``e``: the cuDNN
                                           indexer backward's ``CLIP_LOG_MIN = -100`` (section 8)
``QNORM_EPS``          ``1e-6``            the query RMS norm's ``eps`` (section 9)
``LARGE_SINK``         ``2.4e38``          the largest finite sink that must not overflow
                                           (section 6)
``SLOT_MULTIPLE``      ``64``              the oracle evaluates each row over its slot extent
                                           rounded up to this, so a row's bits do not depend on
                                           the caller's width (sections 6, 8, 10)
``CHUNK_BYTES``        ``2**25``           the oracle's work buffers per row chunk (sections 6,
                                           7, 8; chunking never changes a bit, section 10)
``BOUND_CHUNK_BYTES``  ``2**28``           the error model's temporaries per row chunk
                                           (section 12)
``ROPE_DIM``           ``64``              channels rotated by RoPE, the last of a row (13)
``ROPE_BETA_FAST``     ``32``              YaRN's fast correction bound (section 13)
``ROPE_BETA_SLOW``     ``1``               YaRN's slow correction bound (section 13)
``COMPRESSOR_EPS``     ``1e-6``            the compressor's RMSNorm ``eps`` (section 15)
=====================  ==================  ======================================================
"""
from __future__ import annotations

import math

__all__ = ["FLT_MIN", "LOSS_FLOOR", "GRAD_FLOOR", "QNORM_EPS", "LARGE_SINK",
           "SLOT_MULTIPLE", "CHUNK_BYTES", "BOUND_CHUNK_BYTES", "ROPE_DIM", "ROPE_BETA_FAST",
           "ROPE_BETA_SLOW", "COMPRESSOR_EPS"]

# section 8, policy "clip": the loss floor f and the gradient floor e
FLT_MIN = 2.0 ** -126
LOSS_FLOOR = FLT_MIN
GRAD_FLOOR = math.exp(-100)

# section 9: q_out = q * rsqrt(mean_d(q^2) + eps)
QNORM_EPS = 1e-6

# section 6: finite sinks this large must not overflow (logaddexp, never exp(sink))
LARGE_SINK = 2.4e38

# the oracle's evaluation (sections 6, 8, 10): per-row slot extents are multiples of
# SLOT_MULTIPLE (see reference._reduce.row_extents); work buffers per chunk are small enough to
# stay in cache and are reused across chunks; the error model's bounds chunk more coarsely
SLOT_MULTIPLE = 64
CHUNK_BYTES = 1 << 25
BOUND_CHUNK_BYTES = 1 << 28

# section 13: DSv4 rotates the last 64 channels; YaRN's correction bounds
ROPE_DIM = 64
ROPE_BETA_FAST = 32.0
ROPE_BETA_SLOW = 1.0

# section 15: the compressor's RMSNorm eps
COMPRESSOR_EPS = 1e-6
