"""Calling one op of an adapter: the only place where the implementation's code runs.

:func:`call_op` is the boundary between the conformance engine and the code under test. What
happens inside it (the implementation raising, returning garbage, writing into what it was
handed, exiting, hanging) becomes an :class:`OpError` naming the op; nothing the adapter does
can end the run without a verdict.
"""
from __future__ import annotations

__all__ = ["OpError", "call_op", "where"]


class OpError(RuntimeError):
    """An adapter op raised or returned something that is not the protocol's result."""

    def __init__(self, op: str, message: str):
        super().__init__(f"{op}: {message}")
        self.op = op
        self.message = message


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


def call_op(fn, op: str, args: tuple = (), kwargs: dict | None = None, *,
            timeout: float | None = None):
    """``fn(*args, **kwargs)`` for the adapter op ``op``; any failure is an :class:`OpError`."""
    try:
        return fn(*args, **(kwargs or {}))
    except OpError:
        raise
    except Exception as exc:           # the implementation under test failed on this case
        raise OpError(op, f"raised {type(exc).__name__}: {exc}{where(exc)}") from exc
