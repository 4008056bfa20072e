"""The log-sum-exp ``m + ln l`` (``m·scale + ln l``) on float32 carriers, correctly rounded.

:func:`lse` returns ``fl_fmt(m·scale + ln l)`` (``fl_fmt(m + ln l)`` without ``scale``),
rounded to nearest, ties to even, for every format that fits float32, with no
64-bit type in the program.  Everything but the final rounding is integer
arithmetic (uint32 limbs), so flushed float32 subnormals and contracted
``a * b + c`` (see :mod:`fa_jax.carrier32.elementwise`) cannot touch it.

Method (table-driven logarithm, Tang 1990, "Table-driven implementation of the
logarithm function in IEEE floating-point arithmetic", ACM TOMS 16(4); Muller,
"Elementary Functions: Algorithms and Implementation"):

* ``l = 2**e · F``, ``F = sig 2**-23`` in [1, 2) from the bits (subnormals
  normalised).  ``j = round(256 (F - 1))`` in 0..256, ``r_j = RN_24(1 / (1 + j/256))``
  (``r_0 = 1``, ``r_256 = 1/2``), ``z = F r_j - 1`` exactly (a 24 x 24-bit integer
  product minus a power of two), ``|z| <= 2**-9 + 2**-24``.  Then
  ``ln l = k ln 2 + L_j + ln(1 + z)`` with ``k = e + [j >= 106]`` and
  ``L_j = -ln r_j - [j >= 106] ln 2`` (``F >= 1.414``: ``F / 2`` in [0.707, 1)), so
  ``L_j = 0`` where ``l`` is near 1 and no term cancels another's leading bits.
* Fixed point with 112 fraction bits in 16-bit limbs: ``ln 2``, ``L_j`` and ``1/n``
  rounded to it (errors ``<= 2**-113``); ``k ln 2`` as ``|k|`` times the limbs;
  ``ln(1 + z) - z = -w² T_2`` with ``w = |z|`` and Horner's ``T_n = 1/n ∓ w T_{n+1}``
  (``-`` where ``z > 0``; every ``T_n`` is positive), ``n`` up to 12 (a loop of
  12 products by ``w``, the last two giving ``w T_2`` and ``w² T_2``): the series'
  tail is below ``2**-117``; each product (exact, then truncated) adds less than
  ``2**-112``.  So ``H``, the fixed-point ``ln l``, has
  ``|H - ln l| < 151 · 2**-113 + 2**-111 < 2**-105.5`` (``< 2**-111`` where
  ``k = 0``), relative ``< 2**-86`` as ``|ln l| >= 2**-24`` for ``l != 1``; ``H = 0``
  exactly where ``l = 1``.
* ``m·scale`` is exact: the 48-bit product of the significands (two 24-bit
  terms).  The terms of ``m·scale`` and of ``|H|`` are added exactly in a 128-bit
  two's complement window whose top is the largest term's leading bit; bit 0
  is a sticky bit for a term reaching below the window (which happens only to
  the smaller of the two, far below the larger's last bit), so the window's sum
  lies in the same open interval between multiples of its bit 1 as ``m·scale + H``.
  The nearest 24-bit value of that sum and the sign of the rest go to
  :func:`fa_jax.carrier32.elementwise.round_parts`, then :func:`fa_jax.rounding.round_to`.

Hence the result is ``fl_fmt(y)`` with ``|y - x| < 2**-105.5``, ``x = m·scale + ln l``
the exact value: correctly rounded unless ``x`` lies that close to a rounding
boundary of ``fmt``.  ``x`` is never on a boundary for ``l != 1`` (``ln l`` is
transcendental: Lindemann), and ``y = x`` where ``l = 1``.  The float64 path
(``round_to(m + log(l))`` in float64) has its own ``2**-53``-relative errors and a
double rounding, so it can differ from this one where ``m ≈ -ln l`` cancels.

NaN or infinite ``m``, ``scale`` or ``l``, and ``l <= 0``: what the float64 path
gives under ``jit`` (``ln 0 = -inf``, ``ln`` of a negative number a positive NaN,
the first NaN operand propagated, ``m·scale + ln l`` fused), then ``round_to``.
"""

from __future__ import annotations

