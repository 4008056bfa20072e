"""The summation orders of XLA's attention on the CPU, as YNNPACK runs its dots and
the softmax sum: the model's numerics, each step rounded through :mod:`fa_jax.ops`.

* the dots (:func:`qk_dot`, :func:`pv_dot`): YNNPACK picks a dot kernel by the
  shape (google/XNNPACK, ``ynnpack/kernels/dot/generator/x86_fp32_k2.py``,
  ``x86_fp32_k4.py``).  A kernel keeps ``tile_k`` FMA chains per output in its
  vector lanes (term t in chain t mod tile_k), folds them pairwise at the end,
  ((c0 + c1) + (c2 + c3)), and leaves the last n mod tile_k terms to a remainder
  path whose products are rounded and added in order.  bf16 Q Kᵀ runs AVX-512
  BF16's pair instruction (or AVX2's FMAs in its order), one chain in the order
  1, 0, 3, 2, ... (:func:`permuted`), or AMX's tile dot, blocks of 32 terms in
  two chains (even, odd); YNNPACK cuts the reduction into blocks where the dot
  has few rows.  P V: blocks of keys (each block's sum added in order), or
  Eigen's contraction sharded over the keys (:func:`sharded_pv_dot`).  The
  tile_k and blocks are read from the real program
  (:mod:`~fa_jax.kernels.xla.probes`);
* the softmax sum (:func:`softmax_sum`): YNNPACK's ``sum_float_k1``
  (``ynnpack/kernels/reduce/sum.h``) on 16 lanes, term j in lane j mod 16:
  chunks of 64 terms (4 per lane, left to right), four chunks added together
  while 256 terms remain, a level-1 accumulator added to the level-2 one by
  compensated (Kahan) summation every 1024 terms read by the loops over whole
  chunks (not the ragged last one) and at the end (Higham 2002, §4.3); the 16
  lane sums then halved.  Where XLA rewrites the sum as a tree reduction
  (decoding shapes), ``reduce-window``s of 32 keys (zeros padded around the
  row) in a loop fusion of XLA's (each window summed left to right) or a
  YNNPACK fusion (each window by ``sum_float_k1``), then a ``reduce`` of the
  window sums, left to right; in an XLA loop fusion (small shapes) the whole
  row left to right (:func:`windowed_sum`; the levels read from the HLO,
  :func:`fa_jax.kernels.xla.hlo.sum_window`).

The CPU code: AVX-512, AVX2 (:class:`VectorCode`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.formats import Format
from fa_jax.kernels.xla import own_dots

__all__ = [
    "AVX2",
    "AVX512",
    "CODES",
    "Levels",
    "VectorCode",
    "kahan",
    "permuted",
    "pv_dot",
    "qk_dot",
    "sharded_pv_dot",
    "softmax_sum",
    "windowed_sum",
]


_LANES = 16  # the softmax sum's lanes
_CHUNK = 64  # terms the softmax sum reads at a time (4 vectors of 16 lanes)
_KAHAN = 1024  # terms read between the softmax sum's compensated steps


@dataclasses.dataclass(frozen=True)
class VectorCode:
    """The vector code XLA's CPU backend and YNNPACK run on a class of CPU, as far as
    the model's fixed steps depend on it (the dot orders, blocks and fusions are
    read from the real program by probes, whatever the code).

    ``gemv_lanes``: the float32 lanes XLA's own GEMV (:mod:`~fa_jax.kernels.xla.own_dots`)
    can give its vector, the widths of the registers LLVM targets (AVX's 256 bits;
    AVX-512's 512 too); the model checks each against the real program.

    What does not vary, by YNNPACK's design of kernels numerically consistent
    across ISAs (google/XNNPACK, ynnpack/):

    * the softmax sum's 16 lanes: ``sum_float_k1`` runs its ``*_k1_fp32_*``
      kernels with ``consistent_n = 64 / sizeof(float)`` lanes whatever the vector
      width (kernels/reduce/sum.h, ``sum_float_k1``; AVX holds them in two 8-lane
      registers, kernels/reduce/x86_avx.cc ``sum_k1_fp32_avx``), and
      ``horizontal_sum`` halves them as AVX-512 does (base/simd/vec.h);
    * YNNPACK's exp (``simd::exp``, base/simd/target_independent.inc, FMAs on AVX2
      as on AVX-512: base/simd/x86_vec256_base.h ``fma``) and XLA's own (LLVM's
      FMAs, element by element);
    * bf16 dots without AVX512-BF16: ``x86_avx2_fma3_bf16_bf16_fp32`` adds each
      pair's odd term first, then the even one, by FMAs in one chain, "to match
      the behavior of dpbf16ps" (kernels/dot/generator/x86_bf16_bf16_fp32.py,
      ``product``): the order the probes find with AVX512-BF16;
    * fp32 dots: ``x86_fma3_fp32`` (one chain), ``x86_avx2_fma3_fp32_k2`` (two
      chains, ``hadd``: c0 + c1; kernels/dot/generator/x86_fp32_k2.py), as the
      AVX-512 kernels' chains folded pairwise, whose tile_k the probes read.
    """

    name: str  # the CPU class, as :func:`fa_jax.kernels.x86.cpu.isa` names it
    gemv_lanes: tuple[int, ...]


AVX512 = VectorCode("AVX512", gemv_lanes=(8, 16))
AVX2 = VectorCode("AVX2", gemv_lanes=(8,))  # AVX2 and FMA: 256-bit registers
CODES = {code.name: code for code in (AVX512, AVX2)}


def qk_dot(q, k, *, pairs: bool, acc: Format, tile_k: int = 1, block: int | None = None):
    """fl32(Q Kᵀ), each dot ``tile_k`` sequential FMA chains over d (term t in chain
    t mod tile_k) folded pairwise, the last d mod tile_k terms as rounded products
    added in order, added last; with ``pairs`` (bf16 inputs) the terms in the order 1, 0, 3,
    2, ... (an odd last term comes last), else 0, 1, 2, ...  With ``block`` the
    terms before the remainder are cut into blocks of ``block`` (the last shorter),
    each summed so from zero and the block sums added in order (YNNPACK splits the
    reduction so where a dot has few rows: decoding shapes).  ``tile_k`` 0: every
    product rounded, added in order (YNNPACK's reference kernel,
    ``dot_fp32_1xNx1_1x1x1``: :func:`~fa_jax.kernels.xla.probes.qk_split`)."""
    d = q.shape[-1]
    if tile_k == 0:
        return _rounded_products([(q[..., :, None, t], k[..., None, :, t]) for t in range(d)], acc)
    if pairs:
        order = permuted(d, True)
        q, k = q[..., order], k[..., order]
    rest = d % tile_k if d > tile_k else 0
    if rest:
        main = qk_dot(
            q[..., : d - rest], k[..., : d - rest], pairs=False, acc=acc, tile_k=tile_k, block=block
        )
        tail = [(q[..., :, None, t], k[..., None, :, t]) for t in range(d - rest, d)]
        return ops.add(main, _rounded_products(tail, acc), acc)
    if block is not None and block < d:
        parts = [
            qk_dot(
                q[..., lo : lo + block],
                k[..., lo : lo + block],
                pairs=False,
                acc=acc,
                tile_k=tile_k,
            )
            for lo in range(0, d, block)
        ]
        total = parts[0]
        for part in parts[1:]:
            total = ops.add(total, part, acc)
        return total
    if d < tile_k:  # a short block: the kernel's lanes past d hold zeros
        q = jnp.concatenate([q, jnp.zeros((*q.shape[:-1], tile_k - d), q.dtype)], axis=-1)
        k = jnp.concatenate([k, jnp.zeros((*k.shape[:-1], tile_k - d), k.dtype)], axis=-1)
        d = tile_k
    steps = d // tile_k
    # Chain r holds terms r, r + tile_k, ...: (..., tile_k, N, steps) @ (..., tile_k, steps, M).
    qs = jnp.swapaxes(q.reshape(*q.shape[:-1], steps, tile_k), -1, -2)
    ks = jnp.swapaxes(k.reshape(*k.shape[:-1], steps, tile_k), -1, -2)
    qs = jnp.moveaxis(qs, -2, -3)
    ks = jnp.moveaxis(ks, -2, -3)
    chains = ops.matmul(qs, jnp.swapaxes(ks, -1, -2), acc, accumulation="sequential")
    return own_dots.fold(chains, acc)


def _chain(terms, acc: Format):
    """Sum axis -2 of ``terms`` left to right (the first term is exact, 0 + t)."""
    total = terms[..., 0, :]
    for i in range(1, terms.shape[-2]):
        total = ops.add(total, terms[..., i, :], acc)
    return total


def kahan(a, total, error, acc: Format):
    """One step of compensated (Kahan) summation: ``a`` corrected by the running
    error, added to ``total``; the new total and error (Higham 2002, Algorithm 4.2)."""
    y = ops.sub(a, error, acc)
    t = ops.add(total, y, acc)
    return t, ops.sub(ops.sub(t, total, acc), y, acc)


def softmax_sum(e, acc: Format):
    """The softmax sum: YNNPACK's ``sum_float_k1`` (ynnpack/kernels/reduce/sum.h) on
    16 float32 lanes, term j of a row in lane j mod 16.

    The row is read in chunks of 64 terms (4 per lane, summed left to right; a
    ragged last chunk padded with zeros).  While 256 terms or more remain, four
    chunks are summed left to right and their sum added to a level-1
    accumulator; after that, each chunk is added to it alone.  Each time 1024
    terms have been read, and at the end, the level-1 accumulator is added to
    the level-2 one by compensated (Kahan) summation and cleared.  The 16 lane
    sums are then halved (l + l+8, then + 4, + 2, + 1)."""
    m = e.shape[-1]
    chunks = -(-m // _CHUNK)
    pad = chunks * _CHUNK - m
    if pad:
        e = jnp.concatenate([e, jnp.zeros((*e.shape[:-1], pad), e.dtype)], axis=-1)
    # (..., chunks, 4, 16): a chunk's 4 vectors of 16 lanes.
    terms = e.reshape(*e.shape[:-1], chunks, _CHUNK // _LANES, _LANES)
    leaves = _chain(terms, acc)  # (..., chunks, 16)
    unrolled = m // (4 * _CHUNK)
    groups = leaves[..., : 4 * unrolled, :].reshape(*leaves.shape[:-2], unrolled, 4, _LANES)
    items = jnp.concatenate([_chain(groups, acc), leaves[..., 4 * unrolled :, :]], axis=-2)
    # The chunks read once each item is added: a compensated step at each 1024 terms.
    # YNNPACK's clock ticks in its loops over whole chunks only, so a ragged last
    # chunk (the kernel's remainder) never triggers one; the end does.
    read = [4 * (u + 1) for u in range(unrolled)] + list(range(4 * unrolled + 1, chunks + 1))
    flush = np.asarray([r % (_KAHAN // _CHUNK) == 0 for r in read])
    if pad:
        flush[-1] = False
    zeros = jnp.zeros_like(items[..., 0, :])

    def step(carry, item):
        level1, total, error = carry
        term, now = item
        level1 = ops.add(level1, term, acc)
        kahan_total, kahan_error = kahan(level1, total, error, acc)
        total = jnp.where(now, kahan_total, total)
        error = jnp.where(now, kahan_error, error)
        return (jnp.where(now, zeros, level1), total, error), None

    xs = (jnp.moveaxis(items, -2, 0), jnp.asarray(flush))
    level1, total, error = jax.lax.scan(step, (zeros, zeros, zeros), xs)[0]
    lanes = kahan(level1, total, error, acc)[0]
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = ops.add(lanes[..., :half], lanes[..., half:], acc)
    return lanes[..., 0]


Levels = tuple[tuple[int, int, bool], ...]  # reduce-windows: (size, leading pad, in YNNPACK)


def windowed_sum(e, levels: Levels, acc: Format, ynn_total: bool = False):
    """The softmax sum where XLA rewrites it as a tree reduction (decoding shapes):
    ``levels`` of ``reduce-window``, each of ``size`` terms (stride ``size``; ``pad``
    zeros before the row and as many as fill the last window after it), each
    window summed left to right from 0 in a loop fusion of XLA's, or by YNNPACK's
    sum (:func:`softmax_sum` on the padded window) where the windows sit in a
    YNNPACK fusion; the next level reduces the window sums so; then a ``reduce``
    of the last sums: XLA's, left to right from 0, or YNNPACK's (:func:`softmax_sum`
    again) where it sits in the last windows' fusion (``ynn_total``)."""
    for size, pad, ynn in levels:
        m = e.shape[-1]
        windows = -(-(pad + m) // size)
        after = windows * size - pad - m
        zeros = functools.partial(jnp.zeros, dtype=e.dtype)
        e = jnp.concatenate(
            [zeros((*e.shape[:-1], pad)), e, zeros((*e.shape[:-1], after))], axis=-1
        )
        terms = e.reshape(*e.shape[:-1], windows, size)
        e = softmax_sum(terms, acc) if ynn else _chain(jnp.swapaxes(terms, -1, -2), acc)
    if ynn_total:
        return softmax_sum(e, acc)
    return _chain(e[..., None], acc)[..., 0]


def _rounded_products(pairs, acc: Format):
    """A dot kernel's remainder (the last n mod tile_k terms): each product rounded,
    then added in order (no FMA), as measured against the real kernel."""
    a, b = pairs[0]
    total = ops.mul(a, b, acc)
    for a, b in pairs[1:]:
        total = ops.add(total, ops.mul(a, b, acc), acc)
    return total


def pv_dot(
    p,
    v,
    acc: Format,
    block: int,
    tile_k: int = 1,
    joined: bool = False,
    rest_fma: bool = False,
    tail: list | None = None,
):
    """fl32(P V): blocks of ``block`` keys; in each, ``tile_k`` FMA chains from zero
    (key j of the block in chain j mod tile_k), folded pairwise; the block sums
    added in order; the last N mod tile_k keys (the kernel's remainder) as
    rounded products added in order, added last.  ``joined``: the last keys, fewer
    than a block, are one block with the block before.  Each chain is a
    sequential matmul (:func:`fa_jax.ops.matmul`, on the float32 hardware where
    its products are exact), every block and chain at once, so the program's size
    does not grow with the number of blocks.  ``rest_fma``: the last N mod tile_k
    keys FMA'd in order onto the folded chains of the block they end (one of their
    own, from zero, where the blocks before are whole) before it is added
    (:attr:`~fa_jax.kernels.xla.own_dots.OwnDots.pv_rest_fma`); ``tail``, those
    keys' (P, V) pairs, given with the keys before them."""
    m = p.shape[-1]
    if joined and m > block and m % block:
        cut = (m // block - 1) * block
        last = pv_dot(p[..., cut:], v[..., cut:, :], acc, m - cut, tile_k)
        if not cut:
            return last
        return ops.add(pv_dot(p[..., :cut], v[..., :cut, :], acc, block, tile_k), last, acc)
    rest = m % tile_k if m > tile_k else 0
    if rest:
        tail = [(p[..., j, None], v[..., j, None, :]) for j in range(m - rest, m)]
        if rest_fma and (m - rest) % min(block, m):
            return pv_dot(p[..., : m - rest], v[..., : m - rest, :], acc, block, tile_k, tail=tail)
        main = pv_dot(p[..., : m - rest], v[..., : m - rest, :], acc, block, tile_k)
        if rest_fma:
            own = jnp.zeros_like(main)
            for a, b in tail:
                own = ops.fma(a, b, own, acc)
            return ops.add(main, own, acc)
        return ops.add(main, _rounded_products(tail, acc), acc)
    block = min(block, m)
    nb = -(-m // block)
    steps = -(-block // tile_k)
    pad = nb * steps * tile_k - m
    if pad:
        p = jnp.concatenate([p, jnp.zeros((*p.shape[:-1], pad), p.dtype)], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((*v.shape[:-2], pad, v.shape[-1]), v.dtype)], axis=-2)
    lead = p.ndim - 2
    # Chain r of block b: (..., nb, tile_k, N, steps) @ (..., nb, tile_k, steps, dv).
    ps = p.reshape(*p.shape[:-1], nb, steps, tile_k)
    ps = jnp.transpose(ps, (*range(lead), lead + 1, lead + 3, lead, lead + 2))
    vs = v.reshape(*v.shape[:-2], nb, steps, tile_k, v.shape[-1])
    vs = jnp.transpose(vs, (*range(lead), lead, lead + 2, lead + 1, lead + 3))
    chains = ops.matmul(ps, vs, acc, accumulation="sequential")
    blocks = own_dots.fold(chains, acc)  # (..., nb, N, dv)
    if tail:
        last = blocks[..., -1, :, :]
        for a, b in tail:
            last = ops.fma(a, b, last, acc)
        blocks = jnp.concatenate([blocks[..., :-1, :, :], last[..., None, :, :]], axis=-3)
    if nb == 1:
        return blocks[..., 0, :, :]

    def add(total, block_sum):
        return ops.add(total, block_sum, acc), None

    rest = jnp.moveaxis(blocks[..., 1:, :, :], -3, 0)
    return jax.lax.scan(add, blocks[..., 0, :, :], rest)[0]


def sharded_pv_dot(
    p,
    v,
    acc: Format,
    block: int,
    tile_k: int,
    shard: int,
    kc: int | None,
    rest_fma: bool = False,
):
    """fl32(P V) as Eigen's contraction sharded over the keys (``evalShardedByInnerDim``,
    unsupported/Eigen/src/Tensor/TensorContractionThreadPool.h): shards of ``shard``
    keys, each its own :func:`pv_dot` from zero into a buffer of its own, then the
    buffers summed in Eigen's order (:func:`~fa_jax.kernels.xla.own_dots.eigen_buffers_sum`).
    Each shard is cut in blocks for its own size by Eigen's ``kc``
    (:func:`~fa_jax.kernels.xla.own_dots.eigen_kc`); ``block``, probed at the first
    keys, where no kc cuts them (a shard of one block); ``rest_fma`` as :func:`pv_dot`'s,
    in each shard."""
    m = p.shape[-1]
    parts = [
        pv_dot(
            p[..., lo : lo + shard],
            v[..., lo : lo + shard, :],
            acc,
            block if kc is None else own_dots.eigen_kc(min(shard, m - lo), kc),
            tile_k,
            rest_fma=rest_fma,
        )
        for lo in range(0, m, shard)
    ]
    return own_dots.eigen_buffers_sum(parts, acc)


def permuted(d: int, pairs: bool) -> list[int]:
    """The order of the Q Kᵀ terms: 1, 0, 3, 2, ... (an odd last term last) with
    ``pairs``, else 0, 1, 2, ..."""
    if not pairs:
        return list(range(d))
    return [j for p in range(0, d - 1, 2) for j in (p + 1, p)] + ([d - 1] if d % 2 else [])
