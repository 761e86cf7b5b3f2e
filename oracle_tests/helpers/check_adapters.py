"""Deliberately broken adapters for the ``dsv4-oracle check`` tests (negative controls).

- :class:`SignFlipAdapter`: the portable torch backend with one sign flipped: the sink
  gradient comes back as ``+sum_t P_sink * Delta`` instead of ``-sum_t ...`` (contract section
  6). Everything else is the real implementation, so exactly one quantity must fail.
- :class:`RaisingAdapter`: the attention forward raises (a kernel that rejects a shape).
- :class:`MutatingAdapter`: the attention forward writes into its ``q`` argument.
- writes into what the runner hands an op, each turning a wrong answer into the oracle's if
  the oracle were evaluated on the written tensor: :class:`LseFillBackwardAdapter` (``lse``
  set to +inf, zero gradients), :class:`ZeroTargetAdapter` (``target``/``predict`` zeroed, zero
  indexer gradients), :class:`ZeroLengthsAdapter` (``lengths`` zeroed, sink-only results),
  :class:`ClampIdsAdapter` (``ids`` clamped to -1), :class:`LayoutWriterAdapter` (the layout's
  ``cu_seqlens``), :class:`LayerLeafWriterAdapter` (the packed layer's layout),
  :class:`ResultRewriterAdapter` (a returned ``out`` rewritten by a later call);
- :class:`ExitingAdapter` (``sys.exit(0)`` in an op), :class:`InterruptedAdapter` (Ctrl-C),
  :class:`SleeperAdapter` / :class:`StubbornSleeperAdapter` (an op that never returns; the
  second swallows every interrupt);
- :class:`LoosePrecisionAdapter` / :class:`MappedPrecisionAdapter`: ``out`` 10% too large,
  passed off by declaring bf16 accumulation (for every op / for the forward in a mapping);
- :class:`RaisingNameAdapter`, :class:`RaisingUnavailableAdapter`,
  :class:`RaisingPrecisionAdapter`: adapter attributes that raise while it is inspected.

Used as ``--impl oracle_tests.helpers.check_adapters:SignFlipAdapter`` from the repository root.
"""
from __future__ import annotations

import sys
import time

import torch

from dsv4_oracle.adapters import OPS, GpuImplAdapter
from dsv4_oracle.reference.error_model import Precision


class SignFlipAdapter(GpuImplAdapter):
    """gpu_impl:torch on the CPU, op level only, with ``dsink`` negated."""

    ops = OPS
    name = "sign-flipped dsink (test fixture)"

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = SignFlipAdapter.name

    def sparse_attention_backward(self, *args, **kwargs):
        dq, dkv, dsink, _ = super().sparse_attention_backward(*args, **kwargs)
        return dq, dkv, -dsink


class RaisingAdapter:
    """Only the attention forward, which raises."""

    name = "raising forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        raise RuntimeError(f"unsupported head dim {q.shape[-1]} (test fixture)")


class MutatingAdapter(GpuImplAdapter):
    """gpu_impl:torch whose attention forward scales its ``q`` argument in place first."""

    ops = ("sparse_attention_forward",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "mutating forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        q[0].zero_()                   # the caller's tensor: section 11 forbids this
        return super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim, lengths=lengths)


# ---------------------------------------------------------------------------------------------
# adapters that write into what the runner hands them (intermediates, not case inputs): each
# makes its own wrong answer look right if the oracle were evaluated on the written tensors
# ---------------------------------------------------------------------------------------------
class LseFillBackwardAdapter:
    """The attention backward sets its ``lse`` argument to +inf and returns zeros: with
    ``lse = +inf`` every probability is 0, so zeros would be the oracle's answer."""

    name = "backward writing lse (test fixture)"
    ops = ("sparse_attention_backward",)

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        lse.fill_(float("inf"))
        return torch.zeros_like(q), torch.zeros_like(kv), torch.zeros_like(sink)


class ZeroTargetAdapter:
    """The indexer-loss gradient zeroes its ``target`` and ``predict`` arguments and returns
    zeros (the gradient of ``target - predict = 0``)."""

    name = "loss grad zeroing target/predict (test fixture)"
    ops = ("sparse_indexer_loss_grad",)

    def sparse_indexer_loss_grad(self, q_idx, k_idx, weights, compressed_ids, target, predict,
                                 *, coeff, num_real):
        target.zero_()
        predict.zero_()
        return torch.zeros_like(q_idx), torch.zeros_like(weights), torch.zeros_like(k_idx)


