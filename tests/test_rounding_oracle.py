"""round_to against an exact rational oracle, bit for bit, on random formats and values.

The oracle below rounds the real number ``Fraction(x)`` onto the values of a
format with exact rational arithmetic, following the semantics in the
docstrings of fa_jax/formats.py and fa_jax/rounding.py.  It is the reference
for float64 carriers, where ml_dtypes' casts double-round (via float32), and for
the directed modes, which ml_dtypes lacks.  The values come from the public
strategies in fa_jax.testing, which are themselves checked at the end.
"""

import dataclasses
import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from oracle import round_exact as oracle

from fa_jax import (
    BF16,
    E2M1FN,
    E4M3,
    E4M3FN,
    E4M3FNUZ,
    FP16,
    TF32,
    Format,
    custom,
    get_format,
    registered_formats,
    round_to,
)
from fa_jax import testing as fst

MODES = ("nearest_even", "toward_zero", "up", "down")
BATCH = 32  # values are rounded in padded chunks of this size: one compile per format kind


@pytest.fixture(scope="module", autouse=True)
def _x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# -- the oracle (tests/oracle.py) ---------------------------------------------


def test_oracle_known_values():
    """Hand-checked cases, so that the oracle is not just round_to restated."""
    # e4m3fn: max 448 = 1.75 * 2**8 (mantissa 110, even), ulp 32: the tie 464 stays.
    assert oracle(464.0, E4M3FN, "nearest_even") == 448.0
    assert math.isnan(oracle(464.0001, E4M3FN, "nearest_even"))
    assert oracle(1e9, E4M3FN, "toward_zero") == 448.0
    assert math.isnan(oracle(448.5, E4M3FN, "up")) and oracle(-448.5, E4M3FN, "up") == -448.0
    # e4m3 (ieee): max 240 (mantissa 111, odd): the tie 248 overflows.
    assert oracle(248.0, E4M3, "nearest_even") == math.inf
    assert oracle(247.9, E4M3, "nearest_even") == 240.0
    assert oracle(-248.0, E4M3, "down") == -math.inf and oracle(-248.0, E4M3, "up") == -240.0
    assert oracle(65520.0, FP16, "nearest_even") == math.inf
    assert oracle(65519.99, FP16, "nearest_even") == 65504.0
    # Ties to even, subnormals, signed zeros.
    assert oracle(1 + 2.0**-11, FP16, "nearest_even") == 1.0
    assert oracle(1 + 3 * 2.0**-11, FP16, "nearest_even") == 1 + 2.0**-9
    assert oracle(2.0**-25, FP16, "nearest_even") == 0.0  # S/2 ties to 0
    assert oracle(3 * 2.0**-25, FP16, "nearest_even") == 2.0**-23
    assert math.copysign(1, oracle(-(2.0**-26), FP16, "nearest_even")) == -1
    assert math.copysign(1, oracle(-(2.0**-26), E4M3FNUZ, "nearest_even")) == 1
    assert oracle(-(2.0**-40), FP16, "down") == -(2.0**-24)
    ftz = custom(5, 10, subnormals=False)
    assert oracle(2.0**-15, ftz, "nearest_even") == 0.0  # tiny/2 ties to 0
    assert oracle(2.0**-15 * 1.0001, ftz, "nearest_even") == 2.0**-14
    assert oracle(2.0**-30, ftz, "up") == 2.0**-14
    # m = 0: ties go to the even multiple of the binade's quantum, 2**(e+1).
    e5m0 = custom(5, 0)
    assert oracle(3.0, e5m0, "nearest_even") == 4.0 and oracle(2.9, e5m0, "nearest_even") == 2.0
    # inf, NaN, saturation, finite formats.
    assert oracle(math.inf, E2M1FN, "nearest_even") == 6.0
    assert oracle(7.0, E2M1FN, "up") == 6.0
    assert math.isnan(oracle(math.inf, E4M3FN, "toward_zero"))
    assert oracle(-math.inf, custom(4, 3, overflow="saturate"), "up") == -240.0
    assert math.copysign(1, oracle(math.nan, E2M1FN, "up")) == -1


