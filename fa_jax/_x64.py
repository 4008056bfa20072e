"""The float64 scope: fa_jax's op layer carries values in float64 (and int64 bit
patterns), which JAX enables only under ``jax_enable_x64``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

__all__ = ["float64_enabled"]


@contextlib.contextmanager
def float64_enabled() -> Iterator[None]:
    """``jax_enable_x64`` on inside the block, restored to its previous value on exit."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