class ZeroLengthsAdapter:
    """The attention forward zeroes its ``lengths`` argument (every row sink-only) and returns
    what the oracle gives for sink-only rows: ``out = 0``, ``lse = +inf``."""

    name = "forward zeroing lengths (test fixture)"
    ops = ("sparse_attention_forward",)

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        if lengths is not None:
            lengths.zero_()
        dv = v_dim or q.shape[-1]
        return (q.new_zeros(q.shape[0], q.shape[1], dv),
                torch.full(q.shape[:2], float("inf"), dtype=torch.float32, device=q.device))


class ClampIdsAdapter(ZeroLengthsAdapter):
    """The attention forward clamps its ``ids`` argument to -1 in place (every key invalid)."""

    name = "forward clamping ids (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        ids.clamp_(max=-1)
        dv = v_dim or q.shape[-1]
        return (q.new_zeros(q.shape[0], q.shape[1], dv),
                torch.full(q.shape[:2], float("inf"), dtype=torch.float32, device=q.device))


class LayoutWriterAdapter(GpuImplAdapter):
    """gpu_impl:torch whose CSA row builder writes into the layout it is handed."""

    ops = ("build_csa_indices",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "layout writer (test fixture)"

    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        res = super().build_csa_indices(layout, window=window, ratio=ratio,
                                        compressed_ids=compressed_ids)
        layout.cu_seqlens.zero_()
        return res


class ResultRewriterAdapter(GpuImplAdapter):
    """gpu_impl:torch whose forward returns ``out`` 2x too large and whose backward, called
    later, halves that returned tensor in place (a result rewritten before it is judged)."""

    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "result rewriter (test fixture)"
        self._out = None

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse, _ = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                       lengths=lengths)
        self._out = out * 2
        return self._out, lse

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        if self._out is not None:
            self._out.div_(2)
        return super().sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                 v_dim=v_dim, lengths=lengths)[:3]


class LayerLeafWriterAdapter(GpuImplAdapter):
    """gpu_impl:torch whose packed layer writes into its layout argument."""

    ops = ("csa_layer",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "layer layout writer (test fixture)"

    def csa_layer(self, q, kv, sink, layout, **kw):
        res = super().csa_layer(q, kv, sink, layout, **kw)
        layout.num_rows = 0
        return res


# ---------------------------------------------------------------------------------------------
# adapters that exit, hang, or declare their own loose bounds
# ---------------------------------------------------------------------------------------------
class ExitingAdapter:
    """The attention forward calls ``sys.exit(0)``."""

    name = "exiting forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        sys.exit(0)


class SleeperAdapter:
    """The attention forward never returns (it sleeps, swallowing every interrupt it can)."""

    name = "sleeping forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        while True:
            try:
                time.sleep(3600)
            except Exception:
                pass


class LoosePrecisionAdapter(GpuImplAdapter):
    """gpu_impl:torch whose forward returns ``out`` 10% too large and declares bf16
    accumulation, which loosens its own bounds until that passes."""

    ops = ("sparse_attention_forward",)
    precision = Precision(acc=torch.bfloat16, io=torch.bfloat16)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "loose precision (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse, _ = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                       lengths=lengths)
        return out * 1.1, lse


class _Raises:
    def __get__(self, obj, owner=None):
        raise RuntimeError("adapter attribute failed (test fixture)")


class RaisingNameAdapter(RaisingAdapter):
    name = _Raises()


class RaisingUnavailableAdapter(RaisingAdapter):
    def unavailable(self):
        raise RuntimeError("cannot probe the GPU (test fixture)")


class RaisingPrecisionAdapter(RaisingAdapter):
    def precision(self, dtype):
        raise RuntimeError("no precision table (test fixture)")


class StubbornSleeperAdapter:
    """The attention forward never returns and swallows every interrupt, even the timeout's
    (as an op stuck in native code would never see it)."""

    name = "stubborn sleeper (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass


class InterruptedAdapter:
    """The attention forward is interrupted by the user (Ctrl-C)."""

    name = "interrupted forward (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        raise KeyboardInterrupt


class MappedPrecisionAdapter(LoosePrecisionAdapter):
    """:class:`LoosePrecisionAdapter` declaring its loose precision for the forward only, as a
    mapping op -> Precision."""

    precision = {"sparse_attention_forward": Precision(acc=torch.bfloat16, io=torch.bfloat16)}


# ---------------------------------------------------------------------------------------------
# outputs the adapter changes after returning them
# ---------------------------------------------------------------------------------------------
class WorkspaceForwardAdapter(GpuImplAdapter):
    """gpu_impl:torch whose forward returns views of workspaces it keeps and rewrites on its next
    call (as static CUDA-graph buffers and cached workspaces do): right when returned, changed
    by the next call on other inputs."""

    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "workspace forward (test fixture)"
        self._ws: dict = {}

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse, _ = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                       lengths=lengths)
        key = (tuple(out.shape), tuple(lse.shape))
        if key not in self._ws:
            self._ws[key] = (torch.empty_like(out), torch.empty_like(lse))
        w_out, w_lse = self._ws[key]
        w_out.copy_(out)
        w_lse.copy_(lse)
        return w_out, w_lse