import decimal
import functools
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.carrier32.elementwise import (
    ABS_MASK,
    HIDDEN_BIT,
    I32,
    INF_BITS,
    SIGN_MASK,
    U32,
    as_format,
    bits_of,
    check_carriers,
    clamp_int,
    exact_product,
    first_nan,
    float_of_bits,
    is_nan,
    nearest_rounded,
    normalise_parts,
    round_parts,
    stand_in,
    unpack,
)
from fa_jax.rounding import round_to

__all__ = ["lse"]

_FRACTION_BITS = 112  # the fixed point's resolution: 2**-112
_LIMBS = 8  # 16-bit limbs of a signed fixed-point value (two's complement, 128 bits)
_UNIT_LIMBS = 7  # of an unsigned value below 1
_TABLE_BITS = 8  # j = round(256 (F - 1))
_HALF_WAY = 106  # j from which F / 2 and k = e + 1 are used (1 + 106/256 > 1.414)
_TERMS = 12  # ln(1 + z) - z to the w**12 term
_WINDOW_TOP = 122  # window bit of the largest term's leading bit's successor
_NOWHERE = -(1 << 20)  # the position of a zero term: below every window
_M16 = U32(0xFFFF)
_M32 = U32(0xFFFFFFFF)
_POSITIVE_NAN = U32(0x7FC00000)


# -- constants: fixed point with 112 fraction bits, exact to the nearest ----------------


def _limbs_of(value: int, n: int) -> tuple[np.uint32, ...]:
    """The n 16-bit limbs (least significant first) of ``value mod 2**(16 n)``."""
    value %= 1 << (16 * n)
    return tuple(U32((value >> (16 * i)) & 0xFFFF) for i in range(n))


def _fixed(value: decimal.Decimal) -> int:
    scaled = value * (1 << _FRACTION_BITS)
    return int(scaled.to_integral_value(rounding=decimal.ROUND_HALF_EVEN))


class _Tables(NamedTuple):
    """R_j, t_j (r_j = R_j 2**-(23 + t_j)) and the limbs of L_j, for j = 0 .. 256; the
    limbs of ln 2; of 1/n for the series; the Horner steps' constants."""

    R: np.ndarray
    T: np.ndarray
    L: tuple
    ln2: tuple
    reciprocals: dict
    horner: np.ndarray


@functools.cache
def _tables() -> _Tables:
    """The constants, from exact decimals (computed on first use: about 25 ms, which
    ``import fa_jax`` should not pay)."""
    ctx = decimal.Context(prec=80)
    ln2 = decimal.Decimal(2).ln(ctx)
    size = (1 << _TABLE_BITS) + 1
    sig, shift, logs = [], [], []
    for j in range(size):
        if j in (0, size - 1):
            big, t = 1 << 23, (0 if j == 0 else 1)
        else:  # RN_24(1 / c_j) in (1/2, 1): R = round(2**24 / c_j)
            big, t = round(Fraction(1 << (24 + _TABLE_BITS), (1 << _TABLE_BITS) + j)), 1
        minus_ln_r = ctx.subtract(ctx.multiply(23 + t, ln2), decimal.Decimal(big).ln(ctx))
        if j >= _HALF_WAY:
            minus_ln_r = ctx.subtract(minus_ln_r, ln2)
        sig.append(big)
        shift.append(t)
        logs.append(_limbs_of(_fixed(minus_ln_r), _LIMBS))
    columns = tuple(np.array([row[i] for row in logs], np.uint32) for i in range(_LIMBS))
    reciprocals = {
        n: _limbs_of(round(Fraction(1 << _FRACTION_BITS, n)), _UNIT_LIMBS)
        for n in range(2, _TERMS + 1)
    }
    # The Horner steps' constants: 1/n for n = _TERMS - 1 down to 2, then 0 twice
    # (the products w T_2 and w² T_2).
    horner = np.array(
        [reciprocals[n] for n in range(_TERMS - 1, 1, -1)] + [(U32(0),) * _UNIT_LIMBS] * 2,
        np.uint32,
    )
    return _Tables(
        np.array(sig, np.uint32),
        np.array(shift, np.uint32),
        columns,
        _limbs_of(_fixed(ln2), _LIMBS),
        reciprocals,
        horner,
    )


# -- multi-limb integer arithmetic (16-bit limbs in uint32) ----------------------------


