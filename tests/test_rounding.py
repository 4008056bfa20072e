"""round_to against ml_dtypes/numpy casts, bit for bit, and its JAX transformation contracts.

The exact-rational oracle for float64 carriers and directed modes lives in
test_rounding_oracle.py.
"""

import contextlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled
from hypothesis import given
from hypothesis import strategies as st

import fa_jax
from fa_jax import BF16, E4M3FN, FP16, FP32, custom, registered_formats, round_to

WITH_DTYPE = [f for f in registered_formats() if f.dtype is not None and f.bits <= 16]
round_jit = jax.jit(round_to, static_argnames="mode")


def same_bits(got, want) -> np.ndarray:
    """Elementwise: equal bits, or both NaN with the same sign (payloads are not kept)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    u = np.uint32 if got.dtype == np.float32 else np.uint64
    nan_ok = np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
    return (got.view(u) == want.view(u)) | nan_ok


def assert_same_bits(got, want, x):
    ok = same_bits(got, want)
    if not ok.all():
        i = np.flatnonzero(~ok)[:5]
        raise AssertionError(
            f"{(~ok).sum()} mismatches; x={np.asarray(x)[i]!r} want={np.asarray(want)[i]!r} "
            f"got={np.asarray(got)[i]!r}"
        )


def ml_dtypes_cast(x: np.ndarray, fmt) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(fmt.dtype).astype(x.dtype)


def every_code_and_midpoint(fmt) -> np.ndarray:
    """Every value of fmt, every midpoint between neighbours, one float32 ulp either side
    of each midpoint, and the overflow/underflow edges, with both signs."""
    n = fmt.bits
    codes = np.arange(2**n, dtype=np.uint8 if n <= 8 else np.uint16)
    values = codes.view(fmt.dtype).astype(np.float32)
    finite = np.unique(values[np.isfinite(values)])  # sorted
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    assert (mids.astype(np.float64) == (finite[:-1].astype(np.float64) + finite[1:]) / 2).all()
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    top = min(fmt.max + np.ldexp(1.0, fmt.emax - fmt.man_bits) / 2, 3.4e38)  # max + ulp/2
    edges = np.array(
        [
            top,
            np.nextafter(np.float32(top), np.float32(0)),
            np.nextafter(np.float32(top), np.float32(np.inf)),
            2 * fmt.max,
            3.4e38,
            np.inf,
            np.nan,
            0.0,
            1e-45,
            fmt.smallest_subnormal / 2,
            fmt.smallest_subnormal * 0.75,
        ],
        np.float32,
    )
    x = np.concatenate([values, mids, up, down, edges])
    return np.concatenate([x, -x])


@pytest.mark.parametrize("fmt", WITH_DTYPE, ids=lambda f: f.name)
def test_every_code_and_midpoint_matches_ml_dtypes(fmt):
    x = every_code_and_midpoint(fmt)
    assert_same_bits(round_jit(x, fmt), ml_dtypes_cast(x, fmt), x)


@pytest.mark.parametrize("fmt", [BF16, FP16], ids=lambda f: f.name)
@given(words=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=256))
def test_random_float32_bit_patterns_match_ml_dtypes(fmt, words):
    x = np.array(words, np.uint32).view(np.float32)
    assert_same_bits(round_jit(x, fmt), ml_dtypes_cast(x, fmt), x)


@pytest.mark.parametrize("fmt", [FP16, FP32], ids=lambda f: f.name)
def test_float64_carrier_matches_numpy_correctly_rounded_casts(fmt):
    """numpy's float64 -> float32/float16 casts round correctly (subnormals included):
    random doubles across the target's range, and the exact midpoints between
    neighbouring target values together with one double ulp either side."""
    rng = np.random.default_rng(0)
    n = 20000
    exps = rng.integers(fmt.emin - fmt.man_bits - 3, fmt.emax + 2, n)
    randoms = rng.choice([-1.0, 1.0], n) * np.ldexp(1 + rng.random(n), exps)
    lo = randoms.astype(fmt.dtype)
    with np.errstate(over="ignore"):
        hi = np.nextafter(lo, (np.inf * np.sign(randoms)).astype(fmt.dtype))
    ok = np.isfinite(hi)
    mids = (lo[ok].astype(np.float64) + hi[ok]) / 2  # exact in float64
    x = np.concatenate(
        [
            randoms,
            mids,
            np.nextafter(mids, np.inf),
            np.nextafter(mids, -np.inf),
            [np.inf, -np.inf, np.nan, 0.0, -0.0],
        ]
    )
    with np.errstate(over="ignore"):
        want = x.astype(fmt.dtype).astype(np.float64)
    with x64_enabled():
        assert_same_bits(round_jit(x, fmt), want, x)


def test_ml_dtypes_double_rounds_float64_but_round_to_does_not():
    """ml_dtypes casts float64 -> float8 via float32; round_to rounds once (documented)."""
    x = np.array([1 + 2.0**-4 + 2.0**-40])  # just above the 1 / 1.125 midpoint in e4m3fn
    with x64_enabled():
        assert float(round_to(x, E4M3FN)[0]) == 1.125
    assert float(x.astype(ml_dtypes.float8_e4m3fn)[0]) == 1.0


def test_saturating_overflow():
    sat = custom(4, 3, specials="fn", overflow="saturate", name="e4m3fn_sat")
    x = np.array([464.0, 464.01, 480, 1e6, np.inf, -np.inf, -1e6, np.nan, 300.0], np.float32)
    want = np.array([448, 448, 448, 448, 448, -448, -448, np.nan, 288.0], np.float32)
    assert_same_bits(round_to(x, sat), want, x)
    ieee_sat = custom(5, 10, overflow="saturate")
    assert_same_bits(
        round_to(np.float32([7e4, -np.inf]), ieee_sat), np.float32([65504, -65504]), None
    )


def test_directed_modes_bracket_and_are_adjacent():
    x = np.array([0.1, -0.1, 1 / 3, -2.5e-8, 70000.0, -70000.0, 1e-9], np.float32)
    down = np.asarray(round_to(x, FP16, "down"))
    up = np.asarray(round_to(x, FP16, "up"))
    tz = np.asarray(round_to(x, FP16, "toward_zero"))
    assert (down <= x).all() and (x <= up).all()
    finite = np.isfinite(up)
    above = np.nextafter(down.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    assert (above[finite] == up[finite]).all()
    assert (tz == np.where(x > 0, down, up)).all()
    # Overflow: toward zero gives max, away gives inf.
    assert up[4] == np.inf and down[4] == 65504 and up[5] == -65504 and down[5] == -np.inf


def test_subnormals_false_flushes_onto_zero_or_tiny():
    ftz = custom(5, 10, subnormals=False)
    t = FP16.tiny
    x = np.array([t, t * 0.75, t / 2, t * 0.4999, -t / 2, t * (1 - 2**-11)], np.float32)
    want = np.array([t, t, 0.0, 0.0, -0.0, t], np.float32)
    assert_same_bits(round_to(x, ftz), want, x)
    assert_same_bits(round_to(np.float32([t / 4]), ftz, "up"), np.float32([t]), None)


def test_eager_jit_vmap_agree_bitwise():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 64)) * np.exp2(rng.integers(-20, 20, (8, 64)))).astype(np.float32)
    for fmt in (BF16, FP16, E4M3FN, custom(5, 4)):
        eager = round_to(x, fmt)
        jitted = jax.jit(round_to, static_argnames="mode")(x, fmt)
        vmapped = jax.vmap(lambda r, fmt=fmt: round_to(r, fmt))(x)
        assert_same_bits(jitted, eager, x)
        assert_same_bits(vmapped, eager, x)


def test_vmap_over_mantissa_width_equals_separate_calls():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-140, 120, 4096))).astype(np.float32)
    widths = jnp.arange(1, 24)
    batched = jax.jit(jax.vmap(lambda m: round_to(x, custom(8, m))))(widths)
    for i, m in enumerate(range(1, 24)):
        assert_same_bits(batched[i], round_to(x, custom(8, m)), x)


def test_vmap_over_exponent_and_mantissa_widths():
    x = np.linspace(-300, 300, 2001, dtype=np.float32) ** 3 * np.float32(1e-7)
    pairs = [(e, m) for e in (2, 3, 4, 5, 8) for m in (0, 1, 2, 3, 7)]
    es, ms = (jnp.array(v) for v in zip(*pairs))
    batched = jax.vmap(lambda e, m: round_to(x, custom(e, m)))(es, ms)
    for i, (e, m) in enumerate(pairs):
        assert_same_bits(batched[i], round_to(x, custom(e, m)), x)


def test_gradient_is_straight_through():
    x = jnp.array([0.1, -3.7, 1e-30, 7e4, 0.0], jnp.float32)
    for f in (lambda v: round_to(v, BF16), lambda v: round_to(v, FP16, "up")):
        g = jax.grad(lambda v, f=f: jnp.sum(f(v) * jnp.arange(1.0, 6.0)))(x)
        assert (np.asarray(g) == np.arange(1.0, 6.0)).all()
        gj = jax.jit(jax.grad(lambda v, f=f: jnp.sum(f(v) ** 2)))(x)
        assert_same_bits(gj, 2 * f(x), x)
    _, tangent = jax.jvp(lambda v: round_to(v, E4M3FN), (x,), (jnp.ones_like(x),))
    assert (np.asarray(tangent) == 1).all()


def test_stochastic_is_reproducible_and_brackets():
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    key = jax.random.key(0)
    a = round_to(x, BF16, "stochastic", key=key)
    b = jax.jit(round_to, static_argnames="mode")(x, BF16, "stochastic", key=key)
    assert_same_bits(b, a, x)
    c = round_to(x, BF16, "stochastic", key=jax.random.key(1))
    assert not same_bits(c, a).all()
    lo, hi = round_to(x, BF16, "down"), round_to(x, BF16, "up")
    assert ((a == lo) | (a == hi)).all()


def test_error_messages():
    x = jnp.ones(3, jnp.float32)
    with pytest.raises(ValueError, match=r"mode must be one of .* got 'nearest'"):
        round_to(x, BF16, "nearest")
    with pytest.raises(ValueError, match="needs key="):
        round_to(x, BF16, "stochastic")
    with pytest.raises(ValueError, match="other modes take no key"):
        round_to(x, BF16, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"expected a float32 or float64 array .* got float16"):
        round_to(x.astype(jnp.float16), BF16)
    with pytest.raises(TypeError, match=r"got int(32|64)"):
        round_to(jnp.arange(3), BF16)
    with pytest.raises(
        ValueError, match=r"'float64' does not fit a float32 carrier .*jax_enable_x64"
    ):
        round_to(x, fa_jax.FP64)
    with pytest.raises(ValueError, match="unknown format 'bf61'"):
        round_to(x, "bf61")


@contextlib.contextmanager
def x64_disabled():
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def float64_near_ties(fmt, seed: int, n: int = 4000) -> np.ndarray:
    """float64 values a float32 narrowing would move onto (or off) a tie or a value
    of ``fmt``: its values and midpoints, nudged by float64 ulps and by 2**-40
    relative, with both signs, plus overflow, underflow and specials."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
    with x64_enabled():
        lo = np.asarray(round_to(x, fmt, "down"))
        hi = np.asarray(round_to(x, fmt, "up"))
    mid = lo / 2 + hi / 2  # exact: both are values of a format narrower than float64
    base = np.concatenate([lo, mid, hi])
    nudged = [base, np.nextafter(base, np.inf), np.nextafter(base, -np.inf)]
    nudged += [base * (1 + 2.0**-40), base * (1 - 2.0**-40)]
    tail = [
        fmt.max * 1.5,
        fmt.max * (1 + 2.0**-30),
        fmt.smallest_subnormal / 2,
        fmt.smallest_subnormal * 0.5 * (1 + 2.0**-40),
        1e-300,
        1e300,
        np.inf,
        np.nan,
        0.0,
    ]
    xs = np.concatenate([*nudged, np.array(tail)])
    return np.concatenate([xs, -xs])