class RepointedOutAdapter(GpuImplAdapter):
    """gpu_impl:torch whose forward, on its next call, points the ``out`` it returned before at
    other memory (``Tensor.set_``: same shape and dtype, zeros): the caller's tensor changes
    although no byte of the memory it was returned in is written."""

    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "repointed out (test fixture)"
        self._last = None

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        if self._last is not None:
            with torch.no_grad():
                self._last.set_(torch.zeros_like(self._last))
        out, lse, _ = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                       lengths=lengths)
        self._last = out
        return out, lse


class ScratchOutBackwardAdapter(GpuImplAdapter):
    """gpu_impl:torch whose backward uses the ``out`` its forward returned as scratch space
    (zeroing it), after computing the right gradients."""

    ops = ("sparse_attention_forward", "sparse_attention_backward")

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "backward scribbling on the forward's out (test fixture)"
        self._out = None

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse, _ = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                       lengths=lengths)
        self._out = out
        return out, lse

    def sparse_attention_backward(self, q, kv, ids, sink, out, lse, dout, *, v_dim=None,
                                  lengths=None):
        grads = super().sparse_attention_backward(q, kv, ids, sink, out, lse, dout,
                                                  v_dim=v_dim, lengths=lengths)[:3]
        if self._out is not None:
            self._out.zero_()
        return grads


class _FillOnBackward(torch.autograd.Function):
    """Returns a zero buffer; its backward copies the real value into that buffer."""

    @staticmethod
    def forward(ctx, real):
        buf = torch.zeros_like(real)
        ctx.real, ctx.buf = real.detach(), buf
        return buf

    @staticmethod
    def backward(ctx, g):
        ctx.buf.copy_(ctx.real)
        return g


class LateOutLayerAdapter(GpuImplAdapter):
    """gpu_impl:torch whose packed layer returns ``out`` as zeros and fills the right values in
    during its backward."""

    ops = ("csa_layer",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "layer filling out in its backward (test fixture)"

    def csa_layer(self, *args, **kwargs):
        res = super().csa_layer(*args, **kwargs)
        return res._replace(out=_FillOnBackward.apply(res.out))


# ---------------------------------------------------------------------------------------------
# ops that fail, or return something no later op can use: that op fails, the rest is judged
# ---------------------------------------------------------------------------------------------
class _Torch(GpuImplAdapter):
    """gpu_impl:torch on the CPU, op level (every op), with one op replaced below."""

    ops = OPS

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = type(self).__doc__.split("\n")[0].strip() + " (test fixture)"


class RaisingTopkAdapter(_Torch):
    """Top-K raises."""

    def stable_topk(self, scores, k, *, order="id"):
        raise RuntimeError("top-k kernel rejects this shape (test fixture)")


class FloatIdsAdapter(_Torch):
    """CSA rows returned as float32 ids and lengths."""

    def build_csa_indices(self, layout, *, window, ratio, compressed_ids=None):
        ids, lengths = super().build_csa_indices(layout, window=window, ratio=ratio,
                                                 compressed_ids=compressed_ids)[:2]
        return ids.float(), lengths.float()


class FloatTopkIdsAdapter(_Torch):
    """Top-K ids returned as float32."""

    def stable_topk(self, scores, k, *, order="id"):
        ids, lengths = super().stable_topk(scores, k, order=order)[:2]
        return ids.float(), lengths


class WrongRowsOutAdapter(_Torch):
    """The forward returns 59 rows of out, whatever T."""

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)[:2]
        return out.new_zeros((59,) + tuple(out.shape[1:])), lse


class IntOutAdapter(_Torch):
    """The forward returns out as int32."""

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)[:2]
        return out.to(torch.int32), lse


