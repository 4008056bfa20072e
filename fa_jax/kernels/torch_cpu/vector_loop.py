"""The vector loops of PyTorch's CPU flash attention, as flash-attention variants.

ATen's ``cpu_flash_attention`` (``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``)
runs the online-softmax recurrence of FlashAttention-2 (Dao 2023, Algorithm 1)
with its own summation orders: the row sum of P̃ over vector lanes
(:func:`lane_sum`), the P V product in the CPU GEMM's inner blocks
(:func:`gemm_accumulate`), the statistics updated by an FMA where the build
fuses a · b + c (:func:`torch_step`).  A last query block of 1 to 3 rows
meets MKL's small-matrix GEMM, which sums in other orders
(:func:`torch_qk`, :func:`torch_pv`).  Those GEMM orders are MKL's on the AMD
CPUs the loops were built on; MKL picks other kernels on an Intel CPU (``gemm``
"mkl_intel", :func:`intel_sgemm_blocks`, :data:`MKL_INTEL_LANES`, AMX tile dots
for BF16), and where the CPU has AMX and ATen packs K and V for it
(``need_pack``), both GEMMs are tile dots on every row (``gemm`` "amx",
:mod:`fa_jax.kernels.x86.tile_dot`): the ``gemm`` of :class:`Lanes`.

ATen compiles that loop once per CPU capability, with ``Vectorized<float>``
(``aten/src/ATen/cpu/vec``) of the capability's width; :class:`Lanes` says
what differs between the builds:

- ``DEFAULT``: ``vec_base.h``'s generic ``Vectorized<float>``, 8 lanes
  (``VECTOR_WIDTH`` 32 bytes) held in an array and computed one by one;
  ``vec_reduce_all`` adds lanes 1, 2, … into lane 0 in order; no FMA (the
  baseline x86-64 build has none, so a · b + c rounds twice);
- ``AVX2``: 8 lanes; ``vec_reduce_all`` (``functional_base.h``) halves the
  vector three times, so lane 0 ends as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7));
  a · b + c fused;
- ``AVX512``: 16 lanes; ``vec_reduce_all`` halves four times
  (``_mm512_shuffle_f32x4`` by 256 and 128 bits, then ``_mm512_shuffle_ps``
  by 64 and 32): lane i meets i + 8, then i + 4, i + 2, i + 1; a · b + c fused.
  ``torch_avx512_amx`` is that loop with its GEMMs on AMX; each build's
  ``*_intel`` loop has MKL's Intel GEMMs.

:data:`LANES` names each loop, as :func:`fa_jax.attention.flash_attention`
takes it for ``variant``, with its :class:`Lanes`.  Where a build fuses, a bias
joins the scaled scores in one FMA, S' = fl(fl_qk_acc(Q Kᵀ) · scale + B̂) (ATen's
``_scale_attn_mask_fusion_kernel``: ``a * scale + mask``, contracted), as measured.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from fa_jax import ops
from fa_jax._checks import one_of
from fa_jax.accumulation import fma_chains, lanes, tree, vector
from fa_jax.attention import KernelLoop, register_kernel_loop
from fa_jax.exponential import GLIBC_EXPF
from fa_jax.kernels.x86.tile_dot import tile_dot
from fa_jax.policy import Policy
from fa_jax.softmax import rescale_factor, running_max, shifted_exp

__all__ = [
    "LANES",
    "MKL_INTEL_GEMV_LANES",
    "MKL_INTEL_LANES",
    "SMALL_ROWS",
    "Lanes",
    "gemm_accumulate",
    "gemm_k_blocks",
    "intel_sgemm_blocks",
    "intel_takes_lanes",
    "lane_sum",
    "query_block",
    "query_split",
    "small_block_rows",
    "torch_pv",
    "torch_qk",
    "torch_step",
]

_COMBINES = ("halving", "in_order")
_GEMMS = ("blas", "mkl_intel", "amx")


@dataclasses.dataclass(frozen=True)
class Lanes:
    """One build of ``Vectorized<float>``: ``count`` FP32 lanes; ``combine``, how
    ``vec_reduce_all`` combines them ("halving": lane i + lane i + count/2, then
    the halves again, down to one; "in_order": lanes 1, 2, … added into lane 0);
    ``fused``, whether the build computes a · b + c as one FMA; ``gemm``, the GEMMs
    the loop calls (:func:`torch_qk`, :func:`torch_pv`): "blas", MKL's as on the
    AMD CPUs the loops were built on; "mkl_intel", MKL's on an Intel CPU with
    AVX-512 and AMX; "amx", AMX tile dots on K and V packed for them
    (:mod:`fa_jax.kernels.x86.tile_dot`)."""

    count: int
    combine: str
    fused: bool
    gemm: str = "blas"

    def __post_init__(self):
        if self.count < 1 or self.count & (self.count - 1):
            raise ValueError(f"Lanes.count: expected a power of two, got {self.count!r}")
        one_of(self.combine, _COMBINES, "Lanes.combine")
        one_of(self.gemm, _GEMMS, "Lanes.gemm")


# The variants that model a vector loop, and their lanes (module docstring): each
# build with MKL's GEMMs as on an AMD CPU and as on an Intel one, and the AVX512
# build's loop with K and V packed for AMX.
_BUILDS = {
    "torch_default": Lanes(8, "in_order", fused=False),
    "torch_avx2": Lanes(8, "halving", fused=True),
    "torch_avx512": Lanes(16, "halving", fused=True),
}
LANES = {
    **_BUILDS,
    **{f"{name}_intel": dataclasses.replace(b, gemm="mkl_intel") for name, b in _BUILDS.items()},
    "torch_avx512_amx": dataclasses.replace(_BUILDS["torch_avx512"], gemm="amx"),
}


def lane_sum(e, lanes: Lanes, fmt, *, accumulators: int = 2, vector_tail: bool = False):
    """Σ e over the last axis as a vector loop adds it: vector j (``lanes.count``
    entries) goes to accumulator j mod ``accumulators``, each adds its vectors
    lane by lane in order, the accumulators are added in order, the lanes combine
    as ``lanes.combine`` says (:class:`Lanes`); the entries past the last full
    vector follow one by one, or (``vector_tail``) as a partial vector into the
    first accumulator's lanes.  With ``vector_tail`` and fewer than ``lanes.count``
    entries, the sum is in index order (ATen's ``vec_reduce_all`` of a partial
    vector, ``functional_base.h``)."""
    if not isinstance(lanes, Lanes):
        raise TypeError(f"lane_sum: lanes: expected a Lanes, got {lanes!r}")
    width, n = lanes.count, e.shape[-1]
    if vector_tail:
        if n < width:
            return ops.sum(e, fmt, axis=-1, accumulation="sequential")
        e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, -n % width)])  # + 0 is exact
    count = e.shape[-1] // width
    vectors = e[..., : width * count].reshape(*e.shape[:-1], count, width)
    pad = -count % accumulators
    vectors = jnp.pad(vectors, [(0, 0)] * (vectors.ndim - 2) + [(0, pad), (0, 0)])
    groups = vectors.reshape(*e.shape[:-1], -1, accumulators, width)  # vector j -> j % accumulators
    acc = ops.sum(groups, fmt, axis=-3, accumulation="sequential")  # (..., accumulators, lanes)
    total = acc[..., 0, :]
    for a in range(1, accumulators):
        total = ops.add(total, acc[..., a, :], fmt)
    if lanes.combine == "in_order":
        total = ops.sum(total, fmt, axis=-1, accumulation="sequential")
    else:
        while total.shape[-1] > 1:  # lanes i + (i + half)
            half = total.shape[-1] // 2
            total = ops.add(total[..., :half], total[..., half:], fmt)
        total = total[..., 0]
    for j in range(width * count, e.shape[-1]):
        total = ops.add(total, e[..., j], fmt)
    return total


def gemm_k_blocks(k: int) -> list[tuple[int, int]]:
    """The inner-dimension blocks over which the CPU GEMMs that PyTorch's kernels
    call (bf16/fp16 in, FP32 out in the flash loop; MKL's FP32 GEMM in torch-math)
    sum from 0 before adding into their output, as measured for k <= 1100: one
    block up to 192; below 400 two halves of ⌊k/2⌋ and, for odd k, the last
    product alone; else blocks of 192 and the rest (a rest of at most 16 in two
    halves)."""
    if k <= 192:
        return [(0, k)]
    if k < 400:
        half = k // 2
        return [(0, half), (half, 2 * half)] + ([(2 * half, k)] if k % 2 else [])
    cuts = list(range(0, k, 192))
    rest = k % 192
    if 0 < rest <= 16:
        cuts.append(k - rest + rest // 2)
    return list(zip(cuts, [*cuts[1:], k]))


def gemm_accumulate(c, a, b, fmt, k_blocks=gemm_k_blocks):
    """c + a @ b as that GEMM adds it: per inner block (``k_blocks``, the AMD CPUs'
    :func:`gemm_k_blocks` by default) a sum in index order from 0, each block then
    added into c."""
    for start, stop in k_blocks(a.shape[-1]):
        block = ops.matmul(
            a[..., start:stop], b[..., start:stop, :], fmt, accumulation="sequential"
        )
        c = ops.add(c, block, fmt)
    return c


# The inner dimensions up to which MKL's FP32 and FP16 GEMMs on an Intel CPU were
# measured (1, 2 and 4 threads) to sum in :func:`intel_sgemm_blocks`; past it the
# split depends on the threads.
INTEL_GEMM_K = 768


def intel_sgemm_blocks(k: int) -> list[tuple[int, int]]:
    """The inner-dimension blocks of MKL's FP32 GEMM (torch-math's) and its FP16
    GEMM with FP32 output (the flash loop's) on an Intel CPU, each an FMA chain
    from 0, the sums added: one block up to 384 terms, else the halves ⌈k/2⌉ and
    ⌊k/2⌋, as measured for k up to :data:`INTEL_GEMM_K` (FP32: 4 to 512 rows, 1, 2
    and 4 threads; FP16: 1 to 256 rows of the flash loop's calls, one thread)."""
    if not 1 <= k <= INTEL_GEMM_K:
        raise ValueError(f"intel_sgemm_blocks: expected 1 <= k <= {INTEL_GEMM_K}, got {k}")
    if k <= INTEL_GEMM_K // 2:
        return [(0, k)]
    half = -(-k // 2)
    return [(0, half), (half, k)]


# MKL's FP32 and FP16 GEMMs on an Intel CPU with B transposed (Q Kᵀ) over 2 to
# INTEL_LANES_ROWS rows (columns of its column-major call) and an inner dimension
# of at least INTEL_LANES_PER_ROW per row (:func:`intel_takes_lanes`): 16 lanes of
# FMA chains from 0 (lane i: terms i, i + 16, …; the last K mod 16 terms a partial
# vector), the four 128-bit quarters added lane by lane in order, then the
# quarter's lanes as (0 + 1) + (2 + 3).  Elsewhere :func:`intel_sgemm_blocks`.
MKL_INTEL_LANES = fma_chains(
    lanes(
        16,
        tree((((((0, 4), 8), 12), (((1, 5), 9), 13)), ((((2, 6), 10), 14), (((3, 7), 11), 15)))),
    )
)
INTEL_LANES_ROWS = 15
INTEL_LANES_PER_ROW = 24
# MKL's BF16 GEMM on an Intel CPU over 1 row, a matrix-vector product in
# ``vdpbf16ps`` pairs (products of term 2i + 1, then 2i, each addition rounded):
# Q Kᵀ holds pair i of each 32 terms in lane i mod 16, the lanes combined as
# MKL_INTEL_GEMV_LANES' tree (lane i with i + 8, then i + 1, i + 2, i + 4); P V sums
# each 8 keys in one chain from 0 and adds the sums into o in order.
MKL_INTEL_GEMV_LANES = lanes(
    16, tree(((((0, 8), (1, 9)), ((2, 10), (3, 11))), (((4, 12), (5, 13)), ((6, 14), (7, 15)))))
)
INTEL_GEMV_KEYS = 8


def _odd_first(a, b, k_multiple: int):
    """a (..., n, K), b (..., K, m) with K padded with zero terms to a multiple of
    ``k_multiple`` (even) and each pair's odd term put first: ``vdpbf16ps``'s order."""
    k = a.shape[-1]
    pad = -k % k_multiple
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    order = jnp.arange(k + pad).reshape(-1, 2)[:, ::-1].reshape(-1)
    return a[..., order], b[..., order, :]


def _intel_gemv_qk(q, k_t, fmt):
    """q (..., 1, d) · Kᵀ as MKL_INTEL_GEMV_LANES: term t' of the pair-ordered terms
    in lane (t' // 2) mod 16, in order."""
    a, b = _odd_first(q, k_t, 2 * 16)
    chunks = a.shape[-1] // 32  # per chunk: lane i takes its pair's two terms
    order = jnp.arange(32 * chunks).reshape(chunks, 16, 2).transpose(0, 2, 1).reshape(-1)
    return ops.matmul(a[..., order], b[..., order, :], fmt, accumulation=MKL_INTEL_GEMV_LANES)


def _intel_gemv_pv(o, p, v_j, fmt):
    """o ⊕ p (..., 1, keys) V as MKL's BF16 matrix-vector product adds it."""
    a, b = _odd_first(p, v_j, INTEL_GEMV_KEYS)
    return gemm_accumulate(
        o, a, b, fmt, lambda k: [(lo, lo + INTEL_GEMV_KEYS) for lo in range(0, k, INTEL_GEMV_KEYS)]
    )


def intel_takes_lanes(rows: int, k: int) -> bool:
    """Whether MKL's FP32 or FP16 GEMM on an Intel CPU sums ``rows`` rows of A Bᵀ
    over K = ``k`` in :data:`MKL_INTEL_LANES` (as measured: from K = 24 · rows, for
    2 to 15 rows; the thresholds read at K = 24 r − 1 and 24 r for each)."""
    return 2 <= rows <= INTEL_LANES_ROWS and k >= INTEL_LANES_PER_ROW * rows


def _bf16(policy: Policy) -> bool:
    return policy.inputs.name == "bfloat16"


def _intel_qk(q, k_t, policy: Policy):
    """MKL's Intel GEMMs for Q Kᵀ: BF16 on AMX tile dots (K in blocks of 32), FP16
    in :func:`intel_sgemm_blocks`, or :data:`MKL_INTEL_LANES` on a last block of 2
    to 15 rows where d is large enough; a BF16 last block of 1 row as
    MKL's matrix-vector product (:data:`MKL_INTEL_GEMV_LANES`)."""
    n, d = q.shape[-2], q.shape[-1]
    rows = small_block_rows(n)
    if _bf16(policy):
        if rows != 1:
            return tile_dot(q, k_t, policy.qk_acc, chunking="blocks")
        tail = _intel_gemv_qk(q[..., n - 1 :, :], k_t, policy.qk_acc)
        if n == 1:
            return tail
        head = tile_dot(q[..., : n - 1, :], k_t, policy.qk_acc, chunking="blocks")
        return jnp.concatenate([head, tail], axis=-2)
    zero = jnp.zeros((*q.shape[:-1], k_t.shape[-1]), q.dtype)
    rows = n - query_block(n) * ((n - 1) // query_block(n))  # the last block's
    if not intel_takes_lanes(rows, d):
        return gemm_accumulate(zero, q, k_t, policy.qk_acc, intel_sgemm_blocks)
    tail = ops.matmul(q[..., n - rows :, :], k_t, policy.qk_acc, accumulation=MKL_INTEL_LANES)
    if rows == n:
        return tail
    head = gemm_accumulate(
        zero[..., : n - rows, :], q[..., : n - rows, :], k_t, policy.qk_acc, intel_sgemm_blocks
    )
    return jnp.concatenate([head, tail], axis=-2)


def _intel_pv(o, p, v_j, policy: Policy):
    """MKL's Intel GEMMs for o ⊕ P V: BF16 on AMX tile dots from o (the keys in blocks
    of 32), a last block of 1 row as its matrix-vector product; FP16 in
    :func:`intel_sgemm_blocks` on every row."""
    if not _bf16(policy):
        return gemm_accumulate(o, p, v_j, policy.o_acc, intel_sgemm_blocks)
    n = p.shape[-2]
    if small_block_rows(n) != 1:
        return tile_dot(p, v_j, policy.o_acc, chunking="blocks", initial=o)
    tail = _intel_gemv_pv(o[..., n - 1 :, :], p[..., n - 1 :, :], v_j, policy.o_acc)
    if n == 1:
        return tail
    head = tile_dot(
        p[..., : n - 1, :], v_j, policy.o_acc, chunking="blocks", initial=o[..., : n - 1, :]
    )
    return jnp.concatenate([head, tail], axis=-2)


def query_split(n: int) -> int:
    """The kernel's query tile (``q_split_size``) for N queries: 256 rows (N >= 768),
    64 (N >= 192), else 32."""
    return 256 if n >= 768 else 64 if n >= 192 else 32


def query_block(n: int) -> int:
    """The rows of the kernel's full query blocks (``qSplitSize``): the tile, at
    most N (:func:`query_split`)."""
    return min(query_split(n), n)


# The most rows (columns of its column-major call) for which the CPU BLAS's
# GEMM takes its small-matrix path.
SMALL_ROWS = 3


def small_block_rows(n: int) -> int:
    """How many of N query rows go through the CPU BLAS's small-matrix path: the
    rows of the kernel's last query block (:func:`query_block`) when it holds at
    most 3, else 0 (the same in BF16 and FP16: MKL's GEMM of the FP32 values)."""
    br = query_block(n)
    rows = n - br * ((n - 1) // br)
    return rows if rows <= SMALL_ROWS else 0


def torch_qk(q, k_t, policy: Policy, gemm: str = "blas"):
    """fl_qk_acc(Q Kᵀ) as the kernel's GEMM adds it: AMX tile dots where K is packed
    for them (``gemm`` "amx": :func:`fa_jax.kernels.x86.tile_dot.tile_dot`); MKL's Intel GEMMs
    (``gemm`` "mkl_intel": :func:`_intel_qk`); else each dot in index order
    (``policy.accumulation``), except on the rows of :func:`small_block_rows`,
    where MKL's small-matrix path sums the head dimension in 4 lanes (lane i
    holding terms i, i + 4, …, the lanes combined by halving, the d mod 4 last
    terms then added one by one: ``vector(4)``) for the keys in whole groups of
    4, and in 8 lanes (``vector(8)``) for the key block's last (width mod 4)
    keys.  Revealed by probes on MKL's ``cblas_gemm_f16f16f32`` and ``sgemm_``
    (one thread; the same orders) and checked on random inputs, 1 to 3 rows, 1
    to 512 keys, d = 8 to 256; BF16 by the kernel's outputs."""
    if gemm == "amx":
        return tile_dot(q, k_t, policy.qk_acc)
    if gemm == "mkl_intel":
        return _intel_qk(q, k_t, policy)
    n, width = q.shape[-2], k_t.shape[-1]
    rows = small_block_rows(n)
    if not rows:
        return ops.matmul(q, k_t, policy.qk_acc, accumulation=policy.accumulation)
    tail = q[..., n - rows :, :]
    whole = width - width % 4
    parts = [ops.matmul(tail, k_t[..., :whole], policy.qk_acc, accumulation=vector(4))]
    if whole < width:
        parts.append(ops.matmul(tail, k_t[..., whole:], policy.qk_acc, accumulation=vector(8)))
    small = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if rows == n:
        return small
    head = ops.matmul(q[..., : n - rows, :], k_t, policy.qk_acc, accumulation=policy.accumulation)
    return jnp.concatenate([head, small], axis=-2)


def torch_pv(o, p, v_j, policy: Policy, gemm: str = "blas"):
    """o ⊕ P V as the kernel's GEMM adds it into o: AMX tile dots from o where V is
    packed for them (``gemm`` "amx": :func:`fa_jax.kernels.x86.tile_dot.tile_dot`); MKL's Intel
    GEMMs (``gemm`` "mkl_intel": :func:`_intel_pv`); else :func:`gemm_accumulate`, except
    on the rows of :func:`small_block_rows`, where MKL's small-matrix path runs one
    chain of fused multiply-adds from o over the keys in index order."""
    if gemm == "amx":
        return tile_dot(p, v_j, policy.o_acc, initial=o)
    if gemm == "mkl_intel":
        return _intel_pv(o, p, v_j, policy)
    n = p.shape[-2]
    rows = small_block_rows(n)
    if not rows:
        return gemm_accumulate(o, p, v_j, policy.o_acc)
    small = ops.matmul(
        p[..., n - rows :, :],
        v_j,
        policy.o_acc,
        accumulation="sequential",
        initial=o[..., n - rows :, :],
    )
    if rows == n:
        return small
    head = gemm_accumulate(o[..., : n - rows, :], p[..., : n - rows, :], v_j, policy.o_acc)
    return jnp.concatenate([head, small], axis=-2)


def torch_step(carry, s, v_j, policy: Policy, *, lanes: Lanes, log2_scale):
    """One key block of a ``torch_*`` loop (:data:`LANES`): PyTorch's CPU flash
    attention (``cpu_flash_attention`` in ATen's ``FlashAttentionKernel.cpp``)
    built with ``lanes``::

        m_new = max(m, rowmax S_j);  P̃ = exp(S_j − m_new)  (the policy's exp model)
        α = exp(m − m_new)  (the scalar exp: glibc's expf)
        l = α l + Σ_lanes P̃  (one FMA where ``lanes.fused``, else two roundings)
        o = fl(α o) ⊕ fl_p(P̃) V_j
        O = fl_out(o · fl_stats(1 / l))  (Policy.normalise "reciprocal")

    where Σ_lanes sums P̃ as the kernel's vector loop does: vector j
    (``lanes.count`` entries) goes to accumulator j mod 2, each accumulator adds
    its vectors lane by lane in order from 0, the two are added, their lanes
    combine as ``lanes.combine`` says (:func:`lane_sum`), and the entries past the
    last full vector follow one by one.  ``⊕ P V`` is the GEMM's accumulation
    into o: the key axis in blocks (192 wide, or two halves when fewer than 400,
    as measured on the kernel), each block summed in index order from 0 in FP32
    and added into o; S's Q Kᵀ takes the policy's accumulation (in index order,
    for a head dimension up to 192).  Its last key block is as wide as the keys
    left (no padding), as the kernel's is; ``kv_lengths`` masks keys inside a
    block, so a length-masked call does not follow the kernel on the shorter
    inputs (the kernel has no such mask).
    """
    if log2_scale is not None:
        raise ValueError(
            "flash_attention: the torch_* variants model PyTorch's CPU kernel, which "
            "scales S: expected scale 'scores', got 'exp2'"
        )
    m, l, o = carry
    m_new = running_max(m, jnp.max(s, axis=-1), policy.stats)
    alpha = rescale_factor(m, m_new, policy.replace(exp_model=GLIBC_EXPF))
    e = shifted_exp(s, m_new[..., None], policy)
    total = lane_sum(e, lanes, policy.stats)
    if lanes.fused:
        l_new = ops.fma(alpha, l, total, policy.stats)
    else:
        l_new = ops.add(ops.mul(alpha, l, policy.stats), total, policy.stats)
    o = ops.mul(o, alpha[..., None], policy.o_acc)
    o = torch_pv(o, ops.cast(e, policy.p), v_j, policy, lanes.gemm)
    return m_new, l_new, o


# Each build's loop as a variant of fa_jax.attention.flash_attention.
for _name, _lanes in LANES.items():
    register_kernel_loop(
        _name,
        KernelLoop(
            qk=functools.partial(torch_qk, gemm=_lanes.gemm),
            step=functools.partial(torch_step, lanes=_lanes),
            fused_bias=_lanes.fused,
        ),
    )