def test_oracle_matches_ml_dtypes_on_float32_inputs():
    """For float32 inputs ml_dtypes' casts round correctly: an independent check of
    the oracle's nearest_even on every <=8-bit registered format."""
    rng = np.random.default_rng(0)
    for fmt in registered_formats():
        if fmt.dtype is None or fmt.bits > 8:
            continue
        codes = np.arange(2**fmt.bits, dtype=np.uint8).view(fmt.dtype).astype(np.float32)
        finite = np.unique(codes[np.isfinite(codes)])
        mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
        rand = (rng.standard_normal(64) * np.exp2(rng.integers(-12, 10, 64))).astype(np.float32)
        x = np.concatenate(
            [
                finite,
                mids,
                np.nextafter(mids, np.float32(np.inf)),
                np.nextafter(mids, np.float32(-np.inf)),
                rand,
                np.float32([fmt.max * 1.03, fmt.max * 1.1, 1e30]),
            ]
        )
        x = np.concatenate([x, -x])
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(fmt.dtype).astype(np.float64)
        got = np.array([oracle(v, fmt, "nearest_even") for v in x])
        assert_bits_equal(got, want, x, fmt, "nearest_even(ml_dtypes)")


# -- comparison ------------------------------------------------------------------


def _uint(dtype):
    return np.uint32 if np.dtype(dtype) == np.float32 else np.uint64


def assert_bits_equal(got, want, x, fmt, mode):
    """Equal bits elementwise; where ``want`` is NaN, ``got`` need only be NaN."""
    got, want = np.asarray(got), np.asarray(want, dtype=np.asarray(got).dtype)
    u = _uint(got.dtype)
    ok = np.where(np.isnan(want), np.isnan(got), got.view(u) == want.view(u))
    if not ok.all():
        rows = []
        for i in np.flatnonzero(~ok)[:5]:
            xi = np.asarray(x)[i]
            rows.append(
                f"  x={float(xi)!r} ({float(xi).hex()}) want={float(want[i])!r} "
                f"[{int(want.view(u)[i]):#x}] got={float(got[i])!r} [{int(got.view(u)[i]):#x}]"
            )
        raise AssertionError(
            f"{int((~ok).sum())} mismatch(es) for {fmt!r}, mode={mode}:\n" + "\n".join(rows)
        )


def _static_name(fmt: Format) -> Format:
    # The name is static pytree data: give every format the same one so that one
    # compiled program serves all formats with the same specials/overflow/subnormals.
    return dataclasses.replace(fmt, name="fmt")


@jax.jit
def _round_chunk(x, fmt, key, i):
    """x rounded in the four modes and stochastically (key folded with i), stacked."""
    outs = [round_to(x, fmt, mode) for mode in MODES]
    outs.append(round_to(x, fmt, "stochastic", key=jax.random.fold_in(key, i)))
    return jnp.stack(outs)


