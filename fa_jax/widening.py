"""Exact conversion of narrow floats to float32/float64.

XLA on CPU flushes float32 and bfloat16 subnormals to zero in its conversion to
float64 (jax 0.10.2: ``float32(2**-140).astype(float64) == 0``).  ``widen``
rebuilds them from their bits instead, so every value arrives unchanged.
Its derivative is that of the conversion it replaces: the tangent converted to
the target dtype (the bit manipulation would otherwise give a zero gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["widen"]


def widen(x, dtype) -> jax.Array:
    """``x`` converted exactly to ``dtype`` (float32 or float64), which must be at
    least as wide.  Float64 needs ``jax_enable_x64``."""
    x = jnp.asarray(x)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"widen: expected float32 or float64 as the target, got {dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(dtype)  # integers and bools: exact within the target's range
    if x.dtype == dtype:
        return x
    fi = jnp.finfo(x.dtype)
    if fi.bits > 32 or fi.nexp > 8:
        raise ValueError(f"widen: {x.dtype} does not fit {dtype.name} exactly")
    return _widen_float(x, dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _widen_float(x, dtype):
    x = _to_float32(x)
    if dtype == np.float32:
        return x
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    code = (bits & np.uint32(0x7FFFFFFF)).astype(jnp.float64)  # exact: < 2**31
    tiny = jnp.where(bits >> 31 != 0, -code, code) * np.float64(2.0**-149)  # exact: normal
    return jnp.where((bits & np.uint32(0x7F800000)) == 0, tiny, x.astype(jnp.float64))


@_widen_float.defjvp
def _widen_float_jvp(dtype, primals, tangents):
    (x,), (t,) = primals, tangents
    return _widen_float(x, dtype), t.astype(dtype)


def _to_float32(x):
    if x.dtype == jnp.float32:
        return x
    if x.dtype == jnp.bfloat16:  # the top half of a float32
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << np.uint32(16)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    return x.astype(jnp.float32)  # float16, float8/6/4: their subnormals are float32 normals
