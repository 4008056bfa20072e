"""OpenVINO's CPU ScaledDotProductAttention numerics on x86-64 with AVX-512 or AVX2:
its exp, softmax, decoding dot product and oneDNN brgemm's BF16 dots.

Step by step in :mod:`fa_jax.ops` (sources: ``nodes/kernels/scaled_attn/`` and
``nodes/scaled_attn.cpp`` of openvinotoolkit/openvino's CPU plugin, 2025-2026):

``exp_ps`` (``exp_ps_avx512``), on x = fl(a - max)::

    x' = clamp(x, ln FLT_MIN, ln FLT_MAX)      (0xc2aeac50, 0x42b17218)
    n = floor(fl(fl(x' · log2 e) + 0.5))       r = fl(x' - n · ln 2)   (one fnmadd)
    p = p5;  p = fma(p, r, c) for c in p4, p3, p2, p1, 1
    e = fl(fl(p · 2^(n-1)) · 2)                (2^(n-1) from its bits; 0 where x < ln FLT_MIN)

``softmax`` (``attn_softmax_kernel<float>``, ``scale_add2_reduce_max``,
``exp_reduce_sum``, ``multiply_scalar``) of one row of raw scores s over the
keys a query may see: a = fl(s · scale), the row max, e = exp_ps(fl(a - max)),
Σ e in 16 lanes (entry j into lane j mod 16, each lane in index order), the
lanes reduced as GCC's ``_mm512_reduce_add_ps`` does (lane i + lane i+8, then i
+ i+4, then i + i+2, then the last two), then P = fl(e · fl(1 / Σ)), stored as
FP32 or rounded to BF16 (nearest even); keys a causal row may not see get P = 0.

``bf16_matmul`` (oneDNN's brgemm for ``avx512_core_bf16`` without AMX: K in one
block, one FP32 accumulator per output, ``vdpbf16ps`` on each pair of K): per
pair (2i, 2i+1) acc = fl(fl(acc + a_{2i+1} b_{2i+1}) + a_{2i} b_{2i}), the
products exact (Intel's SDM; an odd K padded with a zero).  With AMX: its tile
dot on K in chunks of 32 (:mod:`fa_jax.kernels.x86.tile_dot`, "blocks").  Denormals, which
the instructions flush, are not modelled.

The plugin builds its kernels for ``ANY``, ``AVX2`` and ``AVX512F`` and runs the
widest the CPU has; :class:`VectorCode` (:data:`AVX512F`, :data:`AVX2`) gives what
differs here: 16 or 8 lanes and the two horizontal sums.  On AVX2 the softmax's
8 lanes are summed by ``hsum`` (``common.hpp``), ((l0 + l1) + (l2 + l3)) + ((l4 +
l5) + (l6 + l7)); the decoding dot ends in ``simd::reduce`` (``simd_avx2.hpp``),
((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), over blocks of 8 and a scalar
tail d mod 8; ``exp_ps_avx2`` gives ``exp_ps_avx512``'s bits.  The AVX2 variant's
BF16 code is not modelled.

``dot_product`` (``mha_single_token.cpp``'s ``dot_product``, AVX-512, the decoding
kernel's Q·K on a BF16, FP32 or u8 cache): blocks of 16 entries of d, four at a
time into accumulators 0-3, each lane an FMA chain from zero.  With BF16 queries
a remaining pair of blocks goes into 0 and 1, a last one into 0, then (acc0 +
acc1) + (acc2 + acc3); with FP32 queries every remaining block goes into 0, then
((acc0 + acc1) + acc2) + acc3 (revealed on the real kernel with
:func:`fa_jax.kernels.reveal.reveal_order`, d = 20 to 112).  Then
``_mm512_reduce_add_ps``.  The last d mod 16 entries: the products rounded and
summed in order from the first, that sum added to the vector part's.

``bf16_scalar``: a BF16 output's last d mod 16 columns go through
``ov::bfloat16(float)``, (bits + ((bits >> 1) & 0x8000)) >> 16 (the columns before:
``vcvtneps2bf16``, ``store_bf16``); the AMX prefill stores a head's N · d outputs
as one run.

``quantize_u8`` (``attn_quant.cpp``'s ``quant_u8``, the u8 KV cache, one group per
token, the default group size): scale = fl(fl(max - min) / 255) (0.0001 where 0),
zp = fl(-min / scale), u = clamp(rint(fma(x, fl(1 / scale), zp)), 0, 255).  The
decoding kernel reads it back as fl(u - zp): its dot product runs on those and
multiplies the result by the key's scale; its P V weight is fl(p · scale of V).
With FP32 queries the kernel instead reads K and V back as fl(fl(u - zp) ·
scale) (``dequantize_u8``) and runs its FP32 path on those (found by trying the
candidates against the real kernel: this one gave every output).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.exponential import ExpModel, exact_pow2, register_exp_model
from fa_jax.formats import BF16, FP32
from fa_jax.kernels.x86.tile_dot import tile_dot

__all__ = [
    "AVX2",
    "AVX512F",
    "OPENVINO_EXP",
    "VectorCode",
    "bf16_matmul",
    "bf16_scalar",
    "dequantize_u8",
    "dot_product",
    "exp_ps",
    "lane_sum",
    "quantize_u8",
    "softmax",
    "store_bf16",
]

LANES = 16  # the AVX-512 code's lanes (the BF16 stores and the u8 paths)


def _halving_tree(lanes: int) -> tuple:
    """``_mm512_reduce_add_ps`` as GCC expands it: lane i + lane i + n/2, then the
    same on the n/2 sums, down to one."""
    tree: list = list(range(lanes))
    while len(tree) > 1:
        half = len(tree) // 2
        tree = [(tree[i], tree[i + half]) for i in range(half)]
    return tree[0]


@dataclasses.dataclass(frozen=True)
class VectorCode:
    """One of the plugin's cross-compiled variants of its attention kernels (module
    docstring): ``lanes`` FP32 lanes, ``softmax_sum`` the tree that adds the lanes
    of ``exp_reduce_sum``'s Σ e, ``dot_sum`` the one that ends the decoding dot
    product (nested pairs of lane indices, each pair one rounded addition);
    ``f32_u8`` how FP32 queries score u8 keys (``"dequantize"``: K read as
    :func:`dequantize_u8`, then the FP32 dot product; ``"affine"``:
    :func:`u8_dot_product`); V is read as :func:`dequantize_u8` in both."""

    name: str
    lanes: int
    softmax_sum: tuple
    dot_sum: tuple
    f32_u8: str


AVX512F = VectorCode("AVX512F", 16, _halving_tree(16), _halving_tree(16), "dequantize")
"""The ``AVX512F`` build: ``_mm512_reduce_add_ps`` for both sums."""

AVX2 = VectorCode(
    "AVX2",
    8,
    (((0, 1), (2, 3)), ((4, 5), (6, 7))),  # hsum (common.hpp)
    (((0, 4), (1, 5)), ((2, 6), (3, 7))),  # simd::reduce (simd_avx2.hpp)
    "affine",
)
"""The ``AVX2`` build (FMA3 on 8 lanes): ``hsum`` and ``simd::reduce``; FP32 queries
score u8 keys in the affine form (``use_affine_k``, ``is_avx2`` in
``mha_kv_cache_codec.cpp``: this build only)."""


def _tree_sum(lanes, tree):
    """The lanes (..., L) added as ``tree`` says, FP32: (...)."""
    if isinstance(tree, int):
        return lanes[..., tree]
    return ops.add(_tree_sum(lanes, tree[0]), _tree_sum(lanes, tree[1]), FP32)


def _f32_bits(bits: int) -> float:
    return float(np.array(bits, np.uint32).view(np.float32))


_LN_FLT_MIN = _f32_bits(0xC2AEAC50)
_LN_FLT_MAX = _f32_bits(0x42B17218)
_LOG2E = _f32_bits(0x3FB8AA3B)
_LN2 = _f32_bits(0x3F317218)
_POLY = (  # p5, p4, p3, p2, p1, 1
    *(_f32_bits(b) for b in (0x3C07CFCE, 0x3D2B9D0D, 0x3E2AAD40, 0x3EFFFEE3, 0x3F7FFFFB)),
    1.0,
)


def _full(x, value: float):
    return jnp.full_like(x, value)


def exp_ps(x):
    """OpenVINO's ``exp_ps_avx512`` of the FP32 values ``x`` (module docstring)."""
    underflow = x < _LN_FLT_MIN
    x = jnp.clip(x, _LN_FLT_MIN, _LN_FLT_MAX)
    n = jnp.floor(ops.add(ops.mul(x, _full(x, _LOG2E), FP32), _full(x, 0.5), FP32))
    r = ops.fma(-n, _full(x, _LN2), x, FP32)
    # (n - 1 + 127) << 23 as bits: 0 (the value +0) where n - 1 = -127.
    pow2 = jnp.where(underflow | (n - 1 < -126), 0.0, exact_pow2(n - 1))
    p = _full(r, _POLY[0])
    for c in _POLY[1:]:
        p = ops.fma(p, r, _full(r, c), FP32)
    y = ops.mul(p, pow2, FP32)
    return ops.mul(y, _full(y, 2.0), FP32)


