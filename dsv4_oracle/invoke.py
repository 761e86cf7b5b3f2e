"""Calling one op of an adapter: the only place where the implementation's code runs.

:func:`call_op` is the boundary between the conformance engine and the code under test. What
happens inside it becomes an :class:`OpError` naming the op; nothing the adapter does can end
the run without a verdict:

- **it cannot change what the oracle sees.** The op is handed private copies of every tensor
  argument (and a copy of a :class:`reference.PackedLayout`, with copies of its tensors); the
  caller's tensors, on which the oracle is evaluated, never reach it. After the call the copies
  are compared bit for bit with what was handed out: a write into an argument (contract
  section 11) is a failure of the op naming the argument, how many elements changed and the
  first one. What it returns is copied too, so that a later call cannot rewrite an earlier
  result that is about to be judged.
- **raising, exiting or hanging is a failure of the op.** Any exception, and also
  ``SystemExit``, ``GeneratorExit`` and every other ``BaseException`` from adapter code, is an
  :class:`OpError`; only ``KeyboardInterrupt`` (the user's Ctrl-C) propagates.
- **a per-op timeout** (:func:`op_timeout`, ``check --timeout``), which covers the op's CUDA
  work too (the device is synchronized before the op counts as returned): in the main thread a
  ``SIGALRM`` timer interrupts the op (re-armed every second, so that an op that swallows the
  interrupt is interrupted again); elsewhere the op runs in a daemon thread that is abandoned
  when it overruns (:func:`abandoned` names them, so that the command can exit with
  ``os._exit`` instead of waiting for them). An op stuck in native code, where no signal is
  delivered, is ended by a watchdog after the timeout plus a grace period when
  :func:`op_timeout` is given ``hard_exit=True``: one line on stderr, exit status 1.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import signal
import sys
import threading
import time
from functools import lru_cache

import torch

__all__ = ["OpError", "call_op", "where", "op_timeout", "abandoned", "arg_names", "describe"]

EXIT_HUNG = 1
_GRACE_S = (2.0, 10.0)      # after the timeout, how long an op stuck in native code is given:
                            # the timeout itself, within these limits
_ALARM_REPEAT_S = 1.0


class OpError(RuntimeError):
    """An adapter op failed: it raised, exited, hung, wrote into an argument, or returned
    something that is not the protocol's result. ``kind`` is ``"error"``, ``"timeout"`` or
    ``"mutation"``."""

    def __init__(self, op: str, message: str, kind: str = "error"):
        super().__init__(f"{op}: {message}")
        self.op = op
        self.message = message
        self.kind = kind


class _Timeout(BaseException):
    """Raised inside the op by the alarm (a BaseException, so ``except Exception`` in adapter
    code does not swallow it)."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (``SystemExit: 0``; ``SystemExit`` when it has none)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def where(exc: BaseException) -> str:
    """`` (at file.py:LINE in func)`` of the innermost frame of ``exc``'s traceback."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return f" (at {code.co_filename.rsplit('/', 1)[-1]}:{last.tb_lineno} in {code.co_name})"


# ---------------------------------------------------------------------------------------------
# the per-op timeout (a context setting, so that every call_op below a run gets it)
# ---------------------------------------------------------------------------------------------
_TIMEOUT: contextvars.ContextVar = contextvars.ContextVar("dsv4_oracle_op_timeout",
                                                          default=(None, False))
_ABANDONED: list = []        # (op, thread) of op threads still running after their timeout


@contextlib.contextmanager
def op_timeout(seconds: float | None, *, hard_exit: bool = False):
    """Within the block, every :func:`call_op` without its own ``timeout`` fails an op that
    does not return within ``seconds`` (``None`` or ``0``: no limit). ``hard_exit``: an op
    stuck in native code past the timeout plus a grace period ends the process (one line on
    stderr, exit status 1): for the command line, never for a library caller."""
    if seconds is not None and (not isinstance(seconds, (int, float)) or seconds < 0):
        raise ValueError(f"op_timeout: seconds must be a number >= 0 or None, got {seconds!r}")
    token = _TIMEOUT.set((seconds or None, hard_exit))
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def abandoned() -> list[str]:
    """The ops whose thread is still running after it timed out (the process must not wait
    for them at exit: ``os._exit``)."""
    return [op for op, t in _ABANDONED if t.is_alive()]


def _in_main_thread() -> bool:
    return (threading.current_thread() is threading.main_thread()
            and hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer"))


def _alarm_call(fn, op: str, timeout: float, hard_exit: bool):
    """``fn()`` in this (the main) thread, interrupted by SIGALRM after ``timeout`` s."""
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Timeout()

    watchdog = None
    if hard_exit:
        def give_up():
            sys.stdout.flush()
            print(f"dsv4-oracle: error: {op} did not return within {timeout:g} s (--timeout) and "
                  f"cannot be interrupted (stuck in native code, or swallowing interrupts); "
                  f"exiting with status {EXIT_HUNG}", file=sys.stderr, flush=True)
            os._exit(EXIT_HUNG)
        grace = min(max(timeout, _GRACE_S[0]), _GRACE_S[1])
        watchdog = threading.Timer(timeout + grace, give_up)
        watchdog.daemon = True
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout, _ALARM_REPEAT_S)
    t0 = time.monotonic()
    if watchdog:
        watchdog.start()
    try:
        return fn()
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if old_handler is None else old_handler)
        if watchdog:
            watchdog.cancel()
        if old_delay:           # an outer timer (e.g. a test runner's): give back what is left
            left = max(old_delay - (time.monotonic() - t0), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def _thread_call(fn, op: str, timeout: float):
    """``fn()`` in a daemon thread with this thread's grad mode, abandoned after ``timeout``."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    box: dict = {}

    def target():
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                box["result"] = fn()
        except BaseException as exc:       # handed to the calling thread below
            box["error"] = exc

    t = threading.Thread(target=target, name=f"dsv4-oracle {op}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        _ABANDONED.append((op, t))
        raise _Timeout()
    if "error" in box:
        raise box["error"]
    return box["result"]


# ---------------------------------------------------------------------------------------------
# private copies and the no-write check
# ---------------------------------------------------------------------------------------------
_LAYER_POSITIONAL = ("q", "kv", "sink", "layout")


@lru_cache(maxsize=None)
def arg_names(op: str) -> tuple:
    """The positional parameter names of ``op`` (the oracle's signature; for the packed layer,
    ``q, kv, sink, layout``), used to name an argument an op wrote into."""
    if op == "csa_layer":
        return _LAYER_POSITIONAL
    from dsv4_oracle import reference
    fn = getattr(reference, op, None)
    if fn is None:
        return ()
    return tuple(n for n, p in inspect.signature(fn).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _twin(t: torch.Tensor) -> torch.Tensor:
    """A private copy of ``t`` with its shape, strides and dtype (no autograd history)."""
    with torch.no_grad():
        try:
            c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            c.copy_(t)
            return c
        except RuntimeError:               # overlapping strides (an expanded view)
            return t.detach().clone()


def _is_layout(v) -> bool:
    from dsv4_oracle import reference
    return isinstance(v, reference.PackedLayout)


def _layout_copy(lay):
    """A fresh PackedLayout built from private copies of ``lay``'s defining arrays."""
    return type(lay)(lay.cu_seqlens.clone(), lay.cu_seqlens_padded.clone(), lay.num_rows)


def _plain(obj) -> dict:
    """An object's plain (scalar) attributes."""
    return {k: v for k, v in vars(obj).items()
            if v is None or isinstance(v, (bool, int, float, str))}


def _hand_out(value, name: str, pairs: list, private: bool):
    """What the op is handed for ``value``: tensors copied (``private``) or as they are, a
    layout always copied; records ``(name, reference, handed)`` for the no-write check, where
    ``reference`` is what the handed object must still equal after the call."""
    if isinstance(value, torch.Tensor):
        handed = _twin(value) if private else value
        pairs.append((name, value if private else _twin(value), handed))
        return handed
    if _is_layout(value):
        handed = _layout_copy(value)
        for k in type(value).TENSORS:
            pairs.append((f"{name}.{k}", getattr(value, k), getattr(handed, k)))
        pairs.append((name, _plain(value), handed))
        return handed
    if isinstance(value, (tuple, list)) and any(
            isinstance(v, torch.Tensor) or _is_layout(v) for v in value):
        items = [_hand_out(v, f"{name}[{i}]", pairs, private) for i, v in enumerate(value)]
        return type(value)._make(items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: _hand_out(v, f"{name}[{k!r}]", pairs, private) for k, v in value.items()}
    return value


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.element_size() in _INT_OF_SIZE else t


def _written(before, after) -> str | None:
    """How ``after`` differs from ``before`` (``None`` when bit for bit the same)."""
    if isinstance(before, dict):               # a layout's plain attributes
        now = _plain(after)
        changed = [k for k in set(before) | set(now) if before.get(k) != now.get(k)]
        if not changed:
            return None
        k = sorted(changed)[0]
        return f"attribute {k} changed from {before.get(k)!r} to {now.get(k)!r}"
    if after.dtype != before.dtype or tuple(after.shape) != tuple(before.shape):
        return (f"changed from {before.dtype} {list(before.shape)} to {after.dtype} "
                f"{list(after.shape)} in place")
    if before.numel() == 0:
        return None
    with torch.no_grad():
        diff = _bits(before.detach()) != _bits(after.detach())
        if diff.dim() > before.dim():              # complex: either part
            diff = diff.any(dim=-1)
        n = int(diff.sum())
        if n == 0:
            return None
        first = tuple(int(i) for i in torch.nonzero(diff)[0].tolist())
    at = first[0] if len(first) == 1 else first
    return f"{n} of {before.numel()} elements changed, the first at index {at}"


def _owned(res):
    """A copy of the op's result that the op no longer holds (tensors, tuples, NamedTuples
    and lists of them; anything else as it is)."""
    if isinstance(res, torch.Tensor):
        return _twin(res)
    if isinstance(res, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in res):
        items = [_twin(v) if isinstance(v, torch.Tensor) else v for v in res]
        return type(res)._make(items) if hasattr(res, "_fields") else type(res)(items)
    return res


# ---------------------------------------------------------------------------------------------
# the call
# ---------------------------------------------------------------------------------------------
_UNSET = object()


def call_op(fn, op: str, args: tuple = (), kwargs: dict | None = None, *, timeout=_UNSET,
            private: bool = True):
    """``fn(*args, **kwargs)`` for the adapter op ``op``; any failure is an :class:`OpError`.

    The op gets private copies of the tensor arguments (``private=False``: the caller's
    tensors are already private to this call, e.g. autograd leaves that must stay leaves; they
    are handed as they are and compared with a snapshot) and a copy of a layout argument; a
    write into any of them fails the op (``kind="mutation"``). The result is returned as a copy
    (``private``). ``timeout`` in seconds (``None``: no limit; default: the enclosing
    :func:`op_timeout`)."""
    hard_exit = False
    if timeout is _UNSET:
        timeout, hard_exit = _TIMEOUT.get()
    names = arg_names(op)
    pairs: list = []
    h_args = tuple(_hand_out(a, names[i] if i < len(names) else f"args[{i}]", pairs, private)
                   for i, a in enumerate(args))
    h_kwargs = {k: _hand_out(v, k, pairs, private) for k, v in (kwargs or {}).items()}
    cuda = any(isinstance(h, torch.Tensor) and h.is_cuda for _, _, h in pairs)

    def run():
        res = fn(*h_args, **h_kwargs)
        if cuda:        # kernels still running (or hung, or faulting) belong to this op
            torch.cuda.synchronize()
        return res
    t0 = time.monotonic()
    try:
        if not timeout:
            res = run()
        elif _in_main_thread():
            res = _alarm_call(run, op, timeout, hard_exit)
        else:
            res = _thread_call(run, op, timeout)
    except OpError:
        raise
    except _Timeout:
        raise OpError(op, f"did not return within {timeout:g} s (--timeout)", "timeout") from None
    except KeyboardInterrupt:           # the user's Ctrl-C: the caller ends the run
        raise
    except BaseException as exc:        # the implementation under test failed on this case
        what = "exited" if isinstance(exc, SystemExit) else "raised"
        raise OpError(op, f"{what} {describe(exc)}{where(exc)}") from exc
    if timeout and time.monotonic() - t0 > timeout:     # it swallowed every interrupt
        raise OpError(op, f"returned after {time.monotonic() - t0:.1f} s, over the timeout of "
                          f"{timeout:g} s (--timeout)", "timeout")
    for name, before, handed in pairs:
        how = _written(before, handed)
        if how:
            raise OpError(op, f"wrote into its argument {name}: {how} (contract section 11: "
                              f"inputs are read-only)", "mutation")
    return _owned(res) if private else res
