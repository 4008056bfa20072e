"""The backward pass of attention under a precision policy.

Given the cotangents of attention's outputs, dO (..., N, d_v) and dL (..., N)
of the log-sum-exp L, these return dQ, dK and dV.  Every step rounds through
:mod:`fa_jax.ops` to a stage of the policy (:mod:`fa_jax.policy`); ``fl_s``
means "rounded to stage s", and every product and sum follows
``policy.accumulation``.

Flash attention (Dao 2023, FlashAttention-2 §3.2, Algorithm 2): P is not
stored but recomputed per key block from the saved log-sum-exp L::

    dO   = fl_d_out(dO)
    D    = fl_d_stats(Σ_c fl_d_stats(dO ∘ O))          D = rowsum(dO ∘ O), once
    D    = fl_d_stats(D − dL)                           the log-sum-exp's cotangent
    for each key block j of Bc columns, in order:
        S_j  = the forward's scores of block j, masked entries -inf
        P_j  = fl_exp(exp(fl_exp(S_j − L)))             P_j = exp(S_j − L)
        dV_j = fl_grads(fl_d_acc(fl_p(P_j)ᵀ dO))
        dP_j = fl_d_p(fl_d_acc(dO V_jᵀ))
        dS_j = fl_d_s(fl_d_stats(P_j ∘ fl_d_stats(dP_j − D)))
        dQ   = fl_d_acc(dQ + fl_d_acc(dS_j K_j))        accumulated across blocks
        dK_j = fl_grads(fl_d_acc(fl_d_acc(dS_jᵀ Q) · scale))
    dQ = fl_grads(fl_d_acc(dQ · scale))

The scale multiplies the accumulated dQ and dK once at the end, as the
FlashAttention-2 kernel does.  With ``policy.scale == "q"`` the scores are
Q' Kᵀ with Q' = fl(Q · scale): then dK_j = fl_grads(fl_d_acc(dS_jᵀ Q')) carries
no scale, and dQ = scale · dQ' as above.  With ``"exp2"`` the scores are
unscaled and P_j = fl_exp(2^fl_exp(fma(S_j, c, -fl_exp(L · c₂)))), with
c = fl_exp(scale · log2 e) and c₂ = fl_exp(log2 e) (:mod:`fa_jax.softmax`).
A softcap S' = c tanh(S / c) multiplies dS by its factor in d_stats before the
rounding to d_s (:mod:`fa_jax.score_mods`).  The log-sum-exp's cotangent enters
through ∂L_i/∂S_ij = P_ij:
dS = P ∘ (dP − D) + P ∘ dL = P ∘ (dP − (D − dL)).

The forward's variant (fa1, fa2, rowwise) changes O and L, not this backward.
Each query row's dQ depends on that row alone and the emulation takes all rows
at once, so ``Br`` does not change the result: the sums over query rows inside
dV_j = P_jᵀ dO and dK_j = dS_jᵀ Q, which the kernel accumulates over Br-row
blocks, follow the accumulation model instead.

Reference (materialised) attention: the backward of the computation as
written, as autograd computes it from the stored P (the softmax backward
D = rowsum(P ∘ dP))::

    dO = fl_d_out(dO)
    dV = fl_grads(fl_d_acc(Pᵀ dO))
    dP = fl_d_p(fl_d_acc(dO Vᵀ))
    D  = fl_d_stats(fl_d_stats(Σ_j fl_d_stats(P ∘ dP)) − dL)
    dS = fl_d_s(fl_d_stats(P ∘ fl_d_stats(dP − D)))
    dQ = fl_grads(fl_d_acc(fl_d_acc(dS K) · scale))
    dK = fl_grads(fl_d_acc(fl_d_acc(dSᵀ Q) · scale))      (no scale for scale="q")

Both need from their caller: Q rows of rows with no kept key set to 0, K and V
rows past the key lengths set to 0, and dO, dL zero on rows with no kept key;
masked entries then have P = 0 and contribute exact zeros, so such rows and
keys get zero gradient and no NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fa_jax import ops
from fa_jax.policy import Policy
from fa_jax.softmax import exp2_factor, shifted_exp

__all__ = ["flash_backward", "reference_backward", "row_dot", "softmax_grad"]


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def _matmul(a, b, policy: Policy):
    """fl_d_acc(a @ b) under the policy's accumulation model."""
    return ops.matmul(a, b, policy.d_acc, accumulation=policy.accumulation)


def row_dot(a, b, policy: Policy):
    """fl_d_stats(Σ_c fl_d_stats(a ∘ b)) along the last axis: D = rowsum(dO ∘ O)
    (Dao 2023, Algorithm 2) or rowsum(P ∘ dP) (the softmax backward)."""
    return ops.sum(
        ops.mul(a, b, policy.d_stats), policy.d_stats, axis=-1, accumulation=policy.accumulation
    )