@pytest.mark.parametrize(
    "fmt", [BF16, FP16, E4M3FN, fa_jax.E5M2, fa_jax.TF32, custom(6, 13)], ids=lambda f: f.name
)
@pytest.mark.parametrize("mode", ["nearest_even", "toward_zero", "up", "down"])
def test_float64_input_without_x64_rounds_once(fmt, mode):
    """With jax_enable_x64 off, JAX narrows float64 host values to float32: round_to
    narrows them by rounding to odd instead, so the result equals rounding the
    float64 value once (the float64 carrier's result, checked against an exact
    oracle elsewhere)."""
    x = float64_near_ties(fmt, seed=len(mode))
    with x64_enabled():
        want = np.asarray(round_to(x, fmt, mode)).astype(np.float32)
    with x64_disabled():
        got = round_to(x, fmt, mode)
        scalar = round_to(float(x[1]), fmt, mode)
    assert got.dtype == jnp.float32
    assert_same_bits(np.asarray(got), want, x)
    assert same_bits(np.asarray(scalar), want[1]).all()


def test_float64_input_without_x64_issue_example():
    # 1 + 2**-4 + 2**-40 narrows to 1 + 2**-4 in float32, a tie that rounds to 1 in
    # e4m3fn; the float64 value lies above the tie and rounds to 1.125.
    with x64_disabled():
        assert float(round_to(np.array([1 + 2**-4 + 2**-40]), E4M3FN)[0]) == 1.125
        assert float(round_to(np.float64(1 + 2**-4 + 2**-40), "e4m3fn")) == 1.125
        # float32's own layout in round-to-nearest is numpy's single rounding.
        assert float(round_to(np.float64(0.1), FP32)) == float(np.float32(0.1))


