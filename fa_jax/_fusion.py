"""Computed once: an array that XLA's CPU fusion would recompute in each consumer.

XLA's CPU fusion copies a chain of cheap elementwise ops (integer arithmetic,
compares, selects: everything an emulated rounding is made of) into every
fusion that consumes it, so a value read by k consumers is computed k times.
``optimization_barrier`` does not stop it: the CPU pipeline removes barriers
before fusion.  XLA never duplicates an op it counts as expensive, and a
windowed reduction is one: :func:`materialised` passes the value's bits through
a bitwise-or ``reduce_window`` of window 1, which XLA keeps, emits as a plain
vector loop with the chain fused in, and stores once for every consumer.  The
same bits come out.  (A full reduction over the pair (x, 0) also stops the
copies, but runs the chain in the reduction's slower loop; a division by a one
XLA cannot fold splits the exp's table lookups into fusions of their own.)
docs/performance.md has the figures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["materialised"]

_BITS = {4: jnp.uint32, 8: jnp.uint64}


@jax.custom_jvp
def materialised(x) -> jax.Array:
    """``x`` (a float32 or float64 array), bit for bit, computed once (module
    docstring); its derivative is the identity's."""
    x = jnp.asarray(x)
    uint = _BITS[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, uint)
    ones = (1,) * x.ndim
    bits = jax.lax.reduce_window(bits, uint(0), jax.lax.bitwise_or, ones, ones, "VALID")
    return jax.lax.bitcast_convert_type(bits, x.dtype)


@materialised.defjvp
def _materialised_jvp(primals, tangents):
    return materialised(primals[0]), tangents[0]
