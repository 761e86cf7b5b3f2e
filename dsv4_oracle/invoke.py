"""Calling one op of an adapter: the only place where the implementation's code runs.

:func:`call_op` is the boundary between the conformance engine and the code under test. What
happens inside it becomes an :class:`OpError` naming the op; nothing the adapter does can end
the run without a verdict:

- **it cannot change what the oracle sees.** The op is handed private copies of every tensor
  argument (and a copy of a :class:`reference.PackedLayout`, with copies of its tensors); the
  caller's tensors, on which the oracle is evaluated, never reach it. After the call the copies
  are compared bit for bit with what was handed out: a write into an argument (contract
  section 11) is a failure of the op naming the argument, how many elements changed and the
  first one.
- **what it returns is checked and kept as it was returned.** A ``result`` callable (the
  caller's rules for the op's outputs) names the returned tensors and refuses an unusable one
  (``kind="result"``); the caller gets private copies. Inside :func:`watching`, the tensors
  themselves are kept and compared with those copies after every later call and at the end
  (:class:`Watched`): an output the adapter changes after returning it (a view of a workspace
  that its next call overwrites, a backward that writes into the forward's ``out``) is a
  failure naming the tensor and the call that changed it.
- **raising, exiting or hanging is a failure of the op.** Any exception, and also
  ``SystemExit``, ``GeneratorExit`` and every other ``BaseException`` from adapter code, is an
  :class:`OpError`; only ``KeyboardInterrupt`` (the user's Ctrl-C) propagates. Its message is
  made printable (:func:`text`: control characters and surrogates escaped, one line, at most
  :data:`TEXT_LIMIT` characters), whatever the exception's ``__str__`` does.
- **a time limit** (:func:`op_timeout`, ``check --timeout``; :func:`bounded` for the adapter's
  import and construction), which covers the op's CUDA work too (the device is synchronized
  before the op counts as returned): in the main thread a ``SIGALRM`` timer interrupts the op
  (re-armed every second, so that an op that swallows the interrupt is interrupted again);
  elsewhere the op runs in a daemon thread that is abandoned when it overruns
  (:func:`abandoned` names them, so that the command can exit with ``os._exit`` instead of
  waiting for them). With ``hard_exit=True``, an op that no interrupt reaches (native code
  holding the GIL, Python swallowing every interrupt) is ended after the timeout plus a grace
  period by a watchdog that needs no Python thread: ``faulthandler``'s, which exits the process
  with status 1 while a small supervising process prints the one-line reason on stderr.
"""
from __future__ import annotations

import contextlib
import contextvars
import faulthandler
import inspect
import re
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache

import torch

__all__ = ["OpError", "call_op", "where", "op_timeout", "abandoned", "arg_names", "describe",
           "text", "bounded", "Overrun", "watching", "Watched", "MAX_TIMEOUT_S", "TEXT_LIMIT",
           "check_timeout"]

EXIT_HUNG = 1
MAX_TIMEOUT_S = 1e6         # the longest time limit (about 11.6 days): the timers' own range
_GRACE_S = (2.0, 10.0)      # after the timeout, how long an op stuck in native code is given:
                            # the timeout itself, within these limits
_ALARM_REPEAT_S = 1.0
TEXT_LIMIT = 2000           # characters of an adapter's message kept in a verdict


class OpError(RuntimeError):
    """An adapter op failed: it raised, exited, hung, wrote into an argument, or returned
    something that is not the protocol's result. ``kind`` is ``"error"``, ``"timeout"``,
    ``"mutation"`` or ``"result"`` (an unusable output; ``output`` names it)."""

    def __init__(self, op: str, message: str, kind: str = "error", output: str | None = None):
        super().__init__(f"{op}: {message}")
        self.op = op
        self.message = message
        self.kind = kind
        self.output = output


class Overrun(BaseException):
    """Raised inside the op by the alarm when it overruns its time limit (a BaseException, so
    ``except Exception`` in adapter code does not swallow it; guards of adapter code let it
    through)."""