def round_all_modes(values, fmt: Format, carrier, key=None):
    """(x, {mode: round_to(x, fmt, mode)}) for x = values padded with zeros to a
    multiple of BATCH; "stochastic" uses key (default key 0)."""
    n = max(1, -(-len(values) // BATCH)) * BATCH
    x = np.zeros(n, carrier)
    x[: len(values)] = np.asarray(values, carrier)
    key = jax.random.key(0) if key is None else key
    fmt = _static_name(fmt)
    chunks = [_round_chunk(jnp.asarray(x[i : i + BATCH]), fmt, key, i) for i in range(0, n, BATCH)]
    out = np.concatenate([np.asarray(c) for c in chunks], axis=1)
    assert out.dtype == carrier
    return x, dict(zip((*MODES, "stochastic"), out))


def check_against_oracle(values, fmt: Format, carrier, concrete=()):
    """round_to == oracle in the four modes.  round_to runs under jit with the
    format's widths traced; for the modes in ``concrete`` also eagerly with the
    concrete format (round_to's other code path: widths compiled in as constants)."""
    x, outs = round_all_modes(values, fmt, carrier)
    for mode in MODES:
        want = np.array([oracle(v, fmt, mode) for v in x], carrier)
        assert_bits_equal(outs[mode], want, x, fmt, mode)
        if mode in concrete:
            got = np.asarray(round_to(jnp.asarray(x), fmt, mode))
            assert_bits_equal(got, want, x, fmt, f"{mode} (concrete format)")


# -- strategies: a format together with values for it -----------------------------


def values_for(fmt: Format, carrier, kinds=("near", "carrier")):
    parts = []
    if "near" in kinds:
        parts.append(fst.near_format_values(fmt, carrier))
    if "carrier" in kinds:
        parts.append(fst.carrier_floats(carrier))
    if "representable" in kinds:
        parts.append(fst.representable(fmt, allow_nan=True, allow_infinity=True))
    return st.lists(st.one_of(*parts), min_size=1, max_size=BATCH)


def with_values(format_strategy, carrier, kinds=("near", "carrier")):
    return format_strategy.flatmap(lambda f: st.tuples(st.just(f), values_for(f, carrier, kinds)))


# -- round_to == oracle, bit for bit ---------------------------------------------


@settings(deadline=None)
@given(case=with_values(fst.formats(carrier=np.float64), np.float64, kinds=("near",)))
def test_custom_formats_float64_near_values(case):
    fmt, values = case
    check_against_oracle(values, fmt, np.float64)


@settings(deadline=None)
@given(case=with_values(fst.formats(carrier=np.float64), np.float64))
def test_custom_formats_float64_any_values(case):
    fmt, values = case
    check_against_oracle(values, fmt, np.float64)


@settings(deadline=None)
@given(case=with_values(fst.formats(carrier=np.float32), np.float32))
def test_custom_formats_float32(case):
    fmt, values = case
    assert fmt.fits(np.float32)
    check_against_oracle(values, fmt, np.float32)


@settings(deadline=None)
@given(case=with_values(fst.registered(), np.float64))
def test_registered_formats_float64(case):
    """Where ml_dtypes double-rounds (float64 -> float32 -> target), the oracle rules."""
    fmt, values = case
    check_against_oracle(values, fmt, np.float64)


@settings(deadline=None)
@given(case=with_values(fst.registered(carrier=np.float32), np.float32))
def test_registered_formats_float32(case):
    fmt, values = case
    check_against_oracle(values, fmt, np.float32)


@pytest.mark.parametrize(
    "fmt",
    [f for f in registered_formats() if f.bits <= 8]
    + [
        custom(3, 2, subnormals=False),
        custom(4, 0),
        custom(3, 1, specials="fn", bias=1),
        custom(4, 2, specials="fnuz", overflow="saturate", bias=9),
    ],
    ids=repr,
)
def test_small_formats_every_code_tie_and_neighbour_float64(fmt):
    """Deterministic sweep: every value, midpoint and double ulp either side."""
    vals = sorted({abs(v) for v in _all_values(fmt)})
    ext = [*vals, float(Fraction(fmt.max) + Fraction(2) ** (fmt.emax - fmt.man_bits))]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(ext)]  # exact for these tiny formats
    pts = vals + mids + [fmt.smallest_subnormal / 4, 2 * fmt.max, math.inf, math.nan]
    pts += [float(np.nextafter(p, d)) for p in mids for d in (0.0, math.inf)]
    check_against_oracle(pts + [-p for p in pts], fmt, np.float64, concrete=("nearest_even",))


@pytest.mark.parametrize(
    "fmt, carrier",
    [
        # The format's normal range reaches below the carrier's (emin < emin_c), so
        # carrier subnormals lie in the format's normal binades, whose quantum
        # shrinks binade by binade.
        pytest.param(
            custom(8, 21, specials="finite", bias=128), np.float32, id="e8m21-finite-b128"
        ),
        pytest.param(custom(8, 3, bias=130), np.float32, id="e8m3-b130"),
        pytest.param(custom(8, 10, subnormals=False, bias=140), np.float32, id="e8m10-ftz-b140"),
        pytest.param(custom(11, 1, specials="fn", bias=1024), np.float64, id="e11m1-fn-b1024"),
        pytest.param(
            custom(11, 30, subnormals=False, bias=1030), np.float64, id="e11m30-ftz-b1030"
        ),
        # The whole format inside the carrier's subnormals: max too is a carrier
        # subnormal, and overflow must still be detected.
        pytest.param(custom(2, 0, bias=150), np.float32, id="e2m0-b150"),
        pytest.param(custom(3, 2, specials="fn", bias=1070), np.float64, id="e3m2-fn-b1070"),
        # Controls: emin == emin_c.
        pytest.param(BF16, np.float32, id="bf16"),
        pytest.param(custom(11, 4), np.float64, id="e11m4"),
    ],
)
def test_carrier_subnormal_inputs(fmt, carrier):
    """Carrier subnormals: every small code, codes around each power of two, random codes."""
    man_c = np.finfo(carrier).nmant
    u = _uint(carrier)
    pow2 = [1 << j for j in range(man_c)]
    codes = list(range(64)) + [p + o for p in pow2 for o in (-1, 0, 1)]
    codes += [int(c) for c in np.random.default_rng(3).integers(0, 1 << man_c, 600)]
    codes += [(1 << man_c) + o for o in range(4)]  # the carrier's smallest normals
    x = np.array(codes, u).view(carrier)
    check_against_oracle(list(x) + list(-x), fmt, carrier, concrete=MODES)


def _all_values(fmt):
    top = (1 << fmt.exp_bits) - (2 if fmt.specials == "ieee" else 1)
    out = []
    for ef in range(top + 1):
        for frac in range(1 << fmt.man_bits):
            if ef == top and fmt.specials == "fn" and frac == (1 << fmt.man_bits) - 1:
                continue
            if ef == 0:
                if fmt.subnormals:
                    out.append(math.ldexp(frac, fmt.emin - fmt.man_bits))
            else:
                out.append(math.ldexp((1 << fmt.man_bits) + frac, ef - fmt.bias - fmt.man_bits))
    return [*out, 0.0]


# -- stochastic rounding ---------------------------------------------------------


@settings(deadline=None)
@given(
    case=with_values(fst.formats(carrier=np.float64), np.float64, kinds=("near", "carrier")),
    seed=st.integers(0, 2**32 - 1),
)
def test_stochastic_gives_a_neighbour_and_is_reproducible(case, seed):
    fmt, values = case
    key = jax.random.key(seed)
    x, outs = round_all_modes(values, fmt, np.float64, key)
    got = outs["stochastic"]
    again = round_all_modes(values, fmt, np.float64, key)[1]["stochastic"]
    assert (got.view(np.uint64) == again.view(np.uint64)).all(), "same key, different bits"
    lo = np.array([oracle(v, fmt, "toward_zero") for v in x])
    hi = np.array([oracle(v, fmt, "down" if math.copysign(1, v) < 0 else "up") for v in x])
    u = np.uint64
    is_lo = np.where(np.isnan(lo), np.isnan(got), got.view(u) == lo.view(u))
    is_hi = np.where(np.isnan(hi), np.isnan(got), got.view(u) == hi.view(u))
    bad = ~(is_lo | is_hi)
    assert not bad.any(), (
        f"{fmt!r}: stochastic result is neither neighbour: x={x[bad][:5]!r} "
        f"got={got[bad][:5]!r} lo={lo[bad][:5]!r} hi={hi[bad][:5]!r}"
    )


@settings(deadline=None)
@given(
    fmt=fst.formats(carrier=np.float64),
    seeds=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=2, unique=True),
)
def test_stochastic_different_keys_differ(fmt, seeds):
    """64 values each strictly between two neighbours with P(away) in [1/4, 3/4]:
    two keys agree on all of them with probability <= (5/8)**64 < 1e-13."""
    # 1/4, 1/2 and 3/4 of the way from 0 to S, from tiny to its upper neighbour
    # and from 2**emax to its upper neighbour, where exact in float64 and <= max.
    two, m = Fraction(2), fmt.man_bits
    pairs = [
        (Fraction(0), Fraction(fmt.smallest_subnormal)),
        (two**fmt.emin, two**fmt.emin + two ** (fmt.emin - m)),
        (two**fmt.emax, two**fmt.emax + two ** (fmt.emax - m)),
    ]
    pts = []
    for lo, hi in pairs:
        for t in (Fraction(1, 4), Fraction(1, 2), Fraction(3, 4)):
            v = lo + t * (hi - lo)
            if Fraction(float(v)) == v and hi <= Fraction(fmt.max):
                pts.append(float(v))
    assume(pts)  # none only for a few tiny formats at the bottom of float64's range
    pts = (pts * 32)[:32]
    x = pts + [-p for p in pts]
    a = round_all_modes(x, fmt, np.float64, jax.random.key(seeds[0]))[1]["stochastic"]
    b = round_all_modes(x, fmt, np.float64, jax.random.key(seeds[1]))[1]["stochastic"]
    assert (a != b).any(), f"{fmt!r}: keys {seeds} gave identical results on {x!r}"


