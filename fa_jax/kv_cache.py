"""Narrow KV caches: K and V stored in FP8 or int8 with scales, dequantized when read.

A serving engine stores K and V in a narrow format and the attention kernel
multiplies each value it reads by a descale factor: vLLM's FP8 KV cache
(``kv_cache_dtype="fp8"``) keeps ``k_scale``, ``v_scale`` per tensor (shape
[1]) or per attention head ([num_kv_heads]), all 1.0 without calibration
(vLLM docs, "Quantized KV Cache"); FlashAttention-3's FP8 forward takes
``descale_k``, ``descale_v`` of shape (batch, nheads_k) (Shah et al. 2024,
arXiv 2407.08608, ``flash_attn_interface``).  Finer, per-token scales are what
KIVI (Liu et al. 2024, arXiv 2402.02750) and KVQuant (Hooper et al. 2024,
arXiv 2401.18079) give V; both quantize K per channel, KIVI with zero points,
which this module does not model: its scales are symmetric.

Policy fields (:mod:`fa_jax.policy`): ``kv``, the cache format (a Format, or
``"int8"``: :data:`fa_jax.quantization.INT8`), and ``kv_scaling``.  From K, V
rounded to ``inputs`` (x below is one of them, shaped (..., H_kv, M, c)), with
:mod:`fa_jax.quantization`'s amax scaling in FP32::

    amax = max |x| over the scaling group's entries
    s    = fl_FP32(amax / kv.max)              (1 where that is 0)
    x̂    = fl_kv(fl_FP32(x / s))               the cache's codes
    x'   = fl_inputs(x̂ · s)                    what attention reads

``kv_scaling`` picks the groups: ``"tensor"`` one s for the whole array (vLLM's
per-tensor ``k_scale``), ``"head"`` one per K/V head, over every leading index,
key and column (vLLM's per-head [num_kv_heads]; per (batch, head) as
FlashAttention-3's descale: ``jax.vmap`` over the batch), ``"token"`` one per
key row over its c columns, and ``"none"`` s = 1, a plain cast x' =
fl_inputs(fl_kv(x)) (vLLM's uncalibrated default; a value past kv.max becomes
what ``kv.overflow`` says).  An int8 cache rounds x / s to the nearest integer,
ties to even, clamped to ±127, and needs a scaling other than "none".

With key lengths (``kv_lengths``) the amax of "tensor" and "head" reads only the
keys j < kv_len (the largest length of a K/V head's group of query heads under
grouped-query attention): padding past them never sets a scale.  Scales are
computed per K/V head, before K and V are repeated over their group's query
heads (:mod:`fa_jax.heads`).

``kv=None`` (the default) is no cache: K and V are read as ``inputs`` stores them,
bit for bit as without this module.

Where it happens.  A kernel dequantizes each K_j, V_j block as its loop loads
it.  Dequantization is elementwise, x'_ij depends on x̂_ij and its group's s
only, so dequantizing every block as read gives the same bits as dequantizing
K and V once before the loop, which is what the emulation does (in
:mod:`fa_jax.attention`'s input preparation, for the reference, every flash
variant and the kernel loops alike); the backward reads the same K', V'.

Gradients pass straight through the cache: dK and dV are the gradients with
respect to K', V' (as the rounding to ``inputs`` passes them), i.e.
∂x'/∂x = 1 — the straight-through estimator of quantization-aware training.

Zeros and non-finite values.  An all-zero group (a zero head, a zero token) has
s = 1 and codes 0: no NaN.  A group holding inf or NaN has a NaN scale, so every
x' of that group is NaN: the result is NaN, never silently finite (keys past
``kv_lengths`` aside, which attention masks).  :func:`quantize_kv` given a
concrete array with inf or NaN raises ValueError.

Everything is ``jax.jit``/``jax.vmap`` compatible and runs in the policy's
carrier (float64, or float32: the same bits); a scaled cache needs a concrete kv.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops, quantization
from fa_jax._checks import one_of
from fa_jax.policy import KV_SCALINGS, Policy
from fa_jax.quantization import IntFormat

__all__ = ["dequantize_kv", "kv_scales", "quantize_kv", "read_kv", "scales_span_batch"]


def _axes(ndim: int, scaling: str, fn: str, shape) -> tuple[int, ...]:
    """The axes one scale spans: all; all but the heads axis (-3); the columns."""
    if scaling == "tensor":
        return tuple(range(ndim))
    if scaling == "token":
        return (ndim - 1,)
    if ndim < 3:
        raise ValueError(
            f"{fn}: kv_scaling='head' needs K, V shaped (..., H_kv, M, c) with a heads "
            f"axis, got shape {tuple(shape)}"
        )
    return tuple(a for a in range(ndim) if a != ndim - 3)


def scales_span_batch(scaling: str) -> bool:
    """Whether one scale of ``scaling`` is taken over every leading (batch) index of
    K or V (:func:`_axes`): "tensor" and "head", not "token" or "none"."""
    one_of(scaling, KV_SCALINGS, "scales_span_batch: scaling")
    return scaling != "none" and 0 in _axes(4, scaling, "scales_span_batch", (1, 1, 1, 1))


def _kept(x, kv_lengths, groups: int):
    """|x| with the keys at or past their length zeroed (they set no scale); the
    length of a K/V head is the largest of its ``groups`` query heads'."""
    a = jnp.abs(x)
    if kv_lengths is None:
        return a
    lead = x.shape[:-2]
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    if groups > 1:
        q_lead = (*lead[:-1], lead[-1] * groups)
        lengths = jnp.max(jnp.broadcast_to(lengths, q_lead).reshape(*lead, groups), axis=-1)
    lengths = jnp.broadcast_to(lengths, lead)[..., None, None]
    j = jnp.arange(x.shape[-2], dtype=jnp.int32)[:, None]
    return jnp.where(j < lengths, a, 0.0)


