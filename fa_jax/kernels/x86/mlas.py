"""MLAS (ONNX Runtime's math library) on x86-64: its FP32 GEMM, exp and softmax, as its
AVX-512F and its FMA3 (AVX2) kernels round them.

Step by step in :mod:`fa_jax.ops`, every step rounded as the vector instructions
round (sources: ``onnxruntime/core/mlas/lib``, ONNX Runtime 1.2x–1.3x).  MLAS picks
its kernels once, from CPUID (``platform.cpp``): the AVX-512F ones where the CPU has
AVX-512F, else the FMA3 ones where it has AVX2 and FMA; the two differ only in the
sum-exp kernel (:class:`SumExpKernel`: :data:`AVX512F`, :data:`FMA3`).

``sum_exp`` on x = fl(s + (-max)) (``MlasComputeSumExpF32KernelAvx512F``,
``x86_64/TransKernelAvx512F.S``; ``MlasComputeSumExpF32KernelFma3``,
``x86_64/TransKernelFma3.S``; constants ``MlasExpConstants`` in ``compute.cpp``)::

    x' = max(x, lower_range)              b = fma(x', log2 e, 1.5·2^23)
    m = b - 1.5·2^23                      r = fma(m, ln2_lo, fma(m, ln2_hi, x'))
    p = poly_0;  p = fma(p, r, c) for c in poly_1 … poly_4, 1, 1
    e = fl(p · 2^m)                       (one rounding, into the subnormals too)

AVX-512F: lower_range = ``LowerRange`` (-103.9720840454), 2^m by ``vscalefps``
(m >= -150).  FMA3: lower_range = ``LowerRangeSumExp`` (-88.3762626647949), so
m >= -127, and 2^m built from its bits, ((m + 127) << 23): m = -127 gives +0, so
e = +0 there (checked against ONNX Runtime's Softmax op, whose exps fall into the
subnormals).

Σ e in lanes (entry i into lane i mod L, each lane in index order): AVX-512F's
16 lanes first folded as lane i + lane i+8 (i < 8, ``vextractf64x4``), FMA3's 8
lanes as they are; then ((b0+b1)+(b2+b3)) + ((b4+b5)+(b6+b7)) (two ``vhaddps``,
``vextractf128``).

``softmax`` (``MlasComputeSoftmaxThreaded``, ``compute.cpp``): the row max,
``sum_exp``, then P = fl(e · fl(1 / Σ)) (the output kernel is AVX on both).

``sgemm`` (``MlasSgemmOperation``, ``sgemm.cpp``; kernels ``SgemmKernelAvx512F``,
``SgemmKernelFma3``, which round alike: no sum crosses lanes):
C = alpha·A B + beta·C with beta 0 or 1.  The K axis is cut in slices of
StrideK (128, doubled while StrideN = 128 halves for a narrow B: N < K and
StrideN / 2 >= N, down to StrideN = 16; halved while StrideK / 2 >= K for
N >= K); per slice each element is an FMA chain from zero over the slice, then
C = fl(acc · alpha) (the first slice with beta = 0) or fma(acc, alpha, C).
One row of A with alpha = 1 (``M == 1``) goes instead to
``MlasSgemmKernelM1Avx`` (B not transposed): products rounded (AVX, no FMA),
summed in groups of four (((p0 + p1) + p2) + p3), the groups added in order
onto C (beta = 1; from the first group for beta = 0), then a pair (p + p) and
a last single product for the K mod 4 rest
(measured with :func:`fa_jax.kernels.reveal.reveal_matmul_order` on ONNX
Runtime's MatMul).  ``MlasSgemmKernelM1TransposeBAvx`` (one row, B transposed,
alpha = 1, beta = 0): products rounded, product i into AVX lane i mod 8 in index
order (the K mod 8 rest too), then for columns in blocks of 4 (((l0 + l1) + l2) +
l3) + (((l4 + l5) + l6) + l7) (revealed with :func:`fa_jax.kernels.reveal.reveal_order`
through OpenVINO's F32 SDPA, whose last query row takes it where N mod 4 = 1; K =
16, 20, 64), for the N mod 4 last columns the trees of its blocks of 2 and 1
(``SgemmKernelM1TransposeBAvx.S``; checked against ONNX Runtime's Gemm); with beta
= 1 it is not modelled (:func:`sgemm` raises).  MLAS runs both one-row kernels
(AVX) on every x86 CPU with AVX, AVX-512F or not.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax.exponential import ExpModel, exact_pow2, register_exp_model
from fa_jax.formats import FP32

__all__ = [
    "AVX512F",
    "FMA3",
    "MLAS_SUM_EXP",
    "MLAS_SUM_EXP_FMA3",
    "STRIDE_K",
    "STRIDE_N",
    "SumExpKernel",
    "lane_sum",
    "sgemm",
    "softmax",
    "stride_k",
    "sum_exp",
]


def _f32_bits(bits: int) -> float:
    return float(np.array(bits, np.uint32).view(np.float32))


def _f32(literal: float) -> float:
    return float(np.float32(literal))


_ROUNDING_BIAS = _f32(12582912.0)  # MLAS_ROUNDING_BIAS_MAGIC, 1.5 · 2^23
_LOG2_RECIPROCAL = _f32(1.44269504088896341)
_LOG2_HIGH = _f32(-6.93145752e-1)
_LOG2_LOW = _f32(-1.42860677e-6)
_POLY = (
    float.fromhex("0x1.694000p-10"),
    float.fromhex("0x1.125edcp-7"),
    float.fromhex("0x1.555b5ap-5"),
    float.fromhex("0x1.555450p-3"),
    float.fromhex("0x1.fffff6p-2"),
    1.0,  # poly_56, applied twice
    1.0,
)
STRIDE_N = 128  # MLAS_SGEMM_STRIDEN
STRIDE_K = 128  # MLAS_SGEMM_STRIDEK


def _full(x, value: float):
    return jnp.full_like(x, value)


@dataclasses.dataclass(frozen=True)
class SumExpKernel:
    """One ISA's ``MlasComputeSumExpF32Kernel`` (module docstring): where it clamps x,
    how it scales by 2^m, and its lanes."""

    name: str
    lower_range: float  # x' = max(x, lower_range)
    scale_from_bits: bool  # 2^m from ((m + 127) << 23): m = -127 gives +0
    lanes: int  # 16 folded to 8 (lane i + lane i+8), or 8

    def __post_init__(self):
        if self.lanes not in (8, 16):
            raise ValueError(f"SumExpKernel.lanes: expected 8 or 16, got {self.lanes!r}")


AVX512F = SumExpKernel("avx512f", _f32(-103.9720840454), scale_from_bits=False, lanes=16)
FMA3 = SumExpKernel("fma3", _f32(-88.3762626647949), scale_from_bits=True, lanes=8)


def sum_exp(x, kernel: SumExpKernel = AVX512F):
    """e = MLAS's exp of the FP32 values ``x`` (the shifted scores s - max, already
    rounded), as ``kernel``'s softmax kernel computes it (module docstring)."""
    x = jnp.maximum(x, kernel.lower_range)
    bias = _full(x, _ROUNDING_BIAS)
    b = ops.fma(x, _full(x, _LOG2_RECIPROCAL), bias, FP32)
    m = ops.sub(b, bias, FP32)
    r = ops.fma(m, _full(m, _LOG2_HIGH), x, FP32)
    r = ops.fma(m, _full(m, _LOG2_LOW), r, FP32)
    p = _full(r, _POLY[0])
    for c in _POLY[1:]:
        p = ops.fma(p, r, _full(r, c), FP32)
    # p · 2^m rounded once (m >= -150); 2^(m + 64) keeps the first step exact.
    e = ops.mul(ops.mul(p, exact_pow2(m + 64), FP32), _full(p, 2.0**-64), FP32)
    if kernel.scale_from_bits:  # exponent field m + 127 = 0: the scale is +0
        e = jnp.where(m == -127, jnp.zeros_like(e), e)  # (the clamp keeps m >= -127)
    return e


