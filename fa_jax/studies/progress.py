"""The one progress display of long studies: a tqdm bar on a terminal, else nothing.

:func:`track` wraps an iterable.  It shows a bar on standard error only when
``quiet`` is false, standard error is a terminal and tqdm (the optional
``progress`` extra) is installed; otherwise it returns the iterable unchanged,
so logs and pipes stay clean and a missing tqdm never fails a run.
:func:`follow` shows, under the same conditions, a bar whose count is read
from elsewhere (a multi-process sweep's whole job, counted by every process)
on a thread, twice a second, while its block runs.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import TypeVar

__all__ = ["follow", "status", "track"]

T = TypeVar("T")


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


_SHOWN: list = []  # the bars on screen, innermost last


def _bar(items: Iterable[T], tqdm, desc: str, total: int | None, unit: str) -> Iterator[T]:
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False) as bar:
        _SHOWN.append(bar)
        try:
            for x in items:
                yield x
                bar.update()
        finally:
            _SHOWN.remove(bar)


def status(text: str) -> None:
    """Show ``text`` beside the innermost bar on screen (e.g. "compiling ..."); an
    empty text clears it; without a bar, nothing."""
    if _SHOWN:
        _SHOWN[-1].set_postfix_str(text, refresh=True)


def _shown(quiet: bool):
    """tqdm, if a bar is to be shown (module docstring), else None."""
    if quiet:
        return None
    isatty = getattr(sys.stderr, "isatty", None)
    if isatty is None or not isatty():
        return None
    return _tqdm()


@contextlib.contextmanager
def follow(
    desc: str,
    total: int,
    count: Callable[[], int],
    *,
    unit: str = "it",
    quiet: bool = False,
    interval: float = 0.5,
) -> Iterator[None]:
    """While the block runs, a bar named ``desc`` at ``count()`` of ``total``,
    read every ``interval`` seconds on a thread (module docstring says when)."""
    tqdm = _shown(quiet)
    if tqdm is None:
        yield
        return
    stop = threading.Event()
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False) as bar:

        def poll():
            while True:
                try:
                    n = count()
                except Exception:  # the counter is gone (the run is ending)
                    return
                if n != bar.n:
                    bar.n = n
                    bar.refresh()
                if stop.wait(interval):
                    return

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def track(
    items: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    quiet: bool = False,
) -> Iterable[T]:
    """``items``, with a progress bar named ``desc`` while they are consumed (module
    docstring says when)."""
    if quiet:
        return items
    isatty = getattr(sys.stderr, "isatty", None)
    if isatty is None or not isatty():
        return items
    tqdm = _tqdm()
    if tqdm is None:
        return items
    if total is None and isinstance(items, Sized):
        total = len(items)
    return _bar(items, tqdm, desc, total, unit)