def test_float64_input_without_x64_raises_where_it_cannot_round_once():
    x = np.array([1 + 2**-30])
    with x64_disabled():
        for fmt, mode, kw in [
            (FP32, "up", {}),
            (custom(8, 22), "nearest_even", {}),
            (BF16, "stochastic", {"key": jax.random.key(0)}),
        ]:
            with pytest.raises(TypeError, match="x is float64 but jax_enable_x64 is off"):
                round_to(x, fmt, mode, **kw)


RESOLUTION_BITS = 12  # P(up) resolved to 2**-12: within every carrier's spare bits here
RESOLUTION_KEYS = 1 << 19  # n * 2**-12 = 128 expected ups, 5 sigma = 57: 0 is far out


def _count_away(fmt):
    """A compiled count, per element of x, of the keys that round it to hi."""

    def count(x, lo, hi, keys):
        r = jax.vmap(lambda k: round_to(x, fmt, "stochastic", key=k))(keys)
        return jnp.sum(r == hi, axis=0), jnp.sum((r != lo) & (r != hi))

    return jax.jit(count)


@pytest.mark.parametrize(
    "fmt, lo",
    [
        (BF16, 1.0),
        (BF16, -3.0),
        (FP16, 0.0),  # below S: the neighbours are 0 and the smallest subnormal
        (FP16, 1.5),
        (E4M3FN, -0.5),
        (E4M3FN, 0.0),
    ],
    ids=str,
)
def test_stochastic_resolves_probabilities_to_2_to_the_minus_12(fmt, lo):
    """x = lo + j * 2**-12 * (hi - lo), hi the neighbour of lo away from zero:
    P(round to hi) = j * 2**-12 over many keys, the smallest steps included (a
    generator with fewer random bits gives 0 or 2**-11 for j = 1)."""
    lo = np.float32(lo)
    away = np.float32(-np.inf if lo < 0 else np.inf)
    hi = np.float32(round_to(np.nextafter(lo, away), fmt, "down" if lo < 0 else "up"))
    k = RESOLUTION_BITS
    j = np.array([1, 2, 3, 5, 2**k // 3, 2 ** (k - 1), 2**k - 2, 2**k - 1])
    x = (lo + j * 2.0**-k * (hi - lo)).astype(np.float32)
    assert ((x.astype(np.float64) - lo) / (hi - lo) * 2.0**k == j).all(), "x inexact"
    keys = jax.random.split(jax.random.key(7), RESOLUTION_KEYS)
    ups, outside = _count_away(fmt)(jnp.asarray(x), lo, hi, keys)
    assert int(outside) == 0, "every rounding is lo or hi"
    expected = RESOLUTION_KEYS * j * 2.0**-k
    five_sigma = 5 * np.sqrt(expected * (1 - j * 2.0**-k))
    assert (np.abs(np.asarray(ups) - expected) <= five_sigma).all(), (
        fmt.name,
        float(lo),
        list(zip(j.tolist(), np.asarray(ups).tolist(), expected.tolist())),
    )


# Formats and carriers whose nearest rounding runs on reduce_precision (rounding.py).
IEEE_NEAREST = [
    *((f, np.float32) for f in (FP16, custom(5, 2), custom(6, 1))),
    *((f, np.float64) for f in (BF16, FP16, FP32, custom(8, 10), custom(5, 2), custom(6, 1))),
]


def _edges(fmt, dtype) -> np.ndarray:
    """Dense hard cases for ``fmt`` on a ``dtype`` carrier: random values from below
    the smallest subnormal to past max, every neighbour pair's midpoint with the
    carrier values either side, the normal/subnormal boundary and the overflow edge,
    carrier subnormals, the carrier's largest values, signed zeros, infinities and NaNs
    with payloads and signs."""
    rng = np.random.default_rng(1)
    n = 4000
    exps = rng.integers(fmt.emin - fmt.man_bits - 3, fmt.emax + 2, n)
    x = np.ldexp(1 + rng.random(n), exps).astype(dtype)
    e = np.maximum(np.floor(np.log2(x.astype(np.float64))), fmt.emin).astype(int)
    q = np.ldexp(1.0, e - fmt.man_bits)
    lo = np.floor(x / q) * q  # a value of fmt (or max + one ulp), exactly
    mids = (lo + q / 2).astype(dtype)
    tiny = np.ldexp(1.0, fmt.emin)
    top = fmt.max + np.ldexp(1.0, fmt.emax - fmt.man_bits) / 2
    base = np.concatenate([x, mids, [tiny, tiny - np.ldexp(1.0, fmt.emin - fmt.man_bits - 1)]])
    base = np.concatenate(
        [
            base,
            [top, fmt.max, np.finfo(dtype).tiny, np.finfo(dtype).smallest_subnormal],
            [np.finfo(dtype).max, np.finfo(dtype).max / 3],  # far past the format
        ]
    )
    inf = np.asarray(np.inf, dtype)
    with np.errstate(over="ignore"):
        base = base.astype(dtype)
        near = np.concatenate([base, np.nextafter(base, inf), np.nextafter(base, -inf)])
    words = np.asarray([0x7FF0000000000001, 0x7FF8000000000123, 0xFFF4000000000000], np.uint64)
    if dtype == np.float32:
        words = np.asarray([0x7F800001, 0x7FC00123, 0xFFA00000], np.uint32)
    specials = np.concatenate([np.asarray([0.0, np.inf, np.nan], dtype), words.view(dtype)])
    both = np.concatenate([near, specials])
    return np.concatenate([both, -both])


@pytest.mark.parametrize(
    "fmt, dtype", IEEE_NEAREST, ids=[f"{f.name}-{np.dtype(d).name}" for f, d in IEEE_NEAREST]
)
def test_reduce_precision_path_equals_the_integer_path(fmt, dtype):
    """round_to to nearest for an IEEE layout whose subnormals are carrier normals runs
    on ``lax.reduce_precision`` and a scaled rounding below the smallest normal; it
    must give the integer path's bits on every hard case (NaN payloads dropped, sign
    kept), and the path must be taken where this claims it is."""
    from fa_jax import rounding

    c = rounding._CARRIERS[np.dtype(dtype)]
    widths = (fmt.exp_bits, fmt.man_bits, fmt.bias)
    static = rounding._Static("nearest_even", fmt.subnormals, fmt.specials, fmt.overflow)
    assert rounding._hardware_nearest(static, widths, dtype)
    with x64_enabled():
        x = jnp.asarray(_edges(fmt, dtype))
        want = jax.jit(rounding._round_ste, static_argnums=0)(static, x, *widths, None)
        got = round_jit(x, fmt)
        eager = round_to(x, fmt)
    bits = np.dtype(c.uint)
    assert np.array_equal(np.asarray(got).view(bits), np.asarray(want).view(bits))
    assert np.array_equal(np.asarray(eager).view(bits), np.asarray(want).view(bits))


@pytest.mark.parametrize(
    "fmt, dtype",
    [(BF16, np.float32), (FP32, np.float32), (custom(4, 0), np.float64), (E4M3FN, np.float64)],
    ids=["bf16-subnormals-in-float32", "fp32-in-float32", "no-mantissa", "e4m3fn"],
)
def test_reduce_precision_path_is_not_taken_where_it_would_be_wrong(fmt, dtype):
    """bf16's subnormals are float32 subnormals (flushed by the CPU's arithmetic);
    a zero-bit mantissa ties to the even exponent in reduce_precision but to the
    larger value in ml_dtypes; formats without infinities overflow otherwise."""
    from fa_jax import rounding

    static = rounding._Static("nearest_even", fmt.subnormals, fmt.specials, fmt.overflow)
    assert not rounding._hardware_nearest(static, (fmt.exp_bits, fmt.man_bits, fmt.bias), dtype)


# Formats and carriers whose nearest rounding is exact float arithmetic (formats.py, Eq. R).
FLOAT_EXACT = [
    *((f, np.float32) for f in (FP16, FP32, E4M3FN, custom(5, 2, subnormals=False))),
    *(
        (f, np.float64)
        for f in (
            BF16,
            FP16,
            FP32,
            fa_jax.FP64,
            E4M3FN,
            fa_jax.E4M3FNUZ,
            fa_jax.E2M1FN,
            custom(8, 10, subnormals=False),
            custom(4, 3, overflow="saturate"),
        )
    ),
]


@pytest.mark.parametrize(
    "fmt, dtype", FLOAT_EXACT, ids=[f"{f.name}-{np.dtype(d).name}" for f, d in FLOAT_EXACT]
)
def test_float_path_equals_the_integer_path(fmt, dtype):
    """Rounding to nearest by (|x| + C) - C, taken for a concrete format that rounds
    exactly in float arithmetic and for traced widths that state it
    (``float_exact_in``), gives the integer path's bits on every hard case, under
    jit, eagerly and vmapped over the widths."""
    import dataclasses

    from fa_jax import rounding

    assert fmt.rounds_in_float(dtype)
    widths = (fmt.exp_bits, fmt.man_bits, fmt.bias)
    static = rounding._Static("nearest_even", fmt.subnormals, fmt.specials, fmt.overflow)
    carriers = (np.dtype(dtype).name,)

    def traced(w):
        f = dataclasses.replace(fmt, name="t", float_exact_in=carriers)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(f), list(w))

    with x64_enabled():
        x = jnp.asarray(_edges(fmt, dtype))
        want = jax.jit(rounding._round_ste, static_argnums=0)(static, x, *widths, None)
        ws = jnp.asarray([widths, widths], jnp.int32)
        vmapped = jax.jit(jax.vmap(lambda w: round_to(x, traced(w))))(ws)
        concrete = [round_jit(x, fmt), round_to(x, fmt)]
    bits = np.dtype(rounding._CARRIERS[np.dtype(dtype)].uint)
    for got in (*concrete, *vmapped):
        assert np.array_equal(np.asarray(got).view(bits), np.asarray(want).view(bits))


def test_traced_widths_take_the_float_path_only_where_stated():
    """A traced format rounds by Eq. (R) (no count-leading-zeros) only where it states
    the carrier; the integer path otherwise."""
    x = jnp.linspace(-3.0, 3.0, 7, dtype=jnp.float32)

    def ops(**kw):
        def f(m):
            return round_to(x, fa_jax.Format("t", 5, m, **kw))

        return str(jax.make_jaxpr(f)(jnp.int32(10)))

    assert "clz" not in ops(float_exact_in=("float32",))
    assert "clz" in ops()
    assert "clz" in ops(float_exact_in=("float64",))  # another carrier's statement


@pytest.mark.parametrize(
    "fmt, dtype, holds",
    [
        (BF16, np.float64, True),
        (BF16, np.float32, False),  # its subnormals are float32 subnormals
        (FP16, np.float32, True),
        (FP32, np.float32, True),  # the carrier's own layout
        (fa_jax.FP64, np.float64, True),
        (fa_jax.TF32, np.float32, False),  # its finest quantum 2**-136
        (custom(11, 3), np.float64, False),  # 2**(emax - 3 + 52) overflows
        (custom(11, 52, subnormals=False), np.float64, False),  # {0, tiny} below tiny
    ],
)
def test_rounds_in_float_where_eq_r_is_exact(fmt, dtype, holds):
    assert fmt.rounds_in_float(dtype) is holds
    stated = fa_jax.Format("t", jnp.int32(5), jnp.int32(2), float_exact_in=("float32",))
    assert stated.rounds_in_float(np.float32) and not stated.rounds_in_float(np.float64)


def test_a_concrete_format_cannot_state_a_carrier_it_does_not_round_in():
    with pytest.raises(ValueError, match=r"float_exact_in: 'bf16' does not round exactly"):
        fa_jax.Format("bf16", 8, 7, float_exact_in=("float32",))
    with pytest.raises(ValueError, match=r"float_exact_in: expected a tuple of carrier names"):
        fa_jax.Format("x", 5, 2, float_exact_in=("float16",))
