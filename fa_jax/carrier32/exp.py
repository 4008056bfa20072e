"""Correctly rounded ``exp`` and ``exp2`` on float32 carriers, without float64.

``exp(x, fmt)`` and ``exp2(x, fmt)`` return ``fl_fmt(e**x)`` and ``fl_fmt(2**x)``
(nearest, ties to even) for a float32 carrier ``x`` and any format that fits
float32: the bits of :func:`fa_jax.ops.exp` / :func:`fa_jax.ops.exp2` (float64
``exp`` rounded once to ``fmt``) wherever those are correctly rounded.  The
program holds no 64-bit value; XLA's float32 habits (subnormals flushed,
``a * b + c`` contracted to an FMA) are avoided as in :mod:`fa_jax.carrier32.elementwise`: every
product that must be exact has operands of at most 12 (or 7 and 17) significant
bits, so contracting it changes nothing, and the arithmetic runs near 1, where a
term flushed below ``2**-126`` is far under the error bound.

Method: table-driven (Tang 1989, "Table-driven implementation of the exponential
function in IEEE floating-point arithmetic"; Muller, "Elementary Functions", ch. 6).

* Reduction.  ``exp``: ``N = round(x 512 / ln 2)``, ``r = x - N ln2/512`` with
  ``ln2/512`` split into six 7-bit pieces (``N`` has 17 bits: each ``N L_i`` is
  exact) and a float32 rest; the differences by TwoSum (Knuth), their errors summed
  into ``r = r_hi + r_lo``.  ``exp2``: ``r = x - N/512`` is exact and
  ``r ln 2`` is formed from exact 12-bit partial products.  ``|r| < 2**-10.3``.
* ``e**r - 1 = r + r**2/2 + r**3/6 + r**4/24 + r**5/120``: ``r + r**2/2`` in
  double-float (the square from exact 12-bit partial products), the rest in
  float32 (below ``2**-33``).
* ``y = T_j (1 + p)``, ``T_j = 2**(j/512)`` (``j = N mod 512``) stored as three
  float32 (a 72-bit value), ``T_hi p_hi`` from exact partial products.  ``y`` ends
  as ``t + u + lo`` with ``t, u`` from TwoSum; the nearest 24-bit value of that sum
  and the sign of its remainder come from rounding ``u + lo`` to odd (as
  :func:`fa_jax.carrier32.elementwise.fma`, Boldo & Melquiond 2008), and ``2**(N div 512)`` is
  applied to the integer exponent in :func:`fa_jax.carrier32.elementwise.round_parts`, so
  ``fmt``'s and float32's subnormal results are exact.

Error bound.  Summing the rounding errors of each step (each at most half an ulp
of an operand whose magnitude is bounded above), the computed ``y`` has relative
error below ``2**-54``; :data:`ERROR_BOUND` allows ``2**-53``.  The rounding can
then only differ from the exact one where ``e**x`` (``2**x``) lies within
``ERROR_BOUND`` of a number of at most 25 significant bits: a value or midpoint of
a format with at most 23 fraction bits, subnormal ranges included (the hard cases
of Lefèvre & Muller 2001, "Worst cases for correct rounding of the elementary
functions in double precision").  The slow test in ``tests/test_exp32.py`` lists,
over every float32 input, each whose computed ``y`` lies within twice the bound of
such a number, and checks each against 200-bit arithmetic: each has the exact
nearest 24-bit value and remainder sign, so every input rounds correctly to every
format.  (``fa_jax.ops`` rounds XLA's float64 result once more, so it can differ
where that result is within its own error of a midpoint; there ``exp``/``exp2``
here are the correctly rounded ones.)

``|x| < 2**-26`` gives ``1 + x`` (``1 + x ln 2``) to first order: the nearest
24-bit value is 1, the remainder has the sign of ``x``.  NaN is returned as given
(its sign kept), ``exp(±inf)`` is ``inf``/``0``; ``round_to`` maps overflow and
specials to ``fmt``.
"""

from __future__ import annotations

import functools
import math
from decimal import Context, Decimal
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.carrier32.elementwise import (
    ABS_MASK,
    INF_BITS,
    SIGN_MASK,
    U32,
    as_format,
    bits_of,
    check_carriers,
    float_of_bits,
    round_sum,
    sign_against,
    two_sum,
)
from fa_jax.rounding import round_to

