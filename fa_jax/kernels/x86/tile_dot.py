"""AMX's BF16 tile dot product, in the chunks of K that the GEMMs calling it give it.

``tdpbf16ps`` (Intel SDM, "Intel AMX instructions") adds into each FP32 output of
a tile the products of up to :data:`TERMS` bf16 terms per instruction, as two
chains, one of the even terms and one of the odd, the two sums added and the
result added to the accumulator::

    t_c = fl(fl(Σ_even a_t b_t) + fl(Σ_odd a_t b_t))   (each Σ a chain of FMAs in order)
    C ← fl(C + t_c)                                    (chunk c = 0, 1, … in order)

(bf16 · bf16 products are exact in FP32, so each chain step rounds once).

The inner dimension K is padded to even with a zero term and cut into chunks
(:data:`CHUNKINGS`, as measured on the kernels' outputs: docs/kernels.md, "On an
Intel Xeon with AMX"):

- ``"divisor"``: PyTorch's CPU flash attention where it packs K and V for AMX
  (``need_pack`` in ATen's ``cpu_flash_attention``,
  :func:`fa_jax.kernels.torch_cpu.amx_packs`), both GEMMs (Q Kᵀ over the head
  dimension, P V over the key block from the rescaled o): equal chunks of w
  terms, w the largest even divisor of K up to 32 (80 → 4 × 20, 74 → 37 × 2,
  300 → 10 × 30); chunks of 32 with a short last one miss there;
- ``"blocks"``: oneDNN's brgemm as OpenVINO's CPU plugin calls it in its BF16
  prefill (:mod:`fa_jax.kernels.openvino.sdpa`): chunks of 32, the last one K mod 32
  (80 → 32 + 32 + 16).
"""

from __future__ import annotations

import jax.numpy as jnp

from fa_jax import ops
from fa_jax._checks import one_of

__all__ = ["CHUNKINGS", "TERMS", "chunk", "tile_dot"]

TERMS = 32  # the bf16 terms of one tdpbf16ps per output: 16 pairs
CHUNKINGS = ("divisor", "blocks")  # how a GEMM cuts K into tile dots (module docstring)


def chunk(k: int, chunking: str = "divisor") -> int:
    """The terms of each tile dot for an inner dimension of ``k`` (rounded up to
    even): its largest even divisor up to :data:`TERMS` ("divisor"), or TERMS, the
    last chunk shorter ("blocks")."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"chunk: expected an inner dimension k >= 1, got {k!r}")
    one_of(chunking, CHUNKINGS, "chunk: chunking")
    k += k % 2
    if chunking == "blocks":
        return min(k, TERMS)
    return max(w for w in range(2, TERMS + 1, 2) if k % w == 0)


def tile_dot(a, b, fmt, *, chunking: str = "divisor", initial=None):
    """fl_fmt(C + a @ b) for a (..., n, K) and b (..., K, m) as chained tile dots
    (module docstring): K padded to even with a zero term, cut into chunks of
    :func:`chunk` (K, ``chunking``) terms, each chunk's even and odd chains added,
    the chunk sums added in order to ``initial`` (C; 0 if None)."""
    k = a.shape[-1]
    if a.ndim < 2 or b.ndim < 2 or k != b.shape[-2]:
        raise ValueError(
            f"tile_dot: expected a (..., n, K) and b (..., K, m), got a {a.shape}, b {b.shape}"
        )
    lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # the chunk axis goes first
    a, b = jnp.broadcast_to(a, (*lead, *a.shape[-2:])), jnp.broadcast_to(b, (*lead, *b.shape[-2:]))
    w = chunk(k, chunking)
    pad = -k % w  # zero terms (a short last chunk's lanes): their products add no bit
    if pad:
        a = jnp.concatenate([a, jnp.zeros((*a.shape[:-1], pad), a.dtype)], axis=-1)
        b = jnp.concatenate([b, jnp.zeros((*b.shape[:-2], pad, b.shape[-1]), b.dtype)], axis=-2)
        k += pad
    # (chunks, ..., n, w/2, parity) and (chunks, ..., w/2, parity, m)
    a_c = jnp.moveaxis(a.reshape(*a.shape[:-1], k // w, w // 2, 2), -3, 0)
    b_c = jnp.moveaxis(b.reshape(*b.shape[:-2], k // w, w // 2, 2, b.shape[-1]), -4, 0)
    even = ops.matmul(a_c[..., 0], b_c[..., 0, :], fmt, accumulation="sequential")
    odd = ops.matmul(a_c[..., 1], b_c[..., 1, :], fmt, accumulation="sequential")
    return ops.sum(ops.add(even, odd, fmt), fmt, axis=0, accumulation="sequential", initial=initial)