class MetaOutAdapter(_Torch):
    """The forward returns meta tensors."""

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)[:2]
        return out.to("meta"), lse.to("meta")


class NaNLseAdapter(_Torch):
    """The forward returns an all-NaN lse."""

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        out, lse = super().sparse_attention_forward(q, kv, ids, sink, v_dim=v_dim,
                                                    lengths=lengths)[:2]
        return out, torch.full_like(lse, float("nan"))


class HugeScoresAdapter(_Torch):
    """The indexer returns -1e30 instead of -inf for groups a row cannot see."""

    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        s = super().indexer_scores(q_idx, k_idx, weights, layout, ratio)[0]
        return torch.where(torch.isinf(s), torch.full_like(s, -1e30), s)


class ExpandedScoresAdapter(_Torch):
    """The indexer returns one row's scores expanded over every row (overlapping memory)."""

    def indexer_scores(self, q_idx, k_idx, weights, layout, ratio):
        s = super().indexer_scores(q_idx, k_idx, weights, layout, ratio)[0]
        return s[-1:].expand_as(s)


class InvisibleTopkAdapter(_Torch):
    """Top-K selects group 0 in every row, visible or not."""

    def stable_topk(self, scores, k, *, order="id"):
        ids, lengths = super().stable_topk(scores, k, order=order)[:2]
        ids = ids.clone()
        ids[:, 0] = 0
        return ids, lengths


class MissingKeywordAdapter:
    """The forward lacks the protocol's keywords."""

    name = "forward without keywords (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink):
        return q, q[..., 0]


class RaisingLayerBackwardAdapter(GpuImplAdapter):
    """gpu_impl:torch whose packed layer's backward raises (its forward is right)."""

    ops = ("csa_layer",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "layer backward raising (test fixture)"

    def csa_layer(self, *args, **kwargs):
        res = super().csa_layer(*args, **kwargs)
        return res._replace(out=_RaiseOnBackward.apply(res.out))


class _RaiseOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward kernel failed (test fixture)")


# ---------------------------------------------------------------------------------------------
# messages no terminal, file or XML parser would take as they are
# ---------------------------------------------------------------------------------------------
class _StrRaises(RuntimeError):
    def __str__(self):
        raise ValueError("no text")


class _MessageAdapter:
    """The attention forward raises ``self.error()``."""

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        raise self.error()


class SurrogateMessageAdapter(_MessageAdapter):
    name = "message with a lone surrogate (test fixture)"
    error = staticmethod(lambda: RuntimeError("bad byte \udcff in a path, caf\u00e9"))


class ControlCharsMessageAdapter(_MessageAdapter):
    name = "message with ANSI codes and a NUL (test fixture)"
    error = staticmethod(lambda: RuntimeError("\x1b[31mred\x1b[0m\x00 and\nmore"))


class HugeMessageAdapter(_MessageAdapter):
    name = "5 MB message (test fixture)"
    error = staticmethod(lambda: RuntimeError("x" * 5_000_000))


class StrRaisesAdapter(_MessageAdapter):
    name = "exception whose str() raises (test fixture)"
    error = _StrRaises


class OddBackendsLayerAdapter(GpuImplAdapter):
    """gpu_impl:torch whose packed layer names its backends with non-strings."""

    ops = ("csa_layer",)

    def __init__(self):
        super().__init__("torch", "cpu")
        self.name = "layer with odd backends (test fixture)"

    def csa_layer(self, *args, **kwargs):
        res = super().csa_layer(*args, **kwargs)
        return res._replace(backends={1: object(), "indexer_scores": None, None: 2.5})


# ---------------------------------------------------------------------------------------------
# hangs the watchdog must end
# ---------------------------------------------------------------------------------------------
class GilHoldingSleeperAdapter:
    """The attention forward sleeps in C while holding the GIL, with SIGALRM blocked in its
    thread (native code that no interrupt reaches and no Python thread can run beside)."""

    name = "GIL-holding native sleep (test fixture)"

    def sparse_attention_forward(self, q, kv, ids, sink, *, v_dim=None, lengths=None):
        import ctypes
        import signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        libc = ctypes.PyDLL(None)            # PyDLL: the call keeps the GIL
        while True:
            libc.sleep(3600)


class HangingConstructorAdapter:
    """Its construction never returns."""

    def __init__(self):
        while True:
            try:
                time.sleep(3600)
            except Exception:
                pass

    def sparse_attention_forward(self, *args, **kwargs):
        raise AssertionError("never reached")