def lane_sum(e, kernel: SumExpKernel = AVX512F):
    """Σ e over the last axis in ``kernel``'s lanes and its final reduction (module
    docstring)."""
    n = e.shape[-1]
    e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, -n % kernel.lanes)])  # + 0: exact (e >= 0)
    vectors = e.reshape(*e.shape[:-1], -1, kernel.lanes)
    b = ops.sum(vectors, FP32, axis=-2, accumulation="sequential")
    if kernel.lanes == 16:
        b = ops.add(b[..., 8:], b[..., :8], FP32)
    pairs = ops.add(b[..., 0::2], b[..., 1::2], FP32)  # b0+b1, b2+b3, b4+b5, b6+b7
    quads = ops.add(pairs[..., 0::2], pairs[..., 1::2], FP32)
    return ops.add(quads[..., 0], quads[..., 1], FP32)


def softmax(s, kernel: SumExpKernel = AVX512F):
    """MLAS's FP32 softmax over the last axis of FP32 scores ``s`` with ``kernel``'s
    sum-exp (module docstring)."""
    row_max = jnp.max(s, axis=-1, keepdims=True)
    e = sum_exp(ops.add(s, -row_max, FP32), kernel)
    total = lane_sum(e, kernel)
    reciprocal = ops.div(jnp.ones_like(total), total, FP32)
    return ops.mul(e, reciprocal[..., None], FP32)


