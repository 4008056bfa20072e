"""Format: derived fields against ml_dtypes/numpy finfo, registry, validation."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fa_jax
from fa_jax import Format, custom, get_format, registered_formats

WITH_DTYPE = [f for f in registered_formats() if f.dtype is not None]


def _finfo(dtype):
    return ml_dtypes.finfo(dtype)


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=lambda f: f.name)
def test_derived_fields_equal_finfo(fmt):
    fi = _finfo(fmt.dtype)
    assert fmt.bits == fi.bits
    assert fmt.exp_bits == fi.nexp
    assert fmt.man_bits == fi.nmant
    assert fmt.bits == fi.nmant + fi.nexp + 1
    assert fmt.emin == fi.minexp
    assert fmt.emax == fi.maxexp - 1
    assert fmt.max == float(fi.max)
    assert -fmt.max == float(fi.min)
    assert fmt.tiny == float(fi.tiny) == float(fi.smallest_normal)
    assert fmt.smallest_subnormal == float(fi.smallest_subnormal)
    assert fmt.eps == float(fi.eps)
    assert fmt.unit_roundoff == float(fi.eps) / 2


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=lambda f: f.name)
def test_specials_match_the_dtype(fmt):
    dt = fmt.dtype
    with np.errstate(over="ignore", invalid="ignore"):
        as_dtype = np.array([np.inf, np.nan], np.float32).astype(dt).astype(np.float32)
    assert fmt.has_inf == bool(np.isinf(as_dtype[0]))
    assert fmt.has_nan == bool(np.isnan(as_dtype[1]))
    neg_zero = np.array([-0.0], np.float32).astype(dt).astype(np.float32)
    assert fmt.has_negative_zero == bool(np.signbit(neg_zero[0]))


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=lambda f: f.name)
def test_from_dtype_round_trips(fmt):
    assert Format.from_dtype(fmt.dtype) is fmt
    assert get_format(fmt.dtype) is fmt
    assert get_format(fmt.name) is fmt


def test_every_signed_small_ml_dtypes_float_is_registered():
    names = {f.name for f in registered_formats()}
    shipped = {
        n
        for n in dir(ml_dtypes)
        if n.startswith(("float8_", "float6_", "float4_")) and not n.endswith("fnu")
    }
    assert shipped <= names, shipped - names


def test_tf32_fields():
    assert (fa_jax.TF32.exp_bits, fa_jax.TF32.man_bits, fa_jax.TF32.bits) == (8, 10, 19)
    assert fa_jax.TF32.max == float(np.ldexp(2.0 - 2.0**-10, 127))
    assert fa_jax.TF32.emin == -126
    assert fa_jax.TF32.smallest_subnormal == 2.0**-136


@pytest.mark.parametrize(
    "alias, fmt",
    [
        ("bf16", fa_jax.BF16),
        ("BFloat16", fa_jax.BF16),
        ("half", fa_jax.FP16),
        ("fp16", fa_jax.FP16),
        ("fp32", fa_jax.FP32),
        ("double", fa_jax.FP64),
        ("tf32", fa_jax.TF32),
        ("e4m3fn", fa_jax.E4M3FN),
        ("fp8_e5m2", fa_jax.E5M2),
        ("e4m3fnuz", fa_jax.E4M3FNUZ),
        ("fp4_e2m1fn", fa_jax.E2M1FN),
        (np.float16, fa_jax.FP16),
    ],
)
def test_get_format_aliases(alias, fmt):
    assert get_format(alias) is fmt


def test_get_format_builds_custom_em_names():
    f = get_format("e5m4")
    assert (f.exp_bits, f.man_bits, f.bias, f.specials) == (5, 4, 15, "ieee")


def test_unknown_names_and_dtypes_are_rejected():
    with pytest.raises(ValueError, match="unknown format 'bf17'"):
        get_format("bf17")
    # numpy reads a dtype of None as float64; a format must be named.
    with pytest.raises(
        ValueError, match="get_format: expected a format name, dtype or Format, got None"
    ):
        get_format(None)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        Format.from_dtype(ml_dtypes.float8_e8m0fnu)
    with pytest.raises(ValueError, match="int32"):
        Format.from_dtype(np.int32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(exp_bits=1, man_bits=3), r"Format.exp_bits: expected an integer in 2..11, got 1"),
        (dict(exp_bits=12, man_bits=3), r"Format.exp_bits: expected an integer in 2..11, got 12"),
        (dict(exp_bits=5, man_bits=53), r"Format.man_bits: expected an integer in 0..52, got 53"),
        (dict(exp_bits=5, man_bits=-1), r"Format.man_bits: expected an integer in 0..52, got -1"),
        (dict(exp_bits=5.0, man_bits=2), r"Format.exp_bits: expected an integer in 2..11, got 5.0"),
        (dict(exp_bits=5, man_bits=2, specials="ibm"), r"Format.specials: expected one of"),
        (dict(exp_bits=5, man_bits=2, overflow="wrap"), r"Format.overflow: expected one of"),
        (
            dict(exp_bits=3, man_bits=2, specials="finite", overflow="inf"),
            r"overflow must be 'saturate'",
        ),
        (dict(exp_bits=4, man_bits=0, specials="fn"), r"needs man_bits >= 1, got 0"),
        (dict(exp_bits=11, man_bits=52, specials="fn"), r"does not fit a float64 carrier"),
        (dict(exp_bits=8, man_bits=3, bias=-900), r"does not fit a float64 carrier"),
    ],
)
def test_validation_names_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Format("x", **kwargs)


def test_formats_are_frozen_and_hashable():
    f = custom(5, 4)
    assert f == Format("e5m4", 5, 4) and hash(f) == hash(Format("e5m4", 5, 4))
    assert len({fa_jax.BF16, get_format("bf16"), fa_jax.FP16}) == 2
    with pytest.raises(AttributeError):
        f.man_bits = 3  # type: ignore[misc]


def test_custom_defaults():
    f = custom(5, 4)
    assert (f.name, f.bias, f.subnormals, f.specials, f.overflow) == (
        "e5m4",
        15,
        True,
        "ieee",
        "inf",
    )
    assert custom(3, 2, specials="finite").overflow == "saturate"
    assert custom(8, 7, subnormals=False).smallest_subnormal == fa_jax.BF16.tiny


def test_carriers():
    assert fa_jax.BF16.carrier == np.float32 and fa_jax.TF32.carrier == np.float32
    assert fa_jax.FP64.carrier == np.float64
    assert custom(8, 24).carrier == np.float64  # more mantissa than float32 holds
    assert custom(9, 10).carrier == np.float64  # more range than float32 holds
    assert not custom(8, 23, bias=140).fits(np.float32)  # bottom bits below float32's
    with pytest.raises(ValueError, match="expected float32 or float64, got float16"):
        fa_jax.BF16.fits(np.float16)


def test_format_is_a_pytree_with_traced_widths():
    leaves, treedef = jax.tree_util.tree_flatten(fa_jax.E4M3FN)
    assert leaves == [4, 3, 7]
    assert jax.tree_util.tree_unflatten(treedef, leaves) == fa_jax.E4M3FN

    def traced_fields(m):
        f = custom(8, m)
        with pytest.raises(TypeError, match=r"Format\.max needs concrete"):
            _ = f.max
        return f.man_bits

    assert jax.jit(traced_fields)(jnp.int32(3)) == 3


# Formats at the edges of what a carrier holds: emin - man_bits = -149 (float32's
# smallest step) or -1074 (float64's), man_bits <= 23 and emax <= 127 for float32.
FITS_CASES = [
    (dict(exp_bits=3, man_bits=4, bias=146), np.float32, True),
    (dict(exp_bits=3, man_bits=4, bias=146, subnormals=False), np.float32, True),
    (dict(exp_bits=3, man_bits=4, bias=147), np.float32, False),
    (dict(exp_bits=3, man_bits=4, bias=150, subnormals=False), np.float32, False),
    (dict(exp_bits=8, man_bits=23), np.float32, True),
    (dict(exp_bits=8, man_bits=24), np.float32, False),
    (dict(exp_bits=9, man_bits=10), np.float32, False),
    (dict(exp_bits=5, man_bits=10, bias=1065), np.float64, True),
    (dict(exp_bits=5, man_bits=10, bias=1065, subnormals=False), np.float64, True),
    (dict(exp_bits=11, man_bits=52), np.float64, True),
    (dict(exp_bits=8, man_bits=23), np.float64, True),
]


def _exact_in(v: Fraction, carrier) -> bool:
    return Fraction(float(np.array(float(v), carrier))) == v


@pytest.mark.parametrize("kwargs, carrier, fits", FITS_CASES, ids=str)
def test_fits(kwargs, carrier, fits):
    """fits(carrier) is True exactly when the format's finest step and its max are
    exact in the carrier; False cases are shown not to be."""
    fmt = Format("f", **kwargs)
    assert fmt.fits(carrier) is fits
    # tiny's upper neighbour (the same spacing with or without subnormals), and max.
    witnesses = [Fraction(fmt.tiny) + Fraction(2) ** (fmt.emin - fmt.man_bits), Fraction(fmt.max)]
    exact = all(_exact_in(v, carrier) for v in witnesses)
    assert exact is fits, (fmt, [float(v) for v in witnesses])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exp_bits=5, man_bits=10, bias=1066),  # emin - man_bits = -1075
        dict(exp_bits=5, man_bits=10, bias=1066, subnormals=False),
        dict(exp_bits=11, man_bits=10, bias=1000),  # emax = 1046
    ],
    ids=str,
)
def test_a_format_that_does_not_fit_float64_is_rejected(kwargs):
    """fits(float64) is never False on a built Format: the constructor refuses it."""
    with pytest.raises(ValueError, match="does not fit a float64 carrier"):
        Format("f", **kwargs)
