"""The one progress display of long studies: a tqdm bar on a terminal, else nothing.

:func:`track` wraps an iterable.  It shows a bar on standard error only when
``quiet`` is false, standard error is a terminal and tqdm (the optional
``progress`` extra) is installed; otherwise it returns the iterable unchanged,
so logs and pipes stay clean and a missing tqdm never fails a run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sized
from typing import TypeVar

__all__ = ["status", "track"]

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