N_KEYS = 20000


@jax.jit
def _many_keys(x, fmt, keys):
    return jax.vmap(lambda k: round_to(x, fmt, "stochastic", key=k))(keys)


@pytest.mark.parametrize(
    "fmt, x, carrier",
    [
        pytest.param(FP16, 1 + 2.0**-12, np.float32, id="fp16-normal"),  # P(away) = 1/4
        pytest.param(BF16, -3.0 + 2.0**-7 / 3, np.float32, id="bf16-negative"),
        pytest.param(FP16, 0.3 * 2.0**-24, np.float32, id="fp16-below-S"),  # S a float32 normal
        pytest.param(E4M3, 0.1, np.float64, id="e4m3-f64"),
        pytest.param(E4M3FNUZ, -0.7 * 2.0**-10, np.float64, id="e4m3fnuz-below-S"),
        pytest.param(
            custom(5, 10, subnormals=False),
            0.6 * 2.0**-14,
            np.float32,
            id="e5m10-no-subnormals-below-tiny",
        ),
        # S a carrier subnormal: TF32's S = 2**-136 and BF16's 2**-133 in float32,
        # custom(11, 10)'s 2**-1032 in float64.  x below S is a carrier subnormal too.
        pytest.param(TF32, 0.75 * 2.0**-136, np.float32, id="tf32-below-S-f32-subnormal"),
        pytest.param(BF16, 0.75 * 2.0**-133, np.float32, id="bf16-below-S-f32-subnormal"),
        pytest.param(
            custom(11, 10), 0.5 * 2.0**-1032, np.float64, id="e11m10-below-S-f64-subnormal"
        ),
    ],
)
def test_stochastic_is_unbiased(fmt, x, carrier):
    x = carrier(x)
    assert float(x) != oracle(x, fmt, "toward_zero"), "pick an x between two values"
    lo = oracle(x, fmt, "toward_zero")
    hi = oracle(x, fmt, "down" if x < 0 else "up")
    alo, ahi = abs(Fraction(lo)), abs(Fraction(hi))
    p = float((abs(Fraction(float(x))) - alo) / (ahi - alo))
    keys = jax.random.split(jax.random.key(1234), N_KEYS)
    r = np.asarray(_many_keys(jnp.asarray(x), _static_name(fmt), keys)).astype(np.float64)
    assert np.isin(r, [lo, hi]).all()
    p_hat = float(np.mean(r == hi))
    sigma = math.sqrt(p * (1 - p) / N_KEYS)
    assert abs(p_hat - p) <= 5 * sigma, (
        f"{fmt!r} x={float(x)!r}: P(away) = {p_hat} over {N_KEYS} keys, expected {p} "
        f"(5 sigma = {5 * sigma:.3g})"
    )
    se = abs(hi - lo) * sigma
    mean = float(np.mean(r))
    assert abs(mean - float(x)) <= 5 * se, (
        f"{fmt!r}: mean {mean!r} of stochastic roundings of {float(x)!r}; 5 SE = {5 * se:.3g}"
    )


