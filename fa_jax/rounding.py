"""Bit-exact rounding of float32/float64 carriers to any :class:`~fa_jax.Format`.

``round_to(x, fmt)`` returns, in ``x``'s own dtype (the *carrier*), the value of
``fmt`` that ``x`` rounds to.  It works on the carrier's bits with integer
operations, so XLA can neither elide it (excess precision) nor flush the
target's subnormals (``lax.reduce_precision`` and CPU float arithmetic do
both).  One case is cheaper and gives the same bits: rounding to nearest to an
IEEE layout whose subnormals are carrier normals (bf16, fp16 and fp32 in
float64; fp16 in float32) is ``reduce_precision`` from the smallest normal up,
and ``x 2**(m - emin)`` rounded to an integer, scaled back, below it (exact
float arithmetic on normal numbers).  Rounding to nearest to a format that rounds
exactly in the carrier's float arithmetic (:meth:`~fa_jax.formats.Format.rounds_in_float`,
stated by a traced format in ``float_exact_in``) is ``(|x| + C) - C``, Eq. (R) of
:mod:`fa_jax.formats`, with the overflow and specials below; to the carrier's own
layout it changes only a NaN (made quiet).

How it works.  For a non-negative float, the integer formed by its exponent and
fraction bits (its *magnitude code*) grows monotonically with its value, and
inside one carrier binade (or across all carrier subnormals) consecutive codes
are one carrier ulp, ``2**(E_lin - M_c)``, apart.  Let ``x`` lie in binade
``E = floor(log2 |x|)``.  The target's quantum there is
``2**(max(E, emin) - man_bits)``, i.e. ``d = max(E, emin) - man_bits - E_lin +
M_c`` low bits of the code.  While ``d <= M_c`` the binade's start is a
multiple of the quantum, so rounding the code to a multiple of ``2**d`` rounds
the value, and a carry out of the fraction correctly bumps the exponent.
``d > M_c`` happens only below ``S``, the smallest positive value of the
format; there the result is 0 or ``S``.  Rounding past ``max`` is then mapped to
the format's overflow value.

Semantics, shared with ml_dtypes' cast for float32 inputs (tests check every
code and midpoint of every <=8-bit format, and exhaustive_rounding.py all 2**32
float32 inputs for bfloat16 and float16):

* ties go to even in ``"nearest_even"``; directed modes never overflow to inf in
  the direction toward zero (they give ±max), as IEEE 754 requires;
* ±inf stays ±inf for formats with infinities, becomes NaN for "fn"/"fnuz"
  formats, and ±max with ``overflow="saturate"`` or ``specials="finite"``;
* NaN becomes a quiet NaN (payload not kept, sign kept except for fnuz, whose
  single NaN decodes as ml_dtypes decodes it); formats without NaN
  (``specials="finite"``) map NaN to a zero whose sign bit is the NaN's sign bit
  inverted — exactly what ml_dtypes does; note it is a silent NaN -> 0;
* fnuz formats have no -0: negative values that round to zero give +0.

For float64 inputs the result is the correctly rounded value (checked against
an exact rational oracle).  ml_dtypes' own float64 -> bfloat16/float8/6/4 cast
goes through float32 first and can double-round, so it is *not* the reference
there.

Stochastic rounding rounds ``x`` up (away from zero) with probability
``(|x| - lo) / (hi - lo)`` for the neighbouring values ``lo <= |x| < hi``,
using ``d`` uniform bits from ``key``; it is exactly unbiased for
``|x| >= S``.  Below ``S`` the probability ``|x|/S`` is resolved to
``M_c + 1`` bits (24 for float32, 53 for float64), a bias of at most
``2**-(M_c+1) * S`` per element.

The gradient is the identity (straight-through estimator): ``d round_to/dx =
1`` everywhere, including at inf and NaN.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax.formats import Format, get_format

__all__ = ["ROUNDING_MODES", "RoundingMode", "round_to"]

RoundingMode = Literal["nearest_even", "toward_zero", "up", "down", "stochastic"]
ROUNDING_MODES: tuple[str, ...] = ("nearest_even", "toward_zero", "up", "down", "stochastic")


_I32 = np.int32  # integer constants stay 32-bit: no 64-bit type in the program


@dataclasses.dataclass(frozen=True)
class _Carrier:
    """Bit layout of a carrier dtype (float32 or float64)."""

    uint: type
    man: int  # M_c, stored mantissa bits
    bias: int

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def width(self) -> int:
        return np.dtype(self.uint).itemsize * 8

    @property
    def sign_mask(self):
        return self.uint(1 << (self.width - 1))

    @property
    def abs_mask(self):
        return self.uint((1 << (self.width - 1)) - 1)

    @property
    def inf_bits(self):
        return self.uint((2 * self.bias + 1) << self.man)

    @property
    def qnan_bits(self):
        return self.uint(((2 * self.bias + 1) << self.man) | (1 << (self.man - 1)))


_FLOATS = {np.uint32: np.float32, np.uint64: np.float64}  # a carrier's float by its bits

_CARRIERS = {
    np.dtype(np.float32): _Carrier(np.uint32, 23, 127),
    np.dtype(np.float64): _Carrier(np.uint64, 52, 1023),
}


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable part of a rounding: mode and the format's non-numeric fields."""

    mode: str
    subnormals: bool
    specials: str
    overflow: str
    in_float: bool = False  # the magnitude rounded by Eq. (R) (:func:`_nearest_in_float`)


