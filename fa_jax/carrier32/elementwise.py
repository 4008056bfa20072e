"""The elementwise emulated ops of :mod:`fa_jax.ops` on float32 carriers, without float64.

Same names, signatures and semantics as :mod:`fa_jax.ops`: each op returns
``fl_fmt(exact result)`` (round to nearest, ties to even), bit for bit what the
float64 ops give, for every format that fits float32 (``Format.fits(np.float32)``:
bf16, fp16, tf32, FP32, the float8/6/4 formats).  The program holds no float64 or
int64 value: it runs with ``jax_enable_x64`` off and on backends without them.

What backends do to float32, and how the ops avoid depending on it:

* XLA's CPU backend flushes float32 subnormals, eagerly as under ``jit``: as
  operands (read as zero) and as results of ``+ - * /``, in compares (a subnormal
  is ``== 0``, not ``> 0``), ``max``, ``sign``, ``exp`` and conversion to float64.
  ``abs``, ``neg``, ``select``, bitcasts and int32 -> float32 keep the values.  TPUs
  have no float32 subnormals.  So every sign, magnitude and exponent test here is
  on the bits (uint32/int32), and powers of two are applied to the exponent bits.
* Under ``jit`` the CPU backend contracts ``a * b + c`` into a fused multiply-add.
  The only float arithmetic on values is TwoSum (Knuth), which has no product.
* That arithmetic runs on operands scaled by a power of two (chosen from the
  exponent bits) into ``[2**-97, 4]`` on grids no finer than ``2**-97``: all its
  results are normal, so flushing cannot touch it.  Exponents live in int32.

Each op reduces its exact result ``x`` to ``s = ±sig 2**(e - 23)``, the nearest
24-bit value (ties to even) with an int32 exponent of any range, and ``rest``,
the sign of ``|x| - |s|``.  :func:`round_parts` then rounds ``x`` to ``fmt`` in
integers: at ``fmt``'s quantum ``2**q`` (``q = max(e, emin) - man_bits``; ``emin``
below a format without subnormals) it drops ``q - e + 23`` bits of ``sig``, rounds
up past half a quantum and breaks an exact half by ``rest`` (to even where ``rest``
is 0).  This is exact: ``|x - s|`` is at most half an ulp of ``s`` and ``fmt``'s
midpoints have at most 24 bits (``man_bits <= 23``), so none lies strictly between
``x`` and ``s``.  :func:`fa_jax.rounding.round_to` (integer operations only) then
maps the rounded value, or ±inf past float32's range, to the format's overflow,
infinities and fnuz zero.

* ``add``/``sub``: both operands scaled by the larger one's exponent; one more
  than 50 binades below the other is replaced by ``±2**-52``, far below half an
  ulp of the larger, which changes neither the nearest 24-bit sum nor the sign
  of its error.  TwoSum gives ``s`` and the exact error, whose sign is ``rest``.
* ``mul``: the exact 48-bit product of the 24-bit significands in uint32 from
  12-bit halves, rounded to 24 bits; ``rest`` from the dropped bits.
* ``div``: 27 quotient bits by restoring long division in uint32; a nonzero
  remainder is a sticky bit.
* ``fma``: the product as two float32 and TwoSum with rounding to odd (Boldo &
  Melquiond 2008), see :func:`fma`.
* ``maximum``: the larger by the bits' total order (``-0 < +0``).

Results with a NaN or ±inf operand, or a zero operand of ``mul``/``div`` (of
``fma``: with ``c`` zero too), are what float32 arithmetic gives on the operands
with each finite nonzero one replaced by ±1 (a NaN made by an invalid operation
has the float64 one's sign on the same hardware), with the first NaN operand
propagated (x86's rule, pinned so that a compiler commuting operands cannot
change which sign survives), then ``round_to``.  ``cast`` is ``round_to``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax._checks import is_int
from fa_jax.formats import Format, get_format
from fa_jax.rounding import round_to

__all__ = ["add", "cast", "div", "fma", "maximum", "mul", "sub"]

U32 = np.uint32
I32 = np.int32
SIGN_MASK = U32(0x80000000)
ABS_MASK = U32(0x7FFFFFFF)
FRACTION_MASK = U32(0x7FFFFF)
HIDDEN_BIT = U32(1 << 23)
_ONE_BITS = U32(0x3F800000)  # 1.0
INF_BITS = U32(0x7F800000)
_ZERO_EXPONENT = -(1 << 12)  # below every float32 exponent: the exponent of a zero
_NEGLIGIBLE = -50  # an addend this many binades below the other only adds a sign
# A negligible addend's stand-in: 2**_STAND_IN_EXPONENT with the addend's sign.
_STAND_IN_EXPONENT = -52
_DIVISION_BITS = 27  # quotient bits: 24, a guard bit and one more at least, then a sticky bit


def check_carriers(*xs) -> None:
    for x in xs:
        dtype = jnp.asarray(x).dtype
        if dtype != np.float32:
            raise TypeError(
                f"fa_jax.carrier32: expected float32 carrier arrays, got {dtype}; cast "
                "values of narrower formats up first (exact), e.g. x.astype(jnp.float32)"
            )


def as_format(fmt) -> Format:
    fmt = get_format(fmt)
    if fmt.is_concrete and not fmt.fits(np.float32):
        raise ValueError(
            f"fa_jax.carrier32: expected a format that fits a float32 carrier, got {fmt.name!r} "
            f"(man_bits={fmt.man_bits}, emin={fmt.emin}, emax={fmt.emax}); use fa_jax.ops"
        )
    return fmt


def clamp_int(x, lo: int, hi: int) -> jax.Array:
    """``x`` (int32) clamped to [lo, hi], with int32 bounds (no int64 under x64)."""
    return jax.lax.clamp(I32(lo), x, I32(hi))


def shift_bits(x, s) -> jax.Array:
    """``x * 2**s`` truncated to an integer (uint32 ``x``; ``s`` int32 of any range,
    bits shifted past the word lost)."""
    left = x << clamp_int(s, 0, 31).astype(jnp.uint32)
    right = x >> clamp_int(-s, 0, 31).astype(jnp.uint32)
    return jnp.where(s >= I32(0), left, right)


def pow2_bits(k) -> jax.Array:
    """float32 bits of 2**k for k in [-149, 127]."""
    normal = (clamp_int(k, -126, 127) + I32(127)).astype(jnp.uint32) << U32(23)
    sub = U32(1) << clamp_int(k + I32(149), 0, 22).astype(jnp.uint32)
    return jnp.where(k >= I32(-126), normal, sub)


def scan_steps(f: Callable, init, xs):
    """``lax.scan(f, init, xs)`` for an ``f`` without outputs, counting in int32 (a
    scan's counter is int64 under ``jax_enable_x64``); no steps give ``init``, as
    ``lax.scan`` gives under ``jit`` (it refuses a zero-length scan under
    ``disable_jit``).  The loop of every accumulator, on both carriers."""
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if n == 0:
        return init, None

    def body(state):
        i, carry = state
        x = jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
        return i + I32(1), f(carry, x)[0]

    _, carry = jax.lax.while_loop(lambda s: s[0] < I32(n), body, (I32(0), init))
    return carry, None


def pad_axis(x, axis: int, n: int) -> jax.Array:
    """``x`` with ``n`` zeros appended along ``axis`` (no int64 pad width under x64)."""
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (0, n, 0)
    return jax.lax.pad(x, jnp.zeros((), x.dtype), config)


def int32_of(v) -> jax.Array:
    """A format width as int32: a constant when concrete, else the traced value."""
    return jnp.asarray(I32(v) if is_int(v) else v, jnp.int32)


def bits_of(x) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def float_of_bits(bits) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


class _Parts(NamedTuple):
    """A float32 as ``±sig * 2**(exp - 23)``, subnormals normalised."""

    sign: jax.Array  # uint32: the sign bit in place
    exp: jax.Array  # int32: floor(log2 |x|); _ZERO_EXPONENT for zeros
    sig: jax.Array  # uint32 in [2**23, 2**24) for finite nonzero x
    zero: jax.Array  # bool
    finite: jax.Array  # bool


def unpack(x) -> _Parts:
    bits = bits_of(x)
    mag = bits & ABS_MASK
    field = (mag >> U32(23)).astype(jnp.int32)
    top = I32(31) - jax.lax.clz(mag).astype(jnp.int32)  # of a subnormal's fraction
    shift = clamp_int(I32(23) - top, 0, 23).astype(jnp.uint32)
    zero = mag == U32(0)
    exp = jnp.where(field > 0, field - I32(127), top - I32(149))
    sig = jnp.where(field > 0, (mag & FRACTION_MASK) | HIDDEN_BIT, mag << shift)
    return _Parts(
        bits & SIGN_MASK, jnp.where(zero, I32(_ZERO_EXPONENT), exp), sig, zero, field < I32(255)
    )


def _pack(sign, exp, sig) -> jax.Array:
    """The float32 ``±sig * 2**(exp - 23)`` for ``exp`` in the normal range (``sig``
    in [2**23, 2**24)), or ±0 where ``sig`` is 0."""
    field = (clamp_int(exp, -126, 127) + I32(127)).astype(jnp.uint32) << U32(23)
    return float_of_bits(jnp.where(sig == U32(0), sign, sign | field | (sig & FRACTION_MASK)))


def stand_in(x) -> jax.Array:
    """``x`` with a finite nonzero value replaced by ±1: what decides a result that
    involves a NaN, an infinity or a zero."""
    bits = bits_of(x)
    mag = bits & ABS_MASK
    plain = (mag != U32(0)) & (mag < INF_BITS)
    return float_of_bits(jnp.where(plain, (bits & SIGN_MASK) | _ONE_BITS, bits))


def nearest_rounded(kept, dropped, half, sticky):
    """Round ``kept + (dropped + sticky) / (2 * half)`` (integers; ``sticky`` a bool
    for "a little more", below one unit of ``dropped``) to the nearest integer, ties
    to even.  Returns (the integer, the sign of the exact value minus it: int32)."""
    up = (dropped > half) | ((dropped == half) & (sticky | ((kept & U32(1)) == U32(1))))
    inexact = (dropped != U32(0)) | sticky
    rest = jnp.where(up, I32(-1), jnp.where(inexact, I32(1), I32(0)))
    return kept + up.astype(jnp.uint32), rest


def round_parts(sign, exp, sig, zero, rest, fmt: Format) -> jax.Array:
    """The float32 of ``round_fmt(x)`` before ``round_to``'s overflow and specials,
    for ``x = ±(sig + ρ) 2**(exp - 23)``: ``sig`` in [2**23, 2**24], ``|ρ| <= 1/2``
    (``|ρ| = 1/2`` only with ``sig`` even) of sign ``rest``; ±0 where ``zero``.
    Past float32's range the value is ±inf (beyond every fitting format's max)."""
    emin = I32(1) - int32_of(fmt.bias)
    m = int32_of(fmt.man_bits)
    if fmt.subnormals:
        q_exp = jnp.maximum(exp, emin) - m
    else:
        q_exp = jnp.where(exp >= emin, exp - m, emin)
    d = clamp_int(q_exp - (exp - I32(23)), 0, 26).astype(jnp.uint32)  # bits to drop
    half = (U32(1) << d) >> U32(1)
    kept = sig >> d
    dropped = sig & ((U32(1) << d) - U32(1))
    up = (d > U32(0)) & (
        (dropped > half)
        | ((dropped == half) & jnp.where(rest == I32(0), (kept & U32(1)) == U32(1), rest > I32(0)))
    )
    mag = (kept + up.astype(jnp.uint32)) << d  # 0 or in [2**23, 2**24]
    top = I32(31) - jax.lax.clz(mag).astype(jnp.int32)  # 23 or 24
    e = exp + top - I32(23)
    field = (clamp_int(e, -126, 127) + I32(127)).astype(jnp.uint32) << U32(23)
    normal = field | ((mag >> (top - I32(23)).astype(jnp.uint32)) & FRACTION_MASK)
    # Below 2**-126 the value is a multiple of 2**-149 (a value of fmt): exact shift.
    subnormal = mag >> clamp_int(I32(-126) - exp, 0, 31).astype(jnp.uint32)
    out = jnp.where(e > I32(127), INF_BITS, jnp.where(e >= I32(-126), normal, subnormal))
    out = jnp.where(zero | (mag == U32(0)), U32(0), out)
    return float_of_bits(sign | out)


def normalise_parts(sig, exp):
    """(sig, exp) with a carry to 2**24 moved into the exponent."""
    carry = sig >> U32(24)
    return sig >> carry, exp + carry.astype(jnp.int32)


def is_nan(x) -> jax.Array:
    return (bits_of(x) & ABS_MASK) > INF_BITS


def first_nan(result, *operands) -> jax.Array:
    """``result`` unless an operand is a NaN: then the first NaN operand (x86's rule
    for float32 and float64 alike, fixed here so that a compiler commuting the
    operands cannot change which NaN's sign survives)."""
    for x in reversed(operands):
        result = jnp.where(is_nan(x), x, result)
    return result


def _finish(special, fallback, main, fmt: Format) -> jax.Array:
    return round_to(jnp.where(special, fallback, main), fmt)


def cast(x, fmt) -> jax.Array:
    """Round a float32 carrier array to ``fmt``."""
    check_carriers(x)
    return round_to(x, as_format(fmt))


def two_sum(a, b):
    """s = fl(a + b) and its exact error e = (a + b) - s (Knuth's TwoSum)."""
    s = a + b
    bp = s - a
    ap = s - bp
    return s, (a - ap) + (b - bp)


def _scaled(p: _Parts, exp) -> jax.Array:
    """The float32 ``x * 2**-exp`` of an operand ``p`` of exponent at most ``exp``,
    or ±2**_STAND_IN_EXPONENT where that lies below 2**_NEGLIGIBLE."""
    rel = p.exp - exp
    negligible = rel < I32(_NEGLIGIBLE)
    sig = jnp.where(p.zero, U32(0), jnp.where(negligible, HIDDEN_BIT, p.sig))
    return _pack(p.sign, jnp.where(negligible, I32(_STAND_IN_EXPONENT), rel), sig)


def sign_against(err, s) -> jax.Array:
    """int32: 0 where ``err`` is ±0, 1 where it has the sign of ``s``, else -1."""
    err_bits = bits_of(err)
    same = (err_bits & SIGN_MASK) == (bits_of(s) & SIGN_MASK)
    zero = (err_bits & ABS_MASK) == U32(0)
    return jnp.where(zero, I32(0), jnp.where(same, I32(1), I32(-1)))


def round_sum(s, rest, exp, fmt: Format) -> jax.Array:
    """``round_parts`` of ``x = 2**exp (s + r)``: ``s`` a scaled float32 (normal or
    zero), nearest to ``x 2**-exp``, and ``rest`` the sign of ``|x| - |s|``."""
    ps = unpack(s)
    return round_parts(ps.sign, ps.exp + exp, ps.sig, ps.zero, rest, fmt)


def add(a, b, fmt) -> jax.Array:
    """fl_fmt(a + b), correctly rounded."""
    check_carriers(a, b)
    fmt = as_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    pa, pb = unpack(a), unpack(b)
    exp = jnp.maximum(pa.exp, pb.exp)
    s, err = two_sum(_scaled(pa, exp), _scaled(pb, exp))
    main = round_sum(s, sign_against(err, s), exp, fmt)
    fallback = first_nan(stand_in(a) + stand_in(b), a, b)
    return _finish(~(pa.finite & pb.finite), fallback, main, fmt)


def sub(a, b, fmt) -> jax.Array:
    """fl_fmt(a - b), correctly rounded."""
    check_carriers(a, b)
    return add(a, float_of_bits(bits_of(b) ^ SIGN_MASK), fmt)


def exact_product(sa, sb):
    """The exact product of two 24-bit integers as (high 24 bits, low 24 bits)."""
    a1, a0 = sa >> U32(12), sa & U32(0xFFF)
    b1, b0 = sb >> U32(12), sb & U32(0xFFF)
    mid = a1 * b0 + a0 * b1  # < 2**25
    low = a0 * b0 + ((mid & U32(0xFFF)) << U32(12))  # < 2**25
    high = a1 * b1 + (mid >> U32(12)) + (low >> U32(24))
    return high, low & U32(0xFFFFFF)


def mul(a, b, fmt) -> jax.Array:
    """fl_fmt(a * b), correctly rounded."""
    check_carriers(a, b)
    fmt = as_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    pa, pb = unpack(a), unpack(b)
    high, low = exact_product(pa.sig, pb.sig)  # the product, in [2**46, 2**48)
    wide = high >= HIDDEN_BIT  # 48 bits: keep the high 24
    kept = jnp.where(wide, high, (high << U32(1)) | (low >> U32(23)))
    dropped = jnp.where(wide, low, low & FRACTION_MASK)
    half = jnp.where(wide, HIDDEN_BIT, U32(1 << 22))
    sig, rest = nearest_rounded(kept, dropped, half, jnp.zeros_like(wide))
    sig, exp = normalise_parts(sig, pa.exp + pb.exp + wide.astype(jnp.int32))
    zero = jnp.zeros_like(wide)
    main = round_parts(pa.sign ^ pb.sign, exp, sig, zero, rest, fmt)
    special = ~(pa.finite & pb.finite) | pa.zero | pb.zero
    return _finish(special, first_nan(stand_in(a) * stand_in(b), a, b), main, fmt)


class _Product(NamedTuple):
    """The exact product of two finite float32 as ``hi + lo``, each ``±sig 2**(exp - 23)``."""

    sign: jax.Array
    zero: jax.Array
    exp: jax.Array  # of hi: floor(log2 |a·b|); _ZERO_EXPONENT for a zero product
    sig_hi: jax.Array
    exp_lo: jax.Array
    sig_lo: jax.Array  # 0 where the low half is zero


def _product_of(pa: _Parts, pb: _Parts) -> _Product:
    high, low = exact_product(pa.sig, pb.sig)  # a·b = (high 2**24 + low) 2**(e_a + e_b - 46)
    zero = pa.zero | pb.zero
    wide = high >= HIDDEN_BIT
    exp_ab = pa.exp + pb.exp
    top = I32(31) - jax.lax.clz(low).astype(jnp.int32)
    return _Product(
        sign=pa.sign ^ pb.sign,
        zero=zero,
        exp=jnp.where(zero, I32(_ZERO_EXPONENT), exp_ab + wide.astype(jnp.int32)),
        sig_hi=jnp.where(wide, high, high << U32(1)),
        exp_lo=exp_ab - I32(46) + top,
        sig_lo=low << clamp_int(I32(23) - top, 0, 23).astype(jnp.uint32),
    )


def _product_scaled(p: _Product, exp):
    """``hi, lo`` scaled by ``2**-exp`` (``exp >= p.exp``); ±2**_STAND_IN_EXPONENT and
    0 where the product lies below 2**_NEGLIGIBLE; ±0 where it is zero."""
    rel = p.exp - exp
    negligible = rel < I32(_NEGLIGIBLE)
    hi = _pack(
        p.sign,
        jnp.where(negligible, I32(_STAND_IN_EXPONENT), rel),
        jnp.where(p.zero, U32(0), jnp.where(negligible, HIDDEN_BIT, p.sig_hi)),
    )
    lo = _pack(p.sign, p.exp_lo - exp, jnp.where(p.zero | negligible, U32(0), p.sig_lo))
    return hi, lo


def fma(a, b, c, fmt) -> jax.Array:
    """fl_fmt(a * b + c) with a single rounding: a fused multiply-add.

    The exact product is two float32 ``hi + lo`` (the high and low 24 bits of the
    significands' product).  Scaled by the larger exponent of ``a·b`` and ``c``:
    ``(t, u) = TwoSum(c, hi)``, then ``v = RO(u + lo)``, the sum rounded to odd
    (TwoSum, then the odd neighbour toward its error ``w``).  Where ``c + hi`` is
    inexact, ``|t| >= |hi| / 2``, so ``|u + lo| <= 4.5 ulp(t)`` and ``v``'s grid ``g``
    is at least 20 bits finer than ``t``'s; ``t + v`` is then the exact sum ``x``
    rounded to odd on ``g``, and rounding it to nearest at 24 bits rounds ``x``
    (Boldo & Melquiond 2008, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd").  Where it is exact, ``u == 0`` and ``v ==
    lo``.  ``(s, e) = TwoSum(t, v)`` gives that ``s``; ``e`` is a multiple of ``g``
    and ``|x - t - v| < g``, so a nonzero ``e`` has the sign of ``x - s``, and
    where ``e == 0`` that sign is ``w``'s, or the opposite where ``v`` moved.
    """
    check_carriers(a, b, c)
    fmt = as_format(fmt)
    a, b, c = jnp.broadcast_arrays(a, b, c)
    pa, pb, pc = unpack(a), unpack(b), unpack(c)
    product = _product_of(pa, pb)
    exp = jnp.maximum(product.exp, pc.exp)
    hi, lo = _product_scaled(product, exp)
    t, u = two_sum(_scaled(pc, exp), hi)
    v0, w = two_sum(u, lo)
    v_bits = bits_of(v0)
    to_odd = (sign_against(w, v0) != I32(0)) & ((v_bits & U32(1)) == U32(0))
    step = jnp.where(sign_against(w, v0) > I32(0), U32(1), U32(0xFFFFFFFF))  # ±1
    v = float_of_bits(jnp.where(to_odd, v_bits + step, v_bits))
    s, e = two_sum(t, v)
    w_rest = sign_against(w, s)
    rest = jnp.where(
        (bits_of(e) & ABS_MASK) != U32(0), sign_against(e, s), jnp.where(to_odd, -w_rest, w_rest)
    )
    main = round_sum(s, rest, exp, fmt)
    special = ~(pa.finite & pb.finite & pc.finite) | ((pa.zero | pb.zero) & pc.zero)
    # A product then a sum, as fa_jax.ops computes it: a NaN product is the result
    # (XLA may contract p + c into an FMA, which would give inf * 0 + NaN c's NaN).
    p = first_nan(stand_in(a) * stand_in(b), a, b)
    fallback = jnp.where(is_nan(p), p, first_nan(p + stand_in(c), c))
    return _finish(special, fallback, main, fmt)


def _quotient(sa, sb):
    """floor(sa * 2**26 / sb) for 24-bit sa, sb (restoring long division, one
    quotient bit a step; the remainder stays below 2**25), and whether the
    division left a remainder."""
    q = jnp.zeros_like(sa)
    r = sa
    for _ in range(_DIVISION_BITS):
        ge = r >= sb
        q = (q << U32(1)) | ge.astype(jnp.uint32)
        r = jnp.where(ge, r - sb, r) << U32(1)
    return q, r != U32(0)


def div(a, b, fmt) -> jax.Array:
    """fl_fmt(a / b), correctly rounded."""
    check_carriers(a, b)
    fmt = as_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    pa, pb = unpack(a), unpack(b)
    q, sticky = _quotient(pa.sig, pb.sig)  # in (2**25, 2**27)
    wide = q >= U32(1 << 26)  # sa >= sb: 27 quotient bits
    kept = jnp.where(wide, q >> U32(3), q >> U32(2))
    dropped = jnp.where(wide, q & U32(7), q & U32(3))
    half = jnp.where(wide, U32(4), U32(2))
    sig, rest = nearest_rounded(kept, dropped, half, sticky)
    sig, exp = normalise_parts(sig, pa.exp - pb.exp - (~wide).astype(jnp.int32))
    main = round_parts(pa.sign ^ pb.sign, exp, sig, jnp.zeros_like(wide), rest, fmt)
    special = ~(pa.finite & pb.finite) | pa.zero | pb.zero
    return _finish(special, first_nan(stand_in(a) / stand_in(b), a, b), main, fmt)


def maximum(a, b, fmt) -> jax.Array:
    """fl_fmt(max(a, b)): the larger by the bits' total order (-0 < +0); where
    either is NaN, float32 ``max`` of the operands' stand-ins (its NaN's sign)."""
    check_carriers(a, b)
    fmt = as_format(fmt)
    a, b = jnp.broadcast_arrays(a, b)
    ba, bb = bits_of(a), bits_of(b)

    def key(bits):  # monotone in the value, -0 just below +0
        flip = jnp.where((bits & SIGN_MASK) != U32(0), ABS_MASK, U32(0))
        return jax.lax.bitcast_convert_type(bits ^ flip, jnp.int32)

    larger = jnp.where(key(ba) >= key(bb), ba, bb)
    nan = ((ba & ABS_MASK) > INF_BITS) | ((bb & ABS_MASK) > INF_BITS)
    fallback = jnp.maximum(stand_in(a), stand_in(b))
    return _finish(nan, fallback, float_of_bits(larger), fmt)
