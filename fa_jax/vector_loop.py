"""The vector loops of PyTorch's CPU flash attention, as flash-attention variants.

ATen's ``cpu_flash_attention`` (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``)
runs the online-softmax recurrence of FlashAttention-2 (Dao 2023, Algorithm 1)
with its own summation orders: the row sum of P̃ over vector lanes
(:func:`lane_sum`), the P V product in the CPU GEMM's inner blocks
(:func:`gemm_accumulate`), the statistics updated by an FMA
(:func:`torch_step`).  :data:`LANES` names each loop, as
:func:`fa_jax.attention.flash_attention` takes it for ``variant``, with its
FP32 lane count.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops
from fa_jax.exponential import CORRECTLY_ROUNDED
from fa_jax.policy import Policy
from fa_jax.softmax import rescale_factor, running_max, shifted_exp

__all__ = ["LANES", "gemm_accumulate", "gemm_k_blocks", "lane_sum", "torch_step"]

# The variants that model a vector loop, and their FP32 lanes.
LANES = {"torch_avx2": 8}


def lane_sum(e, lanes: int, fmt, *, accumulators: int = 2, vector_tail: bool = False):
    """Σ e over the last axis as a vector loop adds it: vector j (``lanes`` entries)
    goes to accumulator j mod ``accumulators``, each adds its vectors lane by lane
    in order, the accumulators are added in order, the lanes combine as AVX2's
    ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); the entries past the last full
    vector follow one by one, or (``vector_tail``) as a partial vector into the
    first accumulator's lanes.  With ``vector_tail`` and fewer than ``lanes``
    entries, the sum is in index order (ATen's ``vec_reduce_all``)."""
    if lanes != 8:
        raise ValueError(f"_lane_sum: expected 8 lanes (AVX2), got {lanes}")
    n = e.shape[-1]
    if vector_tail:
        if n < lanes:
            return ops.sum(e, fmt, axis=-1, accumulation="sequential")
        e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, -n % lanes)])  # + 0 is exact
    count = e.shape[-1] // lanes
    vectors = e[..., : lanes * count].reshape(*e.shape[:-1], count, lanes)
    pad = -count % accumulators
    vectors = jnp.pad(vectors, [(0, 0)] * (vectors.ndim - 2) + [(0, pad), (0, 0)])
    groups = vectors.reshape(*e.shape[:-1], -1, accumulators, lanes)  # vector j -> j % accumulators
    acc = ops.sum(groups, fmt, axis=-3, accumulation="sequential")  # (..., accumulators, lanes)
    total = acc[..., 0, :]
    for a in range(1, accumulators):
        total = ops.add(total, acc[..., a, :], fmt)
    half = ops.add(total[..., :4], total[..., 4:], fmt)  # lanes i + (i + 4)
    quarter = ops.add(half[..., :2], half[..., 2:], fmt)  # (0 + 2), (1 + 3)
    total = ops.add(quarter[..., 0], quarter[..., 1], fmt)
    for j in range(lanes * count, e.shape[-1]):
        total = ops.add(total, e[..., j], fmt)
    return total


def gemm_k_blocks(k: int) -> list[tuple[int, int]]:
    """The inner-dimension blocks over which the CPU GEMM that PyTorch's kernel calls
    (bf16/fp16 in, FP32 out) sums from 0 before adding into its output, as measured
    for k <= 512: one block up to 192, two halves below 400, else blocks of 192 and
    the rest (a rest of at most 16 in two halves)."""
    if k <= 192:
        return [(0, k)]
    if k < 400:
        return [(0, k // 2), (k // 2, k)]
    cuts = list(range(0, k, 192))
    rest = k % 192
    if 0 < rest <= 16:
        cuts.append(k - rest + rest // 2)
    return list(zip(cuts, [*cuts[1:], k]))


def gemm_accumulate(c, a, b, fmt):
    """c + a @ b as that GEMM adds it: per inner block (gemm_k_blocks) a sum in
    index order from 0, each block then added into c."""
    for start, stop in gemm_k_blocks(a.shape[-1]):
        block = ops.matmul(
            a[..., start:stop], b[..., start:stop, :], fmt, accumulation="sequential"
        )
        c = ops.add(c, block, fmt)
    return c


def torch_step(carry, s, v_j, policy: Policy, *, lanes: int, log2_scale):
    """One key block of the ``torch_avx2`` loop: PyTorch's CPU flash attention
    (``cpu_flash_attention`` in ATen's ``FlashAttentionKernel.cpp``, with AVX2's
    8 FP32 lanes)::

        m_new = max(m, rowmax S_j);  P̃ = exp(S_j − m_new)  (the policy's exp model)
        α = exp(m − m_new)  (the scalar exp: correctly rounded)
        l = fma(α, l, Σ_lanes P̃);  o = fl(α o) ⊕ fl_p(P̃) V_j
        O = fl_out(o · fl_stats(1 / l))  (Policy.normalise "reciprocal")

    where Σ_lanes sums P̃ as the kernel's vector loop does: vector j (8 entries)
    goes to accumulator j mod 2, each accumulator adds its vectors lane by lane in
    order from 0, the two are added, their lanes combine as
    ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), and the entries past the last full
    vector follow one by one.  ``⊕ P V`` is the GEMM's accumulation into o: the
    key axis in blocks (192 wide, or two halves when fewer than 400, as measured
    on the kernel), each block summed in index order from 0 in FP32 and added into
    o; S's Q Kᵀ takes the policy's accumulation (in index order, for a head
    dimension up to 192).  Its last key block is as wide as the keys left
    (no padding), as the kernel's is; ``kv_lengths`` masks keys inside a block, so
    a length-masked call does not follow the kernel on the shorter inputs (the
    kernel has no such mask).
    """
    if log2_scale is not None:
        raise ValueError(
            "flash_attention: variant 'torch_avx2' models PyTorch's CPU kernel, which "
            "scales S: expected scale 'scores', got 'exp2'"
        )
    m, l, o = carry
    m_new = running_max(m, jnp.max(s, axis=-1), policy.stats)
    alpha = rescale_factor(m, m_new, policy.replace(exp_model=CORRECTLY_ROUNDED))
    e = shifted_exp(s, m_new[..., None], policy)
    l_new = ops.fma(alpha, l, lane_sum(e, lanes, policy.stats), policy.stats)
    o = ops.mul(o, alpha[..., None], policy.o_acc)
    o = gemm_accumulate(o, ops.cast(e, policy.p), v_j, policy.o_acc)
    return m_new, l_new, o