# ---------------------------------------------------------------------------------------------
# messages from adapter code, made printable
# ---------------------------------------------------------------------------------------------
# C0/C1 control characters (escape sequences, NUL), lone surrogates and the two
# non-characters XML refuses; newlines and tabs are folded into spaces first
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
_BREAKS = re.compile(r"\s*[\r\n\t\f\v]+\s*")


def _escape(m) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def text(obj, limit: int = TEXT_LIMIT) -> str:
    """``str(obj)`` as one printable line: whatever ``__str__`` raises is named instead, line
    breaks and tabs become spaces, control characters (ANSI escapes, NUL) and lone surrogates
    are written as ``\\xNN``/``\\uNNNN`` escapes, and a text longer than ``limit`` characters
    is cut with a note of its length. Safe to print on any terminal and to write into JSON,
    Markdown and XML."""
    try:
        s = obj if isinstance(obj, str) else str(obj)
        if not isinstance(s, str):
            raise TypeError(f"__str__ returned {type(s).__name__}")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:             # adapter code: never let it break a verdict
        s = f"<a {type(obj).__name__} whose str() raised {type(exc).__name__}>"
    n = len(s)
    if n > limit:
        s = s[:limit]
    s = _UNPRINTABLE.sub(_escape, _BREAKS.sub(" ", s)).strip()
    if n > limit:
        s += f" ... ({n} characters in all)"
    return s


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception (``SystemExit: 0``; ``SystemExit`` when it has none),
    printable (:func:`text`)."""
    msg = text(exc)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _innermost(exc: BaseException):
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last


def where(exc: BaseException) -> str:
    """`` (at file.py:LINE in func)`` of the innermost frame of ``exc``'s traceback."""
    last = _innermost(exc)
    if last is None:
        return ""
    code = last.tb_frame.f_code
    return " " + text(f"(at {code.co_filename.rsplit('/', 1)[-1]}:{last.tb_lineno} in "
                      f"{code.co_name})")


def _raised_here(exc: BaseException) -> bool:
    """The exception comes from this module's own frame: the call itself failed (the adapter's
    function was never entered, e.g. an unexpected keyword)."""
    last = _innermost(exc)
    return last is not None and last.tb_frame.f_code.co_filename == __file__


def _signature_mismatch(fn, op: str, args: tuple, kwargs: dict) -> str | None:
    """Why ``fn`` cannot take the protocol's call of ``op`` (``None`` when it can, or when its
    signature cannot be read)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
        return None
    except TypeError as exc:
        names = arg_names(op)
        pos = [names[i] if i < len(names) else f"args[{i}]" for i in range(len(args))]
        call = ", ".join(pos + (["*"] if kwargs else []) + list(kwargs))
        return (f"cannot be called as the protocol calls it, {op}({call}): {text(exc)}; its "
                f"signature is {text(sig)} (dsv4_oracle/protocol.py has each op's call)")


# ---------------------------------------------------------------------------------------------
# time limits (a context setting, so that every call_op below a run gets it)
# ---------------------------------------------------------------------------------------------
_TIMEOUT: contextvars.ContextVar = contextvars.ContextVar("dsv4_oracle_op_timeout",
                                                          default=(None, False))
_ABANDONED: list = []        # (op, thread) of op threads still running after their timeout


def check_timeout(seconds, name: str = "timeout") -> float | None:
    """``seconds`` as a time limit (``None`` or 0: no limit); ``TypeError``/``ValueError``
    naming ``name`` unless it is a real number in ``[0, MAX_TIMEOUT_S]``."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{name} must be a number of seconds (0 or None: no limit), got "
                        f"{type(seconds).__name__}")
    if not 0 <= seconds <= MAX_TIMEOUT_S:       # NaN fails both comparisons
        raise ValueError(f"{name} must be a number of seconds in [0, {MAX_TIMEOUT_S:g}] (0: no "
                         f"limit), got {seconds!r}")
    return float(seconds) or None


