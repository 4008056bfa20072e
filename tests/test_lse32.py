"""fa_jax.carrier32.lse: ``fl_fmt(m·scale + ln l)`` on float32 carriers, correctly rounded.

Against the float64 path (``round_to(m * scale + log(l), fmt)`` with float64
carriers): the bits agree, or mpmath decides and ours is the correctly rounded
one (the float64 path's own errors misround where ``m·scale ≈ -ln l`` cancels).
Also: NaN/inf/zero operands as the float64 path gives them, jit = eager = vmap,
x64 off, traced formats, and no 64-bit type in the program.
"""

import functools
import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from helpers import wide_names, x64_enabled
from mpmath.libmp import mpf_pos, round_down

from fa_jax import FP32, FP64, custom, get_format
from fa_jax.carrier32 import lse as lse32
from fa_jax.rounding import round_to

NAMES = ["bf16", "fp16", "fp32", "tf32", "e4m3fn", "e5m2"]
FORMATS = [get_format(n) for n in NAMES]
N = 1 << 16  # pairs per format and seed: one shape, so each program compiles once


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def to_fmt(x, fmt) -> np.ndarray:
    """float64 values rounded to fmt, as float32 (in one shape: one compiled rounding)."""
    x = np.resize(np.asarray(x, np.float64), N)
    with np.errstate(over="ignore"):
        return np.asarray(round_to(jnp.asarray(x.astype(np.float32)), fmt))


def random_values(fmt, rng, lo, hi) -> np.ndarray:
    """N positive values of fmt with exponents uniform in [lo, hi]."""
    e = rng.integers(lo, hi + 1, N).astype(np.float64)
    x = to_fmt(rng.uniform(1, 2, N) * 2.0**e, fmt)
    return np.where(np.isfinite(x), x, np.float32(fmt.max))


def operands(fmt, seed, with_scale):
    """(m, l, scale or None): l over fmt's whole positive range (subnormals and
    values next to 1 included); m tiny to huge, and m·scale next to -ln l."""
    rng = np.random.default_rng(seed)
    lo, hi = fmt.min_exponent, fmt.emax
    l = random_values(fmt, rng, lo, hi)
    ulp = 2.0 ** -min(fmt.man_bits, 23)
    near_one = to_fmt(1 + rng.integers(-64, 65, N) * ulp / 2, fmt)
    l = np.where(rng.random(N) < 0.15, near_one, l)
    l = np.where((l > 0) & np.isfinite(l), l, np.float32(1))
    if with_scale:
        d = 2.0 ** rng.integers(0, 9, N)
        scale = np.where(
            rng.random(N) < 0.5, to_fmt(1 / np.sqrt(d), fmt), random_values(fmt, rng, -20, 20)
        )
        scale = np.where(scale > 0, scale, np.float32(1)) * rng.choice([-1, 1], N).astype(
            np.float32
        )
    else:
        scale = np.ones(N, np.float32)
    sign = rng.choice([-1.0, 1.0], N)
    m = sign * random_values(fmt, rng, lo, hi)
    m_small = sign * random_values(fmt, rng, lo, min(hi, 0))
    ln_l = np.log(l.astype(np.float64))
    cancel = to_fmt(-ln_l / scale.astype(np.float64), fmt)
    kind = rng.random(N)
    m = np.select([kind < 0.4, kind < 0.5, kind < 0.55], [cancel, m_small, 0.0 * m], m)
    return m.astype(np.float32), l, (scale if with_scale else None)


def float64_path(m, l, scale, fmt) -> np.ndarray:
    """The float64 carrier's ``round_to(m·scale + log l, fmt)``, as float64."""
    args = [
        jnp.asarray(np.asarray(x, np.float64)) for x in (m, l, scale if scale is not None else 1.0)
    ]
    return np.asarray(_float64_program(fmt)(*args))


@functools.cache
def _float64_program(fmt):
    return jax.jit(lambda m, l, s: round_to(m * s + jnp.log(l), fmt))


