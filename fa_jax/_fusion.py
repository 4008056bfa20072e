"""Computed once: an array that XLA's CPU fusion would recompute in each consumer.

XLA's CPU fusion copies a chain of cheap elementwise ops (integer arithmetic,
compares, selects: everything an emulated rounding is made of) into every
fusion that consumes it, so a value read by k consumers is computed k times.
``optimization_barrier`` does not stop it: the CPU pipeline removes barriers
before fusion.  A reduction does, since XLA counts it as expensive and never
duplicates it: :func:`materialised` passes the value's bits through a
bitwise-or reduction over the pair (bits, 0).  The same bits come out,
computed once and stored for every consumer.  On the float32 carrier this
halved a flash attention step (docs/performance.md).
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
    pair = jnp.stack([bits, jnp.zeros_like(bits)])
    bits = jax.lax.reduce(pair, uint(0), jax.lax.bitwise_or, (0,))
    return jax.lax.bitcast_convert_type(bits, x.dtype)


@materialised.defjvp
def _materialised_jvp(primals, tangents):
    return materialised(primals[0]), tangents[0]