def round_to(x, fmt, mode: RoundingMode = "nearest_even", *, key=None) -> jax.Array:
    """Round ``x`` to the nearest value of ``fmt`` (or per ``mode``), bit-exactly.

    Args:
      x: float32 or float64 array (the carrier; Python scalars become jnp
        default floats).  The result has the same dtype and shape.
      fmt: a :class:`Format`, a format name ("bf16", "e4m3fn", "e5m4", ...)
        or a dtype.  Its exp_bits/man_bits/bias may be traced integers.
      mode: "nearest_even" (default), "toward_zero", "up" (toward +inf),
        "down" (toward -inf) or "stochastic".
      key: a ``jax.random`` key, required by (and only by) "stochastic".
        The same key gives the same bits.

    Raises:
      ValueError: unknown mode; missing or superfluous key; a format that does
        not fit the carrier (a float64 carrier needs ``jax_enable_x64``).
      TypeError: ``x`` is not float32/float64.
    """
    fmt = get_format(fmt)
    if mode not in ROUNDING_MODES:
        raise ValueError(f"round_to: mode must be one of {ROUNDING_MODES}, got {mode!r}")
    if (mode == "stochastic") != (key is not None):
        raise ValueError(
            "round_to: mode='stochastic' needs key=jax.random.key(...); other modes take "
            f"no key (got mode={mode!r}, key={'None' if key is None else 'a key'})"
        )
    x = jnp.asarray(_float64_without_x64(x, fmt, mode))
    carrier = _carrier_of(x.dtype, fmt)
    rbits = jax.random.bits(key, x.shape, carrier.uint) if key is not None else None
    in_float = mode == "nearest_even" and fmt.rounds_in_float(x.dtype)
    static = _Static(mode, fmt.subnormals, fmt.specials, fmt.overflow, in_float)
    if fmt.is_concrete:  # one compiled program; widths folded in as constants
        widths = (int(fmt.exp_bits), int(fmt.man_bits), int(fmt.bias))
        return _round_compiled(static, widths, x, rbits)
    widths = (jnp.asarray(w, jnp.int32) for w in (fmt.exp_bits, fmt.man_bits, fmt.bias))
    return _round_traced(static, x, *widths, rbits)


