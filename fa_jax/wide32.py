"""Sequential FP32 accumulation of products exact in float64, on float64 hardware.

The "sequential" model's FP32 accumulator, ``acc_k = fl_32(acc_{k-1} + a_k b_k)``
(:mod:`fa_jax.accumulation`), for operands whose products float64 holds exactly
(each of at most 26 significant bits: FP32 values and narrower) but float32 does
not (an FP32 probability times a bf16 value, two FP32 values), where
:mod:`fa_jax.native32` cannot run it on the float32 adder.  Each step is

    p = a_k b_k                      exact in float64
    s, e = TwoSum(acc, p)            s = fl_64(acc + p), e the exact rest (Knuth)
    s' = s, or its odd neighbour toward e where e != 0 and s is even
    acc_k = fl_32(s')                the hardware's float64 -> float32 conversion

Rounding to 53 bits by round-to-odd and then to 24 by round-to-nearest-even
gives the correctly rounded result, as 53 >= 24 + 2 (Boldo & Melquiond 2008,
"Emulation of FMA and correctly rounded sums: proved algorithms using rounding
to odd"); it is :func:`fa_jax.ops.add`'s method with the last rounding on the
hardware.  That conversion is IEEE round-to-nearest-even except where XLA's CPU
runtime flushes a float32 subnormal to zero (DESIGN.md), so every step checks
that ``s'`` is 0 or a float32-normal magnitude (>= 2**-126) that converts to a
finite value, and marks the accumulator NaN where not (NaN then stays NaN);
where the batch's result holds a NaN, the exact emulation (``fallback``) runs
instead.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._fallback import batch_all
from fa_jax.ops32 import _scan

__all__ = ["sequential_matmul"]

_NORMAL32 = float(np.finfo(np.float32).tiny)  # 2**-126
_ONE = np.uint64(1)


def _odd_then_float32(s, e):
    """fl_32(s + e) for s = fl_64(s + e): s moved to its odd neighbour toward e where
    inexact, then converted; NaN where that conversion is outside the range where
    the hardware's is IEEE, or gives ±inf (module docstring): NaN stays NaN
    through the later steps, so one look at the result tells."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint64)
    even_inexact = (e != 0) & ((bits & _ONE) == 0)
    grow = (e > 0) == (s > 0)  # moving toward e grows |s|
    bits = jnp.where(even_inexact, jnp.where(grow, bits + _ONE, bits - _ONE), bits)
    odd = jax.lax.bitcast_convert_type(bits, jnp.float64)
    narrowed = jax.lax.convert_element_type(odd, jnp.float32)
    rounded = jax.lax.convert_element_type(narrowed, jnp.float64)
    outside = ((odd != 0) & ~(jnp.abs(odd) >= _NORMAL32)) | ~jnp.isfinite(rounded)
    return jnp.where(outside, np.nan, rounded)


def sequential_matmul(a, b, fallback: Callable[[], jax.Array]) -> jax.Array:
    """``acc_k = fl_32(acc_{k-1} + a[..., :, k] b[..., k, :])`` from ``acc_0 = 0`` for
    float64 carriers ``a`` (..., n, K) and ``b`` (..., K, m) whose products float64
    holds exactly (module docstring); ``fallback()``, the exact emulation of the
    same sum, where a step leaves float32's normal range."""
    if a.dtype != jnp.float64 or b.dtype != jnp.float64:
        raise TypeError(
            f"wide32.sequential_matmul: expected float64 carriers, got {a.dtype}, {b.dtype}"
        )
    out_shape = (*jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    a_steps = jnp.moveaxis(a, -1, 0)[..., :, None]  # (K, ..., n, 1)
    b_steps = jnp.moveaxis(b, -2, 0)[..., None, :]  # (K, ..., 1, m)

    def step(acc, ab):
        p = ab[0] * ab[1]
        s = acc + p
        bp = s - acc
        e = (acc - (s - bp)) + (p - bp)
        return _odd_then_float32(s, e), None

    start = jnp.zeros(out_shape, jnp.float64)
    # XLA would fold 0 + p to p (-0 for p = -0, where 0 + -0 is +0).
    acc = _scan(step, jax.lax.optimization_barrier(start), (a_steps, b_steps))[0]
    inside = ~jnp.isnan(acc)
    return jax.lax.cond(batch_all(inside), lambda _: acc, lambda _: fallback(), None)
