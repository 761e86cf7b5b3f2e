'''``dsv4-oracle init-adapter [PATH]``: write a commented adapter to start checking your kernel.

The file (:data:`TEMPLATE`) holds every op of the adapter protocol (:mod:`dsv4_oracle.adapters`)
with its signature, what each argument means and what to return, plus the attributes ``name``,
``device``, ``precision`` and ``backward_convention``. Every op body calls the portable torch
backend of this project (``gpu_impl.api``, ``backend="torch"``) as a placeholder, so the file
passes ``dsv4-oracle check`` as written; replace each body with a call into your kernel, and
delete the ops you do not implement (the oracle stands in for them). It never overwrites a file:
an existing PATH, a PATH not ending in ``.py``, a file name that is not a Python module name
(``my-kernel.py``, ``.py``) or a parent that is missing or not a directory is one line on stderr
and exit status 2.
'''
from __future__ import annotations

import os
import sys

__all__ = ["TEMPLATE", "DEFAULT_PATH", "add_parser", "main_init_adapter"]

DEFAULT_PATH = "dsv4_adapter.py"

TEMPLATE = '''"""My DSv4 sparse-attention kernels as a dsv4-oracle adapter.

Written by `dsv4-oracle init-adapter`. Check it with

    dsv4-oracle check --impl {path}:Adapter

Every op below is a placeholder that calls dsv4-oracle's portable torch backend
(gpu_impl.api, backend="torch"), so this file passes the check as written. To check your own
kernels:

1. replace the body of each op you implement with a call into your kernel
   (marked "REPLACE WITH YOUR KERNEL");
2. DELETE every op you do not implement: the checker then feeds the next op the oracle's
   result (rounded as a kernel stores it) and judges only the ops you kept;
3. set `device` (where the checker puts the inputs) and `precision` (what the error model
   assumes your kernel does).

Ops receive tensors on `device` in the case's dtype (bfloat16 for most cases) and may return
any dtype on any device. Ids are in the logical key space (contract section 2): rows
0 .. T-1 of `kv` are the raw keys/values, rows T .. T+C-1 the compressed ones. `layout` is a
reference.PackedLayout (cu_seqlens, cu_seqlens_padded, num_rows, num_real, ...). Each op must
return at least the fields listed (a tuple or NamedTuple; extra fields are ignored; a
`backend` attribute on the result is recorded in the report). The ops' calls are documented in
dsv4_oracle/protocol.py (one typing.Protocol per op), the attributes in dsv4_oracle/adapters.py;
the numerical contract in docs/contract.md (sections cited below).
"""
import torch

from dsv4_oracle.gpu_impl import api                    # the placeholders only: remove with them
from dsv4_oracle.reference.error_model import Precision


class Adapter:
    """The ops of the protocol, named and called like the float64 oracle's functions."""

    name = "my DSv4 kernels"

    # Where the checker puts the inputs: "cpu", or "cuda" for a GPU kernel.
    device = "cpu"

    # Contract section 6 lets the attention backward compute Delta = <dO, out> from the `out`
    # it is handed ("given", kernel style) or from its own recomputed, unrounded forward
    # ("recomputed", autograd style). None: the checker reports which one holds.
    backward_convention = None

    def precision(self, dtype):
        """The working precision the error model assumes (contract section 12) for inputs of
        `dtype`: here float32 accumulation and statistics, operands and outputs stored in the
        input dtype when it is a 16-bit float. (May also be one Precision, or a mapping from op
        name to either.) A looser precision than your kernel's hides errors."""
        io = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        return Precision(acc=torch.float32, io=io, stats=torch.float32)

    # -- sections 13-15: the compressors ---------------------------------------------------
    def compressor_forward(self, kv, score, ape, norm_weight, layout, ratio, *, rope):
        """kv, score [T, c*d] the token projections (c = 2 with the overlap, on for ratio 4),
        ape [r, c*d] and norm_weight [d] float32, rope a reference.RopeSpec (or a table).
        Return: kv_cmp [C, d], one compressed key per group of r tokens (per document, over
        its padded length), pooled, RMS-normed and rotated at the group's first position."""
        # REPLACE WITH YOUR KERNEL
        return api.compressor_forward(kv, score, ape, norm_weight, layout, ratio, rope=rope,
                                      backend="torch")

    def indexer_compressor_forward(self, kv, score, ape, norm_weight, layout, ratio, *, rope):
        """As compressor_forward, then the normalised Walsh-Hadamard rotation.
        Return: k_idx [C, D_I]."""
        # REPLACE WITH YOUR KERNEL
        return api.indexer_compressor_forward(kv, score, ape, norm_weight, layout, ratio,
                                              rope=rope, backend="torch")

    # -- section 7: lightning-indexer scores ------------------------------------------------
    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        """q_idx [T, H_I, D_I] indexer queries, k_idx [C, D_I] indexer keys of the compressed
        groups, weights [T, H_I] per-head weights, ratio the compression ratio.
        Return: scores [T, C] (float32; -inf where group c is not visible from row t)."""
        # REPLACE WITH YOUR KERNEL
        return api.indexer_scores(q_idx, k_idx, weights, layout, ratio, backend="torch")

    # -- section 4: stable Top-K --------------------------------------------------------------
    def stable_topk(self, scores, k, *, order="id"):
        """scores [T, C], k the number of groups to keep, order "id" (selected ids ascending)
        or "score" (descending score, ties by smaller id). Exact ties go to the smaller id.
        Return: (ids [T, k] int, lengths [T] int: the number of valid entries per row)."""
        # REPLACE WITH YOUR KERNEL
        return api.stable_topk(scores, k, order=order, backend="torch")

    # -- section 5: compressed-first key rows -------------------------------------------------
    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        """window the sliding-window size, ratio the compression ratio (0: window only),
        compressed_ids [T, K] the Top-K selection (None: every visible compressed group).
        Return: (ids [T, width] int key ids, lengths [T] int valid entries per row)."""
        # REPLACE WITH YOUR KERNEL
        return api.build_csa_indices(layout, window=window, ratio=ratio,
                                     compressed_ids=compressed_ids, device=self.device,
                                     backend="torch")

    # -- section 6: sparse attention with a per-head sink ---------------------------------
    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        """q [T, H, D], kv [S, D] (keys = values; the first v_dim columns are the value),
        ids [T, W] key ids (any id outside 0 .. S-1 is invalid), sink [H] float32 per-head
        sink logit, v_dim the value width (None: D), lengths [T] (None: every slot counts;
        slots at or past lengths[t] are invalid).
        Return: (out [T, H, v_dim], lse [T, H]: log-sum-exp of the key logits without the
        sink, +inf on rows with no valid key, where out is 0)."""
        # REPLACE WITH YOUR KERNEL
        return api.sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths,
                                            backend="torch")

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        """The forward's arguments, its outputs out and lse, and dout [T, H, v_dim] the
        gradient of the loss wrt out.
        Return: (dq [T, H, D], dkv [S, D], dsink [H])."""
        # REPLACE WITH YOUR KERNEL
        return api.sparse_attention_backward(q, kv, ids, sink, out, lse, dout, v_dim=v_dim,
                                             lengths=lengths, backend="torch")

    def compressor_backward(self, kv, score, ape, norm_weight, layout, ratio, dout, *, rope):
        """The forward's arguments and dout [C, d], the gradient wrt kv_cmp.
        Return: (dkv [T, c*d], dscore [T, c*d], dape [r, c*d], dnorm_weight [d])."""
        # REPLACE WITH YOUR KERNEL
        return api.compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout,
                                       rope=rope, backend="torch")

    # -- section 8: sparse indexer KL loss ------------------------------------------------
    def sparse_indexer_loss(self, q, kv_cmp, sink, lse, compressed_ids, index_scores, layout, *,
                            coeff):
        """q [T, H, D], kv_cmp [C, D] compressed keys, sink [H], lse [T, H] from the attention
        forward, compressed_ids [T, K] the Top-K selection, index_scores [T, C], coeff the loss
        coefficient.
        Return: (loss 0-dim, kl [T] per-row KL, target [T, K] teacher, predict [T, K]
        student)."""
        # REPLACE WITH YOUR KERNEL
        return api.sparse_indexer_loss(q, kv_cmp, sink, lse, compressed_ids, index_scores,
                                       layout, coeff=coeff, backend="torch")

    def sparse_indexer_loss_grad(self, q_idx, k_idx, weights, compressed_ids, target, predict, *,
                                 coeff, num_real):
        """The indexer inputs, the Top-K selection, the loss's target and predict, coeff and
        num_real (N, the real tokens the loss is normalised by).
        Return: (dq_idx [T, H_I, D_I], dw [T, H_I], dk_idx [C, D_I])."""
        # REPLACE WITH YOUR KERNEL
        return api.sparse_indexer_loss_grad(q_idx, k_idx, weights, compressed_ids, target,
                                            predict, coeff=coeff, num_real=num_real,
                                            backend="torch")

    def indexer_compressor_backward(self, kv, score, ape, norm_weight, layout, ratio, dout, *,
                                    rope):
        """As compressor_backward, for dout = dk_idx [C, D_I] (the indexer's compressor)."""
        # REPLACE WITH YOUR KERNEL
        return api.indexer_compressor_backward(kv, score, ape, norm_weight, layout, ratio, dout,
                                               rope=rope, backend="torch")

    # -- sections 4 to 15: the packed layer (optional) ------------------------------------
    def csa_layer(self, q, kv, sink, layout, *, window, ratio, v_dim=None, coeff=0.0,
                  order="id", kv_cmp=None, q_idx=None, k_idx=None, weights=None, topk=None,
                  compressor=None, index_compressor=None, rope=None):
        """The whole layer with autograd: q [T, H, D], kv [T, D] raw keys/values, sink [H],
        kv_cmp [C, D] (compressed layers), and for a CSA layer the indexer inputs and topk.
        The checker runs the forward, then autograd backward of out and of the loss.
        Return: an object with out, loss, lse, ids, lengths and, for a CSA layer,
        compressed_ids, compressed_lengths, index_scores and indexer_loss (kl, target,
        predict); see gpu_impl.layer.LayerResult. From raw tokens, compressor (and
        index_compressor) hold the compressors' inputs (reference.CompressorInputs) and rope
        instead of kv_cmp (and k_idx); then also return kv_cmp and k_idx."""
        # REPLACE WITH YOUR KERNEL
        from dsv4_oracle.gpu_impl.layer import csa_layer
        return csa_layer(q, kv, sink, layout, window=window, ratio=ratio, v_dim=v_dim,
                         coeff=coeff, order=order, kv_cmp=kv_cmp, q_idx=q_idx, k_idx=k_idx,
                         weights=weights, topk=topk, compressor=compressor,
                         index_compressor=index_compressor, rope=rope, backend="torch")
'''


