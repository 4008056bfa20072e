"""The float32-carrier exp/exp2 against the float64 ops, bit for bit.

``fa_jax.carrier32.exp.exp``/``exp2`` must give exactly the bits of ``fa_jax.ops.exp``/
``exp2`` (float64 ``exp``, rounded once): on every value of the small formats,
random float32 over the whole range, the boundaries where results overflow or go
subnormal in a format or below its smallest subnormal, signed zeros, infinities,
NaNs of both signs and float32 subnormal inputs; eagerly, under ``jit`` and
``vmap``, with ``jax_enable_x64`` off, with traced format widths.  Where the
float64 op is not correctly rounded (its float64 result was within its error of a
midpoint) exp32 must give the correctly rounded result instead (200-bit
``mpmath`` and the exact rational oracle).  The slow test compares every float32
input, and checks every one whose computed result lies within twice the error
bound of a number of at most 25 significant bits against 200-bit arithmetic.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import mpmath
import numpy as np
import pytest
from helpers import wide_names, x64_enabled
from oracle import round_exact

from fa_jax import FP32, custom, get_format, ops
from fa_jax.carrier32 import exp as exp32

FUNCTIONS = ("exp", "exp2")
FORMATS = [get_format(name) for name in ("bf16", "fp16", "tf32", "fp32", "e4m3fn", "e5m2")] + [
    custom(4, 3, bias=2, overflow="saturate", name="e4m3_bias2_saturating")
]
SMALL = ("e4m3fn", "e4m3fnuz", "e5m2", "e3m2fn", "e2m3fn", "e2m1fn")
# Inputs past these give 0 and inf in every format (the functions clamp to them).
RANGE = {"exp": (-110.0, 90.0), "exp2": (-160.0, 130.0)}
N = 1 << 17


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def reference(fn: str, x, fmt) -> np.ndarray:
    """The float64 op's result as float32 (exact: it is a value of fmt)."""
    with np.errstate(invalid="ignore"), x64_enabled():
        wide = np.asarray(x, np.float32).astype(np.float64)
        return np.asarray(getattr(ops, fn)(jnp.asarray(wide), fmt)).astype(np.float32)


def exact(fn: str, x: np.float32) -> Fraction:
    """e**x or 2**x for a finite float32 x: exact for 2**integer, else to 200 bits."""
    if fn == "exp2" and float(x) == int(x):
        return Fraction(2) ** int(x)
    with mpmath.workprec(200):
        v = (
            mpmath.exp(mpmath.mpf(float(x)))
            if fn == "exp"
            else mpmath.power(2, mpmath.mpf(float(x)))
        )
        man, e = v.man_exp
        return Fraction(int(man)) * Fraction(2) ** int(e)


def correctly_rounded(fn: str, x: np.float32, fmt) -> np.float32:
    return np.float32(round_exact(exact(fn, x), fmt))


def assert_same_bits(got, want, x, what: str, fn: str = "", fmt=None) -> int:
    """got == want bit for bit, except where want is not the correctly rounded
    result (the float64 op misrounds): there got must be.  Returns that count."""
    got_bits = np.asarray(got, np.float32).view(np.uint32).ravel()
    want_bits = np.asarray(want, np.float32).view(np.uint32).ravel()
    xs = np.asarray(x, np.float32).ravel()
    bad = np.nonzero(got_bits != want_bits)[0]
    misrounded = 0
    for i in bad:
        right = np.isfinite(xs[i]) and fmt is not None
        right = right and correctly_rounded(fn, xs[i], fmt).view(np.uint32) == got_bits[i]
        if not right:
            raise AssertionError(
                f"{what}: {bad.size} of {got_bits.size} differ; x={xs[i]!r} "
                f"(bits {xs[i].view(np.uint32):#010x}): got {got_bits[i]:#010x}, "
                f"want {want_bits[i]:#010x}"
            )
        misrounded += 1
    return misrounded