@functools.cache
def _traced_program(specials, with_scale):
    """One program for every format with these specials: widths and bias traced."""

    def run(m, l, s, e, man, bias):
        fmt = custom(e, man, bias=bias, specials=specials)
        return lse32.lse(m, l, fmt, s if with_scale else None)

    return jax.jit(run)


def ours(m, l, scale, fmt) -> np.ndarray:
    program = _traced_program(fmt.specials, scale is not None)
    widths = (jnp.int32(fmt.exp_bits), jnp.int32(fmt.man_bits), jnp.int32(fmt.bias))
    s = scale if scale is not None else np.ones_like(m)
    return np.asarray(program(m, l, s, *widths))


def _round_to_odd(x: mpmath.mpf, bits: int) -> float:
    """x rounded to ``bits`` significant bits, to odd (exact as float64): rounding
    that to any format of at most bits - 2 bits is rounding x."""
    sign, man, exp, bc = mpf_pos(x._mpf_, bits, round_down)
    if not man:
        return 0.0
    man, exp = man << (bits - bc), exp - (bits - bc)
    if mpmath.mpf((sign, man, exp, man.bit_length())) != x:
        man |= 1
    return (-1.0 if sign else 1.0) * math.ldexp(float(man), exp)


def correctly_rounded(m, l, scale, fmt) -> np.ndarray:
    """fl_fmt(m·scale + ln l) from mpmath (600 bits), as float64."""
    with mpmath.workprec(600):
        exact = [
            mpmath.mpf(float(a)) * mpmath.mpf(float(s)) + mpmath.log(mpmath.mpf(float(b)))
            for a, b, s in zip(m, l, scale)
        ]
        odd = np.array([_round_to_odd(x, 40) for x in exact])
    return np.asarray(round_to(jnp.asarray(odd), fmt))


def bits64(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float64).view(np.uint64)


def check(m, l, scale, fmt) -> tuple[int, int]:
    """Assert ours is the float64 path's bits or, where not, mpmath's; returns (pairs
    checked, pairs where the float64 path misrounds)."""
    got = ours(m, l, scale, fmt)
    want = float64_path(m, l, scale, fmt)
    bad = np.flatnonzero(bits64(got) != np.asarray(want).view(np.uint64))
    s = scale if scale is not None else np.ones_like(m)
    right = correctly_rounded(m[bad], l[bad], s[bad], fmt)
    wrong = np.flatnonzero(bits64(got[bad]) != right.view(np.uint64))
    shown = [(float(m[i]), float(l[i]), float(s[i]), float(got[i])) for i in bad[wrong[:5]]]
    assert wrong.size == 0, f"{fmt.name}: {wrong.size} not correctly rounded, e.g. {shown}"
    return m.size, bad.size


@pytest.mark.parametrize("with_scale", [False, True], ids=["m", "m_scale"])
@pytest.mark.parametrize("fmt", FORMATS, ids=NAMES)
def test_random_pairs_are_correctly_rounded(fmt, with_scale):
    check(*operands(fmt, 0, with_scale), fmt)


SPECIAL_VALUES = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 2.0**-149, 3e38, -0.5]


def test_nan_inf_zero_and_negative_operands_give_the_float64_paths_bits():
    v = np.array(SPECIAL_VALUES, np.float32)
    m, l, s = (np.resize(x.ravel(), N) for x in np.meshgrid(v, v, v))  # N: compiled shape
    for fmt in (FP32, get_format("e4m3fn")):
        for scale in (None, s):
            got = ours(m, l, scale, fmt)
            want = float64_path(m, l, scale, fmt)
            np.testing.assert_array_equal(bits64(got), want.view(np.uint64))


TINY = 2.0**-149
# (m, l, scale, format, the exact result rounded by hand)
BY_HAND = [
    (1 + 2.0**-12, 1.0, 1 + 2.0**-12, FP32, 1 + 2.0**-11),  # 1 + 2**-11 + 2**-24: a tie, to even
    (1 + 2.0**-12, 1.0, -(1 + 2.0**-12), FP32, -(1 + 2.0**-11)),
    (3 * TINY, 1.0, 0.5, FP32, 2 * TINY),  # 1.5 * 2**-149 (flushed in float32 arithmetic)
    (TINY, 1.0, None, FP32, TINY),
    (2.0**100, 2.0**100, 2.0**100, FP32, np.inf),  # m·scale past float32's range
    (0.0, 2.0, None, FP32, float(np.float32(math.log(2)))),
    (-0.0, 1.0, None, FP32, 0.0),  # -0 + ln 1 = +0
]