def _add(a, b, carry=None) -> list:
    """``a + b + carry`` modulo ``2**(16 len(a))`` (``carry`` 0 or 1, default 0)."""
    out, carry = [], U32(0) if carry is None else carry
    for x, y in zip(a, b):
        s = x + y + carry
        out.append(s & _M16)
        carry = s >> U32(16)
    return out


def _negate(a) -> list:
    return _add([x ^ _M16 for x in a], _limbs_of(1, len(a)))


def _where(cond, a, b) -> list:
    return [jnp.where(cond, x, y) for x, y in zip(a, b)]


def _times_small(a, k) -> list:
    """``a · k`` for constant limbs ``a`` and a uint32 ``k < 2**8``."""
    out, carry = [], U32(0)
    for x in a:
        s = x * k + carry
        out.append(s & _M16)
        carry = s >> U32(16)
    return out


def _times_w(t, d, b) -> list:
    """``floor(T |D| 2**-(32 + b))`` in 7 limbs: ``T`` (7 limbs) times ``w = |D|
    2**-(32 + b)`` (``d``: the 3 limbs of ``|D|``), truncated to the fixed point."""
    cols = [jnp.zeros_like(d[0]) for _ in range(_UNIT_LIMBS + len(d))]
    for i, ti in enumerate(t):
        for k, dk in enumerate(d):
            p = ti * dk  # < 2**32
            cols[i + k] = cols[i + k] + (p & _M16)
            cols[i + k + 1] = cols[i + k + 1] + (p >> U32(16))
    limbs, carry = [], U32(0)
    for c in cols:
        s = c + carry
        limbs.append(s & _M16)
        carry = s >> U32(16)
    up = U32(16) - b
    return [((limbs[i + 2] >> b) | (limbs[i + 3] << up)) & _M16 for i in range(_UNIT_LIMBS)]


# -- ln l in fixed point -----------------------------------------------------------------


def _log_fixed(l):
    """``H ≈ ln l`` for finite positive float32 ``l``: the 8 limbs of ``|H| 2**112`` and
    whether ``H < 0`` (module docstring)."""
    p = unpack(l)
    frac = p.sig - HIDDEN_BIT
    j = ((frac + U32(1 << 14)) >> U32(15)).astype(jnp.int32)  # round(256 (F - 1))
    tables = _tables()
    big, t = jnp.asarray(tables.R)[j], jnp.asarray(tables.T)[j]
    high, low = exact_product(p.sig, big)  # F r_j = (high 2**24 + low) 2**-(46 + t)
    dh = high.astype(jnp.int32) - (I32(1 << 22) << t.astype(jnp.int32))
    z_neg = dh < I32(0)  # z = (dh 2**24 + low) 2**-(46 + t)
    borrow = z_neg & (low != U32(0))
    a = jnp.where(z_neg, -dh - borrow.astype(jnp.int32), dh).astype(jnp.uint32)
    bl = jnp.where(borrow, U32(1 << 24) - low, jnp.where(z_neg, U32(0), low))
    d = [bl & _M16, (bl >> U32(16)) | ((a & U32(0xFF)) << U32(8)), a >> U32(8)]
    b = U32(14) + t  # w = |D| 2**-(46 + t) = |D| 2**-(32 + b)

    coefficients = jnp.asarray(tables.horner)

    def horner(state):  # (i, T_{n+1}) -> (i + 1, T_n), n = _TERMS - 1 - i; then w T_2, w² T_2
        i, terms = state
        product = _times_w(list(terms), d, b)
        c = [coefficients[i, n] for n in range(_UNIT_LIMBS)]
        subtract = ~z_neg & (i < I32(_TERMS - 2))
        flip = jnp.where(subtract, _M16, U32(0))  # c - P = c + (P ^ 0xFFFF...) + 1
        product = [x ^ flip for x in product]
        return i + I32(1), tuple(_add(c, product, subtract.astype(jnp.uint32)))

    start = tuple(jnp.broadcast_to(c, l.shape) for c in tables.reciprocals[_TERMS])
    steps = I32(_TERMS)  # an int32 counter: fori_loop's is int64 under x64
    # Two steps a trip (_TERMS is even): half the loop state's trips through memory.
    _, s = jax.lax.while_loop(
        lambda st: st[0] < steps, lambda st: horner(horner(st)), (I32(0), start)
    )
    s = [*s, jnp.zeros_like(frac)]  # S = w² T_2

    c = U32(2) - t  # |z| 2**112 = |D| 2**(64 + c)
    shifted = [
        d[0] << c,
        (d[1] << c) | (d[0] >> (U32(16) - c)),
        (d[2] << c) | (d[1] >> (U32(16) - c)),
    ]
    w = [jnp.zeros_like(frac)] * 4 + [x & _M16 for x in shifted] + [d[2] >> (U32(16) - c)]
    z = _where(z_neg, _negate(w), w)

    k = p.exp + (j >= I32(_HALF_WAY)).astype(jnp.int32)
    k_ln2 = _times_small(tables.ln2, jnp.abs(k).astype(jnp.uint32))
    k_ln2 = _where(k < I32(0), _negate(k_ln2), k_ln2)
    table = [jnp.asarray(col)[j] for col in tables.L]
    h = _add(_add(_add(k_ln2, table), z), _negate(s))
    negative = (h[-1] >> U32(15)) != U32(0)
    return _where(negative, _negate(h), h), negative


