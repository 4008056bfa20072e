"""Plain float64 attention with every feature, the formula the golden policy must meet.

``plain_attention(q, k, v, ...)`` is written with jnp, so jax.grad differentiates it
(float64 autodiff: the golden backward's reference) and numpy arrays go in: K and V
repeated over each group of H / H_kv query heads (jnp.repeat), S = c tanh(Q Kᵀ ·
scale / c) with a softcap c (else Q Kᵀ · scale), plus the bias; the kept pairs
those of every mask (causal j <= i, i < q_len, j < kv_len, i - left <= j <= i +
right with -1 unbounded, the boolean mask); softmax over the kept keys and a
head's sink logit σ_h (in the denominator only); a row keeping no key gives O = 0
and lse = -inf (σ_h with a sink).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["plain_attention"]


def plain_attention(
    q,
    k,
    v,
    *,
    causal=False,
    q_lengths=None,
    kv_lengths=None,
    scale=None,
    bias=None,
    mask=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """(O, lse) of float64 attention in plain jnp (module docstring)."""
    groups = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
    n, m = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...id,...jd->...ij", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    i, j = jnp.arange(n)[:, None], jnp.arange(m)[None, :]
    keep = jnp.ones(s.shape, bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    if q_lengths is not None:
        keep &= i < jnp.asarray(q_lengths)[..., None, None]
    if kv_lengths is not None:
        keep &= j < jnp.asarray(kv_lengths)[..., None, None]
    if mask is not None:
        keep &= mask
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(keep, s, -jnp.inf), -1, keepdims=True))
    sink = None if sinks is None else jnp.broadcast_to(sinks, q.shape[:-2])[..., None, None]
    if sink is not None:
        shift = jnp.maximum(shift, sink)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    e = jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - shift), 0.0)
    l = jnp.sum(e, -1, keepdims=True)
    if sink is not None:
        l = l + jnp.exp(sink - shift)
    live = l > 0
    l = jnp.where(live, l, 1.0)
    o = jnp.einsum("...ij,...jd->...id", e / l, v, precision=jax.lax.Precision.HIGHEST)
    return o, jnp.where(live[..., 0], (shift + jnp.log(l))[..., 0], -jnp.inf)