def lane_sum(e, code: VectorCode = AVX512F, tree: tuple | None = None):
    """Σ e over the last axis in ``code.lanes`` lanes (entry j into lane j mod lanes,
    each lane in index order), the lanes added by ``tree`` (default: the softmax's,
    ``code.softmax_sum``; module docstring)."""
    n, width = e.shape[-1], code.lanes
    e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, -n % width)])  # + 0 is exact (e >= 0)
    lanes = ops.sum(e.reshape(*e.shape[:-1], -1, width), FP32, axis=-2, accumulation="sequential")
    return _tree_sum(lanes, code.softmax_sum if tree is None else tree)


def softmax(s, scale: float, keep=None, *, bf16: bool = False, code: VectorCode = AVX512F):
    """OpenVINO's softmax of FP32 raw scores ``s`` (..., N, M) over the last axis,
    the scores times ``scale`` first; ``keep`` (broadcastable boolean, True = the
    key is seen; None: all) gives P = 0 elsewhere; ``bf16`` rounds P to BF16;
    ``code`` the variant whose Σ e it follows."""
    a = ops.mul(s, _full(s, float(np.float32(scale))), FP32)
    if keep is None:
        keep = jnp.ones(a.shape, bool)
    row_max = jnp.max(jnp.where(keep, a, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(keep, exp_ps(ops.sub(a, row_max, FP32)), 0.0)
    total = lane_sum(e, code)
    reciprocal = ops.div(jnp.ones_like(total), total, FP32)
    p = ops.mul(e, reciprocal[..., None], FP32)
    return ops.cast(p, BF16) if bf16 else p


def bf16_matmul(a, b, *, amx: bool = False):
    """a (..., N, K) @ b (..., K, M) of BF16 values as ``vdpbf16ps`` chains compute it,
    FP32, or (``amx``) AMX's tile dots (module docstring)."""
    if amx:
        return tile_dot(a, b, FP32, chunking="blocks")
    k = a.shape[-1]
    if k % 2:  # the packed K is padded with a zero
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, 1)])
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, 1), (0, 0)])
        k += 1
    odd_first = np.arange(k).reshape(-1, 2)[:, ::-1].reshape(-1)
    return ops.matmul(a[..., odd_first], b[..., odd_first, :], FP32, accumulation="sequential")