# -- the exact sum of the terms of m·scale and of H, rounded ------------------------------


def _bit_length(x) -> jax.Array:
    return I32(32) - jax.lax.clz(x).astype(jnp.int32)


def _place(sig, s) -> list:
    """``sig 2**s`` in four 32-bit limbs, for ``s + bit_length(sig) <= 122``; where
    ``s < 1`` the bits below window bit 1 are dropped and bit 0 says whether any was
    set (a sticky bit)."""
    r = (s & I32(31)).astype(jnp.uint32)
    q = s >> I32(5)
    lo = sig << r
    hi = jnp.where(r == U32(0), U32(0), sig >> ((U32(32) - r) & U32(31)))
    n = clamp_int(I32(1) - s, 1, 31).astype(jnp.uint32)
    under = ((sig >> n) << U32(1)) | ((sig & ((U32(1) << n) - U32(1))) != U32(0)).astype(jnp.uint32)
    below = s < I32(1)
    out = []
    for i in range(4):
        placed = jnp.where(q == I32(i), lo, jnp.where(q == I32(i - 1), hi, U32(0)))
        out.append(jnp.where(below, under if i == 0 else U32(0), placed))
    return out


def _add32(a, b) -> list:
    out, carry = [], U32(0)
    for x, y in zip(a, b):
        s = x + y
        s2 = s + carry
        carry = ((s < x) | (s2 < s)).astype(jnp.uint32)
        out.append(s2)
    return out


def _negate32(a) -> list:
    return _add32([x ^ _M32 for x in a], [U32(1), U32(0), U32(0), U32(0)])


def _group(terms, bottom) -> list:
    """The OR of the placed terms (their bits are disjoint): one signed group's magnitude."""
    acc = [U32(0)] * 4
    for sig, pos in terms:
        acc = [x | y for x, y in zip(acc, _place(sig, pos - bottom))]
    return acc


def _normalise128(v):
    """(v shifted left until its leading bit is bit 127, the shift)."""
    lz = jnp.where(
        v[3] != U32(0),
        jax.lax.clz(v[3]),
        jnp.where(
            v[2] != U32(0),
            U32(32) + jax.lax.clz(v[2]),
            jnp.where(v[1] != U32(0), U32(64) + jax.lax.clz(v[1]), U32(96) + jax.lax.clz(v[0])),
        ),
    )
    q, r = (lz >> U32(5)).astype(jnp.int32), lz & U32(31)
    moved = [
        sum(
            (jnp.where(q == I32(shift), v[i - shift], U32(0)) for shift in range(i + 1)),
            U32(0),
        )
        for i in range(4)
    ]
    back = (U32(32) - r) & U32(31)
    out = [
        (moved[i] << r) | jnp.where(r == U32(0), U32(0), moved[i - 1] >> back if i else U32(0))
        for i in range(4)
    ]
    return out, lz.astype(jnp.int32)