def kv_scales(x, fmt, scaling: str, *, kv_lengths=None, groups: int = 1) -> jax.Array:
    """The FP32 amax scales s of K or V (..., H_kv, M, c) for ``fmt`` (module
    docstring), in x's carrier, shaped to broadcast against x: () per tensor,
    (1, .., 1, H_kv, 1, 1) per head, (..., M, 1) per token; 1 for "none"."""
    one_of(scaling, KV_SCALINGS, "kv_scales: scaling")
    x = jnp.asarray(x)
    if scaling == "none":
        return jnp.ones((), x.dtype)
    axes = _axes(x.ndim, scaling, "kv_scales", x.shape)
    a = _kept(x, kv_lengths, groups) if scaling != "token" else jnp.abs(x)
    amax = jnp.max(a, axis=axes, keepdims=scaling != "tensor")
    return quantization.amax_scale(amax, fmt, dtype=x.dtype)


def quantize_kv(x, fmt, scaling: str, *, kv_lengths=None, groups: int = 1):
    """(x̂, s): the cache's codes of K or V (values of ``fmt``) and their scales
    (:func:`kv_scales`), in a float32 carrier for float32 x, else float64.  A
    concrete x with inf or NaN raises ValueError."""
    fmt = quantization.storage_format(fmt)
    one_of(scaling, KV_SCALINGS, "quantize_kv: scaling")
    if scaling == "none" and isinstance(fmt, IntFormat):
        raise ValueError(
            f"quantize_kv: an integer cache ({fmt.name}) needs scales: expected scaling "
            f"in {KV_SCALINGS[1:]}, got 'none'"
        )
    dtype = np.float32 if jnp.result_type(x) == np.float32 else np.float64
    x = quantization.finite_input(x, "quantize_kv", dtype)
    s = kv_scales(x, fmt, scaling, kv_lengths=kv_lengths, groups=groups)
    return _codes(x, s, fmt, scaling), s


def _codes(x, s, fmt, scaling: str):
    """x̂ = fl_kv(fl_FP32(x / s)), or fl_kv(x) unscaled ("none")."""
    if scaling == "none":
        return ops.cast(x, fmt)
    return quantization.quantize(x, s, fmt, dtype=x.dtype)


def dequantize_kv(x_hat, s, fmt) -> jax.Array:
    """x' = fl_fmt(x̂ · s), correctly rounded in x̂'s carrier (``fmt``: the inputs stage)."""
    return ops.mul(x_hat, jnp.asarray(s, jnp.asarray(x_hat).dtype), fmt)


def read_kv(k, v, policy: Policy, *, kv_lengths=None, groups: int = 1):
    """K', V': K and V (rounded to ``policy.inputs``, carrier arrays (..., H_kv, M, c))
    as attention reads them from ``policy``'s cache (module docstring); unchanged
    without one (``policy.kv`` None)."""
    kv = policy.kv
    if kv is None:
        return k, v
    if policy.kv_scaling != "none" and not kv.is_concrete:
        raise TypeError(
            f"Policy.kv: kv_scaling={policy.kv_scaling!r} needs a concrete kv format (its "
            f"max sets the scales), got traced widths in {kv!r}"
        )
    out = []
    for t in (k, v):
        s = kv_scales(t, kv, policy.kv_scaling, kv_lengths=kv_lengths, groups=groups)
        out.append(dequantize_kv(_codes(t, s, kv, policy.kv_scaling), s, policy.inputs))
    return out[0], out[1]
