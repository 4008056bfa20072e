"""An exact rational oracle for rounding: the reference the tests hold fa_jax to.

``round_exact(v, fmt, mode)`` rounds the real number ``v`` (a float, including
±inf and NaN, or an exact ``fractions.Fraction``) onto the values of ``fmt``
with rational arithmetic, following the semantics documented in
fa_jax/formats.py and fa_jax/rounding.py.  Results are Python floats.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from fa_jax.formats import Format


def _past_max(fmt: Format, neg: bool) -> float:
    """What a value rounded past max becomes (non-saturating formats)."""
    if fmt.specials == "ieee":
        return -math.inf if neg else math.inf
    return math.nan


def round_exact(
    v, fmt: Format, mode: str = "nearest_even", *, negative_zero: bool = False
) -> float:
    """``v`` rounded to ``fmt`` in ``mode``, exactly.

    For a Fraction, ``negative_zero`` gives the sign of a zero ``v`` (Fractions
    have no -0).
    """
    if isinstance(v, Fraction):
        neg = v < 0 or (v == 0 and negative_zero)
        a = abs(v)
    else:
        x = float(v)
        neg = math.copysign(1.0, x) < 0
        sat = fmt.overflow == "saturate"
        if math.isnan(x):
            # No NaN to give: ml_dtypes' zero with the NaN's sign bit inverted.
            return (0.0 if neg else -0.0) if fmt.specials == "finite" else math.nan
        if math.isinf(x):
            if sat:
                return -fmt.max if neg else fmt.max
            return _past_max(fmt, neg)
        a = abs(Fraction(x))
    sat = fmt.overflow == "saturate"
    m = fmt.man_bits
    if a == 0:
        r = Fraction(0)
    else:
        # Binade of a: 2**e <= a < 2**(e+1).
        e = a.numerator.bit_length() - a.denominator.bit_length()
        if Fraction(2) ** e > a:
            e -= 1
        assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
        # Quantum: below tiny it is the subnormal spacing, or tiny itself (grid
        # {0, tiny}) without subnormals.  Above, the exponent range is unbounded.
        q = (
            Fraction(2) ** (max(e, fmt.emin) - m)
            if fmt.subnormals
            else (Fraction(2) ** (e - m) if e >= fmt.emin else Fraction(2) ** fmt.emin)
        )
        k = a.numerator * q.denominator // (a.denominator * q.numerator)  # floor(a / q)
        lo, hi = k * q, (k + 1) * q
        assert lo <= a < hi
        if mode == "nearest_even":
            away = (a - lo > hi - a) or (a - lo == hi - a and k % 2 == 1)
        else:
            away = {
                "toward_zero": False,
                "up": not neg and a != lo,
                "down": neg and a != lo,
            }[mode]
        r = hi if away else lo
    if r > Fraction(fmt.max):
        toward_max = (
            sat or mode == "toward_zero" or (mode == "up" and neg) or (mode == "down" and not neg)
        )
        if not toward_max:
            return _past_max(fmt, neg)
        r = Fraction(fmt.max)
    if r == 0 and fmt.specials == "fnuz":
        return 0.0
    out = float(r)
    assert Fraction(out) == r
    return -out if neg else out


def exact_matmul(a, b) -> list[list[Fraction]]:
    """The exact product of two 2-D arrays of floats, as rows of Fractions."""
    fa = [[Fraction(float(v)) for v in row] for row in a]
    fb = [[Fraction(float(v)) for v in col] for col in zip(*b)]
    return [[sum((x * y for x, y in zip(r, c)), Fraction(0)) for c in fb] for r in fa]


def exactly_rounded_matmul(a, b, fmt: Format):
    """:func:`exact_matmul` with each output rounded once to ``fmt`` (float32 array)."""
    rows = [[round_exact(v, fmt) for v in row] for row in exact_matmul(a, b)]
    return np.asarray(rows, np.float32)