@pytest.mark.parametrize("case", BY_HAND, ids=lambda c: f"{c[0]}_{c[1]}_{c[2]}")
def test_results_rounded_by_hand(case):
    m, l, scale, fmt, want = case
    m, l = (np.full(N, np.float32(x)) for x in (m, l))  # N: the compiled shape
    got = ours(m, l, None if scale is None else np.full(N, np.float32(scale)), fmt)
    assert got.view(np.uint32)[0] == np.float32(want).view(np.uint32), (got[0], want)


def test_cancellation_keeps_every_bit_of_the_difference():
    """m = -fl32(ln l): x = ln l - fl32(ln l), at most 2**-24 of |m|, correctly
    rounded to 24 bits."""
    l = np.float32([3.0, 1e-30, 7e37, 1 + 2.0**-23, 1 - 2.0**-24, 2.0**-149, 0.7])
    m = np.float32(-np.log(l.astype(np.float64)))
    got = ours(np.resize(m, N), np.resize(l, N), None, FP32)[: l.size]
    want = correctly_rounded(m, l, np.ones(l.size), FP32)
    np.testing.assert_array_equal(bits64(got), want.view(np.uint64))
    assert np.all((got != 0) & (np.abs(got) <= np.abs(m) * 2.0**-24)), got


@pytest.mark.extended  # 10 s
def test_jit_eager_vmap_and_traced_formats_give_the_same_bits():
    fmt = get_format("bf16")
    m, l, s = (x[:1024] for x in operands(fmt, 1, True))

    def jitted(m, l, s):  # one program: the call as is and vmapped over rows
        rows = [x.reshape(16, -1) for x in (m, l, s)]
        mapped = jax.vmap(lambda a, b, c: lse32.lse(a, b, fmt, c))(*rows)
        return lse32.lse(m, l, fmt, s), mapped.ravel()

    want = np.asarray(lse32.lse(m, l, fmt, s)).view(np.uint32)  # eager
    for got in (*jax.jit(jitted)(m, l, s), ours(m, l, s, fmt)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want)


def test_results_do_not_depend_on_x64():
    fmt = get_format("fp32")
    m, l, s = operands(fmt, 2, True)
    with_x64 = np.asarray(_traced_program("ieee", True)(m, l, s, 8, 23, 127))
    jax.config.update("jax_enable_x64", False)
    try:
        widths = [jnp.int32(x) for x in (8, 23, 127)]
        without = np.asarray(_traced_program("ieee", True)(m, l, s, *widths))
    finally:
        jax.config.update("jax_enable_x64", True)
    np.testing.assert_array_equal(with_x64.view(np.uint32), without.view(np.uint32))


@pytest.mark.parametrize("x64", [False, True])
def test_programs_have_no_64_bit_types(x64):
    x = jnp.zeros(8, jnp.float32)
    jax.config.update("jax_enable_x64", x64)
    try:
        text = jax.jit(lse32.lse, static_argnums=2).lower(x, x, FP32, x).as_text()
    finally:
        jax.config.update("jax_enable_x64", True)
    assert not wide_names(text)


def test_float64_carriers_and_wide_formats_are_refused():
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(TypeError, match="expected float32 carrier arrays, got float64"):
        lse32.lse(jnp.ones(2), x, FP32)
    with pytest.raises(ValueError, match="expected a format that fits a float32 carrier"):
        lse32.lse(x, x, FP64)


@pytest.mark.slow
@pytest.mark.parametrize("with_scale", [False, True], ids=["m", "m_scale"])
@pytest.mark.parametrize("fmt", FORMATS, ids=NAMES)
def test_many_more_pairs(fmt, with_scale):
    for seed in range(10, 26):
        check(*operands(fmt, seed, with_scale), fmt)
