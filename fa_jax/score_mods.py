"""Score modifications: softcapping, an additive bias (ALiBi's too) of the scaled scores,
and attention sinks.

With S = fl_scores(fl_qk_acc(Q Kᵀ) · scale) the scores of :mod:`fa_jax.attention`,
a bias B broadcastable to (..., N, M) is stored in the policy's ``bias`` stage and
added to the scaled scores with one rounding in that stage::

    B̂ = fl_bias(B)              (once, as the inputs are rounded to ``inputs``)
    S' = fl_bias(S + B̂)         (-inf in B̂ masks the pair: S' = -inf)

``Policy.bias`` defaults to the ``scores`` format, so PyTorch's math path
(``attn_mask`` of the query dtype added to the scaled scores in that dtype) is
``torch_math`` as it stands, and a FlashAttention-2 kernel (bias added to its FP32
scores) is ``fa2_kernel``.  The bias enters the forward only: it has no gradient
(its cotangent is taken as zero).  Under ``Policy.scale == "exp2"`` the scores
are unscaled, and a bias there is refused (FlashAttention-2 divides its ALiBi
slopes by the scale instead, which is not modelled).

Softcap c > 0 (Gemma 2; FlashAttention-2's ``softcap``, applied to the scaled
scores, before the bias and the masks), in the ``scores`` stage with the policy's
``tanh_model`` (correctly rounded by default), and its backward factor::

    ĉ = fl_scores(c);  u = fl_scores(S / ĉ);  t = tanh_model(u);  S' = fl_scores(ĉ t)
    dS = fl_d_s(fl_d_stats(fl_d_stats(P ∘ (dP − D)) · fl_d_stats(1 − fl_d_stats(t²))))

ALiBi (Press et al. 2022, "Train short, test long", §3): head h of H adds
-slope_h · |i - j| with slopes 2^(-8 h / H), h = 1..H, for H a power of two;
otherwise the slopes of the nearest lower power of two 2^k followed by every
other slope of 2^(k+1) (the paper's code, ``get_slopes``).  FlashAttention-2's
``alibi_slopes`` takes the slopes and adds -slope · |i + M - N - j| (bottom-right
aligned; for N = M the same): :func:`alibi_bias` builds either, aligned as
fa_jax's causal mask by ``q_offset`` (top-left by default, |i - j|;
:mod:`fa_jax.masking`), the product taken in float64.

Attention sinks (Xiao et al. 2024, "Efficient streaming language models with
attention sinks"; a learned per-head logit, gpt-oss; llama.cpp's
``ggml_flash_attn_ext_add_sinks``): head h's logit σ_h joins every row's softmax
denominator and adds no value, P_ij = exp(S'_ij - m) / (exp(σ_h - m) + Σ_j
exp(S'_ij - m)), m the row max over the keys and σ_h.  σ̂ = fl_stats(σ) (as the
running max); the flash loops start from it (m_0 = σ̂, l_0 = 1, o_0 = 0, as vLLM's
unified attention kernel), the reference takes it as a first column of S'
(:func:`sink_start`).  σ = -inf is no sink.  Like a bias, sinks need scaled scores
(not ``scale="exp2"``) and have no gradient.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax._checks import broadcasts_to
from fa_jax.masking import check_broadcast, q_offset_of
from fa_jax.policy import Policy
from fa_jax.softmax import cast_scores

__all__ = [
    "add_bias",
    "alibi_bias",
    "alibi_slopes",
    "check_sink_values",
    "check_softcap",
    "prepare_bias",
    "prepare_sinks",
    "sink_start",
    "softcap",
    "softcap_grad_factor",
]


def check_softcap(softcap, fn: str = "attention") -> float | None:
    """``softcap`` as a float, or None; ValueError naming it unless a finite number > 0."""
    if softcap is None:
        return None
    ok = isinstance(softcap, (int, float, np.floating, np.integer)) and not isinstance(
        softcap, bool
    )
    if not ok or not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"{fn}: softcap: expected a finite number > 0, got {softcap!r}")
    return float(softcap)


def softcap(s, c: float, policy: Policy):
    """(S', t): S' = fl_scores(ĉ · t), t = tanh_model(fl_scores(S / ĉ)) (module docstring)."""
    c_hat = ops.constant(c, policy.scores, s.dtype)
    t = policy.tanh_model.fn(ops.div(s, c_hat, policy.scores), policy.scores)
    return ops.mul(c_hat, t, policy.scores), t


def softcap_grad_factor(t, policy: Policy):
    """∂S'/∂S = fl_d_stats(1 − fl_d_stats(t²)) (module docstring)."""
    return ops.sub(jnp.ones_like(t), ops.mul(t, t, policy.d_stats), policy.d_stats)


def prepare_bias(fn: str, bias, target: tuple, policy: Policy):
    """B̂ = fl_bias(B) as a carrier of the policy's, checked to broadcast to
    ``target`` (..., N, M); -inf kept (a mask); None for no bias."""
    if bias is None:
        return None
    check_broadcast(fn, "bias", bias, target)
    if policy.scale == "exp2":
        raise ValueError(
            f"{fn}: bias: expected a policy whose scores are scaled (Policy.scale "
            "'scores' or 'q'), got scale='exp2', where the scores are unscaled"
        )
    b = ops.carrier(bias, policy.carrier_dtype())
    return cast_scores(b, policy.bias)


def prepare_sinks(fn: str, sinks, lead: tuple, policy: Policy):
    """σ̂ = fl_stats(σ) broadcast to the leading dimensions ``lead`` (..., H) of Q
    (module docstring); None for no sinks.  ValueError naming them for a shape
    that does not broadcast or a ``scale="exp2"`` policy (their values:
    :func:`check_sink_values`)."""
    if sinks is None:
        return None
    if not broadcasts_to(np.shape(sinks), lead):
        raise ValueError(
            f"{fn}: sinks: expected one logit per head, an array broadcastable to Q's "
            f"leading dimensions (..., H) = {lead}, got shape {tuple(np.shape(sinks))}"
        )
    if policy.scale == "exp2":
        raise ValueError(
            f"{fn}: sinks: expected a policy whose scores are scaled (Policy.scale "
            "'scores' or 'q'), got scale='exp2', where the scores are unscaled"
        )
    s = ops.carrier(jnp.broadcast_to(jnp.asarray(sinks), lead), policy.carrier_dtype())
    return cast_scores(s, policy.stats)


def check_sink_values(sinks, fn: str = "attention") -> None:
    """ValueError naming the sinks where one is NaN or +inf (finite logits or -inf,
    no sink, expected); run on concrete values, before tracing."""
    values = np.asarray(sinks, np.float64)
    if np.isnan(values).any() or (values == np.inf).any():
        raise ValueError(f"{fn}: sinks: expected finite logits or -inf, got NaN or +inf")


def sink_start(sinks, n: int):
    """(m_0, l_0) of ``n`` query rows for the sinks σ̂ (..., H): σ̂ and 1 where the
    head has a sink, -inf and 0 (no sink) where σ̂ = -inf."""
    m0 = jnp.broadcast_to(sinks[..., None], (*sinks.shape, n))
    return m0, jnp.where(m0 > -jnp.inf, 1.0, 0.0).astype(m0.dtype)


def add_bias(s, b, policy: Policy):
    """S' = fl_bias(S + B̂); -inf where B̂ = -inf; S unchanged without a bias."""
    if b is None:
        return s
    masked = b == -jnp.inf
    return jnp.where(masked, -jnp.inf, ops.add(s, jnp.where(masked, 0.0, b), policy.bias))


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (module docstring), float64, shape (heads,)."""
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"alibi_slopes: heads: expected a positive int, got {heads!r}")

    def power_of_two(h: int) -> list[float]:
        return [2.0 ** (-8.0 * i / h) for i in range(1, h + 1)]

    k = 2 ** math.floor(math.log2(heads))
    slopes = power_of_two(k)
    if k < heads:
        slopes += power_of_two(2 * k)[0::2][: heads - k]
    return np.array(slopes, np.float64)


def alibi_bias(slopes, n: int, m: int, q_offset=None) -> np.ndarray:
    """The ALiBi bias -slope_h · |i + q_offset - j|, shape (H, n, m) for slopes (H,)
    (``q_offset`` as :func:`fa_jax.masking.q_offset_of` reads it: top-left by
    default, query i facing key i; "bottom-right" as FlashAttention-2), in
    float64: exact for slopes that are powers of two."""
    slopes = np.asarray(slopes, np.float64)
    if slopes.ndim != 1:
        raise ValueError(f"alibi_bias: slopes: expected shape (H,), got {slopes.shape}")
    p = np.arange(n)[:, None] + q_offset_of(q_offset, n, m, "alibi_bias")
    dist = np.abs(p - np.arange(m)[None, :]).astype(np.float64)
    return -slopes[:, None, None] * dist
