"""Cooperative Ctrl-C: SIGINT becomes a request that long loops honour between work units.

Python's default SIGINT handler raises KeyboardInterrupt wherever the main thread
happens to be, XLA compilation included; unwinding from there can leave XLA's
threads running while the interpreter shuts down.  Inside
:func:`deferred_interrupts` the first SIGINT only records a stop request;
:func:`check_interrupt`, called by a study at a safe point (the sweep calls it
once the rows computed so far are written), raises KeyboardInterrupt there.  A
request still pending when the block ends raises there, so none is lost.  A
second SIGINT ends the process at once (``os._exit(130)``, after writing
``message`` to standard error): files already written atomically stay whole.

Outside the block, :func:`check_interrupt` does nothing and SIGINT keeps Python's
default behaviour, so library callers see ordinary KeyboardInterrupts.  The
handler can only be installed from the main thread; elsewhere the block changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

__all__ = ["check_interrupt", "deferred_interrupts", "interrupt_requested"]


class _State:
    active = False  # a deferring handler is installed
    requested = False  # a SIGINT arrived while it was


def interrupt_requested() -> bool:
    """Whether a SIGINT arrived inside :func:`deferred_interrupts` and is not yet honoured."""
    return _State.requested


def check_interrupt() -> None:
    """Raise KeyboardInterrupt if a stop was requested (see the module docstring)."""
    if _State.requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupts(message: str = "interrupted") -> Iterator[None]:
    """While the block runs, SIGINT requests a stop instead of raising; a second
    SIGINT writes ``message`` to standard error and exits with status 130.  The
    previous handler is restored on exit.  Nested blocks share the outer one."""
    if _State.active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _State.requested:
            os.write(2, (message + "\n").encode())
            os._exit(128 + signal.SIGINT)
        _State.requested = True

    _State.requested = False
    previous = signal.signal(signal.SIGINT, handler)
    _State.active = True
    try:
        yield
        check_interrupt()
    finally:
        # None: the previous handler was not installed from Python (not restorable)
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        _State.active, _State.requested = False, False