def _sum_rounded(groups, fmt):
    """``round_parts`` of the exact sum of signed groups of ``(sig, pos)`` terms
    (``sig 2**pos``, ``sig < 2**24``; a group's terms have disjoint bits)."""
    tops = [
        jnp.where(sig == U32(0), I32(_NOWHERE), pos + _bit_length(sig))
        for _, terms in groups
        for sig, pos in terms
    ]
    top = tops[0]
    for x in tops[1:]:
        top = jnp.maximum(top, x)
    bottom = top - I32(_WINDOW_TOP)  # the weight of window bit 0
    total = [U32(0)] * 4
    for negative, terms in groups:
        acc = _group(terms, bottom)
        total = _add32(total, _where(negative, _negate32(acc), acc))
    sign = total[3] & SIGN_MASK
    mag = _where(sign != U32(0), _negate32(total), total)
    zero = (mag[0] | mag[1] | mag[2] | mag[3]) == U32(0)
    norm, lz = _normalise128(mag)
    kept = norm[3] >> U32(8)
    guard = (norm[3] >> U32(7)) & U32(1)
    sticky = ((norm[3] & U32(0x7F)) | norm[2] | norm[1] | norm[0]) != U32(0)
    sig, rest = nearest_rounded(kept, guard, U32(1), sticky)
    sig, exp = normalise_parts(sig, bottom + I32(127) - lz)
    return round_parts(sign, exp, sig, zero, rest, fmt)


def _fallback(m, l, scale) -> jax.Array:
    """float64's ``m (·scale) + ln l`` where an operand is NaN or infinite or ``l <= 0``.

    With ``scale``, as XLA's CPU backend computes it under ``jit``: contracted into
    one fused multiply-add, which returns its first NaN operand (``m``, ``scale``,
    ``ln l``), else the default NaN of an invalid ``0 · inf`` or ``inf - inf``."""
    lb = bits_of(l)
    log = jnp.where(
        (lb & ABS_MASK) == U32(0),
        float_of_bits(U32(0xFF800000)),  # ln ±0 = -inf
        jnp.where((lb & SIGN_MASK) != U32(0), float_of_bits(_POSITIVE_NAN), jnp.zeros_like(l)),
    )
    log = jnp.where(lb == INF_BITS, l, log)  # ln inf = inf
    log = jnp.where(is_nan(l), l, log)
    if scale is None:
        return first_nan(stand_in(m) + log, m, log)
    return first_nan(stand_in(m) * stand_in(scale) + log, m, scale, log)


def lse(m, l, fmt, scale=None) -> jax.Array:
    """``fl_fmt(m·scale + ln l)`` (``fl_fmt(m + ln l)`` where ``scale`` is None),
    correctly rounded (module docstring), for float32 carrier arrays ``m``, ``l``
    (and ``scale``) that broadcast together.  Returns a float32 carrier array."""
    args = (m, l) if scale is None else (m, l, scale)
    check_carriers(*args)
    fmt = as_format(fmt)
    arrays = jnp.broadcast_arrays(*(jnp.asarray(x) for x in args))
    m, l = arrays[0], arrays[1]
    scale = arrays[2] if scale is not None else None
    pm = unpack(m)
    if scale is None:
        sign, m_terms = pm.sign, [(pm.sig, pm.exp - I32(23))]
        finite = pm.finite
    else:
        ps = unpack(scale)
        high, low = exact_product(pm.sig, ps.sig)  # m·scale = (high 2**24 + low) 2**(e - 46)
        e = pm.exp + ps.exp - I32(46)
        zero = pm.zero | ps.zero
        high, low = jnp.where(zero, U32(0), high), jnp.where(zero, U32(0), low)
        sign, m_terms = pm.sign ^ ps.sign, [(high, e + I32(24)), (low, e)]
        finite = pm.finite & ps.finite
    pl = unpack(l)
    positive = ~pl.zero & (pl.sign == U32(0))
    safe_l = jnp.where(positive & pl.finite, l, jnp.ones_like(l))
    h, h_negative = _log_fixed(safe_l)
    h_terms = [(limb, I32(16 * i - _FRACTION_BITS)) for i, limb in enumerate(h)]
    main = _sum_rounded([(sign != U32(0), m_terms), (h_negative, h_terms)], fmt)
    special = ~(finite & pl.finite & positive)
    return round_to(jnp.where(special, _fallback(m, l, scale), main), fmt)
