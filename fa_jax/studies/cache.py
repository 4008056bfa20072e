"""The persistent compilation cache of fa_jax's studies.

A sweep's time on a small grid is mostly XLA compiling its few programs
(golden, baseline, and flash per tile width and length bucket).  JAX can keep
compiled executables on disk and load them in a later process, but by default
it stores only programs that took over a second to compile, so most of a
sweep's programs were never stored.  :func:`compilation_cache` points JAX at a
cache folder and stores every program for as long as it is active, then puts
JAX's settings back.

Location: ``$FA_JAX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fa_jax``
(``~/.cache/fa_jax`` without ``XDG_CACHE_HOME``); JAX's entries go to its
``xla`` folder, the sweep's own compiled programs
(:mod:`fa_jax.studies.sweep.executables`) to ``programs``; while a sweep
runs, JAX's cache is off and only ``programs`` is used
(:mod:`fa_jax.studies.sweep.engine`).  ``run_sweep`` and the CLI use it by
default; ``cache=False`` (CLI: ``--no-cache``) leaves JAX's
settings alone.  JAX keys each entry on the program, its compile options, the jax and
jaxlib versions and the device, so a loaded executable computes exactly what a
fresh compile would.  A folder that cannot be created is reported by a warning
and the run goes on without the cache.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = ["CACHE_ENV", "cache_dir", "compilation_cache"]

CACHE_ENV = "FA_JAX_CACHE_DIR"

# JAX's thresholds below which an executable is not stored: zero stores them all.
_STORE_EVERYTHING = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def cache_dir() -> pathlib.Path:
    """The default cache folder (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "fa_jax"


def _resolve(cache) -> pathlib.Path | None:
    if cache is True:
        return cache_dir()
    if cache is False or cache is None:
        return None
    if isinstance(cache, (str, os.PathLike)):
        return pathlib.Path(cache).expanduser()
    raise TypeError(f"cache: expected True, False or a folder path, got {cache!r}")


@contextlib.contextmanager
def compilation_cache(
    cache: bool | str | os.PathLike | None = True,
) -> Iterator[pathlib.Path | None]:
    """JAX's persistent compilation cache under ``cache`` (True: :func:`cache_dir`;
    a path; False or None: unchanged) while the block runs; yields that cache
    folder, or None."""
    path = _resolve(cache)
    if path is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            warnings.warn(
                f"compilation cache: cannot create {path} ({e.strerror}); running without it",
                stacklevel=3,
            )
            path = None
    if path is None:
        yield None
        return
    settings = {"jax_compilation_cache_dir": str(path / "xla"), **_STORE_EVERYTHING}
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    _jax_cache.reset_cache()  # JAX opens its cache once; make it open this folder
    try:
        yield path
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        _jax_cache.reset_cache()