def stride_k(n: int, k: int, *, trans_a: bool = False) -> int:
    """The K slice of ``MlasSgemmOperation`` for an (M, K) x (K, N) product."""
    sn, sk = STRIDE_N, STRIDE_K
    if n >= k:
        while sk // 2 >= k:
            sn, sk = sn * 2, sk // 2
    elif not trans_a:
        while sn > 16 and sn // 2 >= n:
            sn, sk = sn // 2, sk * 2
    return sk


def _m1(a, b, c):
    """``MlasSgemmKernelM1Avx`` on each row of A (..., M, K) alone, times B (..., K, N):
    products rounded, the groups added in order onto C (beta = 1) or from the
    first group (beta = 0)."""
    k = a.shape[-1]
    prod = ops.mul(a[..., :, :, None], b[..., None, :, :], FP32)  # (..., M, K, N)

    def group(lo: int, hi: int):
        g = prod[..., lo, :]
        for i in range(lo + 1, hi):
            g = ops.add(g, prod[..., i, :], FP32)
        return g

    cuts = list(range(0, k - k % 4, 4))
    groups = [(lo, lo + 4) for lo in cuts]
    rest = k - 4 * len(cuts)
    if rest >= 2:
        groups.append((4 * len(cuts), 4 * len(cuts) + 2))
    if rest % 2:
        groups.append((k - 1, k))
    acc = c
    if cuts:  # the groups of four in order, one vectorised chain
        quads = prod[..., : 4 * len(cuts), :].reshape(*prod.shape[:-2], len(cuts), 4, -1)
        g4 = quads[..., 0, :]
        for i in range(1, 4):
            g4 = ops.add(g4, quads[..., i, :], FP32)
        acc = ops.sum(g4, FP32, axis=-2, accumulation="sequential", initial=acc)
        groups = groups[len(cuts) :]
    for lo, hi in groups:
        g = group(lo, hi)
        acc = g if acc is None else ops.add(acc, g, FP32)
    assert acc is not None
    return acc


M1T_LANES = 8  # MlasSgemmKernelM1TransposeBAvx: one 8-lane AVX accumulator