def random_float32(n: int, seed: int) -> np.ndarray:
    """n float32: arbitrary bit patterns, then values spread over the range where
    the results are neither 0 nor inf, then values near 0 and subnormals."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n // 4, dtype=np.uint64).astype(np.uint32)
    quiet = np.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x00400000, bits).astype(np.uint32)
    spread = rng.uniform(-160.0, 130.0, n // 4)
    near = rng.choice([-1.0, 1.0], n // 4) * 2.0 ** rng.uniform(-40, 3, n // 4)
    sub = rng.integers(0, 1 << 23, n - 3 * (n // 4)).astype(np.uint32)
    sub |= rng.integers(0, 2, sub.size).astype(np.uint32) << np.uint32(31)
    return np.concatenate(
        [
            quiet.view(np.float32),
            spread.astype(np.float32),
            near.astype(np.float32),
            sub.view(np.float32),
        ]
    )


def boundaries(fn: str, fmt) -> np.ndarray:
    """Inputs around where the result overflows fmt, reaches its smallest normal
    and subnormal and half of that, for both float32 neighbours; plus specials."""
    log = np.log if fn == "exp" else np.log2
    targets = [fmt.max, fmt.max * (1 + 2.0 ** -(fmt.man_bits + 1)), 2.0 ** (fmt.emax + 1)]
    targets += [fmt.tiny, fmt.smallest_subnormal, fmt.smallest_subnormal / 2]
    targets += [fmt.smallest_subnormal * 1.5, 2.0**-126, 2.0**-149, 2.0**-150, 2.0**128]
    x = np.array([log(t) for t in targets], np.float64).astype(np.float32)
    near = [x, np.nextafter(x, np.float32(-np.inf)), np.nextafter(x, np.float32(np.inf))]
    ints = np.arange(-152, 130, dtype=np.float32)  # exp2: exact powers of two, ties below 2**-149
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 2.0**-149, -(2.0**-149), 2.0**-26], np.float32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFF800001], np.uint32).view(np.float32)
    return np.concatenate([*near, ints, ints + np.float32(0.5), specials, -specials, nans])


def every_code(name: str) -> np.ndarray:
    """Every bit pattern of a format (NaNs included) as float32."""
    fmt = get_format(name)
    dtype = np.dtype(getattr(ml_dtypes, fmt.name, fmt.name))
    width = 1 + fmt.exp_bits + fmt.man_bits
    codes = np.arange(1 << width, dtype=np.uint16 if width == 16 else np.uint8)
    with np.errstate(invalid="ignore"):
        return codes.view(dtype).astype(np.float32)


ALL_FORMATS = [*FORMATS, custom(8, 22)]  # e8m22: its midpoints have 24 bits


def all_formats(fn: str):
    """One program: fn of its input rounded to each of ALL_FORMATS (exp32's and
    the float64 op's), so that each side compiles once."""
    mine = jax.jit(lambda v: [getattr(exp32, fn)(v, f) for f in ALL_FORMATS])
    with x64_enabled():
        theirs = jax.jit(lambda v: [getattr(ops, fn)(v, f) for f in ALL_FORMATS])
    return mine, theirs


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_jitted_results_are_the_float64_ops_bits(fn):
    """Random float32, every format's boundaries and every value of bf16, fp16 and
    the 8/6/4-bit formats, to each format of ALL_FORMATS."""
    parts = [random_float32(N, seed=1)]
    parts += [boundaries(fn, get_format(f)) for f in (*ALL_FORMATS, *SMALL)]
    parts += [every_code(name) for name in (*SMALL, "bf16", "fp16")]
    parts += [np.array(AMBIGUOUS[fn], np.uint32).view(np.float32)]
    x = np.concatenate(parts)
    mine, theirs = all_formats(fn)
    got = mine(jnp.asarray(x))
    with np.errstate(invalid="ignore"), x64_enabled():
        want = theirs(jnp.asarray(x.astype(np.float64)))
    for fmt, g, w in zip(ALL_FORMATS, got, want):
        w = np.asarray(w).astype(np.float32)
        assert_same_bits(g, w, x, f"{fn} {fmt.name}", fn, fmt)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_eager_jit_and_vmap_agree(fn):
    fmt = get_format("bf16")
    x = np.concatenate([random_float32(1 << 12, seed=2), boundaries(fn, FP32)])
    x = x[: (x.size // 64) * 64]
    eager = getattr(exp32, fn)(jnp.asarray(x), FP32)
    jitted = jax.jit(lambda v: getattr(exp32, fn)(v, FP32))(jnp.asarray(x))
    vmapped = jax.jit(jax.vmap(lambda v: getattr(exp32, fn)(v, fmt)))(
        jnp.asarray(x.reshape(64, -1))
    )
    want = reference(fn, x, FP32)
    assert_same_bits(eager, want, x, f"eager {fn}", fn, FP32)
    assert_same_bits(jitted, want, x, f"jit {fn}", fn, FP32)
    assert_same_bits(np.asarray(vmapped).ravel(), reference(fn, x, fmt), x, f"vmap {fn}", fn, fmt)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_traced_format_widths_give_the_concrete_formats_bits(fn):
    x = random_float32(1 << 13, seed=3)
    widths = [2, 10, 22, 23]
    run = jax.jit(jax.vmap(lambda m: getattr(exp32, fn)(jnp.asarray(x), custom(8, m))))
    for m, row in zip(widths, run(jnp.array(widths, jnp.int32))):
        assert_same_bits(row, reference(fn, x, custom(8, m)), x, f"{fn} e8m{m}", fn, custom(8, m))


def test_results_do_not_depend_on_x64():
    x = jnp.asarray(random_float32(1 << 12, seed=4))

    def both(v):
        return exp32.exp(v, FP32), exp32.exp2(v, get_format("bf16"))

    with_x64 = jax.jit(both)(x)
    jax.config.update("jax_enable_x64", False)
    try:
        without = jax.jit(both)(x)
    finally:
        jax.config.update("jax_enable_x64", True)
    for a, b in zip(with_x64, without):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def _lowered():
    x = jnp.zeros(8, jnp.float32)
    return jax.jit(lambda v: (exp32.exp(v, FP32), exp32.exp2(v, "bf16"))).lower(x)


def test_programs_have_no_64_bit_types_under_x64():
    assert not wide_names(_lowered().as_text())


def test_programs_have_no_64_bit_types_without_x64():
    jax.config.update("jax_enable_x64", False)
    try:
        text = _lowered().as_text()
    finally:
        jax.config.update("jax_enable_x64", True)
    assert not wide_names(text)


def test_float64_carriers_and_wide_formats_are_refused():
    with pytest.raises(TypeError, match="expected float32 carrier arrays, got float64"):
        exp32.exp(jnp.ones(2, jnp.float64), "bf16")
    with pytest.raises(ValueError, match="expected a format that fits a float32 carrier"):
        exp32.exp2(jnp.ones(2, jnp.float32), "fp64")


# -- exhaustive (slow) ----------------------------------------------------------


def ambiguous(fn: str, x) -> jax.Array:
    """Where the computed ``y`` lies within twice the error bound of a number of at
    most 25 significant bits (a value or midpoint of some format): only there can
    the rounding differ from the exact one.  Float64 analysis of exp32's parts."""
    lo, hi = RANGE[fn]
    reduce = exp32._exp_reduce if fn == "exp" else exp32._exp2_reduce
    n, (z_hi, z_lo) = reduce(jnp.clip(x, lo, hi))
    parts = exp32._parts(n, z_hi, z_lo)
    t = parts.t.astype(jnp.float64)
    d = parts.u.astype(jnp.float64) + parts.lo.astype(jnp.float64)
    y = t + d
    grid = jnp.where(y >= 1.0, 2.0**-24, 2.0**-25)  # 25-bit numbers near y (t is on it)
    q = d / grid
    near = jnp.abs(q - jnp.round(q)) * grid <= 2 * exp32.ERROR_BOUND * y
    tiny = jnp.abs(x) < 2.0**-26
    exact = (x == jnp.round(x)) if fn == "exp2" else tiny  # 2**k: computed exactly
    return near & ~tiny & ~exact & (x > lo) & (x < hi)


EXHAUSTIVE_FORMATS = ("fp32", "bf16", "fp16")


def exhaustive_chunk(fn: str, start: int, count: int):
    """For the float32 inputs with bits start .. start + count - 1: the bits where
    exp32 differs from the float64 op, per format, and where y is ambiguous.  The
    float64 results become float32 on the host (XLA's conversion would flush
    float32 subnormals)."""
    fmts = [get_format(name) for name in EXHAUSTIVE_FORMATS]

    @jax.jit
    def run(bits):
        x = jax.lax.bitcast_convert_type(bits, jnp.float32)
        mine = [getattr(exp32, fn)(x, f) for f in fmts]
        theirs = [getattr(ops, fn)(x.astype(jnp.float64), f) for f in fmts]
        return mine, theirs, ambiguous(fn, x)

    with x64_enabled():
        bits = np.arange(start, start + count, dtype=np.uint64).astype(np.uint32)
        mine, theirs, amb = run(jnp.asarray(bits))
        differ = [
            np.asarray(a).view(np.uint32) != np.asarray(b).astype(np.float32).view(np.uint32)
            for a, b in zip(mine, theirs)
        ]
    return [bits[np.nonzero(row)[0]] for row in differ], bits[np.nonzero(np.asarray(amb))[0]]


def exhaustive(fn: str, chunk: int = 1 << 22, progress=None, smallest: int = 0):
    """exhaustive_chunk over every float32 whose result is not 0 or inf everywhere
    (``|x|`` from the float32 with bits ``smallest``)."""
    lo, hi = RANGE[fn]
    top = int(np.float32(max(-lo, hi)).view(np.uint32))
    differ: list[list[np.ndarray]] = [[] for _ in EXHAUSTIVE_FORMATS]
    amb: list[np.ndarray] = []
    for sign in (0, 1 << 31):
        for start in range(sign + smallest, sign + top + 1, chunk):
            count = min(chunk, sign + top + 1 - start)
            d, a = exhaustive_chunk(fn, start, count)
            for acc, row in zip(differ, d):
                acc.append(row)
            amb.append(a)
            if progress:
                progress(
                    fn, start, [sum(len(r) for r in acc) for acc in differ], sum(map(len, amb))
                )
    return [np.concatenate(acc) for acc in differ], np.concatenate(amb)


def computed_parts(fn: str, x: np.ndarray):
    """exp32's (exponent, 24-bit significand, sign of the remainder) of the result
    for finite float32 ``x`` with ``2**-26 <= |x|`` inside RANGE."""
    lo, hi = RANGE[fn]
    reduce = exp32._exp_reduce if fn == "exp" else exp32._exp2_reduce

    @jax.jit
    def run(xj):
        n, (z_hi, z_lo) = reduce(jnp.clip(xj, lo, hi))
        parts = exp32._parts(n, z_hi, z_lo)
        s, rest = exp32._round_odd(parts)
        return parts.k, s, rest

    k, s, rest = run(jnp.asarray(x))
    mant, e = np.frexp(np.asarray(s, np.float64))  # s = mant 2**e, mant in [1/2, 1)
    return np.asarray(k) + e - 1, (mant * 2**24).astype(np.int64), np.asarray(rest)


def exact_parts(fn: str, x: np.float32) -> tuple[int, int, int]:
    """(k, S, rest) with the exact result 2**k (S + rho) 2**-23, S the nearest
    24-bit integer in [2**23, 2**24] and rest the sign of rho."""
    v = exact(fn, x)
    k = v.numerator.bit_length() - v.denominator.bit_length()
    k -= Fraction(2) ** k > v
    scaled = v / Fraction(2) ** (k - 23)
    sig = round(scaled)
    return k, sig, (scaled > sig) - (scaled < sig)


def check_ambiguous(fn: str, xs: np.ndarray) -> list[int]:
    """The bits of the inputs among ``xs`` whose computed parts are not the exact
    ones."""
    if xs.size == 0:
        return []
    ks, sigs, rests = computed_parts(fn, xs)
    wrong = []
    for x, k, sig, rest in zip(xs, ks, sigs, rests):
        ek, esig, erest = exact_parts(fn, x)
        if esig == 1 << 24:
            ek, esig = ek + 1, 1 << 23
        if (int(k), int(sig), int(rest)) != (ek, esig, erest):
            wrong.append(int(x.view(np.uint32)))
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("fn", FUNCTIONS)
def test_every_float32_input(fn):
    """All float32 inputs: for FP32, bf16 and fp16 the float64 op's bits, or where
    they differ the correctly rounded result; and every input whose computed result
    lies within the error bound of a number of at most 25 significant bits has the
    exact nearest 24-bit significand and remainder sign (so every format is right)."""
    differ, amb = exhaustive(fn)
    for name, bad in zip(EXHAUSTIVE_FORMATS, differ):
        fmt, xs = get_format(name), bad.view(np.float32)
        got = np.asarray(getattr(exp32, fn)(jnp.asarray(xs), fmt)).view(np.uint32)
        wrong = [x for x, g in zip(xs, got) if correctly_rounded(fn, x, fmt).view(np.uint32) != g]
        assert not wrong, f"{fn} {name}: {len(wrong)} misrounded, first {wrong[:8]}"
    assert check_ambiguous(fn, amb.view(np.float32)) == []


# The inputs the exhaustive search finds within twice the error bound of a number
# of at most 25 significant bits (test_every_float32_input finds them again).
AMBIGUOUS = {
    "exp": (
        0x33FFFFFF, 0x347FFFFE, 0x34FFFFFC, 0x357FFFF8, 0x35BFFFF7, 0x35FFFFF0, 0x363FFFEE,
        0x367FFFE0, 0x369FFFE7, 0x36BFFFDC, 0x36DFFFCF, 0x36FFFFC0, 0xB4800001, 0xB5000002,
        0xB5800004, 0xB5C00009, 0xB6000008, 0xB6400012, 0xB6800010, 0xB6A00019, 0xB6C00024,
        0xB6E00031, 0xB7000020, 0xBB32CF64, 0xC16912CD,
    ),
    "exp2": (0x3B429D37, 0xB52D1F9A, 0xB6A477AF, 0xB8D3D026, 0xBAEC2B40, 0xBCF3A937),
}  # fmt: skip


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_results_nearest_to_rounding_boundaries(fn):
    """The exact nearest 24-bit significand and remainder sign, so the correctly
    rounded result in every format (test_jitted_results_are_the_float64_ops_bits
    rounds them to formats whose midpoints they are nearest to)."""
    xs = np.array(AMBIGUOUS[fn], np.uint32).view(np.float32)
    assert check_ambiguous(fn, xs) == []
