"""XLA CPU's own float32 exp, bit for bit (:func:`xla_cpu_exp`), registered as the
exp model ``"xla_cpu"`` (:data:`XLA_CPU_EXP`).

XLA's CPU backend emits ``exponential`` outside YNNPACK fusions (eager fp16, small
shapes) as its own Cephes-style polynomial with FMAs (LLVM IR from XLA's
CPU intrinsics, openxla/xla ``xla/codegen/intrinsic/``), results below FLT_MIN
flushed to zero.  Inside a YNNPACK fusion the exp is YNNPACK's ``simd::exp``
(:func:`fa_jax.exponential.ynnpack_exp`); the two differ by an ulp on a few
percent of inputs.  Which one a program runs is read from its HLO
(:func:`fa_jax.kernels.xla.hlo.in_ynn_fusions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.exponential import ExpModel, register_exp_model
from fa_jax.formats import FP32, Format

__all__ = ["XLA_CPU_EXP", "xla_cpu_exp", "xla_cpu_exp_model"]


_F32_TINY = float(np.finfo(np.float32).tiny)


_LOG2E = 1.44269504088896341
_C1, _C2 = 0.693359375, -2.12194440e-4  # ln 2 = C1 + C2 (Cody & Waite)
_CEPHES = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
_HALF_COEFF = 5.0000001201e-1


def _f32(v: float) -> float:
    return float(np.float32(v))


def xla_cpu_exp(x: jax.Array) -> jax.Array:
    """XLA CPU's float32 exp of float32 values ``x`` (float64 carriers), bit for bit.

    x clamped to [-104, 88.8]; n = floor(fma(x, log2 e, 1/2)) clamped to
    [-127, 127]; a = fma(-C2, n, fma(-C1, n, x)); z = 1 + fma(p(a), a², a) with
    the Cephes polynomial p evaluated by FMAs (Horner); the result z · 2^n, and
    0 where it falls below FLT_MIN (flushed to zero).
    """
    x = jnp.clip(x, -104.0, 88.8)
    n = jnp.floor(ops.fma(x, _f32(_LOG2E), 0.5, FP32))
    n = jnp.clip(n, -127.0, 127.0)
    a = ops.fma(-_f32(_C1), n, x, FP32)
    a = ops.fma(-_f32(_C2), n, a, FP32)
    z = ops.fma(a, _f32(_CEPHES[0]), _f32(_CEPHES[1]), FP32)
    for c in (*_CEPHES[2:], _HALF_COEFF):
        z = ops.fma(z, a, _f32(c), FP32)
    z = ops.fma(z, ops.mul(a, a, FP32), a, FP32)
    z = ops.add(1.0, z, FP32)
    out = jnp.ldexp(z, n.astype(jnp.int32))  # exact in float64
    return jnp.where(out < _F32_TINY, 0.0, out)


def _xla_cpu_exp(x, fmt: Format) -> jax.Array:
    return ops.cast(xla_cpu_exp(x), fmt)


XLA_CPU_EXP = ExpModel("xla_cpu", _xla_cpu_exp)
register_exp_model(XLA_CPU_EXP)


def xla_cpu_exp_model() -> ExpModel:
    """:func:`xla_cpu_exp` as a :class:`fa_jax.exponential.ExpModel` ("xla_cpu")."""
    return XLA_CPU_EXP
