"""Sequential FP32 accumulation on the hardware's float32 adder, where it is exact.

The "sequential" model rounds after every multiply-add, ``acc_k = fl_32(acc_{k-1}
+ a_k b_k)`` (:mod:`fa_jax.accumulation`), which for an FP32 accumulator is one
float32 multiply and one float32 add per step — provided the hardware's add is
IEEE binary32 with round-to-nearest-even there.  Two things break that: a
product that float32 cannot hold exactly, and a subnormal (XLA's CPU runtime
flushes them to zero; DESIGN.md).  Both are ruled out for a whole matmul
before it starts, by three checks on its operands:

1. every nonzero ``a`` and ``b`` is a binary32 normal with at most 12
   significant bits (bf16, fp16, TF32, FP8 values), so a product has at most 24
   bits;
2. ``lo_a lo_b >= 2**-102`` for the smallest nonzero magnitudes, and
   ``hi_a hi_b <= max_32`` for the largest: each product is then a binary32
   normal, exact, and a multiple of ``q = 2**-126`` (a 12-bit significand at
   exponent ``e`` is a multiple of ``2**(e - 11)``, and ``e_a + e_b >= -104``);
3. the starting value is 0 or ``|c| >= 2**-103`` (a multiple of ``q`` too).

Every exact partial sum is then a multiple of ``q``, and so is its rounding to
binary32 (whose quantum there is either ``>= q`` or the sum is already on the
grid): every nonzero accumulator is ``>= 2**-126``, a normal, and a flushed
subnormal cannot occur.  Overflow rounds to ±inf as in the model.  A fused
multiply-add that XLA may form gives the same bits, since the products are
exact.  Where the checks fail for any configuration of a batch, the caller's
exact emulation runs instead (:func:`fa_jax._fallback.batch_all`).

This serves both carriers: float64 operands pass check 1 only where they
convert to float32 exactly, and the result converts back exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._fallback import batch_all
from fa_jax.carrier32.elementwise import scan_steps
from fa_jax.formats import FP32, Format

__all__ = ["is_binary32", "sequential_matmul"]

_LOW_BITS = np.uint32((1 << 12) - 1)  # the 12 fraction bits past a 12-bit significand
_MAX = np.float32(np.finfo(np.float32).max)
_PRODUCT_FLOOR = np.float32(2.0**-102)  # check 2: lo_a lo_b
_START_FLOOR = np.float32(2.0**-103)  # check 3


def _fields(fmt: Format) -> tuple:
    return (fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.subnormals, fmt.specials, fmt.overflow)


def is_binary32(fmt: Format) -> bool:
    """Whether ``fmt`` is, statically, IEEE binary32 (FP32, with overflow to inf)."""
    fields = _fields(fmt)
    return all(isinstance(f, (bool, int, str)) for f in fields) and fields == _fields(FP32)


def _binary32(x, *, short: bool) -> tuple[jax.Array, jax.Array]:
    """``x`` as float32, and whether all of it is that exactly, finite, free of
    subnormals and, if ``short``, of at most 12 significant bits (check 1).

    Read from the bits: XLA's CPU runtime compares a subnormal equal to zero, and
    LLVM turns a test of the bits for zero into that comparison.  The largest of
    the fraction fields of exponent field 0 and of the low fraction bits of the
    rest, a reduction, it leaves alone."""
    x32 = jax.lax.convert_element_type(x, jnp.float32)
    ok = jnp.isfinite(x32)
    if x.dtype != jnp.float32:
        ok &= jax.lax.convert_element_type(x32, x.dtype) == x
    bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    tiny = (bits << np.uint32(1)) >> np.uint32(24) == 0  # exponent field 0
    fraction = bits & np.uint32((1 << 23) - 1)
    beyond = jnp.where(tiny, fraction, bits & _LOW_BITS if short else np.uint32(0))
    return x32, jnp.all(ok) & (jnp.max(beyond) == 0)


def _magnitudes(x32) -> tuple[jax.Array, jax.Array]:
    """The smallest nonzero and the largest magnitude (inf and 0 where all are 0)."""
    mag = jnp.abs(x32)
    return jnp.min(jnp.where(mag > 0, mag, np.float32(np.inf))), jnp.max(mag)


def _on_grid(x32) -> jax.Array:
    """Whether every element is 0 or of magnitude ``>= 2**-103``: a binary32 normal
    and a multiple of ``q = 2**-126`` (check 3)."""
    return jnp.all((x32 == 0) | (jnp.abs(x32) >= _START_FLOOR))


def _products_on_grid(a32, b32) -> jax.Array:
    """Check 2 of the module docstring, over whole operands."""
    lo_a, hi_a = _magnitudes(a32)
    lo_b, hi_b = _magnitudes(b32)
    return (lo_a * lo_b >= _PRODUCT_FLOOR) & (hi_a * hi_b <= _MAX)


def sequential_matmul(a, b, start, fallback: Callable[[], jax.Array]) -> jax.Array:
    """``acc_k = fl_32(acc_{k-1} + a[..., :, k] b[..., k, :])`` from ``acc_0 = start``.

    ``a`` (..., n, K) and ``b`` (..., K, m) are carrier arrays (float32 or
    float64), ``start`` the (..., n, m) accumulator in the same dtype.  Runs on
    float32 hardware where the module docstring's checks hold for the whole
    batch, else returns ``fallback()``, the exact emulation of the same sum.
    """
    (a32, a_ok), (b32, b_ok) = _binary32(a, short=True), _binary32(b, short=True)
    c32, c_ok = _binary32(start, short=False)
    ok = a_ok & b_ok & c_ok & _products_on_grid(a32, b32) & _on_grid(c32)
    a_steps = jnp.moveaxis(a32, -1, 0)[..., :, None]  # (K, ..., n, 1)
    b_steps = jnp.moveaxis(b32, -2, 0)[..., None, :]  # (K, ..., 1, m)

    def hardware(_):
        acc = jax.lax.optimization_barrier(c32)  # XLA folds 0 + x to x (-0 for x = -0)
        acc, _ = scan_steps(lambda acc, ab: (acc + ab[0] * ab[1], None), acc, (a_steps, b_steps))
        return jax.lax.convert_element_type(acc, start.dtype)

    return jax.lax.cond(batch_all(ok), hardware, lambda _: fallback(), None)
