"""ggml's CPU vector routines on x86-64, AVX-512 or AVX2 builds, step by step in :mod:`fa_jax.ops`.

Each function rounds as the compiled routine of ggml 0.25.3 (``ggml/src/ggml-cpu``,
vendored by llama-cpp-python 0.3.36; built with ``-O3 -std=gnu++17`` and the build's
``-m`` flags, so GCC contracts ``a*b + c`` into one FMA) rounds.  Which vector code
a build holds is a :class:`VecCode`: :data:`AVX512` (``__AVX512F__``, with
AVX512-BF16 and AVX512-DQ: ``GGML_F32_EPR = 16``, ``GGML_F32_STEP = 64``) or
:data:`AVX2` (``__AVX2__`` with FMA and F16C, no AVX-512: ``GGML_F32_EPR = 8``,
``GGML_F32_STEP = 32``) (``simd-mappings.h``); every function takes it as ``code``
(default :data:`AVX512`).  Values are FP32 (or FP16) values held in float64
carriers; the last axis is the vector.

* :func:`dot_f32` -- ``ggml_vec_dot_f32`` (``vec.cpp:11``): ``GGML_F32_ARR = 4``
  accumulators of ``EPR`` lanes, one FMA per ``STEP``-element step, then
  ``GGML_F32_VEC_REDUCE``: acc0+acc2, acc1+acc3, then their sum, then the lanes --
  AVX-512 (``GGML_F32x16_REDUCE``, simd-mappings.h:464): GCC's
  ``_mm512_reduce_add_ps``: halves of 8, of 4, then (l0+l2)+(l1+l3); AVX2
  (``GGML_F32x8_REDUCE``, simd-mappings.h:602): the two 128-bit halves added, then
  two ``_mm_hadd_ps``: (l0+l1)+(l2+l3) -- and the leftovers ``sumf += x*y`` product
  and sum rounded apart (not contracted: found by experiment, d = 80).
* :func:`dot_f16` -- ``ggml_vec_dot_f16`` (``vec.cpp:264``, ``GGML_F16_DOT_*`` =
  ``GGML_F16_*``: the same lanes, step and REDUCE as F32) on FP16 inputs widened to
  FP32, then the leftovers' exact products added in double and the result rounded to
  FP32.
* :func:`dot_bf16` -- ``ggml_vec_dot_bf16`` (``vec.cpp:139``).  AVX512-BF16: per 64
  elements two ``vdpbf16ps`` on accumulators c1 (elements 0..31) and c2 (32..63),
  lane j adding the products of elements 2j+1 then 2j, each addition rounded to FP32
  (the Intel SDM's order; products of BF16 values are exact);
  ``_mm512_reduce_add_ps`` of c1 then of c2 added in double.  AVX2 (vec.cpp:172):
  per 32 elements ``c_j = x·y + c_j`` on four accumulators of 8 lanes (elements
  8j..8j+7; the products exact, so contracted or not alike), ``(c1+c3)+(c2+c4)``,
  halves of 4, then (l0+l2)+(l1+l3) (``_mm_movehl_ps``, ``_mm_movehdup_ps``), into
  double.  Then the leftovers' exact products in double, rounded to FP32.
* :func:`reduce_add` -- one vector's sum in ``ggml_vec_soft_max_f32`` (vec.cpp:531):
  ``_mm512_reduce_add_ps`` (16 lanes) or the AVX2 branch's ``_mm_movehl_ps`` /
  ``_mm_movehdup_ps`` sum (8 lanes): halving trees both.
* :func:`v_expf` -- ``ggml_v_expf`` (``vec.h``): ARM's optimized-routines exp,
  ``z = fma(x, log2 e, 0x1.8p23)``, ``n = z - 0x1.8p23``, ``b = x - n·ln2_hi -
  n·ln2_lo`` (two FMAs), ``u = b²``.  AVX-512 (``ggml_v_expf(__m512)``, vec.h:1191):
  ``j = 1 + b·(c0 + ...)`` as a degree-5 polynomial in ``b`` and ``u`` ending in
  ``fma(c0, b, 1)``, ``scalef(j, n)``; 0 or inf where ``|n| > 192``.  AVX2
  (``ggml_v_expf(__m256)``, vec.h:1234): the polynomial ends in ``fl(c0·b)`` without
  the 1, ``k = 2^n`` made from z's bits, the result ``fma(k, j, k)`` where ``|n| <=
  126``; ``fl(fma(s2, j, s2) · s1)`` with ``s1·s2 = 2^n`` (``s1 = 2^-125`` for
  ``n <= 0``, ``2^127`` otherwise) where ``126 < |n| <= 192``; ``fl(s1·s1)`` (0 or
  inf) beyond.
* :func:`hsum_float_8` -- ``hsum_float_8`` (``arch/x86/quants.c``): halves of 4,
  then (l0+l2)+(l1+l3).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from fa_jax import ops
from fa_jax.formats import FP32, get_format

__all__ = [
    "AVX2",
    "AVX512",
    "CODES",
    "VecCode",
    "dot_bf16",
    "dot_f16",
    "dot_f32",
    "hsum_float_8",
    "reduce_add",
    "reduce_add_16",
    "v_expf",
]

FP64 = get_format("fp64")


@dataclass(frozen=True)
class VecCode:
    """The x86 vector code of one ggml build, as far as it changes the roundings.

    ``lanes``: ``GGML_F32_EPR`` (= ``GGML_F16_EPR``), the FP32 lanes of a vector; the
    dots' step is ``GGML_F32_ARR = 4`` vectors of them.  ``reduce_hadd``:
    ``GGML_F32_VEC_REDUCE`` sums the last 4 lanes by two ``_mm_hadd_ps``, adjacent
    lanes first (AVX), not by halves (``_mm512_reduce_add_ps``).  ``bf16_pairs``:
    ``ggml_vec_dot_bf16`` by ``vdpbf16ps`` on BF16 pairs (AVX512-BF16), not by
    multiplies and adds on 8 lanes (AVX2).  ``exp_scalef``: ``ggml_v_expf`` ends in
    ``vscalefps`` of ``1 + b·p(b)`` (AVX-512), not in ``fma(2^n, b·p(b), 2^n)`` with
    its two wider ranges (AVX2).
    """

    name: str
    lanes: int
    reduce_hadd: bool
    bf16_pairs: bool
    exp_scalef: bool

    @property
    def step(self) -> int:
        """``GGML_F32_STEP``: the elements of one step of the dots."""
        return 4 * self.lanes


AVX512 = VecCode("AVX512", lanes=16, reduce_hadd=False, bf16_pairs=True, exp_scalef=True)
AVX2 = VecCode("AVX2", lanes=8, reduce_hadd=True, bf16_pairs=False, exp_scalef=False)
CODES = {c.name: c for c in (AVX512, AVX2)}


def _tree(x, width: int):
    """Halve the last axis (``width`` lanes) as the x86 horizontal reductions do: lanes
    i and i + width/2 summed, down to 2 lanes, then l0 + l1."""
    while width > 2:
        half = width // 2
        x = ops.add(x[..., half:width], x[..., :half], FP32)
        width = half
    return ops.add(x[..., 0], x[..., 1], FP32)


def reduce_add(x, code: VecCode = AVX512):
    """The sum of one vector (``code.lanes`` on the last axis) in
    ``ggml_vec_soft_max_f32``: a halving tree."""
    return _tree(x, code.lanes)


def reduce_add_16(x):
    """``_mm512_reduce_add_ps`` of the 16 lanes on the last axis."""
    return _tree(x, 16)


def hsum_float_8(x):
    """``hsum_float_8`` of the 8 lanes on the last axis."""
    return _tree(x, 8)


def _vec_reduce(x, code: VecCode):
    """``GGML_F32_VEC_REDUCE``'s last step: one vector's lanes (last axis) to a sum."""
    if not code.reduce_hadd:
        return _tree(x, code.lanes)
    while x.shape[-1] > 4:  # the 128-bit halves: lanes i and i + 4
        half = x.shape[-1] // 2
        x = ops.add(x[..., :half], x[..., half:], FP32)
    pairs = ops.add(x[..., 0::2], x[..., 1::2], FP32)  # _mm_hadd_ps: (l0+l1), (l2+l3)
    return ops.add(pairs[..., 0], pairs[..., 1], FP32)


def _accumulate(x, y, code: VecCode):
    """The ``STEP``-element steps of the dots: 4 accumulators of ``lanes``, one FMA per
    step; returns them (..., 4, lanes) and the number of elements used."""
    n = x.shape[-1]
    step, lanes = code.step, code.lanes
    np_ = n - n % step
    lead = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = jnp.zeros((*lead, 4, lanes), jnp.float64)
    for i in range(0, np_, step):
        xb = x[..., i : i + step].reshape(*x.shape[:-1], 4, lanes)
        yb = y[..., i : i + step].reshape(*y.shape[:-1], 4, lanes)
        acc = ops.fma(xb, yb, acc, FP32)
    return acc, np_


def _fold(acc):
    """(acc0 + acc2) + (acc1 + acc3), lane by lane."""
    a0 = ops.add(acc[..., 0, :], acc[..., 2, :], FP32)
    a1 = ops.add(acc[..., 1, :], acc[..., 3, :], FP32)
    return ops.add(a0, a1, FP32)


def _vector_part(x, y, code: VecCode):
    """The steps of ``ggml_vec_dot_f32``/``_f16`` and ``GGML_F32_VEC_REDUCE``; returns
    the FP32 sum and the number of elements used."""
    acc, np_ = _accumulate(x, y, code)
    return _vec_reduce(_fold(acc), code), np_


def dot_f32(x, y, code: VecCode = AVX512):
    """``ggml_vec_dot_f32`` of FP32 vectors on the last axis (broadcast)."""
    s, np_ = _vector_part(x, y, code)
    for i in range(np_, x.shape[-1]):
        s = ops.add(s, ops.mul(x[..., i], y[..., i], FP32), FP32)
    return s


def _leftovers_in_double(s, x, y, start: int):
    """``sumf += (ggml_float)(x[i]*y[i])`` from ``start`` (exact products in double),
    then ``*s = sumf`` rounded to FP32."""
    for i in range(start, x.shape[-1]):
        s = ops.add(s, ops.mul(x[..., i], y[..., i], FP64), FP64)
    return ops.cast(s, FP32)


def dot_f16(x, y, code: VecCode = AVX512):
    """``ggml_vec_dot_f16`` of FP16 vectors on the last axis (broadcast)."""
    s, np_ = _vector_part(x, y, code)
    if np_ < x.shape[-1]:
        # double sumf += (double)(x*y): the FP16 products are exact in FP32 and the
        # double additions plain float64 arithmetic
        s = _leftovers_in_double(s, x, y, np_)
    return s


def dot_bf16(x, y, code: VecCode = AVX512):
    """``ggml_vec_dot_bf16`` of BF16 vectors on the last axis (broadcast)."""
    if not code.bf16_pairs:
        acc, np_ = _accumulate(x, y, code)
        return _leftovers_in_double(_tree(_fold(acc), code.lanes), x, y, np_)
    n = x.shape[-1]
    np_ = n - n % 64
    lead = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = jnp.zeros((*lead, 2, 16), jnp.float64)
    for i in range(0, np_, 64):
        xb = x[..., i : i + 64].reshape(*x.shape[:-1], 2, 16, 2)
        yb = y[..., i : i + 64].reshape(*y.shape[:-1], 2, 16, 2)
        acc = ops.fma(xb[..., 1], yb[..., 1], acc, FP32)
        acc = ops.fma(xb[..., 0], yb[..., 0], acc, FP32)
    s = ops.add(reduce_add_16(acc[..., 0, :]), reduce_add_16(acc[..., 1, :]), FP64)
    return _leftovers_in_double(s, x, y, np_)


_LOG2E = float.fromhex("0x1.715476p+0")
_SHIFT = float.fromhex("0x1.8p23")
_LN2_HI = float.fromhex("0x1.62e4p-1")
_LN2_LO = float.fromhex("0x1.7f7d1cp-20")
_C = tuple(
    float.fromhex(h)
    for h in ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7")
)


def v_expf(x, code: VecCode = AVX512):
    """``ggml_v_expf`` of FP32 values ``x``, as FP32 values."""
    c = lambda value: jnp.full_like(x, value)  # noqa: E731
    z = ops.fma(x, c(_LOG2E), c(_SHIFT), FP32)
    n = ops.sub(z, c(_SHIFT), FP32)
    b = ops.fma(-n, c(_LN2_LO), ops.fma(-n, c(_LN2_HI), x, FP32), FP32)
    u = ops.mul(b, b, FP32)
    high = ops.fma(
        ops.fma(c(_C[4]), b, c(_C[3]), FP32), u, ops.fma(c(_C[2]), b, c(_C[1]), FP32), FP32
    )
    big = jnp.abs(n) > 192
    if code.exp_scalef:
        j = ops.fma(high, u, ops.fma(c(_C[0]), b, c(1.0), FP32), FP32)
        # scalef(j, n) = j · 2^n rounded once (n is an integer here; |n| <= 192)
        safe_n = jnp.where(big, 0.0, n)
        res = ops.cast(jnp.ldexp(j, safe_n.astype(jnp.int32)), FP32)
        alt = jnp.where(n <= 0, 0.0, jnp.inf)
        return jnp.where(big, alt, res)
    j = ops.fma(high, u, ops.mul(c(_C[0]), b, FP32), FP32)
    safe_n = jnp.where(big | jnp.isnan(n), 0.0, n).astype(jnp.int32)
    k = jnp.ldexp(jnp.ones_like(x), safe_n)  # 2^n, exact for |n| <= 126
    near = ops.fma(k, j, k, FP32)
    # 126 < |n| <= 192: s2 = 2^(n + 125), s1 = 2^-125 (n <= 0); 2^(n - 127), 2^127
    low = n <= 0
    s1 = jnp.where(low, 2.0**-125, 2.0**127)
    s2 = jnp.ldexp(jnp.ones_like(x), jnp.where(low, safe_n + 125, safe_n - 127))
    far = ops.mul(ops.fma(s2, j, s2, FP32), s1, FP32)
    beyond = jnp.where(low, 0.0, jnp.inf)  # fl(s1 · s1): 2^-250 or 2^254
    return jnp.where(big, beyond, jnp.where(jnp.abs(n) > 126, far, near))