def _m1_transpose_b(a, b):
    """``MlasSgemmKernelM1TransposeBAvx`` on each row of A (..., M, K) alone, times B
    (..., K, N) given transposed, beta = 0: products rounded, product i into lane
    i mod 8 in index order (the K mod 8 tail too), then a tree that depends on the
    output column's block (SgemmKernelM1TransposeBAvx.S): columns in blocks of 4
    (((l0 + l1) + l2) + l3) + (((l4 + l5) + l6) + l7); a block of 2 where N & 2,
    ((l0 + l2) + (l4 + l6)) + ((l1 + l3) + (l5 + l7)); a last column where N & 1,
    two horizontal adds, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); then
    + C (+0 for beta = 0: a -0 becomes +0).  The same AVX code on every x86 CPU
    (MLAS never replaces it)."""
    k, n = a.shape[-1], b.shape[-1]
    prod = ops.mul(a[..., :, None, :], jnp.swapaxes(b, -1, -2)[..., None, :, :], FP32)
    prod = jnp.pad(prod, [(0, 0)] * (prod.ndim - 1) + [(0, -k % M1T_LANES)])  # + 0: exact
    l = ops.sum(
        prod.reshape(*prod.shape[:-1], -1, M1T_LANES), FP32, axis=-2, accumulation="sequential"
    )

    def add(x, y):
        return ops.add(x, y, FP32)

    def chain(i, j):  # ((li + li+1) + li+2) + li+3 over the lanes i..j
        acc = l[..., i]
        for lane in range(i + 1, j):
            acc = add(acc, l[..., lane])
        return acc

    fours = add(chain(0, 4), chain(4, 8))
    pairs = add(
        add(add(l[..., 0], l[..., 2]), add(l[..., 4], l[..., 6])),
        add(add(l[..., 1], l[..., 3]), add(l[..., 5], l[..., 7])),
    )
    halves = add(
        add(add(l[..., 0], l[..., 1]), add(l[..., 2], l[..., 3])),
        add(add(l[..., 4], l[..., 5]), add(l[..., 6], l[..., 7])),
    )
    column = jnp.arange(n)
    tail = jnp.where(column < n - n % 2, pairs, halves) if n & 2 else halves
    out = jnp.where(column < n - n % 4, fours, tail)
    return add(out, jnp.zeros_like(out))


def sgemm(a, b, *, alpha: float = 1.0, c=None, trans_b: bool = False, rows_apart: bool = False):
    """fl(alpha · a @ b (+ c)) as MLAS's FP32 GEMM computes it (module docstring):
    ``a`` (..., M, K); ``b`` (..., K, N), given already transposed where the call
    passes Bᵀ (``trans_b`` only picks the one-row kernel); ``c`` the C that beta = 1
    adds (None: beta = 0).  ``rows_apart``: every row of ``a`` is its own call
    (M = 1), as a caller that runs them one by one."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    alpha = _f32(alpha)
    if (m == 1 or rows_apart) and alpha == 1.0:
        if trans_b:
            if c is not None:
                raise NotImplementedError(
                    "mlas.sgemm: MlasSgemmKernelM1TransposeBAvx with beta = 1 is not modelled"
                )
            return _m1_transpose_b(a, b)
        return _m1(a, b, c)
    step = min(stride_k(n, k), k)
    slices = -(-k // step)
    # Every slice's chain at once (one scan of ``step`` over a batch of slices, not one
    # program per slice): the last, short slice padded with zeros in front, as adding
    # 0 · 0 to the zero it starts from leaves it +0, the start of a chain anyway.
    front = slices * step - k
    last = (slices - 1) * step
    a = jnp.concatenate(
        [a[..., :last], jnp.zeros((*a.shape[:-1], front), a.dtype), a[..., last:]], -1
    )
    b = jnp.concatenate(
        [b[..., :last, :], jnp.zeros((*b.shape[:-2], front, n), b.dtype), b[..., last:, :]], -2
    )
    a_s = jnp.moveaxis(a.reshape(*a.shape[:-1], slices, step), -2, 0)  # (S, ..., M, step)
    b_s = jnp.moveaxis(b.reshape(*b.shape[:-2], slices, step, n), -3, 0)  # (S, ..., step, N)
    acc = ops.matmul(a_s, b_s, FP32, accumulation="sequential")  # (S, ..., M, N)
    alphas = _full(acc[0], alpha)
    out = ops.mul(acc[0], alphas, FP32) if c is None else ops.fma(acc[0], alphas, c, FP32)
    for i in range(1, slices):
        out = ops.fma(acc[i], alphas, out, FP32)
    return out


MLAS_SUM_EXP = ExpModel("mlas_sum_exp_avx512f", lambda x, fmt: ops.cast(sum_exp(x), fmt))
MLAS_SUM_EXP_FMA3 = ExpModel("mlas_sum_exp_fma3", lambda x, fmt: ops.cast(sum_exp(x, FMA3), fmt))
register_exp_model(MLAS_SUM_EXP)
register_exp_model(MLAS_SUM_EXP_FMA3)
