"""A fast path's guard: one predicate for a whole batch, so its fallback stays a branch.

A fast path that is exact only where a check holds runs under
``lax.cond(batch_all(ok), fast, fallback)``.  Under ``jax.vmap`` a batched
predicate turns the ``cond`` into a ``select`` that runs the fallback always;
:func:`batch_all` takes the predicate over the whole batch instead, so the
``cond`` stays a branch.  Where any configuration of a batch needs the
fallback, all take it; every fallback is exact for every element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["batch_all"]


@jax.custom_batching.custom_vmap
def batch_all(x) -> jax.Array:
    """``jnp.all(x)``, taken over the whole batch under ``vmap`` (a scalar there too)."""
    return jnp.all(x)


@batch_all.def_vmap
def _batch_all_batched(axis_size: int, in_batched, x):
    del axis_size, in_batched
    return jnp.all(x), False