# -- the fa_jax.testing strategies deliver what they promise ---------------------


@settings(deadline=None)
@given(
    case=with_values(fst.formats(carrier=np.float64), np.float64, kinds=("representable",)),
    seed=st.integers(0, 2**32 - 1),
)
def test_representable_values_round_to_themselves(case, seed):
    fmt, values = case
    for v in values:
        assert isinstance(v, float)
        if math.isinf(v):
            assert fmt.has_inf
        elif math.isnan(v):
            assert fmt.has_nan
        else:
            assert abs(v) <= fmt.max
            if fmt.specials == "fnuz":
                assert not (v == 0 and math.copysign(1, v) < 0)
    x, outs = round_all_modes(values, fmt, np.float64, jax.random.key(seed))
    finite = np.isfinite(x)
    for mode, out in outs.items():
        assert (out.view(np.uint64) == x.view(np.uint64))[finite].all(), (fmt, mode, x, out)
    for mode in MODES:
        want = np.array([oracle(v, fmt, mode) for v in x])
        assert (want.view(np.uint64) == x.view(np.uint64))[finite].all(), (fmt, mode, x, want)


@pytest.mark.parametrize("carrier", [np.float32, np.float64])
@settings(deadline=None)
@given(data=st.data())
def test_formats_strategy_fits_and_respects_arguments(carrier, data):
    max_e = data.draw(st.integers(2, 11), label="max_exp_bits")
    max_m = data.draw(st.integers(1, 52), label="max_man_bits")
    specials = tuple(
        sorted(
            data.draw(
                st.sets(st.sampled_from(("ieee", "fn", "fnuz", "finite")), min_size=1),
                label="specials",
            )
        )
    )
    subnormals = tuple(sorted(data.draw(st.sets(st.booleans(), min_size=1), label="subnormals")))
    fmt = data.draw(
        fst.formats(
            max_exp_bits=max_e,
            max_man_bits=max_m,
            carrier=carrier,
            specials=specials,
            subnormals=subnormals,
        )
    )
    assert isinstance(fmt, Format) and fmt.is_concrete
    assert fmt.fits(carrier)
    fi = np.finfo(carrier)  # and the lowest normal binade's spacing, whatever the subnormals
    assert fmt.emin - fmt.man_bits >= fi.minexp - fi.nmant
    assert fmt.exp_bits <= max_e and fmt.man_bits <= max_m
    assert fmt.specials in specials and fmt.subnormals in subnormals
    if fmt.specials == "finite":
        assert fmt.overflow == "saturate"
    if fmt.specials == "fn":
        assert fmt.man_bits >= 1
    assert fmt == custom(
        fmt.exp_bits,
        fmt.man_bits,
        subnormals=fmt.subnormals,
        specials=fmt.specials,
        bias=fmt.bias,
        overflow=fmt.overflow,
    )