__all__ = ["ERROR_BOUND", "exp", "exp2"]

ERROR_BOUND = 2.0**-53  # relative error of the computed y (see the module docstring)
_T = 9  # table index bits: 512 entries
_I32 = np.int32
_F32 = np.float32
_SPLIT = U32(0xFFFFF000)  # keeps a float32's sign, exponent and top 12 significant bits
_TINY = -26  # |x| < 2**_TINY: the nearest 24-bit value of the result is 1


def _decimal_pieces(value: Decimal, n: int, bits: int | None = None) -> tuple[float, ...]:
    """``value`` as ``n`` float32 terms (each the nearest of the remainder; ``bits``
    significant bits for all but the last term where given)."""
    out = []
    rest = value
    for i in range(n):
        if bits is not None and i < n - 1 and rest != 0:
            e = math.frexp(float(rest))[1] - 1  # floor(log2 |rest|), or one more
            if Decimal(2) ** e > abs(rest):
                e -= 1
            piece = float(round(rest / Decimal(2) ** (e - bits + 1)) * Decimal(2) ** (e - bits + 1))
        else:
            piece = float(np.float32(float(rest)))
        out.append(piece)
        rest -= Decimal(piece)
    return tuple(out)


@functools.cache
def _constants():
    """The table of 2**(j/512) and the pieces of ln2/512 and ln 2, from exact decimals
    (computed on first use: about 70 ms, which ``import fa_jax`` should not pay)."""
    ctx = Context(prec=60)
    ln2 = ctx.ln(Decimal(2))
    step = ctx.divide(ln2, Decimal(1 << _T))
    rows = [
        _decimal_pieces(ctx.power(Decimal(2), ctx.divide(j, 1 << _T)), 3) for j in range(1 << _T)
    ]
    table = tuple(np.array(column, _F32) for column in zip(*rows))  # 2**(j/512): hi, mid, lo
    reduction = _decimal_pieces(step, 7, bits=7)  # ln2/512: six 7-bit pieces and a rest
    ln2_pieces = _decimal_pieces(ln2, 3, bits=12)  # ln 2: two 12-bit pieces and a rest
    inv_step = float(np.float32(float(ctx.divide(Decimal(1), step))))
    return table, reduction, ln2_pieces, inv_step


def _c(v) -> jax.Array:
    return jnp.asarray(v, jnp.float32)


def _split(a):
    """a = hi + lo exactly, ``hi`` the top 12 significant bits of ``a`` (masked)."""
    hi = float_of_bits(bits_of(a) & _SPLIT)
    return hi, a - hi


class _Parts(NamedTuple):
    """The result as ``2**k (t + u + lo)``, ``t`` and ``u`` from TwoSum, ``t`` near 1."""

    k: jax.Array
    t: jax.Array
    u: jax.Array
    lo: jax.Array


def _exp_reduce(x):
    """(N, (r_hi, r_lo)) with ``x = N ln2/512 + r_hi + r_lo`` (to the error bound)."""
    _, reduction, _, inv_step = _constants()
    n = jnp.round(x * _c(inv_step))
    pieces = [-n * _c(piece) for piece in reduction[:-1]]  # exact: 17 + 7 bits
    a, e1 = two_sum(x, pieces[0])  # e1 == 0 unless |N| == 1
    a, e2 = two_sum(a, pieces[1])
    a, e3 = two_sum(a, pieces[2])
    a, e4 = two_sum(a, pieces[3])
    a, e5 = two_sum(a, pieces[4])
    a, e6 = two_sum(a, pieces[5])
    small = ((e3 + e4) + (e5 + e6)) + (e1 + -n * _c(reduction[-1]))
    r_hi, t = two_sum(a, e2)
    return n, two_sum(r_hi, t + small)


def _exp2_reduce(x):
    """(N, (z_hi, z_lo)) with ``2**x = 2**(N/512) e**(z_hi + z_lo)``."""
    n = jnp.round(x * _c(1 << _T))
    r = x - n * _c(1.0 / (1 << _T))  # exact
    r1, r0 = _split(r)
    a1, a0, rest = (_c(v) for v in _constants()[2])
    z, e = two_sum(r1 * a1, r1 * a0)
    z, f = two_sum(z, r0 * a1)
    lo = (e + f) + (r0 * a0 + r * rest)
    return n, two_sum(z, lo)


