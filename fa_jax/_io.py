"""Shared plumbing of the experiment drivers: atomic file writes, a float64 scope, and
matplotlib behind the optional ``plot`` extra."""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import jax

__all__ = ["atomic_write", "float64_enabled", "pyplot"]


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


@contextlib.contextmanager
def float64_enabled():
    """``jax_enable_x64`` on inside the block (the emulated ops need float64
    carriers), restored to its previous value on exit."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


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