def add_parser(sub):
    p = sub.add_parser(
        "init-adapter", help="write a commented adapter template to start checking your kernel",
        description="Write a commented adapter (every op of the protocol, its arguments and "
                    "what to return) whose ops call the portable torch backend as placeholders, "
                    "so that 'dsv4-oracle check --impl PATH:Adapter' passes as written. Replace "
                    "each op's body with your kernel and delete the ops you do not implement. "
                    "Never overwrites a file.")
    p.add_argument("path", nargs="?", default=DEFAULT_PATH, metavar="PATH",
                   help=f"the file to write, ending in .py (default: {DEFAULT_PATH})")
    p.set_defaults(func=main_init_adapter)
    return p


def _error(msg: str) -> int:
    print(f"dsv4-oracle init-adapter: error: {msg}", file=sys.stderr)
    return 2


def _module_name_problem(path: str) -> str | None:
    """Why ``path`` cannot be an adapter file that ``check --impl PATH:Adapter`` imports."""
    import keyword
    if not path.endswith(".py"):
        return f"{path!r} does not end in .py (the checker imports it as Python)"
    stem = os.path.basename(path)[:-3]
    if not stem.isidentifier() or keyword.iskeyword(stem):
        hint = "".join(c if c.isalnum() or c == "_" else "_" for c in stem) or "dsv4_adapter"
        if hint[0].isdigit() or keyword.iskeyword(hint):
            hint = f"dsv4_{hint}"
        return (f"{os.path.basename(path)!r} is not a Python module name, which the checker "
                f"imports the file as (use, e.g., {hint}.py)")
    return None


def main_init_adapter(args) -> int:
    import tempfile
    path = args.path
    why = _module_name_problem(path)
    if why:
        return _error(why)
    if os.path.lexists(path):
        return _error(f"{path} exists; not overwriting it (choose another PATH)")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        if os.path.exists(parent):
            return _error(f"{parent} is not a directory")
        return _error(f"directory {parent} does not exist")
    text = TEMPLATE.replace("{path}", path)
    # a complete temporary file of a fresh name, then a hard link (which refuses an existing
    # name): never a half-written PATH, never a replaced one, never another file removed
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=parent)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.link(tmp, path)
    except FileExistsError:
        return _error(f"{path} exists; not overwriting it (choose another PATH)")
    except OSError as exc:
        return _error(f"cannot write {path}: {exc.strerror or exc}")
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
    print(f"wrote {path}; check it with: dsv4-oracle check --impl {path}:Adapter")
    return 0
