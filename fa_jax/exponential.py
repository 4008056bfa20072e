"""Exp implementations: which exponential a kernel's softmax computes.

A real kernel rarely computes a correctly rounded exp: PyTorch's CPU flash
attention evaluates a polynomial (``fexp_u20``) on full vectors of lanes and
the C library's ``expf`` on the rest.  An :class:`ExpModel` names one such
implementation; ``fn(x, fmt)`` returns its result for the carrier array ``x``
(the shifted scores; last axis = the key positions of the current block),
composed only of :mod:`fa_jax.ops` operations, so it is jittable and bit-exact.

:data:`CORRECTLY_ROUNDED` (``ops.exp``, fl_fmt(exp(x))) is the default of every
policy.  :data:`EXP2` (``ops.exp2``, fl_fmt(2^x)) is the exp of a policy that
folds the softmax scale and log2 e into one FMA before an exp2, as the
FlashAttention-2/3 CUDA kernels do (``Policy.scale == "exp2"``; their
``ex2.approx`` is not correctly rounded, and with no GPU to read its bits from,
the correctly rounded exp2 stands in for it).  More are registered by
:func:`register_exp_model`.

:func:`exp_u20` and :func:`fexp_u20` are ATen's vectorised FP32 exps
(``Vectorized<float>::exp_u20`` and ``::fexp_u20`` in PyTorch's ``ATen/cpu/vec``),
step by step, every step rounded to FP32 as the vector instructions round
(the constants are the FP32 values of the source's literals).  ``exp_u20``,
with x clamped to [ln FLT_MIN, ln FLT_MAX]::

    n = floor(fma(x, log2 e, 1/2))           r = fma(-n, ln 2, x)
    p = 1 + r(c1 + r(c2 + r(c3 + r(c4 + r c5))))      (Horner, one fma a step)
    y = fl(fl(p · 2^(n-1)) · 2)              (2^(n-1) = 0 below 2^-126)

and y = 0 for x < ln FLT_MIN.  ``fexp_u20`` (Schraudolph's exponent-field trick
with a cubic correction) computes t = fl(x log2 e), f = t - floor(t),
t' = fl(t - (c0 + f(c1 + f(c2 + f c3)))) and reads the integer
trunc(fl(2^23 t' + 127 · 2^23)) as the bits of an FP32 number; 0 below
ln FLT_MIN, inf above ln FLT_MAX.

:func:`vectorised` builds the model of a loop that runs a vector exp on full
vectors of ``lanes`` entries and the C library's scalar ``expf`` (modelled as
correctly rounded) on the rest: :data:`TORCH_AVX2` is PyTorch's CPU
flash-attention softmax on AVX2 (8 lanes, ``fexp_u20``).  :data:`SLEEF_U10`
is ATen's ``Vectorized<float>::exp`` (Sleef's ``expf`` to 1 ulp), the exp of
PyTorch's CPU softmax, on every entry.

:func:`ynnpack_exp` is YNNPACK's float32 exp (``simd::exp``, ``exp_taylor2`` in
``ynnpack/base/simd/target_independent.inc`` of google/XNNPACK), which XLA's
CPU backend runs for an exp inside a YNNPACK fusion: x clamped to
[-88.0297, 88.7228], b = round(fl(x log2 e)), r = fma(b, -ln2_lo, fma(b,
-ln2_hi, x)), expm1(r) ~ r + r²·P(r) with P of degree 6 evaluated in r² (even and
odd terms apart), and y = fma(2^b, expm1(r), 2^b): :data:`YNNPACK`.

:func:`glibc_expf` is glibc's scalar ``expf`` (``sysdeps/ieee754/flt-32/e_expf.c``,
glibc 2.27 and later: a 32-entry table of 2^(i/32) and a cubic, in double), the
``std::exp`` of PyTorch's CPU kernels: :data:`GLIBC_EXPF` on every entry, and
:data:`TORCH_FLASH_AVX2` / :data:`TORCH_FLASH_AVX512`, ``fexp_u20`` on full
vectors of 8 / 16 lanes and glibc's ``expf`` on the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from decimal import Decimal, localcontext

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import ops
from fa_jax._checks import one_of
from fa_jax.formats import FP32, Format, get_format
from fa_jax.widening import widen

__all__ = [
    "CORRECTLY_ROUNDED",
    "EXP2",
    "GLIBC_EXPF",
    "SLEEF_U10",
    "TORCH_AVX2",
    "TORCH_FLASH_AVX2",
    "TORCH_FLASH_AVX512",
    "YNNPACK",
    "ExpModel",
    "exp_models",
    "exp_u20",
    "fexp_u20",
    "get_exp_model",
    "glibc_expf",
    "register_exp_model",
    "sleef_expf_u10",
    "vectorised",
    "ynnpack_exp",
]


_BASES = ("e", "2")


@dataclasses.dataclass(frozen=True)
class ExpModel:
    """An exp implementation: ``fn(x, fmt)`` is its result on the carrier ``x``,
    rounded to ``fmt`` as that implementation rounds; ``base`` "e" (e^x) or "2"
    (2^x, for policies that fold the softmax scale into an exp2:
    ``Policy.scale == "exp2"``)."""

    name: str
    fn: Callable[[jax.Array, Format], jax.Array]
    base: str = "e"

    def __post_init__(self):
        one_of(self.base, _BASES, "ExpModel.base")

    def __str__(self) -> str:
        return self.name


def _correctly_rounded(x: jax.Array, fmt: Format) -> jax.Array:
    return ops.exp(x, fmt)


CORRECTLY_ROUNDED = ExpModel("correctly_rounded", _correctly_rounded)
EXP2 = ExpModel("exp2_correctly_rounded", lambda x, fmt: ops.exp2(x, fmt), base="2")


def _f32_bits(bits: int) -> float:
    return float(np.array(bits, np.uint32).view(np.float32))


def _f32(literal: float) -> float:
    return float(np.float32(literal))


_LOG2E = _f32_bits(0x3FB8AA3B)
_LN2 = _f32_bits(0x3F317218)
_LN_FLT_MIN = _f32_bits(0xC2AEAC50)
_LN_FLT_MAX = _f32_bits(0x42B17218)
# 1/k! as the source writes them (its float literals), highest degree first.
_U20_POLY = tuple(_f32(c) for c in (0.00828929059, 0.0418978221, 0.166676521, 0.499991506))
_U20_C1 = _f32(0.999999701)


def exp_u20(x: jax.Array) -> jax.Array:
    """ATen's ``Vectorized<float>::exp_u20`` of FP32 values ``x`` (module docstring),
    as FP32 carrier values."""
    small = x < _LN_FLT_MIN
    src = jnp.clip(x, _LN_FLT_MIN, _LN_FLT_MAX)
    n = jnp.floor(ops.fma(src, jnp.full_like(src, _LOG2E), jnp.full_like(src, 0.5), FP32))
    r = ops.fma(-n, jnp.full_like(n, _LN2), src, FP32)
    p = ops.fma(r, jnp.full_like(r, _U20_POLY[0]), jnp.full_like(r, _U20_POLY[1]), FP32)
    for c in (*_U20_POLY[2:], _U20_C1, 1.0):
        p = ops.fma(r, p, jnp.full_like(r, c), FP32)
    exponent = jnp.clip(n - 1, -126, 127).astype(jnp.int32)
    scale = jnp.where(small | (n - 1 < -126), 0.0, jnp.ldexp(1.0, exponent))  # (n+126) << 23
    return ops.mul(ops.mul(p, scale, FP32), jnp.full_like(p, 2.0), FP32)


# fexp_u20: 2^f on f in [0, 1) as f - (c0 + f(c1 + f(c2 + f c3))), highest degree first.
_FEXP_POLY = tuple(
    _f32(c)
    for c in (
        -0.079204240219773236,
        -0.22433836478672356,
        0.30354260500649682,
        0.00010703434948458272,
    )
)
_TWO_23 = 2.0**23
_MAX_CODE = float(0x7F800000)  # the code of +inf, the largest code taken


def fexp_u20(x: jax.Array) -> jax.Array:
    """ATen's ``Vectorized<float>::fexp_u20`` of FP32 values ``x`` (module docstring),
    as FP32 carrier values."""
    src = ops.mul(x, jnp.full_like(x, _LOG2E), FP32)
    frac = ops.sub(src, jnp.floor(src), FP32)  # exact
    p = ops.fma(frac, jnp.full_like(frac, _FEXP_POLY[0]), jnp.full_like(frac, _FEXP_POLY[1]), FP32)
    for c in _FEXP_POLY[2:]:
        p = ops.fma(frac, p, jnp.full_like(frac, c), FP32)
    t = ops.sub(src, p, FP32)
    # The FP32 bits of the result are the integer trunc(fl(2^23 t + 127 · 2^23)), in
    # [0, 2^31) wherever x is in [ln FLT_MIN, ln FLT_MAX].
    bits = jnp.trunc(ops.fma(jnp.full_like(t, _TWO_23), t, jnp.full_like(t, 127 * _TWO_23), FP32))
    code = jnp.clip(bits, 0, _MAX_CODE).astype(jnp.int32)
    value = widen(jax.lax.bitcast_convert_type(code, jnp.float32), x.dtype)
    value = jnp.where(x < _LN_FLT_MIN, 0.0, value)
    return jnp.where(x > _LN_FLT_MAX, jnp.inf, value)


# Sleef's expf (u10, FMA build): ln 2 split in two, 1/k! from degree 7 down to 2.
_SLEEF_LN2_HI = _f32(0.693145751953125)
_SLEEF_LN2_LO = _f32(1.428606765330187045e-06)
_SLEEF_POLY = tuple(
    _f32(c)
    for c in (
        0.000198527617612853646278381,
        0.00139304355252534151077271,
        0.00833336077630519866943359,
        0.0416664853692054748535156,
        0.166666671633720397949219,
        0.5,
    )
)


def exact_pow2(n: jax.Array) -> jax.Array:
    """2^n for integer-valued n, exactly from its FP32 bits (FP32's subnormals
    included, which float arithmetic may flush): 0 below 2^-149, inf above 2^127."""
    k = jnp.clip(n, -150, 128).astype(jnp.int32)
    normal = (k + 127) << 23
    subnormal = jnp.where(k >= -149, jnp.left_shift(1, jnp.clip(k + 149, 0, 22)), 0)
    code = jnp.where(k > 127, 0x7F800000, jnp.where(k >= -126, normal, subnormal))
    return widen(jax.lax.bitcast_convert_type(code.astype(jnp.int32), jnp.float32), n.dtype)


def sleef_expf_u10(x: jax.Array) -> jax.Array:
    """Sleef's ``expf`` to 1 ulp (``Sleef_expf8_u10``, FMA build), ATen's
    ``Vectorized<float>::exp``, of FP32 values ``x``, as FP32 carrier values::

        q = rint(fl(x · log2 e));  s = fma(q, -ln2_lo, fma(q, -ln2_hi, x))
        u = Horner of the degree-7..2 coefficients in s (one fma a step)
        y = fl(1 + fma(fl(s · s), u, s)) · 2^q      (0 below -104)
    """
    q = jnp.round(ops.mul(x, jnp.full_like(x, _LOG2E), FP32))  # rint: ties to even
    s = ops.fma(q, jnp.full_like(q, -_SLEEF_LN2_HI), x, FP32)
    s = ops.fma(q, jnp.full_like(q, -_SLEEF_LN2_LO), s, FP32)
    u = jnp.full_like(s, _SLEEF_POLY[0])
    for c in _SLEEF_POLY[1:]:
        u = ops.fma(u, s, jnp.full_like(s, c), FP32)
    u = ops.add(jnp.ones_like(s), ops.fma(ops.mul(s, s, FP32), u, s, FP32), FP32)
    half = jnp.floor(q / 2)  # ldexp in two steps, as Sleef's vldexp2
    y = ops.mul(ops.mul(u, exact_pow2(half), FP32), exact_pow2(q - half), FP32)
    return jnp.where(x < -104.0, 0.0, jnp.where(x > 100.0, jnp.inf, y))


# YNNPACK's float32 exp: ln 2 split in two, expm1(r) = r + r² P(r), P highest degree first.
_YNN_LN2_HI = _f32(6.9314575195e-01)
_YNN_LN2_LO = _f32(1.4286067653e-06)
_YNN_MIN_X = _f32(-88.02969360351562)
_YNN_MAX_X = _f32(88.72283935546875)
_YNN_POLY = tuple(
    _f32(c)
    for c in (
        -4.9866619520e-05,
        2.2773783712e-04,
        1.4132461511e-03,
        8.3242934197e-03,
        4.1665628552e-02,
        1.6666725278e-01,
        4.9999994040e-01,
    )
)
_ROUND_MAGIC = 1.5 * 2.0**23  # (magic + t) - magic rounds t to an integer, ties to even
_FLT_MIN = float(np.finfo(np.float32).tiny)


def ynnpack_exp(x: jax.Array) -> jax.Array:
    """YNNPACK's float32 exp (``simd::exp``, module docstring) of FP32 values ``x``,
    as FP32 carrier values, every step rounded to FP32 as the vector code rounds
    (``multiply_add`` is an FMA)::

        x' = clamp(x, -88.0297, 88.7228);  b = (M + fl(x' log2 e)) - M,  M = 1.5 · 2^23
        r = fma(b, -ln2_lo, fma(b, -ln2_hi, x'));  s = fl(r · r)
        P = fma(r, odd(s), even(s))   (P's even and odd terms, each Horner in s)
        y = fma(2^b, fma(s, P, r), 2^b)          (inf where 2^b overflows)

    and 0 where y falls below FLT_MIN (the CPU flushes subnormal results to zero).
    """
    xc = jnp.clip(x, _YNN_MIN_X, _YNN_MAX_X)
    t = ops.mul(xc, jnp.full_like(xc, _LOG2E), FP32)
    magic = jnp.full_like(t, _ROUND_MAGIC)
    b = ops.sub(ops.add(magic, t, FP32), magic, FP32)
    r = ops.fma(b, jnp.full_like(b, -_YNN_LN2_HI), xc, FP32)
    r = ops.fma(b, jnp.full_like(b, -_YNN_LN2_LO), r, FP32)
    s = ops.mul(r, r, FP32)
    # Two Horner chains in s: coefficients 0, 2, 4, 6 (ending on the constant term)
    # and 1, 3, 5.
    chains = [jnp.full_like(s, c) for c in _YNN_POLY[:2]]
    for i, c in enumerate(_YNN_POLY[2:]):
        chains[i % 2] = ops.fma(s, chains[i % 2], jnp.full_like(s, c), FP32)
    even, odd = chains
    p = ops.fma(r, odd, even, FP32)
    expm1_r = ops.fma(s, p, r, FP32)
    scale = jnp.where(b > 127, jnp.inf, exact_pow2(b))  # 2^128 overflows FP32
    y = jnp.where(jnp.isinf(scale), scale, ops.fma(scale, expm1_r, scale, FP32))
    y = jnp.where(y < _FLT_MIN, 0.0, y)
    return jnp.where(jnp.isnan(x), x, y)


def vectorised(
    name: str,
    lanes: int,
    vector_exp: Callable[[jax.Array], jax.Array],
    scalar_exp: Callable[[jax.Array], jax.Array] | None = None,
) -> ExpModel:
    """The model of a loop that applies ``vector_exp`` (FP32 in, FP32 out) to the
    first ``lanes * (n // lanes)`` entries of the last axis (n entries) and
    ``scalar_exp`` (the correctly rounded exp unless given) to the rest; results
    rounded to ``fmt``."""

    def fn(x: jax.Array, fmt: Format) -> jax.Array:
        full = lanes * (x.shape[-1] // lanes)
        head = vector_exp(x[..., :full])
        rest = x[..., full:]
        tail = ops.exp(rest, FP32) if scalar_exp is None else scalar_exp(rest)
        return ops.cast(jnp.concatenate([head, tail], axis=-1), fmt)

    return ExpModel(name, fn)


TORCH_AVX2 = vectorised("torch_fexp_u20_avx2", 8, fexp_u20)
SLEEF_U10 = ExpModel("sleef_expf_u10", lambda x, fmt: ops.cast(sleef_expf_u10(x), fmt))
YNNPACK = ExpModel("ynnpack", lambda x, fmt: ops.cast(ynnpack_exp(x), fmt))

_MODELS: dict[str, ExpModel] = {
    m.name: m for m in (CORRECTLY_ROUNDED, EXP2, TORCH_AVX2, SLEEF_U10, YNNPACK)
}


def register_exp_model(model: ExpModel) -> None:
    """Make ``model`` available by name; a name already taken by another model raises."""
    if not isinstance(model, ExpModel):
        raise TypeError(f"register_exp_model: expected an ExpModel, got {model!r}")
    known = _MODELS.get(model.name)
    if known is not None and known != model:
        raise ValueError(
            f"register_exp_model: name {model.name!r}: expected a new name, got one "
            "already registered to another model"
        )
    _MODELS[model.name] = model


def exp_models() -> list[str]:
    """The registered names."""
    return sorted(_MODELS)


def get_exp_model(spec: str | ExpModel) -> ExpModel:
    """An ExpModel itself, or the registered one of that name."""
    if isinstance(spec, ExpModel):
        return spec
    if isinstance(spec, str) and spec in _MODELS:
        return _MODELS[spec]
    raise ValueError(f"exp model: expected an ExpModel or one of {exp_models()}, got {spec!r}")


# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, glibc 2.27 and later): in double,
# x · 32/ln 2 = k + r, 2^(k/32) from a table of 32 doubles, a cubic in r.
def _two_to(i: int) -> float:
    """2^(i/32) rounded to a double (from 60 decimal digits)."""
    with localcontext() as context:
        context.prec = 60
        return float(Decimal(2) ** (Decimal(i) / 32))


_GLIBC_TABLE = tuple(_two_to(i) for i in range(32))
_GLIBC_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * 32
_GLIBC_POLY = (
    float.fromhex("0x1.c6af84b912394p-5") / 32**3,
    float.fromhex("0x1.ebfce50fac4f3p-3") / 32**2,
    float.fromhex("0x1.62e42ff0c52d6p-1") / 32,
)
_GLIBC_UNDERFLOW = float.fromhex("-0x1.9fe368p6")  # log(2^-150)
_GLIBC_OVERFLOW = float.fromhex("0x1.62e42ep6")  # log(2^128), rounded down


def glibc_expf(x: jax.Array) -> jax.Array:
    """glibc's ``expf`` (the C library's scalar exp behind ``std::exp(float)``) of
    FP32 values ``x``, as FP32 carrier values, every step in double as glibc's
    code rounds it::

        z = fl64(x · 32/ln 2);  k = rint(z);  r = z − k       (exact)
        s = T[k mod 32] · 2^⌊k/32⌋,  T[i] = fl64(2^(i/32))
        y = fl64(fl64(c2 r + 1) + fl64(c0 r + c1) · fl64(r r)) · s
        expf(x) = fl32(y);  0 below log(2^-150), inf above log(2^128)

    glibc's FMA build (x86-64 with FMA) fuses the polynomial's a · b + c; this
    model rounds them apart, which changes fl32(y) only where y lies within
    about 2^-52 of a rounding boundary.  Needs 64-bit floats (``jax_enable_x64``).
    """
    if not jax.config.read("jax_enable_x64"):
        raise ValueError("glibc_expf: expected jax_enable_x64 (it computes in double), got it off")
    fp64 = get_format("fp64")
    xd = widen(x, jnp.float64)
    z = ops.mul(xd, jnp.full_like(xd, _GLIBC_INV_LN2_N), fp64)
    k = jnp.round(z)  # ties to even, as glibc's z + 1.5 · 2^52 - 1.5 · 2^52
    r = ops.sub(z, k, fp64)
    i = jnp.mod(k, 32).astype(jnp.int32)
    s = jnp.ldexp(jnp.asarray(_GLIBC_TABLE, jnp.float64)[i], ((k - i) // 32).astype(jnp.int32))
    c0, c1, c2 = (jnp.full_like(r, c) for c in _GLIBC_POLY)
    p = ops.add(ops.mul(c0, r, fp64), c1, fp64)
    y = ops.add(ops.mul(c2, r, fp64), jnp.ones_like(r), fp64)
    y = ops.mul(ops.add(ops.mul(p, ops.mul(r, r, fp64), fp64), y, fp64), s, fp64)
    y = widen(ops.cast(y, FP32), x.dtype)
    y = jnp.where(x < _GLIBC_UNDERFLOW, 0.0, y)
    return jnp.where(x > _GLIBC_OVERFLOW, jnp.inf, jnp.where(jnp.isnan(x), x, y))


GLIBC_EXPF = ExpModel("glibc_expf", lambda x, fmt: ops.cast(glibc_expf(x), fmt))
# PyTorch's CPU flash-attention softmax (``cpu_flash_attention``): fexp_u20 on full
# vectors (vec256_float.h and vec512_float.h write it with each ISA's intrinsics,
# step for step) and glibc's expf on the rest, on AVX2 (8 lanes) and AVX-512 (16).
TORCH_FLASH_AVX2 = vectorised("torch_flash_avx2", 8, fexp_u20, glibc_expf)
TORCH_FLASH_AVX512 = vectorised("torch_flash_avx512", 16, fexp_u20, glibc_expf)
for _model in (GLIBC_EXPF, TORCH_FLASH_AVX2, TORCH_FLASH_AVX512):
    register_exp_model(_model)
