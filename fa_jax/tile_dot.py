"""AMX's BF16 tile dot product, in the chunks PyTorch's packed GEMMs give it.

``tdpbf16ps`` (Intel SDM, "Intel AMX instructions") adds into each FP32 output of
a tile the products of up to :data:`TERMS` bf16 terms per instruction, as two
chains, one of the even terms and one of the odd, the two sums added and the
result added to the accumulator::

    t_c = fl(fl(Σ_even a_t b_t) + fl(Σ_odd a_t b_t))   (each Σ a chain of FMAs in order)
    C ← fl(C + t_c)                                    (chunk c = 0, 1, … in order)

(bf16 · bf16 products are exact in FP32, so each chain step rounds once).

PyTorch's CPU flash attention, where it packs K and V for AMX (``need_pack`` in
ATen's ``cpu_flash_attention``, :func:`fa_jax.kernels.torch_cpu.amx_packs`), runs
both GEMMs so: Q Kᵀ over the head dimension, P V over the key block (its
accumulator starting from the rescaled o).  Each inner dimension K is padded to
even with a zero term (ATen's ``eheadSize``, ``ekvSplitSize``) and cut into equal
chunks of w terms, w the largest even divisor of K up to 32 (:func:`chunk`:
80 → 4 × 20, 74 → 37 × 2, 300 → 10 × 30), as measured on the kernel's outputs
(docs/kernels.md, "On an Intel Xeon with AMX"); chunks of 32 with a short last one
miss.
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops

__all__ = ["TERMS", "chunk", "tile_dot"]

TERMS = 32  # the bf16 terms of one tdpbf16ps per output: 16 pairs


def chunk(k: int) -> int:
    """The terms of each tile dot for an inner dimension of ``k``: the largest even
    divisor of k (rounded up to even) up to :data:`TERMS`."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"chunk: expected an inner dimension k >= 1, got {k!r}")
    k += k % 2
    return max(w for w in range(2, TERMS + 1, 2) if k % w == 0)


def tile_dot(a, b, fmt, *, initial=None):
    """fl_fmt(C + a @ b) for a (..., n, K) and b (..., K, m) as chained tile dots
    (module docstring): K padded to even with a zero term, cut into chunks of
    :func:`chunk` (K) terms, each chunk's even and odd chains added, the chunk sums
    added in order to ``initial`` (C; 0 if None)."""
    k = a.shape[-1]
    if a.ndim < 2 or b.ndim < 2 or k != b.shape[-2]:
        raise ValueError(
            f"tile_dot: expected a (..., n, K) and b (..., K, m), got a {a.shape}, b {b.shape}"
        )
    lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # the chunk axis goes first
    a, b = jnp.broadcast_to(a, (*lead, *a.shape[-2:])), jnp.broadcast_to(b, (*lead, *b.shape[-2:]))
    if k % 2:  # a zero term: its products are 0 and add no bit
        a = jnp.concatenate([a, jnp.zeros((*a.shape[:-1], 1), a.dtype)], axis=-1)
        b = jnp.concatenate([b, jnp.zeros((*b.shape[:-2], 1, b.shape[-1]), b.dtype)], axis=-2)
        k += 1
    w = chunk(k)
    # (chunks, ..., n, w/2, parity) and (chunks, ..., w/2, parity, m)
    a_c = jnp.moveaxis(a.reshape(*a.shape[:-1], k // w, w // 2, 2), -3, 0)
    b_c = jnp.moveaxis(b.reshape(*b.shape[:-2], k // w, w // 2, 2, b.shape[-1]), -4, 0)
    even = ops.matmul(a_c[..., 0], b_c[..., 0, :], fmt, accumulation="sequential")
    odd = ops.matmul(a_c[..., 1], b_c[..., 1, :], fmt, accumulation="sequential")
    return ops.sum(ops.add(even, odd, fmt), fmt, axis=0, accumulation="sequential", initial=initial)