def _float64_without_x64(x, fmt: Format, mode: str):
    """Host float64 values (numpy arrays, numpy or Python floats) when
    ``jax_enable_x64`` is off, which JAX would round to float32 before
    ``round_to`` rounds them again.  They are narrowed here by rounding to odd
    instead: float32 with its last bit set where the narrowing was inexact.
    Rounding to odd to q >= p + 2 bits, then to p bits in any direction, equals
    rounding once (Boldo & Melquiond 2008, "Emulation of FMA and correctly rounded
    sums: proved algorithms using rounding to odd", Thm. 3), so every format with
    two bits to spare in float32 (man_bits <= 21, quantum >= 2**-147) is rounded
    correctly.  Float32's own layout in round-to-nearest is numpy's cast, one
    rounding; other formats, traced formats and stochastic rounding raise."""
    if jax.config.read("jax_enable_x64") or isinstance(x, jax.Array):
        return x
    a = np.asarray(x)
    if a.dtype != np.float64:
        return x
    spare_bits = (
        fmt.is_concrete
        and fmt.man_bits <= 21
        and fmt.emax <= 127
        and fmt.emin - fmt.man_bits >= -147
    )
    float32_nearest = (
        fmt.is_concrete
        and mode == "nearest_even"
        and (fmt.man_bits, fmt.emax, fmt.min_exponent) == (23, 127, -149)
    )
    if float32_nearest:
        with np.errstate(over="ignore"):
            return a.astype(np.float32)
    if mode == "stochastic" or not spare_bits:
        what = "stochastic rounding" if mode == "stochastic" else f"{fmt.name}"
        raise TypeError(
            f"round_to: x is float64 but jax_enable_x64 is off, and {what} cannot be "
            "rounded exactly from a float32 carrier; enable float64 with "
            "jax.config.update('jax_enable_x64', True) or pass float32 values"
        )
    return _round_to_odd_float32(a)


