"""Shared plumbing of the experiment drivers: atomic file writes, a float64 scope, and
matplotlib behind the optional ``plot`` extra."""

from __future__ import annotations

import os
import pathlib
import tempfile


__all__ = ["atomic_write", "pyplot"]


def atomic_write(path, write, *, binary: bool = False) -> None:
    """Call ``write(fh)`` on a temporary file beside ``path``, flush and fsync it,
    then rename it over ``path``: readers see the old file or the new one, never
    a torn one (the resumable sweeps and studies rely on this)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"newline": ""})) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def pyplot(purpose: str):
    """``matplotlib.pyplot`` on the non-interactive Agg backend; without matplotlib,
    an ImportError that names ``purpose`` and the ``plot`` extra."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"{purpose} needs matplotlib; install it with "
                          "pip install 'fa-jax[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
