"""Exact, pure-Python conversion between a Format's bit codes and its values.

``decode(code, fmt)`` and ``encode(value, fmt)`` work on Python ints and floats
for concrete formats of up to 64 bits.  They are reference code for tests and
display (``fa-jax round`` prints the fields), not for arrays: round arrays with
:func:`fa_jax.round_to`.
"""

from __future__ import annotations

import math

from fa_jax.formats import Format

__all__ = ["decode", "encode", "fields"]


def fields(code: int, fmt: Format) -> tuple[int, int, int]:
    """(sign, exponent field, mantissa field) of a code."""
    fmt.require_concrete("fields")
    if not 0 <= code < (1 << fmt.bits):
        raise ValueError(f"code: expected 0..{(1 << fmt.bits) - 1} for {fmt.name}, got {code}")
    m = fmt.man_bits
    return code >> (fmt.bits - 1), (code >> m) & ((1 << fmt.exp_bits) - 1), code & ((1 << m) - 1)


def decode(code: int, fmt: Format) -> float:
    """The value a code stands for (NaN for NaN codes)."""
    sign, e_field, frac = fields(code, fmt)
    top = (1 << fmt.exp_bits) - 1
    if fmt.specials == "fnuz" and code == 1 << (fmt.bits - 1):
        return math.nan
    if e_field == top:
        if fmt.specials == "ieee":
            return math.nan if frac else (-math.inf if sign else math.inf)
        if fmt.specials == "fn" and frac == (1 << fmt.man_bits) - 1:
            return math.nan
    if e_field == 0:
        if not fmt.subnormals and frac:
            return math.nan  # unused codes of a format without subnormals
        value = math.ldexp(frac, fmt.emin - fmt.man_bits)
    else:
        value = math.ldexp((1 << fmt.man_bits) | frac, e_field - fmt.bias - fmt.man_bits)
    return -value if sign else value


def encode(value: float, fmt: Format) -> int:
    """The code of a value of ``fmt`` (round it first).  NaN gives the format's
    canonical NaN code; a value not in the format raises ValueError."""
    fmt.require_concrete("encode")
    sign_bit = 1 << (fmt.bits - 1)
    if math.isnan(value):
        if not fmt.has_nan:
            raise ValueError(f"{fmt.name} has no NaN")
        if fmt.specials == "fnuz":
            return sign_bit
        top = ((1 << fmt.exp_bits) - 1) << fmt.man_bits
        return top | (
            (1 << fmt.man_bits) - 1 if fmt.specials == "fn" else 1 << max(fmt.man_bits - 1, 0)
        )
    mag = abs(value)
    negative = math.copysign(1.0, value) < 0 and (mag != 0 or fmt.has_negative_zero)
    sign = sign_bit if negative else 0
    if math.isinf(mag):
        if not fmt.has_inf:
            raise ValueError(f"{fmt.name} has no infinity")
        return sign | (((1 << fmt.exp_bits) - 1) << fmt.man_bits)
    if mag == 0:
        return sign
    if mag > fmt.max or mag < fmt.smallest_subnormal:
        raise ValueError(f"{value!r} is outside the finite range of {fmt.name}")
    mant, exp = math.frexp(mag)  # mag = mant * 2**exp, 0.5 <= mant < 1
    e = exp - 1
    if e < fmt.emin:
        scaled = math.ldexp(mag, fmt.man_bits - fmt.emin)
        code = int(scaled)
    else:
        scaled = math.ldexp(mant, fmt.man_bits + 1)
        code = ((e + fmt.bias) << fmt.man_bits) | (int(scaled) - (1 << fmt.man_bits))
    if scaled != int(scaled):
        raise ValueError(f"{value!r} is not a value of {fmt.name}; round it first")
    return sign | code