def _round_to_odd_float32(a: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: exact values stay; an inexact one becomes
    the float32 neighbour toward zero with its last bit set (the odd one of the two
    that bracket it; FLT_MAX past the range, ±2**-149 below it)."""
    with np.errstate(over="ignore"):
        nearest = a.astype(np.float32)
    back = nearest.astype(np.float64)
    inexact = (back != a) & np.isfinite(a)
    away = inexact & (np.abs(back) > np.abs(a))
    code = nearest.view(np.uint32)
    code = np.where(away, code - np.uint32(1), code)  # sign-magnitude: one step toward 0
    code = np.where(inexact, code | np.uint32(1), code)
    return np.asarray(code, np.uint32).view(np.float32)


def _carrier_of(dtype, fmt: Format) -> _Carrier:
    dtype = np.dtype(dtype)
    if dtype not in _CARRIERS:
        raise TypeError(
            f"round_to: expected a float32 or float64 array (the carrier), got {dtype.name}; "
            "cast narrower inputs up first (exact), e.g. x.astype(jnp.float32)"
        )
    if fmt.is_concrete and not fmt.fits(dtype):
        hint = ""
        if dtype == np.float32 and fmt.fits(np.float64):
            hint = (
                "; pass a float64 array (enable it with jax.config.update('jax_enable_x64', True))"
            )
        raise ValueError(
            f"round_to: format {fmt.name!r} does not fit a {dtype.name} carrier "
            f"(man_bits={fmt.man_bits}, emin={fmt.emin}, emax={fmt.emax}){hint}"
        )
    return _CARRIERS[dtype]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _round_ste(static, x, exp_bits, man_bits, bias, rbits):
    return _round_bits(static, x, exp_bits, man_bits, bias, rbits)


# One traced program per (static, shapes), bound as one call wherever a traced-width
# format is rounded: tracing it again at every op would dominate a sweep's compile.
_round_traced = jax.jit(_round_ste, static_argnums=(0,))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _round_compiled(static, widths, x, rbits):
    if static in _IEEE_NEAREST and _carrier_layout(widths, x.dtype):
        return _quiet_nan_ste(x)
    if _hardware_nearest(static, widths, x.dtype):
        return _round_nearest_ste(widths, x)
    return _round_ste(static, x, *(np.int32(w) for w in widths), rbits)


def _carrier_layout(widths, dtype) -> bool:
    """Whether ``widths`` are the carrier's own (FP64 in float64, FP32 in float32):
    rounding to nearest then changes no value."""
    c = _CARRIERS[np.dtype(dtype)]
    return tuple(widths) == (np.dtype(dtype).itemsize * 8 - 1 - c.man, c.man, c.bias)


@jax.custom_jvp
def _quiet_nan_ste(x):
    """Rounding to the carrier's own layout to nearest: every value kept, a NaN
    made the quiet NaN of its sign (as :func:`_round_bits` gives it)."""
    return _quiet_nans(x, x)


@_quiet_nan_ste.defjvp
def _quiet_nan_jvp(primals, tangents):
    return _quiet_nan_ste(*primals), tangents[0]


_IEEE_NEAREST = tuple(_Static("nearest_even", True, "ieee", "inf", b) for b in (False, True))


def _hardware_nearest(static: _Static, widths, dtype) -> bool:
    """Whether XLA's ``reduce_precision`` rounds to the format exactly above its
    smallest normal: an IEEE layout (bias 2**(e-1) - 1, infinities, subnormals,
    overflow to inf) rounded to nearest, narrower than the carrier, whose
    subnormals are carrier normals (so the scaled rounding below them is exact
    float arithmetic that no flush to zero touches)."""
    e, m, bias = widths
    c = _CARRIERS[np.dtype(dtype)]
    return (
        static in _IEEE_NEAREST
        and bias == (1 << (e - 1)) - 1
        and 0 < m < c.man
        and (1 - bias) - m >= c.emin
    )


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _round_nearest_ste(widths, x):
    """The nearest rounding of :func:`_hardware_nearest`'s formats (module
    docstring); NaN becomes the quiet NaN of its sign, as in :func:`_round_bits`."""
    e, m, bias = widths
    emin = 1 - bias
    normal = jax.lax.reduce_precision(x, exponent_bits=e, mantissa_bits=m)
    up = np.asarray(2.0 ** (m - emin), x.dtype)
    down = np.asarray(2.0 ** (emin - m), x.dtype)
    tiny = jax.lax.round(x * up, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * down
    out = jnp.where(jnp.abs(x) < np.asarray(2.0**emin, x.dtype), tiny, normal)
    return _quiet_nans(x, out)


def _quiet_nans(x, out):
    """``out``, with the quiet NaN of its sign wherever ``x`` is a NaN."""
    c = _CARRIERS[np.dtype(x.dtype)]
    bits = jax.lax.bitcast_convert_type(x, c.uint)
    nan = jax.lax.bitcast_convert_type((bits & c.sign_mask) | c.qnan_bits, x.dtype)
    return jnp.where(jnp.isnan(x), nan, out)


@_round_nearest_ste.defjvp
def _round_nearest_jvp(widths, primals, tangents):
    return _round_nearest_ste(widths, *primals), tangents[0]


@_round_ste.defjvp
def _round_ste_jvp(static, primals, tangents):
    # Straight-through: the rounding is treated as the identity for gradients.
    return _round_ste(static, *primals), tangents[0]


def _round_code(static: _Static, c: _Carrier, a, neg, emin, m, s_exp, rbits):
    """The magnitude code ``a`` rounded on the target's grid by integer operations
    (module docstring), values below S onto {0, S}; before overflow and specials."""
    U, M = c.uint, c.man
    one, zero = U(1), U(0)
    mode = static.mode
    # -- round the magnitude code to a multiple of 2**d ---------------------
    # The code is linear in the value with step 2**(E_lin - M) inside a carrier
    # binade, and across all carrier subnormals (E_lin = emin_c there).  The
    # target's quantum follows the value's true binade E, which for a carrier
    # subnormal lies below emin_c: it matters for formats with emin < emin_c.
    Ef = (a >> U(M)).astype(jnp.int32)
    E_lin = jnp.maximum(Ef, 1) - c.bias
    top_bit = (c.width - 1) - jax.lax.clz(a).astype(jnp.int32)  # -1 for a == 0
    E = jnp.where(Ef > 0, E_lin, c.emin - M + top_bit)  # floor(log2 |x|)
    sig = jnp.where(Ef > 0, (a & U((1 << M) - 1)) | U(1 << M), a)  # with hidden bit
    q_exp = (jnp.maximum(E, emin) if static.subnormals else E) - m  # target quantum
    d = jnp.clip(q_exp - (E_lin - M), _I32(0), _I32(M))  # out of range only below S: see below
    du = d.astype(U)
    mask = (one << du) - one
    if mode == "nearest_even":
        # Parity of the quantum count comes from the significand: at d == M the
        # kept bit is the hidden bit, not the exponent field's lowest bit.
        inc = jnp.where(d > 0, (mask >> one) + ((sig >> du) & one), zero)
    elif mode == "toward_zero":
        inc = zero
    elif mode == "up":
        inc = jnp.where(neg, zero, mask)
    elif mode == "down":
        inc = jnp.where(neg, mask, zero)
    else:  # stochastic
        inc = rbits & mask
    a_r = (a + inc) & ~mask

    # -- below S the neighbours are 0 and S ----------------------------------
    s_bits = _pow2_bits(s_exp, c)
    if mode == "nearest_even":
        away = a > _pow2_bits(s_exp - 1, c)  # |x| == S/2 ties to 0 (even)
    elif mode == "toward_zero":
        away = jnp.zeros_like(neg)
    elif mode == "up":
        away = ~neg & (a > 0)
    elif mode == "down":
        away = neg & (a > 0)
    else:  # stochastic: P(away) = |x|/S, resolved to M+1 bits
        # |x|/S = sig / 2**k with k = s_exp - E_lin + M; the threshold t = |x|/S * 2**(M+1)
        # needs a right shift by sh = k - (M+1), or a left shift when S is itself a
        # carrier subnormal (sh < 0; t stays below 2**(M+1) since |x| < S).
        sh = s_exp - E_lin - 1
        t = jnp.where(
            sh >= 0,
            sig >> jnp.clip(sh, _I32(0), _I32(M + 1)).astype(U),
            sig << jnp.clip(-sh, _I32(0), _I32(M + 1)).astype(U),
        )
        away = (rbits & U((1 << (M + 1)) - 1)) < t
    a_r = jnp.where(a < s_bits, jnp.where(away, s_bits, zero), a_r)
    return a_r


def _nearest_in_float(c: _Carrier, a, emin, m, subnormals: bool):
    """The magnitude code ``a`` rounded to nearest even by Eq. (R) of
    :mod:`fa_jax.formats`: ``(|x| + C) - C`` with ``C = 2**(q + M_c)``, whose ulp
    is the target's quantum ``2**q`` at ``x`` (``|x| < C`` there, so the sum stays
    in C's binade and its one rounding is the target's; ``C / 2**q`` is even, so
    ties go to an even multiple).  Codes already on the grid (the carrier's ulp at
    ``x`` no coarser than ``2**q``) are kept.  Exact under
    :meth:`~fa_jax.formats.Format.rounds_in_float`: every ``2**q`` rounded to is a
    carrier normal (flushing cannot touch it) and ``C`` is finite up to the format's
    top binade.  Past it (inf included) ``C`` is held at the carrier's top binade;
    what comes out is then still past the format's max, or inf, or NaN for NaN,
    which the overflow and specials below replace."""
    U, M = c.uint, c.man
    E_lin = jnp.maximum((a >> U(M)).astype(jnp.int32), 1) - c.bias  # x's binade, ulp 2**(E_lin - M)
    if subnormals:
        q = jnp.maximum(E_lin, emin) - m
    else:  # below tiny the grid is {0, tiny}
        q = jnp.where(E_lin < emin, emin, E_lin - m)
    kept = q <= E_lin - M
    C_bits = jnp.clip(q + M + c.bias, _I32(1), _I32(2 * c.bias)).astype(U) << U(M)
    mag = jax.lax.bitcast_convert_type(a, _FLOATS[U])
    C = jax.lax.bitcast_convert_type(C_bits, _FLOATS[U])
    rounded = jax.lax.bitcast_convert_type((mag + C) - C, U)
    return jnp.where(kept, a, rounded)


def _pow2_bits(k, c: _Carrier):
    """Carrier bits of 2**k (int32 k), 0 where 2**k is below the carrier's range."""
    U = c.uint
    normal = jnp.clip(k + c.bias, _I32(0), _I32(2 * c.bias)).astype(U) << U(c.man)
    sub_shift = k - c.emin + c.man  # position of the single bit of a subnormal
    sub = U(1) << jnp.clip(sub_shift, _I32(0), _I32(c.man - 1)).astype(U)
    return jnp.where(k >= c.emin, normal, jnp.where(sub_shift >= 0, sub, U(0)))