@contextlib.contextmanager
def op_timeout(seconds: float | None, *, hard_exit: bool = False):
    """Within the block, every :func:`call_op` without its own ``timeout`` fails an op that
    does not return within ``seconds`` (``None`` or ``0``: no limit; at most
    :data:`MAX_TIMEOUT_S`, else ``ValueError``). ``hard_exit``: an op that no interrupt
    reaches, past the timeout plus a grace period, ends the process (one line on stderr, exit
    status 1)."""
    seconds = check_timeout(seconds, "op_timeout: seconds")
    token = _TIMEOUT.set((seconds, hard_exit))
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


# The supervising process of the hard watchdog: it reads the line to print when the watchdog
# fires ("arm\t<line>"), and prints it when faulthandler's dump ("Timeout (...") arrives just
# before the process it watches exits; SIGINT is the user's, for the process it watches.
_SUPERVISOR = r"""
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
line = None
for raw in sys.stdin.buffer:
    if raw.startswith(b"arm\t"):
        line = raw[4:].rstrip(b"\n")
    elif raw.startswith(b"Timeout (") and line is not None:
        sys.stderr.buffer.write(line + b"\n")
        sys.stderr.flush()
        line = None
"""


class _Watchdog:
    """Ends the process when an op overruns its time limit plus a grace period, whatever the op
    does: ``faulthandler.dump_traceback_later(exit=True)`` runs in a C thread that needs no GIL
    and exits with status 1; its dump goes to a supervising process, which prints the one-line
    reason instead (without one, the dump goes to stderr)."""

    def __init__(self):
        self._proc = None
        self._failed = False
        self._told = None

    def _sink(self):
        if self._proc is None and not self._failed and sys.executable:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _SUPERVISOR], stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, close_fds=True)
            except (OSError, ValueError):
                self._failed = True
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.stdin
        return None

    def _tell(self, sink, line: str) -> bool:
        try:
            sink.write(line.encode("utf-8", "backslashreplace"))
            sink.flush()
            return True
        except (OSError, ValueError):
            return False

    def arm(self, seconds: float, line: str) -> None:
        # the supervisor is told a line only when it changes: a dump can only come while armed,
        # and then the line it holds is the one armed last (no disarm message is needed)
        sink = self._sink()
        told = sink is not None and (line == self._told or self._tell(
            sink, f"arm\t{text(line, 10 * TEXT_LIMIT)}\n"))
        if told:
            self._told = line
            faulthandler.dump_traceback_later(seconds, exit=True, file=sink)
        else:
            self._told = None
            faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()


_WATCHDOG = _Watchdog()


@contextlib.contextmanager
def _hard_limit(what: str, timeout: float, hard_exit: bool):
    """With ``hard_exit``, the watchdog armed for ``timeout`` plus the grace period."""
    if not hard_exit:
        yield
        return
    grace = min(max(timeout, _GRACE_S[0]), _GRACE_S[1])
    _WATCHDOG.arm(timeout + grace, f"dsv4-oracle: error: {what} did not return within "
                  f"{timeout:g} s (--timeout) and cannot be interrupted (stuck in native code, "
                  f"or swallowing interrupts); exiting with status {EXIT_HUNG}")
    try:
        yield
    finally:
        _WATCHDOG.disarm()


