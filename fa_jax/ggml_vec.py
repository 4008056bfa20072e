"""ggml's CPU vector routines on x86-64 with AVX-512, step by step in :mod:`fa_jax.ops`.

Each function rounds as the compiled routine of ggml 0.25.3 (``ggml/src/ggml-cpu``,
vendored by llama-cpp-python 0.3.36; built with ``-march=native -O3 -std=gnu++17``,
so GCC contracts ``a*b + c`` into one FMA) rounds, for ``GGML_F32_EPR = 16`` lanes
and ``GGML_F32_STEP = 64`` (``simd-mappings.h``).  Values are FP32 (or FP16) values
held in float64 carriers; the last axis is the vector.

* :func:`dot_f32` -- ``ggml_vec_dot_f32`` (``vec.cpp``): 4 accumulators of 16 lanes,
  one FMA per 64-element step, ``GGML_F32x16_REDUCE`` (acc0+acc2, acc1+acc3, then
  their sum, then GCC's ``_mm512_reduce_add_ps``: halves of 8, of 4, then
  (l0+l2)+(l1+l3)), and the leftovers ``sumf += x*y`` product and sum rounded apart
  (not contracted: found by experiment, d = 80).
* :func:`dot_f16` -- ``ggml_vec_dot_f16``: the same on FP16 inputs widened to FP32,
  then the leftovers' exact products added in double and the result rounded to FP32.
* :func:`dot_bf16` -- ``ggml_vec_dot_bf16`` with AVX512-BF16: per 64 elements two
  ``vdpbf16ps`` on accumulators c1 (elements 0..31) and c2 (32..63), lane j adding
  the products of elements 2j+1 then 2j, each addition rounded to FP32 (the Intel SDM's
  order; products of BF16 values are exact); ``_mm512_reduce_add_ps`` of c1 then of c2
  added in double, the leftovers' exact products in double, rounded to FP32.
* :func:`reduce_add_16` -- ``_mm512_reduce_add_ps`` (GCC's ``avx512fintrin.h``).
* :func:`v_expf` -- ``ggml_v_expf(__m512)`` (``vec.h``): ARM's optimized-routines
  exp, ``z = fma(x, log2 e, 0x1.8p23)``, ``n = z - 0x1.8p23``, ``b = x - n·ln2_hi -
  n·ln2_lo`` (two FMAs), a degree-5 polynomial in ``b`` and ``b²``, ``scalef(j, n)``;
  0 or inf where ``|n| > 192``.
* :func:`hsum_float_8` -- ``hsum_float_8`` (``arch/x86/quants.c``): halves of 4,
  then (l0+l2)+(l1+l3).
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops
from fa_jax.formats import FP32, get_format

__all__ = ["dot_bf16", "dot_f16", "dot_f32", "hsum_float_8", "reduce_add_16", "v_expf"]

FP64 = get_format("fp64")


def _tree(x, width: int):
    """Halve the last axis (``width`` lanes) as the x86 horizontal reductions do: lanes
    i and i + width/2 summed, down to 2 lanes, then l0 + l1."""
    while width > 2:
        half = width // 2
        x = ops.add(x[..., half:width], x[..., :half], FP32)
        width = half
    return ops.add(x[..., 0], x[..., 1], FP32)


def reduce_add_16(x):
    """``_mm512_reduce_add_ps`` of the 16 lanes on the last axis."""
    return _tree(x, 16)


def hsum_float_8(x):
    """``hsum_float_8`` of the 8 lanes on the last axis."""
    return _tree(x, 8)


def _vector_part(x, y):
    """The 64-element steps of ``ggml_vec_dot_f32``/``_f16`` and their reduction; returns
    the FP32 sum and the number of elements used."""
    n = x.shape[-1]
    np_ = n - n % 64
    lead = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = jnp.zeros((*lead, 4, 16), jnp.float64)
    for i in range(0, np_, 64):
        xb = x[..., i : i + 64].reshape(*x.shape[:-1], 4, 16)
        yb = y[..., i : i + 64].reshape(*y.shape[:-1], 4, 16)
        acc = ops.fma(xb, yb, acc, FP32)
    a0 = ops.add(acc[..., 0, :], acc[..., 2, :], FP32)
    a1 = ops.add(acc[..., 1, :], acc[..., 3, :], FP32)
    return reduce_add_16(ops.add(a0, a1, FP32)), np_


def dot_f32(x, y):
    """``ggml_vec_dot_f32`` of FP32 vectors on the last axis (broadcast)."""
    s, np_ = _vector_part(x, y)
    for i in range(np_, x.shape[-1]):
        s = ops.add(s, ops.mul(x[..., i], y[..., i], FP32), FP32)
    return s


def dot_f16(x, y):
    """``ggml_vec_dot_f16`` of FP16 vectors on the last axis (broadcast)."""
    s, np_ = _vector_part(x, y)
    if np_ < x.shape[-1]:
        # double sumf += (double)(x*y): the FP16 products are exact in FP32 and the
        # double additions plain float64 arithmetic
        for i in range(np_, x.shape[-1]):
            s = ops.add(s, ops.mul(x[..., i], y[..., i], FP64), FP64)
        s = ops.cast(s, FP32)
    return s


def dot_bf16(x, y):
    """``ggml_vec_dot_bf16`` (AVX512-BF16) of BF16 vectors on the last axis (broadcast)."""
    n = x.shape[-1]
    np_ = n - n % 64
    lead = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = jnp.zeros((*lead, 2, 16), jnp.float64)
    for i in range(0, np_, 64):
        xb = x[..., i : i + 64].reshape(*x.shape[:-1], 2, 16, 2)
        yb = y[..., i : i + 64].reshape(*y.shape[:-1], 2, 16, 2)
        acc = ops.fma(xb[..., 1], yb[..., 1], acc, FP32)
        acc = ops.fma(xb[..., 0], yb[..., 0], acc, FP32)
    s = ops.add(reduce_add_16(acc[..., 0, :]), reduce_add_16(acc[..., 1, :]), FP64)
    for i in range(np_, n):
        s = ops.add(s, ops.mul(x[..., i], y[..., i], FP64), FP64)
    return ops.cast(s, FP32)


_LOG2E = float.fromhex("0x1.715476p+0")
_SHIFT = float.fromhex("0x1.8p23")
_LN2_HI = float.fromhex("0x1.62e4p-1")
_LN2_LO = float.fromhex("0x1.7f7d1cp-20")
_C = tuple(
    float.fromhex(h)
    for h in ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7")
)


def v_expf(x):
    """``ggml_v_expf`` (AVX-512) of FP32 values ``x``, as FP32 values."""
    c = lambda value: jnp.full_like(x, value)  # noqa: E731
    z = ops.fma(x, c(_LOG2E), c(_SHIFT), FP32)
    n = ops.sub(z, c(_SHIFT), FP32)
    b = ops.fma(-n, c(_LN2_LO), ops.fma(-n, c(_LN2_HI), x, FP32), FP32)
    u = ops.mul(b, b, FP32)
    j = ops.fma(
        ops.fma(
            ops.fma(c(_C[4]), b, c(_C[3]), FP32), u, ops.fma(c(_C[2]), b, c(_C[1]), FP32), FP32
        ),
        u,
        ops.fma(c(_C[0]), b, c(1.0), FP32),
        FP32,
    )
    # scalef(j, n) = j · 2^n rounded once (n is an integer here; |n| <= 192)
    safe_n = jnp.where(jnp.abs(n) > 192, 0.0, n)
    res = ops.cast(jnp.ldexp(j, safe_n.astype(jnp.int32)), FP32)
    alt = jnp.where(n <= 0, 0.0, jnp.inf)
    return jnp.where(jnp.abs(n) > 192, alt, res)