def _round_bits(static: _Static, x, exp_bits, man_bits, bias, rbits):
    c = _CARRIERS[np.dtype(x.dtype)]
    U, M = c.uint, c.man
    one, zero = U(1), U(0)
    mode, specials = static.mode, static.specials

    bits = jax.lax.bitcast_convert_type(x, U)
    neg = (bits & c.sign_mask) != 0
    a = bits & c.abs_mask  # magnitude code

    e, m, b = (jnp.asarray(v, jnp.int32) for v in (exp_bits, man_bits, bias))
    emin = 1 - b
    emax = (1 << e) - (2 if specials == "ieee" else 1) - b
    s_exp = emin - m if static.subnormals else emin  # log2 of S, the smallest positive

    if static.in_float:
        a_r = _nearest_in_float(c, a, emin, m, static.subnormals)
    else:
        a_r = _round_code(static, c, a, neg, emin, m, s_exp, rbits)

    # -- overflow, inf and NaN -------------------------------------------------
    mu = m.astype(U)
    max_frac = (one << mu) - (U(2) if specials == "fn" else one)
    # max = 2**emax * (1 + max_frac / 2**m); its fraction sits at the target's quantum,
    # which is finer than the carrier's ulp by M - m bits (fewer if max is a carrier
    # subnormal, as in formats that live wholly below the carrier's normal range).
    frac_shift = (M - m + jnp.minimum(emax - c.emin, 0)).astype(U)
    max_bits = _pow2_bits(emax, c) + (max_frac << frac_shift)
    nan_bits = c.qnan_bits
    if static.overflow == "saturate":
        toward_max = True
    elif mode == "toward_zero":
        toward_max = True
    elif mode == "up":
        toward_max = neg
    elif mode == "down":
        toward_max = ~neg
    else:
        toward_max = False
    past_max = c.inf_bits if specials == "ieee" else nan_bits
    mag = jnp.where(a_r > max_bits, jnp.where(toward_max, max_bits, past_max), a_r)

    is_inf = a == c.inf_bits
    is_nan = a > c.inf_bits
    if static.overflow == "saturate":
        inf_out = max_bits
    else:
        inf_out = c.inf_bits if specials == "ieee" else nan_bits
    mag = jnp.where(is_inf, inf_out, mag)
    out_neg = neg
    if specials == "finite":  # no NaN to give: ml_dtypes returns -sign(NaN) * 0
        mag = jnp.where(is_nan, zero, mag)
        out_neg = jnp.where(is_nan, ~neg, neg)
    else:
        mag = jnp.where(is_nan, nan_bits, mag)
    if specials == "fnuz":  # unsigned zero; the only NaN decodes with the sign set
        out_neg = jnp.where(mag == 0, False, jnp.where(mag == nan_bits, True, neg))

    out = jnp.where(out_neg, c.sign_mask, zero) | mag
    return jax.lax.bitcast_convert_type(out, x.dtype)