def _alarm_call(fn, timeout: float):
    """``fn()`` in this (the main) thread, interrupted by SIGALRM after ``timeout`` s."""
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise Overrun()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout, _ALARM_REPEAT_S)
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if old_handler is None else old_handler)
        if old_delay:           # an outer timer (e.g. a test runner's): give back what is left
            left = max(old_delay - (time.monotonic() - t0), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def _thread_call(fn, what: str, timeout: float):
    """``fn()`` in a daemon thread with this thread's grad mode, abandoned after ``timeout``."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    box: dict = {}

    def target():
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                box["result"] = fn()
        except BaseException as exc:       # handed to the calling thread below
            box["error"] = exc

    t = threading.Thread(target=target, name=f"dsv4-oracle {what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        _ABANDONED.append((what, t))
        raise Overrun()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _limited(fn, what: str, timeout: float | None, hard_exit: bool):
    """``fn()`` under the time limit ``timeout`` (``None``: none); raises :class:`Overrun`."""
    if not timeout:
        return fn()
    with _hard_limit(what, timeout, hard_exit):
        if _in_main_thread():
            return _alarm_call(fn, timeout)
        return _thread_call(fn, what, timeout)


def bounded(fn, what: str, *, timeout=None, hard_exit: bool = False):
    """``fn()`` (the adapter's import, construction or inspection) under the time limit
    ``timeout`` (default: the enclosing :func:`op_timeout`'s): ``TimeoutError`` naming
    ``what`` when it overruns; with ``hard_exit`` the watchdog ends the process when no
    interrupt reaches it. Anything ``fn`` raises propagates."""
    if timeout is None:
        timeout, hard_exit = _TIMEOUT.get()
    t0 = time.monotonic()
    try:
        res = _limited(fn, what, timeout, hard_exit)
    except Overrun:
        raise TimeoutError(f"{what} did not finish within {timeout:g} s (--timeout)") from None
    if timeout and time.monotonic() - t0 > timeout:
        raise TimeoutError(f"{what} finished after {time.monotonic() - t0:.1f} s, over the "
                           f"time limit of {timeout:g} s (--timeout)")
    return res


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
        if t.layout != torch.strided:      # a sparse tensor: a copy, whatever its layout
            return t.detach().clone()
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
    """A PackedLayout over private copies of ``lay``'s tensors."""
    return lay.clone()


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
    b, a = _bits(before.detach()), _bits(after.detach())
    if torch.equal(b, a):                      # the usual answer, without a count
        return None
    with torch.no_grad():
        diff = b != a
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
# returned tensors, watched after they are returned
# ---------------------------------------------------------------------------------------------
def _place(t: torch.Tensor) -> tuple:
    """Where and how ``t``'s values lie: a view made of ``t`` still reads them while this holds."""
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


class Watched:
    """The tensors ops returned (the adapter's own objects), each kept with the copy taken when
    it was returned, and compared bit for bit with that copy after every later call
    (:func:`call_op`) and at :meth:`verify` (the caller's end of a run).

    ``record``: whether :func:`call_op` keeps what ops return now; ``tag``: stored with each
    tensor (the runner's level); ``phase``: where the calls are (``"the torch.no_grad() run"``,
    ``"replay 2"``), named in a finding. ``changes``: one finding per tensor that changed,
    ``(tag, op, name, how, by_op, by_phase)`` (``by_op`` ``None``: found at the end, after no
    call). ``held``: per tag, how many tensors were kept."""

    def __init__(self):
        self.entries: list = []
        self.changes: list = []
        self.held: dict = {}
        self.calls = 0
        self.record = False
        self.tag = None
        self.phase = ""

    def hold(self, op: str, originals: dict, copies: dict) -> None:
        kept = {n: t for n, t in originals.items()        # tensors that hold values
                if isinstance(t, torch.Tensor) and t.layout == torch.strided
                and t.device.type != "meta"}
        for name, t in kept.items():
            c = copies[name]
            # bit views of both, made once: a write into t's memory shows through its view (a
            # t moved to other memory, or reshaped, is compared afresh by _written)
            views = (_bits(t.detach()), _bits(c))
            self.entries.append((self.tag, op, name, t, c, _place(t), views))
        self.held[self.tag] = self.held.get(self.tag, 0) + len(kept)

    def verify(self, by_op: str | None = None) -> None:
        """Compare every kept tensor with its copy; a changed one becomes a finding (once)."""
        if by_op is not None:
            self.calls += 1
        keep = []
        for entry in self.entries:
            tag, op, name, t, copy, place, views = entry
            if _place(t) == place and torch.equal(*views):
                keep.append(entry)              # unchanged: the usual answer, cheaply
                continue
            how = _written(copy, t)
            if how:
                self.changes.append((tag, op, name, how, by_op, self.phase))
            else:
                keep.append(entry)
        self.entries = keep


_WATCHED: contextvars.ContextVar = contextvars.ContextVar("dsv4_oracle_watched", default=None)


@contextlib.contextmanager
def watching():
    """A :class:`Watched` for the block: every :func:`call_op` with a ``result`` inside it keeps
    what the op returned while ``record`` is set, and compares everything kept after each
    call."""
    w = Watched()
    token = _WATCHED.set(w)
    try:
        yield w
    finally:
        _WATCHED.reset(token)


def _named(result, res, op: str) -> dict:
    """``result(res)``: the op's named outputs, or an :class:`OpError` (``kind="result"``)
    when they are unusable or cannot be read."""
    try:
        named = result(res)
    except (OpError, KeyboardInterrupt, Overrun):
        raise
    except BaseException as exc:        # reading the adapter's result ran its code
        raise OpError(op, f"its result cannot be read: {describe(exc)}{where(exc)}",
                      "result") from exc
    return named


# ---------------------------------------------------------------------------------------------
# the call
# ---------------------------------------------------------------------------------------------
_UNSET = object()


def call_op(fn, op: str, args: tuple = (), kwargs: dict | None = None, *, timeout=_UNSET,
            private: bool = True, result=None, label: str | None = None):
    """``fn(*args, **kwargs)`` for the adapter op ``op``; any failure is an :class:`OpError`.

    The op gets private copies of the tensor arguments (``private=False``: the caller's
    tensors are already private to this call, e.g. autograd leaves that must stay leaves; they
    are handed as they are and compared with a snapshot) and a copy of a layout argument; a
    write into any of them fails the op (``kind="mutation"``). ``timeout`` in seconds
    (``None``: no limit; default: the enclosing :func:`op_timeout`).

    Without ``result``, the result is returned as a copy (``private``) or as it is. With
    ``result``, a callable ``res -> {name: tensor}`` that names the op's outputs and raises
    :class:`OpError` (``kind="result"``) for an unusable one, call_op returns
    ``{name: private copy}``; inside :func:`watching` the returned tensors themselves are kept
    (while ``record`` is set) and compared with those copies after every later call.
    ``label``: the call as messages name it (default ``op``)."""
    hard_exit = False
    if timeout is _UNSET:
        timeout, hard_exit = _TIMEOUT.get()
    label = label or op
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
    watched = _WATCHED.get()
    t0 = time.monotonic()
    try:
        try:
            res = _limited(run, label, timeout, hard_exit)
        except OpError:
            raise
        except Overrun:
            raise OpError(op, f"did not return within {timeout:g} s (--timeout)",
                          "timeout") from None
        except KeyboardInterrupt:           # the user's Ctrl-C: the caller ends the run
            raise
        except BaseException as exc:        # the implementation under test failed on this case
            why = (_signature_mismatch(fn, op, h_args, h_kwargs)
                   if isinstance(exc, TypeError) and _raised_here(exc) else None)
            what = "exited" if isinstance(exc, SystemExit) else "raised"
            raise OpError(op, why or f"{what} {describe(exc)}{where(exc)}") from exc
        if timeout and time.monotonic() - t0 > timeout:     # it swallowed every interrupt
            raise OpError(op, f"returned after {time.monotonic() - t0:.1f} s, over the timeout "
                              f"of {timeout:g} s (--timeout)", "timeout")
        for name, before, handed in pairs:
            how = _written(before, handed)
            if how:
                raise OpError(op, f"wrote into its argument {name}: {how} (contract section "
                                  f"11: inputs are read-only)", "mutation")
        if result is None:
            return _owned(res) if private else res
        named = _named(result, res, op)
        copies = {k: _twin(t) for k, t in named.items()}
        if watched is not None and watched.record:
            watched.hold(label, named, copies)
        return copies
    finally:
        if watched is not None:
            watched.verify(label)
