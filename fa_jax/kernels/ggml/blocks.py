"""ggml's Q8_0 and Q4_0 blocks: 32 values on the last axis share one FP16 scale ``d``.

ggml 0.25.3 (vendored by llama-cpp-python 0.3.36) quantizes stored tensors with the
reference routines (``ggml/src/ggml-quants.c``) and the query of its CPU flash
attention with the x86 routine (``ggml/src/ggml-cpu/arch/x86/quants.c``):

* :func:`quantize_ref` ``"q8_0"`` (``quantize_row_q8_0_ref``, ggml-quants.c:276):
  ``amax = max |x|``, ``d = fl32(amax / 127)``, ``id = fl32(1 / d)`` (0 where d = 0),
  ``q = roundf(fl32(x · id))`` (half away from zero), scale stored as ``fp16(d)``.
* :func:`quantize_ref` ``"q4_0"`` (``quantize_row_q4_0_ref``, ggml-quants.c:113): ``max``
  the signed value of largest magnitude (the first one), ``d = fl32(max / -8)``, ``id =
  fl32(1 / d)``, ``q = min(15, trunc(fl32(fl32(x · id) + 8.5))) - 8``, scale ``fp16(d)``.
* :func:`quantize_q8_0_x86` (``quantize_row_q8_0``, arch/x86/quants.c:302): ``d =
  fl32(amax / 127)`` stored as ``fp16(d)``, ``id = fl32(127 / amax)``, ``q =
  rint(fl32(x · id))`` (half to even, ``_mm256_round_ps``).
* :func:`dot` -- ``ggml_vec_dot_q8_0_q8_0`` / ``ggml_vec_dot_q4_0_q8_0`` (AVX2 code,
  arch/x86/quants.c:1308, :701): per block the exact integer sums of 4 consecutive
  products in 8 lanes, ``acc = fma(fl32(d_x · d_y), sum, acc)`` block after block, then
  ``hsum_float_8``.

A value is ``q · d`` (exact in FP32): :func:`dequantize`.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops
from fa_jax._checks import one_of
from fa_jax.formats import FP32, get_format
from fa_jax.kernels.ggml.vec import hsum_float_8

__all__ = ["QK", "dequantize", "dot", "quantize_q8_0_x86", "quantize_ref"]

QK = 32  # QK8_0 = QK4_0
FP16 = get_format("fp16")


def _blocks(x):
    x = jnp.asarray(x, jnp.float64)
    if x.shape[-1] % QK:
        raise ValueError(
            f"ggml blocks: expected a last axis that is a multiple of {QK}, got shape {x.shape}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _div(a, b):
    return ops.div(jnp.broadcast_to(jnp.asarray(a, jnp.float64), jnp.shape(b)), b, FP32)


def quantize_ref(x, kind: str):
    """ggml's reference quantization of ``x`` (FP32 values) to ``kind`` (``q8_0`` or
    ``q4_0``): integer values (..., n/32, 32) and FP16 scales (..., n/32, 1)."""
    one_of(kind, ("q8_0", "q4_0"), "quantize_ref: kind")
    xb = _blocks(x)
    if kind == "q8_0":
        amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
        d = _div(amax, jnp.full_like(amax, 127.0))
    else:
        first = jnp.argmax(jnp.abs(xb), axis=-1)[..., None]
        big = jnp.take_along_axis(xb, first, axis=-1)
        d = _div(big, jnp.full_like(big, -8.0))
    safe = jnp.where(d == 0, 1.0, d)
    inv = jnp.where(d == 0, 0.0, _div(1.0, safe))
    y = ops.mul(xb, inv, FP32)
    if kind == "q8_0":
        q = jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5)  # roundf; y + 0.5 exact in double
    else:
        q = jnp.minimum(15.0, jnp.trunc(ops.add(y, jnp.full_like(y, 8.5), FP32))) - 8.0
    return q, ops.cast(d, FP16)


def quantize_q8_0_x86(x):
    """The x86 ``quantize_row_q8_0`` of ``x`` (the query): values and FP16 scales."""
    xb = _blocks(x)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)
    d = _div(amax, jnp.full_like(amax, 127.0))
    safe = jnp.where(amax == 0, 1.0, amax)
    inv = jnp.where(amax == 0, 0.0, _div(127.0, safe))
    q = jnp.clip(jnp.round(ops.mul(xb, inv, FP32)), -128.0, 127.0)
    return q, ops.cast(d, FP16)


def dequantize(q, d, kind: str = "q8_0"):
    """Block values ``q · d`` flattened back to the last axis (exact in FP32)."""
    one_of(kind, ("q8_0", "q4_0"), "dequantize: kind")
    x = q * d
    return x.reshape(*x.shape[:-2], -1)


def dot(q, k, kind: str):
    """K·q of a query ``q`` (R, D) FP32 and keys ``k`` (R, M, D) stored as ``kind``: the
    query quantized to Q8_0 by the x86 routine, then ``vec_dot`` (module docstring)."""
    one_of(kind, ("q8_0", "q4_0"), "ggml_blocks.dot: kind")
    qq, qd = quantize_q8_0_x86(q)  # (R, nb, 32), (R, nb, 1)
    kq, kd = quantize_ref(k, kind)  # (R, M, nb, 32), (R, M, nb, 1)
    lanes = (kq * qq[:, None]).reshape(*kq.shape[:-1], 8, 4).sum(-1)  # exact integers
    scale = ops.mul(kd, qd[:, None], FP32)  # (R, M, nb, 1)
    acc = jnp.zeros((*lanes.shape[:-2], 8))
    for b in range(lanes.shape[-2]):
        acc = ops.fma(scale[..., b, :], lanes[..., b, :], acc, FP32)
    return hsum_float_8(acc)
