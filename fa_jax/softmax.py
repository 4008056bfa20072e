"""Safe (3-pass), online (2-pass) and naive softmax under a precision policy.

Notation follows Milakov & Gimelshein 2018 (arXiv 1805.02867):
x are the scores, m the running maximum, d the running sum of exponentials.
Every operation rounds through :mod:`fa_jax.ops` to the policy's format for
its stage; ``fl_s`` below means "rounded to stage s":

safe (Algorithm 3 of Milakov & Gimelshein)::

    m   = max_j x_j                                   (exact; stored in stats)
    e_j = fl_exp(exp(fl_exp(x_j - m)))                (exp: the policy's exp model)
    d   = Σ_j e_j                                     (stats, accumulation model)
    y_j = fl_p(e_j / d)

online (their Algorithm 3 with blocks B_1..B_K of ``block`` entries;
``block=1`` is the original recurrence m_j, d'_j)::

    m_k     = max(m_{k-1}, max_{j∈B_k} x_j)
    α_k     = fl_exp(exp(fl_exp(m_{k-1} - m_k)))      (0 for k = 1; 1 if m_k = m_{k-1})
    s_k     = Σ_{j∈B_k} fl_exp(exp(fl_exp(x_j - m_k)))  (stats, accumulation model)
    d_k     = fl_stats(fl_stats(d_{k-1} α_k) + s_k)
    y_j     = fl_p(fl_exp(exp(fl_exp(x_j - m_K))) / d_K)

naive: ``y_j = fl_p(fl_exp(exp(x_j)) / Σ_j fl_exp(exp(x_j)))`` — no shift, so it
overflows once ``x_j`` exceeds log(max) of the exp format.

Under ``Policy.scale == "exp2"`` (the FlashAttention-2/3 CUDA kernels' softmax,
``scale_apply_exp2`` in their ``softmax.h``) the scores x are unscaled and the
scale is folded, with log2 e, into c = fl_exp(scale · log2 e)
(:func:`exp2_factor`); every exp of x - m above becomes::

    e_j = fl_exp(2^t_j),  t_j = fl_exp(fma(x_j, c, -fl_exp(m c)))   (one FMA)
    α_k = fl_exp(2^fl_exp(fl_exp(m_{k-1} - m_k) · c))

with the policy's base-2 exp model; the functions here take ``log2_scale=c``
(scale 1 where none is given: c = fl_exp(log2 e)).

Masked entries are ``-inf`` scores; ``-inf`` is a mask, not a value, so it is
never rounded (formats without infinities would turn it into NaN).  A row
whose entries are all ``-inf`` has
m = -inf and d = 0; its output is defined as 0 (not NaN).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from fa_jax import ops
from fa_jax._checks import positive_int
from fa_jax._fusion import materialised
from fa_jax._jit import jit_config
from fa_jax.policy import Policy

__all__ = [
    "cast_scores",
    "exp2_factor",
    "naive_softmax",
    "normalise",
    "online_softmax",
    "online_update",
    "rescale_factor",
    "running_max",
    "safe_softmax",
    "shifted_exp",
]


def cast_scores(x, fmt):
    """fl_fmt(x), keeping -inf (a masked entry, not a value) as -inf.

    Rounding -inf to a format without infinities (e4m3fn, the fnuz formats)
    would give NaN; a mask must survive every format.
    """
    return jnp.where(x == -jnp.inf, -jnp.inf, ops.cast(jnp.where(x == -jnp.inf, 0.0, x), fmt))


def running_max(m, block_max, fmt):
    """fl_fmt(max(m, block_max)), exact for values of fmt; -inf while all is masked."""
    return cast_scores(jnp.maximum(m, block_max), fmt)


_LOG2E = math.log2(math.e)


def exp2_factor(scale, fmt, dtype=None):
    """c = fl_fmt(scale · log2 e), the product taken in float64 (as a kernel's host
    code computes it in double precision before storing it in FP32), as a carrier of
    ``dtype`` (default: the carrier of ``scale`` if an array, else "auto").

    A host ``scale`` (a number, or an array known at trace time) is multiplied on
    the host; a traced one in its float64 carrier.  A traced float32 ``scale`` has
    no float64 to multiply in, and raises."""
    if dtype is None:
        array = isinstance(scale, (jax.Array, np.ndarray))
        dtype = jnp.result_type(scale) if array else ops.carrier_dtype()
    if isinstance(scale, Tracer):
        if np.dtype(dtype) != np.float64:
            raise ValueError(
                "exp2_factor: expected a scale known at trace time on a float32 carrier "
                "(scale · log2 e is taken in float64, on the host), got a traced one; "
                "give the scale as a number, or use a float64 carrier"
            )
        return ops.cast(ops.carrier(scale, dtype) * _LOG2E, fmt)
    with jax.ensure_compile_time_eval():
        return ops.constant(float(np.float64(scale) * _LOG2E), fmt, dtype)


def _log2_scale(policy: Policy, log2_scale):
    if log2_scale is None:
        return exp2_factor(1.0, policy.exp, policy.carrier_dtype())
    return log2_scale


def shifted_exp(x, m, policy: Policy, *, log2_scale=None, shift_scale=None):
    """fl_exp(exp(fl_exp(x - m))); exactly 0 where x = -inf (masked), whatever m is.

    The exp is the policy's ``exp_model`` (correctly rounded by default).  Under
    ``scale == "exp2"`` it is fl_exp(2^fl_exp(fma(x, c, -fl_exp(m c')))) with
    c = ``log2_scale`` and c' = ``shift_scale`` (default c; module docstring).

    Masked entries never reach the rounding, so formats without infinities work.
    """
    masked = x == -jnp.inf
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked so far: any shift will do
    x = jnp.where(masked, m, x)
    if policy.scale == "exp2":
        c = _log2_scale(policy, log2_scale)
        shift = ops.mul(m, c if shift_scale is None else shift_scale, policy.exp)
        shifted = ops.fma(x, jnp.broadcast_to(c, x.shape), -shift, policy.exp)
    else:
        shifted = ops.sub(x, m, policy.exp)
    e = jnp.where(masked, 0.0, policy.exp_model.fn(shifted, policy.exp))
    return materialised(e)  # read by the row sum and by P: computed once


def rescale_factor(m_old, m_new, policy: Policy, *, log2_scale=None):
    """α = fl_exp(exp(fl_exp(m_old - m_new))): 0 when m_old = -inf, exactly 1 when
    unchanged; under ``scale == "exp2"``, fl_exp(2^fl_exp(fl_exp(m_old - m_new) · c))."""
    if policy.scale != "exp2":
        return shifted_exp(m_old, m_new, policy)
    masked = m_old == -jnp.inf
    m_new = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    m_old = jnp.where(masked, m_new, m_old)
    c = _log2_scale(policy, log2_scale)
    t = ops.mul(ops.sub(m_old, m_new, policy.exp), c, policy.exp)
    return jnp.where(masked, 0.0, policy.exp_model.fn(t, policy.exp))


def online_update(m, d, x_block, policy: Policy, *, axis: int = -1, log2_scale=None):
    """One step of the (blocked) online recurrence.

    Args:
      m, d: running max and sum, shape of x_block without ``axis``.
      x_block: the next block of scores.
      log2_scale: c under ``scale == "exp2"`` (module docstring).
    Returns:
      (m_new, d_new, e, α): e = shifted_exp(x_block, m_new) is returned for flash
      attention, which multiplies it into V.
    """
    m_new = running_max(m, jnp.max(x_block, axis=axis), policy.stats)
    alpha = rescale_factor(m, m_new, policy, log2_scale=log2_scale)
    e = shifted_exp(x_block, jnp.expand_dims(m_new, axis), policy, log2_scale=log2_scale)
    s = ops.sum(e, policy.stats, axis=axis, accumulation=policy.accumulation)
    d_new = ops.add(ops.mul(d, alpha, policy.stats), s, policy.stats)
    return m_new, d_new, e, alpha


def normalise(num, den, fmt, *, divisor=None):
    """fl_fmt(num / den), defined as 0 where den = 0 (fully masked rows); ``divisor``
    the format of den's values where the caller knows it (:func:`fa_jax.ops.div`)."""
    safe_den = jnp.where(den == 0, 1.0, den)
    return jnp.where(den == 0, 0.0, ops.div(num, safe_den, fmt, divisor=divisor))


def _prepare(x, policy: Policy, axis: int):
    x = cast_scores(ops.carrier(x, policy.carrier_dtype()), policy.scores)
    return jnp.moveaxis(x, axis, -1)


@jit_config("policy", "axis")
def safe_softmax(x, policy: Policy, *, axis: int = -1) -> jax.Array:
    """Three-pass softmax with max subtraction (module docstring)."""
    x = _prepare(x, policy, axis)
    m = cast_scores(jnp.max(x, axis=-1, keepdims=True), policy.stats)
    e = shifted_exp(x, m, policy)
    d = ops.sum(e, policy.stats, axis=-1, accumulation=policy.accumulation)
    return jnp.moveaxis(normalise(e, d[..., None], policy.p, divisor=policy.stats), -1, axis)


def online_softmax(x, policy: Policy, *, block: int = 1, axis: int = -1) -> jax.Array:
    """Two-pass online softmax: one pass for (m, d) in blocks of ``block``, one for y."""
    block = positive_int(block, "online_softmax: block")
    return _online_softmax(x, policy=policy, block=block, axis=axis)


@jit_config("policy", "block", "axis")
def _online_softmax(x, *, policy: Policy, block: int, axis: int) -> jax.Array:
    x = _prepare(x, policy, axis)
    n = x.shape[-1]
    pad = -n % block
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    blocks = jnp.moveaxis(padded.reshape(*x.shape[:-1], (n + pad) // block, block), -2, 0)

    def step(carry, x_block):
        m, d = carry
        m, d, _, _ = online_update(m, d, x_block, policy)
        return (m, d), None

    init = (jnp.full(x.shape[:-1], -jnp.inf, x.dtype), jnp.zeros(x.shape[:-1], x.dtype))
    (m, d), _ = jax.lax.scan(step, init, blocks)
    e = shifted_exp(x, m[..., None], policy)
    return jnp.moveaxis(normalise(e, d[..., None], policy.p, divisor=policy.stats), -1, axis)


@jit_config("policy", "axis")
def naive_softmax(x, policy: Policy, *, axis: int = -1) -> jax.Array:
    """Softmax without max subtraction; shows overflow (module docstring)."""
    x = _prepare(x, policy, axis)
    if policy.scale == "exp2":
        scaled = ops.mul(jnp.where(x == -jnp.inf, 0.0, x), _log2_scale(policy, None), policy.exp)
        x = jnp.where(x == -jnp.inf, -jnp.inf, scaled)
    e = policy.exp_model.fn(x, policy.exp)
    d = ops.sum(e, policy.stats, axis=-1, accumulation=policy.accumulation)
    return jnp.moveaxis(normalise(e, d[..., None], policy.p, divisor=policy.stats), -1, axis)
