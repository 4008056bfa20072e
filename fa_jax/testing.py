"""Hypothesis strategies for property-testing code built on fa_jax formats.

This module needs `hypothesis <https://hypothesis.readthedocs.io>`_, which is a
test extra (``pip install fa-jax[test]``); importing it without hypothesis
raises ``ImportError``.  It does not import ``fa_jax.rounding`` and runs no JAX
computations: every strategy builds its values with exact integer / float
arithmetic on the host.

Strategies:

* :func:`formats` -- random valid custom formats (:class:`~fa_jax.Format`)
  that fit a carrier dtype (float32 or float64), mixing all four ``specials``
  encodings, formats with and without subnormals, saturating and
  non-saturating overflow and, now and then, a non-default exponent bias (up
  to the extremes that still fit the carrier).
* :func:`registered` -- one of :func:`~fa_jax.registered_formats`.
* :func:`representable` -- values of a given format, exactly (Python floats).
* :func:`rounding_modes` -- names accepted by :func:`~fa_jax.round_to`.
* :func:`carrier_floats` -- any float32/float64 value, subnormals, ±inf and NaN
  included, built from its sign, exponent and fraction bit fields.
* :func:`near_format_values` -- carrier values where rounding onto a format is
  delicate: format values, midpoints between neighbours (ties) and a few
  carrier ulps either side, the overflow threshold, ``tiny`` and the range
  below the smallest subnormal, with both signs.

Typical use, checking that a kernel built on ``round_to`` returns values of the
target format::

    import numpy as np
    from hypothesis import given, strategies as st
    from fa_jax import round_to
    from fa_jax import testing as fst

    @given(st.data())
    def test_kernel_outputs_are_in_format(data):
        fmt = data.draw(fst.formats(carrier=np.float32))
        xs = data.draw(st.lists(fst.near_format_values(fmt, np.float32), min_size=1))
        y = np.asarray(my_kernel(np.array(xs, np.float32), fmt))
        assert (np.asarray(round_to(y, fmt)) == y)[np.isfinite(y)].all()

Strategies that take a format build their values from it when drawn, so combine
them with ``st.data()`` or ``formats().flatmap(...)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

import numpy as np

try:
    from hypothesis import strategies as st
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "fa_jax.testing needs hypothesis, a test extra: pip install 'fa-jax[test]' "
        "(or pip install hypothesis)"
    ) from err

from fa_jax.formats import (
    EXP_BITS_RANGE,
    MAN_BITS_RANGE,
    Format,
    custom,
    get_format,
    registered_formats,
)

__all__ = [
    "carrier_floats",
    "formats",
    "near_format_values",
    "registered",
    "representable",
    "rounding_modes",
]

_SPECIALS = ("ieee", "fn", "fnuz", "finite")
# (stored mantissa bits, emin, emax, exponent field width) of each carrier dtype.
_CARRIERS = {
    "float32": (23, -126, 127, 8, np.uint32),
    "float64": (52, -1022, 1023, 11, np.uint64),
}


def _carrier(dtype):
    name = np.dtype(dtype).name
    if name not in _CARRIERS:
        raise ValueError(f"carrier dtype: expected float32 or float64, got {name}")
    return np.dtype(dtype), _CARRIERS[name]


# -- formats ------------------------------------------------------------------


def _top_exponent(exp_bits: int, specials: str) -> int:
    """The exponent field of the largest finite binade."""
    return (1 << exp_bits) - (2 if specials == "ieee" else 1)


def _bias_range(exp_bits, man_bits, specials, limits):
    """Inclusive range of biases for which every value of the format is exact in the
    carrier (may be empty)."""
    man_c, emin_c, emax_c = limits[:3]
    lo = _top_exponent(exp_bits, specials) - emax_c  # emax <= emax_c
    # The finest spacing of the format is 2**(emin - man_bits), in the subnormals and
    # in the lowest normal binade alike, so with or without subnormals:
    # emin - man_bits = 1 - bias - man_bits >= emin_c - man_c  (as in Format.fits).
    hi = 1 - (emin_c - man_c) - man_bits
    return lo, hi


# How formats() picks a bias: mostly the default, sometimes a small offset from it,
# sometimes the smallest or largest bias that fits the carrier (formats at the top
# or at the bottom of the carrier's range, e.g. reaching into its subnormals).
_BIAS_CHOICES = ("default", "default", "default", "offset", "offset", "lowest", "highest")


def formats(
    *,
    max_exp_bits: int = 11,
    max_man_bits: int = 52,
    carrier=np.float64,
    specials: Iterable[str] = ("ieee", "fn", "fnuz", "finite"),
    subnormals: Iterable[bool] = (True, False),
) -> st.SearchStrategy[Format]:
    """Random valid custom formats that fit ``carrier``.

    Draws ``specials`` from ``specials``, ``subnormals`` from ``subnormals``,
    ``exp_bits`` in ``2..max_exp_bits`` and ``man_bits`` in ``0..max_man_bits``
    (``1..`` for "fn", which keeps its NaN in the all-ones mantissa), restricted
    to what ``carrier`` can hold: every value of the format, the lowest normal
    binade included, is exact in ``carrier`` (so :meth:`Format.fits` holds).
    The bias is most often the default ``2**(exp_bits-1) - 1``, otherwise that
    plus or minus a small offset, or the smallest or the largest bias that fits
    (a format at the top of the carrier's range, or one reaching into its
    subnormals), always clipped to the biases that fit: where the default does
    not fit (e.g. a non-IEEE format with 11 exponent bits in a float64 carrier)
    the nearest bias that fits is used.  ``overflow`` is "saturate" for
    "finite" formats (the only choice) and either "inf" or "saturate" otherwise.
    Formats are named ``e{exp_bits}m{man_bits}`` like :func:`~fa_jax.custom`.

    Raises ValueError (when called) if no format satisfies the arguments.
    """
    dtype, limits = _carrier(carrier)
    specials = tuple(specials)
    subnormals = tuple(subnormals)
    for s in specials:
        if s not in _SPECIALS:
            raise ValueError(f"formats: specials must be among {_SPECIALS}, got {s!r}")
    if not subnormals or not all(isinstance(b, bool) for b in subnormals):
        raise ValueError(
            f"formats: subnormals must be a non-empty tuple of bools, got {subnormals!r}"
        )
    max_e = min(max_exp_bits, EXP_BITS_RANGE[1])
    max_m = min(max_man_bits, MAN_BITS_RANGE[1], limits[0])

    # Precompute, per (specials, subnormals), the feasible exponent widths and for
    # each the largest feasible mantissa width (the bias range shrinks as m grows).
    choices = []
    for spec in specials:
        m_lo = 1 if spec == "fn" else 0
        for sub in subnormals:
            widths = []
            for e in range(EXP_BITS_RANGE[0], max_e + 1):
                m_hi = max_m
                while m_hi >= m_lo:
                    lo, hi = _bias_range(e, m_hi, spec, limits)
                    if lo <= hi:
                        break
                    m_hi -= 1
                if m_hi >= m_lo:
                    widths.append((e, m_lo, m_hi))
            if widths:
                choices.append((spec, sub, tuple(widths)))
    if not choices:
        raise ValueError(
            f"formats: no format with specials in {specials}, subnormals in {subnormals}, "
            f"exp_bits <= {max_exp_bits} and man_bits <= {max_man_bits} fits {dtype.name}"
        )

    @st.composite
    def _formats(draw):
        spec, sub, widths = draw(st.sampled_from(choices))
        e, m_lo, m_hi = draw(st.sampled_from(widths))
        m = draw(st.integers(m_lo, m_hi))
        lo, hi = _bias_range(e, m, spec, limits)
        default = (1 << (e - 1)) - 1
        how = draw(st.sampled_from(_BIAS_CHOICES))
        if how == "lowest":
            bias = lo
        elif how == "highest":
            bias = hi
        else:
            offset = 0 if how == "default" else draw(st.integers(-3, 3))
            bias = min(max(default + offset, lo), hi)
        overflow = "saturate" if spec == "finite" else draw(st.sampled_from(("inf", "saturate")))
        return custom(e, m, subnormals=sub, specials=spec, bias=bias, overflow=overflow)

    return _formats()


def registered(formats=None, *, carrier=None) -> st.SearchStrategy[Format]:
    """One of the registry formats, :func:`~fa_jax.registered_formats`.

    Args:
      formats: optional names, dtypes or Formats (anything
        :func:`~fa_jax.get_format` accepts) to choose from instead of the
        whole registry.
      carrier: if given (float32 or float64), only formats that fit it.
    """
    pool = registered_formats() if formats is None else tuple(get_format(f) for f in formats)
    if carrier is not None:
        dtype, _ = _carrier(carrier)
        pool = tuple(f for f in pool if f.fits(dtype))
    if not pool:
        raise ValueError("registered: no format to choose from")
    return st.sampled_from(pool)


# -- values of a format -------------------------------------------------------


def _field_ranges(fmt: Format):
    """(top exponent field, largest fraction field in the top binade)."""
    top = _top_exponent(fmt.exp_bits, fmt.specials)
    top_frac = (1 << fmt.man_bits) - (2 if fmt.specials == "fn" else 1)
    return top, top_frac


def _magnitude(fmt: Format, ef: int, frac: int) -> Fraction:
    """The exact value of the positive code (ef, frac).  frac may be 2**man_bits
    (giving the first value of the next binade) and ef may exceed the top
    field, as if the exponent range were unbounded."""
    m = fmt.man_bits
    if ef == 0:
        if not fmt.subnormals:
            assert frac == 0, "without subnormals the zero exponent field only encodes 0"
            return Fraction(0)
        return Fraction(frac) * Fraction(2) ** (fmt.emin - m)
    return Fraction((1 << m) + frac) * Fraction(2) ** (ef - fmt.bias - m)


def _check_format(fmt, who: str, dtype=np.float64) -> Format:
    """fmt as a concrete Format whose every value is exact in dtype."""
    fmt = get_format(fmt)
    if not fmt.is_concrete:
        raise TypeError(f"{who}: needs a format with concrete exp_bits/man_bits/bias")
    dtype, (man_c, emin_c, *_) = _carrier(dtype)
    # The spacing of the lowest normal binade, 2**(emin - man_bits), is checked here
    # too, explicitly: without subnormals it is finer than smallest_subnormal.
    if not (fmt.fits(dtype) and fmt.emin - fmt.man_bits >= emin_c - man_c):
        raise ValueError(
            f"{who}: not every value of {fmt!r} is exact in {dtype.name} (its spacing "
            f"near tiny is 2**{fmt.emin - fmt.man_bits}, its max {fmt.max!r})"
        )
    return fmt


@st.composite
def _codes(draw, fmt: Format):
    """(negative, exponent field, fraction field) of a finite value of fmt.

    The exponent field is uniform over its range half of the time, and otherwise
    one of the lowest or highest four binades (subnormals, tiny, max), where
    carrier and format ranges meet and edge cases live."""
    top, top_frac = _field_ranges(fmt)
    ef = draw(
        st.one_of(
            st.integers(0, top), st.integers(0, min(3, top)), st.integers(max(0, top - 3), top)
        )
    )
    if ef == 0 and not fmt.subnormals:
        frac = 0  # without subnormals the zero exponent field only encodes 0
    else:
        frac = draw(st.integers(0, top_frac if ef == top else (1 << fmt.man_bits) - 1))
    neg = draw(st.booleans())
    return neg, ef, frac


def representable(fmt, *, allow_nan: bool = False, allow_infinity: bool = False):
    """Python floats that are exactly values of ``fmt``.

    Values are built from random sign, exponent and fraction fields of the
    format's finite codes (subnormals only if ``fmt.subnormals``; never the
    fnuz "-0" code, which is its NaN; never the fn NaN code), so every binade
    and both zeros (one for fnuz) occur.  With ``allow_nan`` a NaN is also
    drawn when the format has one; with ``allow_infinity`` ±inf when it has
    infinities (only "ieee" formats).  All values are exact in float64, and in
    float32 when ``fmt.fits(np.float32)``.  Raises ValueError for a format with
    values float64 cannot hold (possible without subnormals: the lowest normal
    binade is spaced 2**(emin - man_bits)).
    """
    fmt = _check_format(fmt, "representable")

    def build(code):
        neg, ef, frac = code
        v = float(_magnitude(fmt, ef, frac))  # exact: checked by _check_format
        if fmt.specials == "fnuz" and v == 0:
            neg = False
        return -v if neg else v

    values = _codes(fmt).map(build)
    extras = []
    if allow_nan and fmt.has_nan:
        extras.append(st.just(math.nan))
    if allow_infinity and fmt.has_inf:
        extras.append(st.sampled_from((math.inf, -math.inf)))
    return st.one_of(values, *extras) if extras else values


def rounding_modes(stochastic: bool = False) -> st.SearchStrategy[str]:
    """A rounding mode name: "nearest_even", "toward_zero", "up", "down", and
    "stochastic" too if ``stochastic`` (which then needs a key)."""
    modes = ("nearest_even", "toward_zero", "up", "down")
    return st.sampled_from(modes + (("stochastic",) if stochastic else ()))


# -- carrier values -----------------------------------------------------------


def carrier_floats(
    dtype=np.float32,
    *,
    allow_nan: bool = True,
    allow_infinity: bool = True,
    allow_subnormal: bool = True,
) -> st.SearchStrategy:
    """Any value of the carrier ``dtype`` (float32 or float64), as a numpy scalar
    of that dtype (so NaN payloads and signs survive; ``np.array(list_of_them)``
    has the carrier dtype).

    Built from independently drawn sign, exponent-field and fraction-field
    integers, so zeros, subnormals, every binade, ±inf and NaNs with any
    payload all occur, and shrinking goes towards +0.  ``allow_nan``,
    ``allow_infinity`` and ``allow_subnormal`` exclude those values (zeros are
    always allowed).
    """
    dtype, (man_c, _, _, exp_w, uint) = _carrier(dtype)
    all_ones = (1 << exp_w) - 1
    top = all_ones if (allow_nan or allow_infinity) else all_ones - 1

    @st.composite
    def _floats(draw):
        ef = draw(st.integers(0, top))
        if ef == all_ones:
            if allow_nan and allow_infinity:
                frac = draw(st.integers(0, (1 << man_c) - 1))
            elif allow_infinity:
                frac = 0
            else:
                frac = draw(st.integers(1, (1 << man_c) - 1))
        elif ef == 0 and not allow_subnormal:
            frac = 0
        else:
            frac = draw(st.integers(0, (1 << man_c) - 1))
        sign = draw(st.booleans())
        word = (int(sign) << (exp_w + man_c)) | (ef << man_c) | frac
        return np.array(word, uint).view(dtype)[()]

    return _floats()


def _to_carrier(v: Fraction, dtype, sign: bool):
    """The carrier value nearest to v >= 0 (float64: correctly rounded; float32:
    via float64, exact whenever v is a float32 value), with the given sign;
    values past the carrier's range become its largest finite value."""
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    with np.errstate(over="ignore"):
        c = np.array(f, dtype)
    if np.isinf(c):
        c = np.array(np.finfo(dtype).max, dtype)
    c = c[()]  # a numpy scalar of the carrier dtype
    return -c if sign else c


