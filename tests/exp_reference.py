"""Independent numpy float32 evaluations of the vectorised exps that
fa_jax/exponential.py models: ATen's ``exp_u20`` and ``fexp_u20`` (ATen/cpu/vec,
vec256_float.h), Sleef's ``xexpf`` (sleefsimdsp.c, the u10 FMA build) and
YNNPACK's ``simd::exp`` (``exp_taylor2``, ynnpack/base/simd/target_independent.inc).

Each is written out from the published algorithm with numpy's float32
arithmetic (one IEEE rounding per ``+ - *``), its own copies of the source's
literals, and an FMA of three float32 values made exact here: the product is
exact in float64, the sum is rounded to odd at float64's 53 bits (TwoSum's
error term decides the sticky bit) and then once to float32, which is the
correctly rounded FMA since 53 >= 24 + 2.  Nothing is imported from fa_jax, so
a wrong constant, step or boundary in the models shows as a differing bit.
"""

from __future__ import annotations

import numpy as np

__all__ = ["exp_u20", "fexp_u20", "fma", "sleef_expf_u10", "ynnpack_exp"]

f32 = np.float32


def bits(u) -> np.ndarray:
    return np.asarray(u, np.uint32).view(np.float32)


def fma(a, b, c) -> np.ndarray:
    """fl32(a · b + c) for float32 a, b, c, rounded once."""
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b  # exact: 24 + 24 bits
        s = p + c
        bp = s - c
        err = (p - bp) + (c - (s - bp))  # TwoSum: s + err = p + c exactly
        odd = (err != 0) & np.isfinite(s) & ((s.view(np.uint64) & 1) == 0)
        s = np.where(odd, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def pow2(k) -> np.ndarray:
    """2^k as float32 from its bits (subnormals included), 0 below 2^-149, inf above 2^127."""
    k = np.asarray(k, np.int64)
    out = np.zeros(k.shape, np.float32)
    normal = (k >= -126) & (k <= 127)
    out[normal] = ((k[normal] + 127).astype(np.uint32) << 23).view(np.float32)
    sub = (k < -126) & (k >= -149)
    out[sub] = (np.uint32(1) << (k[sub] + 149).astype(np.uint32)).view(np.float32)
    out[k > 127] = np.inf
    return out


LOG2E = bits(0x3FB8AA3B)
LN2 = bits(0x3F317218)
LN_FLT_MIN = bits(0xC2AEAC50)
LN_FLT_MAX = bits(0x42B17218)

# exp_u20: 1/5! .. 1/1! as vec256_float.h writes them.
U20 = (0.00828929059, 0.0418978221, 0.166676521, 0.499991506, 0.999999701)
# fexp_u20: the cubic's coefficients, highest degree first.
FEXP = (-0.079204240219773236, -0.22433836478672356, 0.30354260500649682, 0.00010703434948458272)
# Sleef xexpf: L2Uf, L2Lf and the degree 7 .. 2 coefficients.
SLEEF_LN2 = (0.693145751953125, 1.428606765330187045e-06)
SLEEF = (
    0.000198527617612853646278381,
    0.00139304355252534151077271,
    0.00833336077630519866943359,
    0.0416664853692054748535156,
    0.166666671633720397949219,
    0.5,
)
# YNNPACK exp_taylor2: ln 2 split, the clamp, P's coefficients highest degree first.
YNN_LN2 = (6.9314575195e-01, 1.4286067653e-06)
YNN_CLAMP = (-88.02969360351562, 88.72283935546875)
YNN = (
    -4.9866619520e-05,
    2.2773783712e-04,
    1.4132461511e-03,
    8.3242934197e-03,
    4.1665628552e-02,
    1.6666725278e-01,
    4.9999994040e-01,
)


def exp_u20(x, coefficients=U20) -> np.ndarray:
    """Vectorized<float>::exp_u20: x clamped to [ln FLT_MIN, ln FLT_MAX] by min/max,
    n = floor(fma(x, log2 e, 1/2)), r = fnmadd(n, ln 2, x), Horner by fmadd, then
    times 2^(n-1) (built as the bits (n - 1 + 127) << 23, 0 below ln FLT_MIN) and 2."""
    x = np.asarray(x, np.float32)
    c = [f32(v) for v in coefficients]
    with np.errstate(invalid="ignore", over="ignore"):
        small = x < LN_FLT_MIN
        src = np.maximum(np.minimum(x, LN_FLT_MAX), LN_FLT_MIN)
        n = np.floor(fma(src, LOG2E, f32(0.5)))
        r = fma(-n, LN2, src)
        p = fma(r, c[0], c[1])
        for k in (*c[2:], f32(1.0)):
            p = fma(r, p, k)
        code = np.nan_to_num(n - 1).astype(np.int64) + 127  # n - 1 >= -127 after the clamp
        scale = (np.clip(code, 0, 255).astype(np.uint32) << 23).view(np.float32)
        scale = np.where(small, f32(0), scale)
        return ((p * scale) * f32(2)).astype(np.float32)


def fexp_u20(x, coefficients=FEXP) -> np.ndarray:
    """Vectorized<float>::fexp_u20: t = x log2 e, f = t - floor(t), t' = t - cubic(f),
    the integer cvtt(fma(2^23, t', 127 · 2^23)) read as float32 bits; 0 below
    ln FLT_MIN, inf above ln FLT_MAX."""
    x = np.asarray(x, np.float32)
    c = [f32(v) for v in coefficients]
    with np.errstate(invalid="ignore", over="ignore"):
        t = x * LOG2E
        frac = t - np.floor(t)
        p = fma(frac, c[0], c[1])
        for k in c[2:]:
            p = fma(frac, p, k)
        t = t - p
        code = np.trunc(fma(f32(2.0**23), t, f32(127 * 2.0**23)).astype(np.float64))
        y = np.clip(np.nan_to_num(code), 0, 0x7F800000).astype(np.uint32).view(np.float32)
        y = np.where(x < LN_FLT_MIN, f32(0), y)
        return np.where(x > LN_FLT_MAX, f32(np.inf), y).astype(np.float32)


def sleef_expf_u10(x, coefficients=SLEEF, ln2=SLEEF_LN2) -> np.ndarray:
    """Sleef's xexpf: q = rint(x log2 e), s = x - q ln2 in two fmas, u by Horner
    (vmla = fma), 1 + fma(s², u, s), vldexp2 (times 2^(q>>1), then 2^(q - (q>>1))),
    0 below -104, inf above 100, NaN kept."""
    x = np.asarray(x, np.float32)
    c = [f32(v) for v in coefficients]
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(x * LOG2E)
        s = fma(q, -f32(ln2[0]), x)
        s = fma(q, -f32(ln2[1]), s)
        u = np.full_like(s, c[0])
        for k in c[1:]:
            u = fma(u, s, k)
        u = f32(1) + fma(s * s, u, s)
        qi = np.clip(np.nan_to_num(q), -300, 300).astype(np.int64)
        half = qi >> 1
        y = (u * pow2(half)) * pow2(qi - half)
        y = np.where(x < -104, f32(0), y)
        y = np.where(x > 100, f32(np.inf), y)
        return np.where(np.isnan(x), x, y).astype(np.float32)


def ynnpack_exp(x, coefficients=YNN, ln2=YNN_LN2, clamp=YNN_CLAMP) -> np.ndarray:
    """YNNPACK's exp: x clamped, b = round(x log2 e) by the 1.5 · 2^23 trick,
    r = x - b ln2 in two fmas, s = r², P in s by even and odd Horner chains,
    expm1 = fma(s, fma(r, odd, even), r), y = fma(2^b, expm1, 2^b) (inf where
    2^b overflows), flushed to 0 below FLT_MIN, NaN kept."""
    x = np.asarray(x, np.float32)
    c = [f32(v) for v in coefficients]
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.minimum(np.maximum(x, f32(clamp[0])), f32(clamp[1]))
        t = xc * LOG2E
        magic = f32(1.5 * 2.0**23)
        b = (magic + t) - magic
        r = fma(b, -f32(ln2[0]), xc)
        r = fma(b, -f32(ln2[1]), r)
        s = r * r
        even, odd = np.full_like(s, c[0]), np.full_like(s, c[1])
        for k in (c[2], c[4], c[6]):
            even = fma(s, even, k)
        for k in (c[3], c[5]):
            odd = fma(s, odd, k)
        expm1 = fma(s, fma(r, odd, even), r)
        scale = pow2(np.nan_to_num(b).astype(np.int64))
        y = np.where(np.isinf(scale), scale, fma(scale, expm1, scale))
        y = np.where(y < np.finfo(np.float32).tiny, f32(0), y)
        return np.where(np.isnan(x), x, y).astype(np.float32)