def _expm1(r_hi, r_lo):
    """e**r - 1 for ``r = r_hi + r_lo``, ``|r| < 2**-10.3``, as a float32 pair."""
    h1, h0 = _split(r_hi)
    half = _c(0.5)
    q1, q2 = two_sum(h1 * h1 * half, h1 * h0)  # r_hi**2/2: h1**2/2 + h1 h0 + h0**2/2
    q_small = q2 + (h0 * h0 * half + r_hi * r_lo)
    poly = _c(1.0 / 3) + r_hi * (_c(1.0 / 12) + r_hi * _c(1.0 / 60))
    cubic = q1 * r_hi * poly  # r**3/6 + r**4/24 + r**5/120
    p_hi, e = two_sum(r_hi, q1)
    return two_sum(p_hi, ((e + r_lo) + q_small) + cubic)


def _parts(n, z_hi, z_lo) -> _Parts:
    """``2**(n/512) e**z`` as :class:`_Parts`."""
    ni = n.astype(jnp.int32)
    j = ni & _I32((1 << _T) - 1)
    k = (ni - j) >> _I32(_T)
    t_hi, t_mid, t_lo = (jnp.asarray(column)[j] for column in _constants()[0])
    p_hi, p_lo = _expm1(z_hi, z_lo)
    g1, g0 = _split(t_hi)
    h1, h0 = _split(p_hi)
    a, e = two_sum(g1 * h1, g1 * h0)  # T_hi p_hi from exact partial products
    a, f = two_sum(a, g0 * h1)
    small = ((e + f) + g0 * h0) + (t_hi * p_lo + t_mid * p_hi)
    t, u = two_sum(t_hi, a)
    u, g = two_sum(u, t_mid)
    return _Parts(k, t, u, (g + t_lo) + small)


def _round_odd(parts: _Parts):
    """(s, rest): the float32 nearest to ``t + u + lo`` and the sign of the remainder,
    by rounding ``u + lo`` to odd (see :func:`fa_jax.carrier32.elementwise.fma`)."""
    v0, w = two_sum(parts.u, parts.lo)
    v_bits = bits_of(v0)
    w_sign = sign_against(w, v0)
    to_odd = (w_sign != _I32(0)) & ((v_bits & U32(1)) == U32(0))
    step = jnp.where(w_sign > _I32(0), U32(1), U32(0xFFFFFFFF))
    v = float_of_bits(jnp.where(to_odd, v_bits + step, v_bits))
    s, e = two_sum(parts.t, v)
    w_rest = sign_against(w, s)
    rest = jnp.where(
        (bits_of(e) & ABS_MASK) != U32(0), sign_against(e, s), jnp.where(to_odd, -w_rest, w_rest)
    )
    return s, rest


def _evaluate(x, fmt, reduce, lo: float, hi: float) -> jax.Array:
    check_carriers(x)
    fmt = as_format(fmt)
    x = jnp.asarray(x)
    bits = bits_of(x)
    mag = bits & ABS_MASK
    tiny = mag < U32((127 + _TINY) << 23)
    xc = jnp.clip(jnp.where(tiny, _c(0.0), x), _c(lo), _c(hi))
    n, (z_hi, z_lo) = reduce(xc)
    parts = _parts(n, z_hi, z_lo)
    s, rest = _round_odd(parts)
    x_sign = jnp.where(mag == U32(0), _I32(0), jnp.where(bits >= SIGN_MASK, _I32(-1), _I32(1)))
    s = jnp.where(tiny, _c(1.0), s)
    rest = jnp.where(tiny, x_sign, rest)
    k = jnp.where(tiny, _I32(0), parts.k)
    main = round_sum(s, rest, k, fmt)
    nan = mag > INF_BITS
    infinite = mag == INF_BITS
    special = jnp.where(nan, x, jnp.where(bits == INF_BITS, float_of_bits(INF_BITS), _c(0.0)))
    return round_to(jnp.where(nan | infinite, special, main), fmt)


def exp(x, fmt) -> jax.Array:
    """fl_fmt(e**x), correctly rounded, for a float32 carrier ``x``."""
    return _evaluate(x, fmt, _exp_reduce, -110.0, 90.0)


def exp2(x, fmt) -> jax.Array:
    """fl_fmt(2**x), correctly rounded, for a float32 carrier ``x``."""
    return _evaluate(x, fmt, _exp2_reduce, -160.0, 130.0)
