"""glibc's scalar ``tanhf`` (``std::tanh(float)``) as it rounds, step by step.

ONNX Runtime's softcap (``MlasComputeSoftcap<float>``, ``core/mlas/lib/tanh.cpp``)
calls ``std::tanh`` on each score, so its result is the C library's ``tanhf``.
Up to glibc 2.40 that is the fdlibm code (``sysdeps/ieee754/flt-32/s_tanhf.c``,
``s_expm1f.c``; from 2.41 CORE-MATH's correctly rounded ``tanhf`` replaces it),
compiled for the x86-64 baseline (SSE, no FMA: glibc has no FMA variant of
either), so every ``*``, ``+``, ``-``, ``/`` rounds once to FP32::

    tanhf(x), a = |x|:   a < 2^-55: x;   a >= 22: ±1;
        a >= 1:  t = expm1f(2a),   z = 1 - 2 / (t + 2)
        else:    t = expm1f(-2a),  z = -t / (t + 2)          (sign of x on z)

    expm1f(x):  k = 0 for |x| <= ln2 / 2; ±1 below 1.5 ln2 (hi = x ∓ ln2_hi,
        lo = ±ln2_lo); else k = trunc(x / ln2 ± 1/2) (``invln2 * x ± 0.5``),
        hi = x - k ln2_hi, lo = k ln2_lo; x = hi - lo, c = (hi - x) - lo;
        hfx = x / 2, hxs = x hfx, r1 = 1 + hxs (Q1 + hxs (Q2 + … hxs Q5)),
        t = 3 - r1 hfx, e = hxs ((r1 - t) / (6 - x t)), then per k (fdlibm's
        reconstruction: x - (x e - hxs) for k = 0, and so on).

:func:`tanhf` computes this on FP32 values in float64 carriers (:mod:`fa_jax.ops`),
every branch at once and the right one picked per element, so it jits and vmaps.
:data:`GLIBC_TANHF` is it as a :class:`~fa_jax.tanh_models.TanhModel`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.exponential import exact_pow2
from fa_jax.formats import FP32
from fa_jax.tanh_models import TanhModel, register_tanh_model

__all__ = ["GLIBC_TANHF", "expm1f", "tanhf"]


def _f32_bits(bits: int) -> float:
    return float(np.array(bits, np.uint32).view(np.float32))


# s_expm1f.c's constants.
_LN2_HI = _f32_bits(0x3F317180)
_LN2_LO = _f32_bits(0x3717F7D1)
_INVLN2 = _f32_bits(0x3FB8AA3B)
_Q = tuple(_f32_bits(b) for b in (0xBD088889, 0x3AD00D01, 0xB8A670CD, 0x36867E54, 0xB457EDBB))
_HALF_LN2 = _f32_bits(0x3EB17218)  # |x| > this: argument reduction
_THREE_HALVES_LN2 = _f32_bits(0x3F851592)  # |x| < this: k = ±1
_TINY = _f32_bits(0x33000000)  # 2^-25: expm1f(x) = x below
_BIG_NEGATIVE = _f32_bits(0x4195B844)  # 27 ln2: expm1f(x) = -1 below -this


def _add(a, b):
    return ops.add(a, b, FP32)


def _sub(a, b):
    return ops.sub(a, b, FP32)


def _mul(a, b):
    return ops.mul(a, b, FP32)


def _div(a, b):
    return ops.div(a, b, FP32)


def _c(x, value: float):
    return jnp.full_like(x, value)


def expm1f(x):
    """glibc's fdlibm ``expm1f`` of FP32 values ``x`` (module docstring), for x
    below its overflow threshold (88.72...; tanhf calls it on [-2, 44))."""
    a = jnp.abs(x)
    negative = x < 0
    # Argument reduction (|x| > ln2 / 2).
    near = a < _THREE_HALVES_LN2
    k_near = jnp.where(negative, -1.0, 1.0)
    k_far = jnp.trunc(_add(_mul(_c(x, _INVLN2), x), jnp.where(negative, -0.5, 0.5)))
    k = jnp.where(a > _HALF_LN2, jnp.where(near, k_near, k_far), 0.0)
    hi = jnp.where(near, _sub(x, k * _LN2_HI), _sub(x, _mul(k, _c(x, _LN2_HI))))
    lo = jnp.where(near, k * _LN2_LO, _mul(k, _c(x, _LN2_LO)))
    reduced = _sub(hi, lo)
    c = jnp.where(k != 0, _sub(_sub(hi, reduced), lo), 0.0)
    x = jnp.where(k != 0, reduced, x)
    # x is now in the primary range.
    hfx = _mul(_c(x, 0.5), x)
    hxs = _mul(x, hfx)
    r = _c(x, _Q[4])
    for q in _Q[3::-1]:
        r = _add(_c(x, q), _mul(hxs, r))
    r1 = _add(_c(x, 1.0), _mul(hxs, r))
    t = _sub(_c(x, 3.0), _mul(r1, hfx))
    e = _mul(hxs, _div(_sub(r1, t), _sub(_c(x, 6.0), _mul(x, t))))
    k0 = _sub(x, _sub(_mul(x, e), hxs))
    e = _sub(_sub(_mul(x, _sub(e, c)), c), hxs)
    k_minus1 = _sub(_mul(_c(x, 0.5), _sub(x, e)), _c(x, 0.5))
    k_plus1 = jnp.where(
        x < -0.25,
        _mul(_c(x, -2.0), _sub(e, _add(x, _c(x, 0.5)))),
        _add(_c(x, 1.0), _mul(_c(x, 2.0), _sub(x, e))),
    )
    scale, unscale = exact_pow2(k), exact_pow2(-k)  # adding k to y's exponent: exact (|k| <= 64)
    wide = _sub(_mul(_sub(_c(x, 1.0), _sub(e, x)), scale), _c(x, 1.0))  # k <= -2 or k > 56
    mid = _mul(_sub(_sub(_c(x, 1.0), unscale), _sub(e, x)), scale)  # 2 <= k < 23: t = 1 - 2^-k
    high = _mul(_add(_sub(x, _add(e, unscale)), _c(x, 1.0)), scale)  # 23 <= k <= 56: t = 2^-k
    out = jnp.where(
        k == 0,
        k0,
        jnp.where(
            k == -1,
            k_minus1,
            jnp.where(
                k == 1,
                k_plus1,
                jnp.where((k <= -2) | (k > 56), wide, jnp.where(k < 23, mid, high)),
            ),
        ),
    )
    out = jnp.where(a < _TINY, x, out)
    return jnp.where(negative & (a >= _BIG_NEGATIVE), -1.0, out)


def tanhf(x):
    """glibc's fdlibm ``tanhf`` of FP32 values ``x`` (module docstring); NaN stays NaN."""
    a = jnp.abs(x)
    big = a >= 1.0
    t = expm1f(jnp.where(big, 2.0 * a, -2.0 * a))  # 2|x| is exact
    two = _c(x, 2.0)
    z = jnp.where(
        big,
        _sub(_c(x, 1.0), _div(two, _add(t, two))),
        _div(-t, _add(t, two)),
    )
    z = jnp.where(a >= 22.0, 1.0, z)
    z = jnp.where(x < 0, -z, z)
    return jnp.where((a < 2.0**-55) | jnp.isnan(x), x, z)


def _glibc_tanhf(x, fmt):
    return ops.cast(tanhf(ops.cast(x, FP32)), fmt)


GLIBC_TANHF = TanhModel("glibc_tanhf", _glibc_tanhf)
register_tanh_model(GLIBC_TANHF)