def _step(c, k: int, dtype):
    """c moved by k carrier ulps (towards +inf for k > 0)."""
    direction = np.array(np.inf if k > 0 else -np.inf, dtype)
    with np.errstate(over="ignore"):
        for _ in range(abs(k)):
            c = np.nextafter(c, direction)
    return c


_KINDS = ("midpoint", "exact", "overflow", "tiny", "below_smallest")


def near_format_values(fmt, carrier=np.float64) -> st.SearchStrategy:
    """Carrier values (numpy scalars of ``carrier``) where rounding onto ``fmt``
    is delicate, with both signs:

    * ``"midpoint"``: the exact midpoint between a value of ``fmt`` and the next
      one up in magnitude (a tie for round-to-nearest), or -- when the midpoint
      needs more precision or range than the carrier has -- the carrier value
      nearest it, moved by 0, ±1 or ±2 carrier ulps;
    * ``"exact"``: values of ``fmt``, moved by 0, ±1 or ±2 carrier ulps;
    * ``"overflow"``: around ``max``, the overflow threshold ``max + ulp(max)/2``,
      ``max + ulp(max)`` (the first value past ``max`` were the exponent range
      unbounded), ``2**(emax+1)``, twice ``max`` and the carrier's largest
      finite value, each moved by 0, ±1 or ±2 carrier ulps (so the carrier's
      largest value may step to ±inf);
    * ``"tiny"``: ``tiny`` (the smallest normal), ``tiny/2`` and the midpoint
      above ``tiny``, moved likewise;
    * ``"below_smallest"``: in ``(0, S]`` for the smallest positive value ``S``:
      ``S``, ``S/2`` (a tie), and random fractions of ``S`` (rounded to the
      carrier, down to its smallest subnormal or 0), moved likewise.

    The "next value up" of the largest code is taken as if the format's exponent
    range were unbounded, so the midpoint above ``max`` is the overflow
    threshold.  Every value of ``fmt`` must be exact in ``carrier`` (else
    ValueError).
    """
    fmt = _check_format(fmt, "near_format_values", carrier)
    dtype, _ = _carrier(carrier)
    two = Fraction(2)
    S = two**fmt.min_exponent
    tiny = two**fmt.emin
    mx = Fraction(fmt.max)
    ulp_max = two ** (fmt.emax - fmt.man_bits)
    cmax = Fraction(float(np.finfo(dtype).max))
    overflow_points = (mx, mx + ulp_max / 2, mx + ulp_max, two ** (fmt.emax + 1), 2 * mx, cmax)
    tiny_points = (tiny, tiny / 2, tiny + two ** (fmt.emin - fmt.man_bits) / 2)
    offsets = st.integers(-2, 2)

    @st.composite
    def _values(draw):
        kind = draw(st.sampled_from(_KINDS))
        if kind in ("midpoint", "exact"):
            _, ef, frac = draw(_codes(fmt))
            lo = _magnitude(fmt, ef, frac)
            if kind == "exact":
                v = lo
            else:  # the next value up; 0's neighbour is tiny without subnormals
                hi = tiny if (ef == 0 and not fmt.subnormals) else _magnitude(fmt, ef, frac + 1)
                v = (lo + hi) / 2
        elif kind == "overflow":
            v = min(draw(st.sampled_from(overflow_points)), cmax)
        elif kind == "tiny":
            v = draw(st.sampled_from(tiny_points))
        else:
            which = draw(st.sampled_from(("S", "S/2", "fraction")))
            if which == "S":
                v = S
            elif which == "S/2":
                v = S / 2
            else:
                bits = draw(st.integers(1, 60))
                v = S * Fraction(draw(st.integers(1, (1 << bits) - 1)), 1 << bits)
        neg = draw(st.booleans())
        c = _to_carrier(v, dtype, neg)
        k = draw(offsets)
        return _step(c, k, dtype) if k else c

    return _values()