def softmax_grad(p, d_p, d_row, policy: Policy, d_cap=None):
    """dS = fl_d_s(fl_d_stats(P ∘ fl_d_stats(dP − D))) (Dao 2023, Algorithm 2), with
    ``d_row`` the per-row D (..., N) already less the log-sum-exp cotangent; with a
    softcap's factor ``d_cap`` = ∂S'/∂S (:mod:`fa_jax.score_mods`), multiplied in
    d_stats before the rounding to d_s."""
    ds = ops.mul(p, ops.sub(d_p, d_row[..., None], policy.d_stats), policy.d_stats)
    if d_cap is not None:
        ds = ops.mul(ds, d_cap, policy.d_stats)
    return ops.cast(ds, policy.d_s)


def _scaled(acc, scale, policy: Policy):
    """fl_grads(fl_d_acc(acc · scale)): the softmax scale applied to an accumulated gradient."""
    return ops.cast(ops.mul(acc, scale, policy.d_acc), policy.grads)


def _d_k(acc, scale, policy: Policy):
    """dK from the accumulated dSᵀ Q: scaled for unscaled Q; for scale="q" the Q
    in the product is already the scaled Q'."""
    if policy.scale != "q":
        return _scaled(acc, scale, policy)
    return ops.cast(acc, policy.grads)


def _d_row(d_row, d_lse, policy: Policy):
    """D − dL in d_stats (exact, hence unchanged, where dL = 0)."""
    return ops.sub(d_row, d_lse, policy.d_stats)


def flash_backward(
    q, k_blocks, v_blocks, col0s, o, lse, d_o, d_lse, scores: Callable, scale, policy: Policy
):
    """FlashAttention-2's backward (module docstring; Dao 2023, Algorithm 2).

    Args:
      q: (..., N, d) Q as the forward's scores use it (Q' for scale="q").
      k_blocks, v_blocks: (n_blocks, ..., Bc, d) and (n_blocks, ..., Bc, d_v), the
        key and value blocks, padded with zeros.
      col0s: (n_blocks,) the first key column of each block.
      o, lse: the forward's O (..., N, d_v) and log-sum-exp L (..., N).
      d_o, d_lse: their cotangents.
      scores: ``scores(k_j, col0)`` -> (S_j (..., N, Bc) exactly as the forward
        computes it, masked entries -inf; a softcap's factor ∂S'/∂S, or None).
      scale: the softmax scale as the forward used it.
    Returns:
      (dQ (..., N, d), dK blocks (n_blocks, ..., Bc, d), dV blocks (n_blocks, ..., Bc, d_v)).
    """
    d_o = ops.cast(d_o, policy.d_out)
    d_row = _d_row(row_dot(d_o, o, policy), d_lse, policy)

    exp2_scales = {}
    if policy.scale == "exp2":  # P_j = 2^fl_exp(fma(S_j, c, -fl_exp(L log2 e)))
        exp2_scales = dict(
            log2_scale=exp2_factor(scale, policy.exp),
            shift_scale=exp2_factor(1.0, policy.exp, policy.carrier_dtype()),
        )

    def step(d_q, xs):
        k_j, v_j, col0 = xs
        s_j, d_cap = scores(k_j, col0)
        p_j = shifted_exp(s_j, lse[..., None], policy, **exp2_scales)
        d_v_j = ops.cast(_matmul(_t(ops.cast(p_j, policy.p)), d_o, policy), policy.grads)
        d_p_j = ops.cast(_matmul(d_o, _t(v_j), policy), policy.d_p)
        d_s_j = softmax_grad(p_j, d_p_j, d_row, policy, d_cap)
        d_q = ops.add(d_q, _matmul(d_s_j, k_j, policy), policy.d_acc)
        d_k_j = _d_k(_matmul(_t(d_s_j), q, policy), scale, policy)
        return d_q, (d_k_j, d_v_j)

    d_q, (d_k, d_v) = jax.lax.scan(step, jnp.zeros(q.shape, q.dtype), (k_blocks, v_blocks, col0s))
    return _scaled(d_q, scale, policy), d_k, d_v


def reference_backward(q, k, v, p, d_o, d_lse, scale, policy: Policy, d_cap=None):
    """The materialised attention's backward (module docstring).

    Args:
      q, k, v: Q (Q' for scale="q"), K and V as the forward used them.
      p: (..., N, M) the stored probabilities P (stage ``p``).
      d_o, d_lse: the cotangents of O (..., N, d_v) and of the log-sum-exp (..., N).
      scale: the softmax scale as the forward used it.
      d_cap: a softcap's factor ∂S'/∂S (..., N, M), or None.
    Returns:
      (dQ, dK, dV) shaped like q, k, v.
    """
    d_o = ops.cast(d_o, policy.d_out)
    d_v = ops.cast(_matmul(_t(p), d_o, policy), policy.grads)
    d_p = ops.cast(_matmul(d_o, _t(v), policy), policy.d_p)
    d_s = softmax_grad(p, d_p, _d_row(row_dot(p, d_p, policy), d_lse, policy), policy, d_cap)
    d_q = _scaled(_matmul(d_s, k, policy), scale, policy)
    d_k = _d_k(_matmul(_t(d_s), q, policy), scale, policy)
    return d_q, d_k, d_v
