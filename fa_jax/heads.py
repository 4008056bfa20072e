"""Grouped-query and multi-query attention: K and V with fewer heads than Q.

Q is shaped (..., H, N, d) and K, V (..., H_kv, M, d) with H_kv dividing H; the
heads axis is the third from last.  Query head h reads K/V head h // G with
G = H / H_kv (jax.nn.dot_product_attention, PyTorch SDPA's ``enable_gqa``,
FlashAttention-2's ``nheads_k``): H_kv = 1 is multi-query attention.

Forward: each query head's numbers are those of ordinary attention against its
K/V head, so GQA equals attention with K and V repeated G times along the heads
axis, bit for bit (the emulation repeats them after rounding them to ``inputs``).

Backward: each query head h gives the gradients dK_h, dV_h of its K/V head as
ordinary attention does (stage ``grads``); the K/V head's gradient sums the G of
its group in head order, under the policy's accumulation model, in ``d_acc``,
then rounds to ``grads``::

    dK_g = fl_grads(fl_d_acc(Σ_{h in group g} dK_h))      (same for dV)

as FlashAttention-2 does (``mha_bwd`` in ``flash_api.cpp`` writes per-query-head
``dk_expanded``, ``dv_expanded`` in the input dtype and sums each group with
``at::sum`` in FP32).  With H_kv = H nothing is summed or rounded again.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops
from fa_jax.policy import Policy

__all__ = ["kv_groups", "repeat_kv", "sum_groups"]


def kv_groups(fn: str, q_shape, k_shape, v_shape) -> int:
    """G = H / H_kv for Q (..., H, N, d) and K, V (..., H_kv, M, d); 1 when the
    leading dimensions are equal.  ValueError naming the shapes otherwise."""
    lead_q, lead_k, lead_v = q_shape[:-2], k_shape[:-2], v_shape[:-2]
    if lead_q == lead_k == lead_v:
        return 1
    if (
        len(lead_q) >= 1
        and lead_k == lead_v
        and len(lead_k) == len(lead_q)
        and lead_q[:-1] == lead_k[:-1]
        and lead_k[-1] > 0
        and lead_q[-1] % lead_k[-1] == 0
    ):
        return lead_q[-1] // lead_k[-1]
    raise ValueError(
        f"{fn}: leading dimensions differ: expected k and v with those of q, or with "
        f"H_kv heads (third from last) where H_kv divides q's H, got q {tuple(q_shape)}, "
        f"k {tuple(k_shape)}, v {tuple(v_shape)}"
    )


def repeat_kv(x, groups: int):
    """K or V (..., H_kv, M, c) with each head repeated ``groups`` times: (..., H, M, c)."""
    if groups == 1:
        return x
    return jnp.repeat(x, groups, axis=-3)


def sum_groups(d, groups: int, policy: Policy):
    """dK or dV (..., H, M, c) per query head summed over each group (module
    docstring): (..., H_kv, M, c)."""
    if groups == 1:
        return d
    lead, h = d.shape[:-3], d.shape[-3]
    grouped = d.reshape(*lead, h // groups, groups, *d.shape[-2:])
    total = ops.sum(grouped, policy.d_acc, axis=-3, accumulation=policy.accumulation)
    return ops.cast(total, policy.grads)