def test_value_strategies_reject_formats_the_carrier_cannot_hold():
    with pytest.raises(ValueError):
        fst.near_format_values(get_format("float64"), np.float32)
    with pytest.raises(ValueError):  # from Format itself once it checks this, else from fst
        fst.representable(custom(2, 2, subnormals=False, bias=1075))
    fst.near_format_values(get_format("float32"), np.float32)
    fst.representable(custom(2, 2, subnormals=True, bias=1073))


def test_formats_strategy_rejects_impossible_requests():
    with pytest.raises(ValueError, match="no format"):
        fst.formats(max_exp_bits=1)
    with pytest.raises(ValueError, match="no format"):
        fst.formats(specials=("fn",), max_man_bits=0)
    with pytest.raises(ValueError, match="float32 or float64"):
        fst.formats(carrier=np.float16)


@settings(deadline=None)
@given(fmt=fst.registered(carrier=np.float32))
def test_registered_strategy(fmt):
    assert fmt in registered_formats() and fmt.fits(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(deadline=None)
@given(data=st.data())
def test_carrier_floats_strategy(dtype, data):
    allow_nan = data.draw(st.booleans(), label="allow_nan")
    allow_inf = data.draw(st.booleans(), label="allow_infinity")
    allow_sub = data.draw(st.booleans(), label="allow_subnormal")
    v = data.draw(
        fst.carrier_floats(
            dtype, allow_nan=allow_nan, allow_infinity=allow_inf, allow_subnormal=allow_sub
        )
    )
    assert isinstance(v, np.generic) and v.dtype == dtype
    assert allow_nan or not np.isnan(v)
    assert allow_inf or not np.isinf(v)
    assert allow_sub or not (0 < abs(v) < np.finfo(dtype).tiny)


@pytest.mark.parametrize("carrier", [np.float32, np.float64])
@settings(deadline=None)
@given(data=st.data())
def test_near_format_values_strategy(carrier, data):
    fmt = data.draw(fst.formats(carrier=carrier))
    v = data.draw(fst.near_format_values(fmt, carrier))
    assert isinstance(v, np.generic) and v.dtype == carrier and not np.isnan(v)


def test_near_format_values_hits_ties_and_thresholds():
    """The strategy reaches exact ties, the overflow threshold and below S."""
    from hypothesis import find

    fmt = custom(4, 3)  # e4m3: max 240, threshold 248, S = 2**-9
    strat = fst.near_format_values(fmt, np.float64)
    find(strat, lambda v: float(v) == 248.0)
    find(strat, lambda v: float(v) == -(2.0**-10))
    find(strat, lambda v: 1 < abs(float(v)) < 2 and abs(float(v)) * 16 % 2 == 1)  # a tie
    find(strat, lambda v: 0 < abs(float(v)) < 2.0**-10)