def _accumulator_of_blocks(blocks: int, fp32: bool) -> list[int]:
    out = [0, 1, 2, 3] * (blocks // 4)
    if fp32:  # the blocks after the last four all into accumulator 0
        return out + [0] * (blocks % 4)
    if len(out) + 2 <= blocks:
        out += [0, 1]
    if len(out) + 1 <= blocks:
        out += [0]
    return out


def _four_accumulators(terms, width: int, fp32: bool, tree: tuple):
    """The exact ``terms`` (..., B) (B a multiple of ``width``) summed as the decoding
    kernel's vector loops sum them: blocks of ``width`` lanes into four accumulators
    (each lane a chain of additions, or of FMAs, from zero: the same roundings), four
    blocks at a time, the rest as :func:`_accumulator_of_blocks` says; the
    accumulators added in the ``fp32`` or the other order, the lanes by ``tree``."""
    blocks = terms.reshape(*terms.shape[:-1], terms.shape[-1] // width, width)
    owner = _accumulator_of_blocks(blocks.shape[-2], fp32)
    acc = []
    for j in range(4):
        mine = [b for b, a in enumerate(owner) if a == j]
        if mine:
            acc.append(ops.sum(blocks[..., mine, :], FP32, axis=-2, accumulation="sequential"))
        else:
            acc.append(jnp.zeros((*blocks.shape[:-2], width), blocks.dtype))
    if fp32:
        total = ops.add(ops.add(ops.add(acc[0], acc[1], FP32), acc[2], FP32), acc[3], FP32)
    else:
        total = ops.add(ops.add(acc[0], acc[1], FP32), ops.add(acc[2], acc[3], FP32), FP32)
    return _tree_sum(total, tree)


def dot_product(q, k, *, fp32: bool = False, code: VectorCode = AVX512F):
    """q (..., N, d) · k (..., M, d) -> (..., N, M) as the decoding kernel's
    ``dot_product`` computes each entry, FP32 (module docstring); ``fp32``: the
    order it takes for FP32 queries; ``code``: the variant (lanes, final sum)."""
    d, width = q.shape[-1], code.lanes
    body = d - d % width
    out = None
    if body:
        prod = q[..., :, None, :body] * k[..., None, :, :body]  # (..., N, M, body), exact
        out = _four_accumulators(prod, width, fp32, code.dot_sum)
    if body < d:  # the scalar tail: its own sum of rounded products, then added
        tail = ops.mul(q[..., :, None, body:], k[..., None, :, body:], FP32)
        tail = ops.sum(tail, FP32, axis=-1, accumulation="sequential")
        out = tail if out is None else ops.add(out, tail, FP32)
    return out


def u8_dot_product(q, u, scale, zp, code: VectorCode = AVX2):
    """q (..., N, d) · the u8 keys (..., M, d) -> (..., N, M), FP32, as the AVX2 build
    scores FP32 queries on a u8 cache (``mha_kv_cache``, ``mha_kv_cache_codec.cpp``,
    ``use_affine_k``: the zero point subtracted after the dot, one group per key):
    u the keys' integers, ``scale`` and ``zp`` (..., M, 1) theirs.  The query's sum
    first (``q_group_sums``): its blocks of 8 added into one accumulator,
    ``simd::reduce``, then its last d mod 8 entries added in order.  Then
    raw = Σ q·u as :func:`dot_product` with FP32 queries (``codec_dot``: the u8 read
    as its integer, ``RawDecoder<uint8_t>``), and ``AffineView::correct_dot``
    (``codecs/codecs.hpp``): scale · (raw - zp · Σ q), the inner difference one
    FMA."""
    d, width = q.shape[-1], code.lanes
    body = d - d % width
    head = jnp.zeros(q.shape[:-1], q.dtype)
    if body:
        blocks = q[..., :body].reshape(*q.shape[:-1], body // width, width)
        lanes = ops.sum(blocks, FP32, axis=-2, accumulation="sequential")
        head = _tree_sum(lanes, code.dot_sum)
    if body < d:
        terms = jnp.concatenate([head[..., None], q[..., body:]], axis=-1)
        head = ops.sum(terms, FP32, axis=-1, accumulation="sequential")
    raw = jnp.asarray(dot_product(q, u, fp32=True, code=code))
    zp_t = jnp.broadcast_to(jnp.swapaxes(zp, -1, -2), raw.shape)  # (..., N, M)
    scale_t = jnp.broadcast_to(jnp.swapaxes(scale, -1, -2), raw.shape)
    head = jnp.broadcast_to(head[..., None], raw.shape)
    return ops.mul(scale_t, ops.fma(-zp_t, head, raw, FP32), FP32)


def bf16_scalar(x):
    """``ov::bfloat16(float)`` of the FP32 values ``x``, the scalar stores of BF16
    outputs: (bits + ((bits >> 1) & 0x8000)) >> 16 (module docstring)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded = (bits + ((bits & np.uint32(0x10000)) >> 1)) & np.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(x.dtype)


def store_bf16(x):
    """The FP32 values ``x`` stored to BF16 along their last axis as the plugin's
    converting copy does: whole blocks of :data:`LANES` by ``vcvtneps2bf16`` (to
    nearest even), the last (length mod 16) by :func:`bf16_scalar`."""
    vector = x.shape[-1] - x.shape[-1] % LANES
    return jnp.concatenate([ops.cast(x[..., :vector], BF16), bf16_scalar(x[..., vector:])], axis=-1)


def quantize_u8(x):
    """(u, scale, zp) of the u8 cache for FP32 values ``x`` (..., M, S), one scale and
    zero point per row (module docstring); u as float64 integers, scale and zp (..., M, 1)."""
    hi = jnp.max(x, axis=-1, keepdims=True)
    lo = jnp.min(x, axis=-1, keepdims=True)
    scale = ops.div(ops.sub(hi, lo, FP32), _full(hi, 255.0), FP32)
    scale = jnp.where(scale == 0, float(np.float32(0.0001)), scale)
    zp = ops.div(-lo, scale, FP32)
    inverse = ops.div(jnp.ones_like(scale), scale, FP32)
    t = ops.fma(x, jnp.broadcast_to(inverse, x.shape), jnp.broadcast_to(zp, x.shape), FP32)
    return jnp.clip(jnp.round(t), 0, 255), scale, zp  # jnp.round: to nearest even


def dequantize_u8(x):
    """FP32 values ``x`` (..., M, S) through the u8 cache and back as the FP32
    decoding kernel reads them: fl(fl(u - zp) · scale) (module docstring)."""
    u, scale, zp = quantize_u8(x)
    return ops.mul(
        ops.sub(u, jnp.broadcast_to(zp, u.shape), FP32), jnp.broadcast_to(scale, u.shape), FP32
    )


OPENVINO_EXP = ExpModel("openvino_exp_ps_avx512", lambda x, fmt: ops.cast(exp_ps(x), fmt))
register_exp_model(OPENVINO_EXP)
