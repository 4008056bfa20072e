"""The float32-carrier ops against the float64 op layer, bit for bit.

``fa_jax.carrier32.elementwise`` must give exactly the bits of ``fa_jax.ops`` (float64 carriers,
correctly rounded) for every format that fits float32, whatever XLA does to
float32 subnormals: operands are values of the format, every subnormal and
overflow boundary of the format and of float32 with their float32 neighbours,
exact ties, signed zeros, infinities, NaNs, arbitrary float32 bit patterns and
huge/tiny mixes; eagerly, under ``jit`` and under ``vmap``.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import wide_names, x64_enabled

from fa_jax import BF16, FP32, FP64, custom, get_format, ops
from fa_jax.carrier32 import elementwise as ops32
from fa_jax.rounding import round_to

FORMATS = [
    get_format(name)
    for name in (
        "bf16",
        "fp16",
        "tf32",
        "fp32",
        "e5m2",
        "e4m3fn",
        "e4m3fnuz",
        "e3m2fn",
        "e2m1fn",
        "e8m2",
    )
] + [
    custom(5, 2, subnormals=False, name="e5m2_no_subnormals"),
    custom(6, 22, name="e6m22"),
    custom(4, 3, bias=2, overflow="saturate", name="e4m3_bias2_saturating"),
]
BINARY = ("add", "sub", "mul", "div", "maximum")
ALL_OPS = (*BINARY, "fma")
JIT_FORMATS = [get_format("bf16"), FP32, get_format("e4m3fn")]
N = 1 << 14  # operands per test: one shape, so eager ops compile once for all formats


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def f32(values) -> np.ndarray:
    """float64 values (exact in float32, or past its range: ±inf) as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(values, np.float64).astype(np.float32)


def float32_bits(n, rng) -> np.ndarray:
    """n arbitrary float32 (NaNs quiet), a quarter subnormal and a quarter near 1."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    kind = rng.integers(0, 4, n)
    bits = np.where(kind == 0, bits & np.uint32(0x807FFFFF), bits)
    bits = np.where(kind == 1, (bits & np.uint32(0x83FFFFFF)) | np.uint32(0x3C000000), bits)
    return quiet(bits.view(np.float32))


def quiet(x) -> np.ndarray:
    """float32 ``x`` with its signalling NaNs made quiet (so float64 casts are silent)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, bits | np.uint32(0x00400000), bits).astype(np.uint32).view(np.float32)


def values_of(fmt, n, rng) -> np.ndarray:
    """n (at most N) random values of fmt (subnormals, zeros, max and overflow values
    included), rounded in one shape (one compiled rounding per format)."""
    e = rng.integers(fmt.min_exponent - 3, fmt.emax + 2, N)
    x = rng.choice([-1.0, 1.0], N) * rng.uniform(1, 2, N) * 2.0 ** e.astype(np.float64)
    return np.asarray(round_to(jnp.asarray(f32(x)), fmt))[:n]


def boundaries(fmt) -> np.ndarray:
    """fmt's and float32's subnormal, normal and overflow boundaries and the
    midpoints between them, both signs, with their float32 neighbours."""
    s, tiny, q_top = fmt.smallest_subnormal, fmt.tiny, 2.0 ** (fmt.emax - fmt.man_bits)
    points = [s, s / 2, 3 * s / 2, 2 * s, tiny, tiny - s, tiny - s / 2, tiny / 2]
    points += [fmt.max, fmt.max + q_top / 2, fmt.max + q_top, 2.0 ** (fmt.emax + 1), 1.0, 1.5]
    points += [2.0**-149, 2.0**-148, 3 * 2.0**-150, 2.0**-126, 2.0**-126 - 2.0**-149, 2.0**-127]
    points += [2.0**127, float(np.finfo(np.float32).max)]
    base = f32([p for p in points if 2.0**-149 <= p <= float(np.finfo(np.float32).max)])
    with np.errstate(over="ignore"):
        up = np.nextafter(base, np.float32(np.inf))
    near = [base, np.nextafter(base, np.float32(0)), up]
    out = np.unique(np.concatenate(near))
    return np.concatenate([out, -out])


SPECIALS = f32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan])


def ties(fmt, rng, n) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) with a + b exactly a midpoint of fmt, and a hair above or below one:
    a a value of fmt, b half its quantum (times 1 + 2**-23 or 1 - 2**-24)."""
    a = values_of(fmt, n, rng)
    a = np.where(np.isfinite(a) & (a != 0), a, np.float32(1.0))
    e = np.floor(np.log2(np.abs(a.astype(np.float64))))
    half = 2.0 ** (np.maximum(e, fmt.emin) - fmt.man_bits - 1)
    nudge = rng.choice([1.0, 1.0, 1 + 2.0**-23, 1 - 2.0**-24], n)
    b = rng.choice([-1.0, 1.0], n) * half * nudge
    keep = np.abs(b) >= 2.0**-149
    return a[keep], f32(b[keep])


def short_significands(n, rng, bits=13) -> np.ndarray:
    """float32 with at most ``bits`` significant bits: their products and sums often
    land exactly on midpoints."""
    k = rng.integers(2 ** (bits - 1), 2**bits, n).astype(np.float64)
    e = rng.integers(-140, 110, n).astype(np.float64)
    return f32(rng.choice([-1.0, 1.0], n) * k * 2.0 ** (e - bits))


def operand_pairs(fmt, seed=0, n=3000) -> tuple[np.ndarray, np.ndarray]:
    """N pairs: every pair of fmt's boundaries and specials, then a sample of values
    of fmt, arbitrary float32, huge with tiny, ties, short significands."""
    rng = np.random.default_rng(seed)
    edge = boundaries(fmt)
    pool = np.concatenate([edge, SPECIALS])
    cross_a, cross_b = (x.ravel() for x in np.meshgrid(pool, pool))
    huge = f32(rng.uniform(1, 2, n) * 2.0 ** rng.integers(90, 128, n))
    tiny = float32_bits(n, rng) * np.float32(2.0**-100)
    tie_a, tie_b = ties(fmt, rng, n)
    a = [values_of(fmt, n, rng), float32_bits(n, rng), huge, tie_a, tie_b]
    b = [values_of(fmt, n, rng), float32_bits(n, rng), tiny, tie_b, tie_a]
    a += [short_significands(n, rng), values_of(fmt, n, rng)]
    b += [short_significands(n, rng), rng.choice(edge, n)]
    a, b = np.concatenate(a), np.concatenate(b)
    pick = np.resize(rng.permutation(a.size), N - cross_a.size)
    return np.concatenate([cross_a, a[pick]]), np.concatenate([cross_b, b[pick]])


def operand_triples(fmt, seed=0):
    """(a, b, c) for fma: c also the negated product rounded to float32 or to fmt
    (massive cancellation) and values far below or above the product."""
    a, b = operand_pairs(fmt, seed)
    rng = np.random.default_rng(seed + 1)
    with np.errstate(all="ignore"):
        product = a.astype(np.float64) * b.astype(np.float64)
        minus_product = (-product).astype(np.float32)
    u = rng.random(a.size)
    c = np.select(
        [u < p for p in (0.2, 0.4, 0.5, 0.6)],
        [
            minus_product,
            np.asarray(round_to(jnp.asarray(minus_product), fmt)),
            minus_product * np.float32(2.0**-60),
            float32_bits(a.size, rng),
        ],
        default=np.roll(b, 7),
    )
    return a, b, c.astype(np.float32)


def reference(op, *operands, fmt):
    """The float64 op layer's bits, as float64."""
    args = [jnp.asarray(x.astype(np.float64)) for x in operands]
    return np.asarray(getattr(ops, op)(*args, fmt))


def assert_same_bits(got, want, *operands, what=""):
    got = np.asarray(got)
    assert got.dtype == np.float32, got.dtype
    g, w = got.astype(np.float64).view(np.uint64), np.asarray(want).view(np.uint64)
    bad = np.flatnonzero(g != w)
    shown = [
        (*(hex(x[i].view(np.uint32)) for x in operands), float(got[i]), float(want[i]))
        for i in bad[:5]
    ]
    assert bad.size == 0, f"{what}: {bad.size} of {g.size} differ, e.g. {shown}"


def operands_for(op, fmt, seed=0):
    return operand_triples(fmt, seed) if op == "fma" else operand_pairs(fmt, seed)


EAGER_FORMATS = [f for f in FORMATS if f.name not in ("float6_e3m2fn", "e6m22")]  # rest: slow


@pytest.mark.parametrize("fmt", EAGER_FORMATS, ids=lambda f: f.name)
def test_eager_ops_give_the_float64_ops_bits(fmt):
    pairs, triples = operand_pairs(fmt), operand_triples(fmt)
    for op in ALL_OPS:
        operands = triples if op == "fma" else pairs
        got = getattr(ops32, op)(*(jnp.asarray(x) for x in operands), fmt)
        want = reference(op, *operands, fmt=fmt)
        assert_same_bits(got, want, *operands, what=f"{op} {fmt.name}")


def every_op(fmt, ops_=ALL_OPS):
    """One function running each op on its operands: one compiled program for all."""

    def run(pairs, triples):
        return {op: getattr(ops32, op)(*(triples if op == "fma" else pairs), fmt) for op in ops_}

    return run


@pytest.mark.parametrize("fmt", JIT_FORMATS, ids=lambda f: f.name)
def test_jitted_ops_give_the_float64_ops_bits(fmt):
    """Under jit XLA fuses, contracts a * b + c into an FMA and flushes subnormals."""
    pairs, triples = operand_pairs(fmt, seed=1), operand_triples(fmt, seed=1)
    got = jax.jit(every_op(fmt))(pairs, triples)
    for op in ALL_OPS:
        operands = triples if op == "fma" else pairs
        want = reference(op, *operands, fmt=fmt)
        assert_same_bits(got[op], want, *operands, what=f"jit {op} {fmt.name}")


TINY = 2.0**-149  # float32's smallest subnormal, which XLA's CPU arithmetic flushes
# (op, operands, format, exact result rounded by hand)
BY_HAND = [
    ("add", (2.0**-126, -TINY), FP32, 2.0**-126 - TINY),  # a subnormal difference
    ("sub", (3 * TINY, TINY), FP32, 2 * TINY),
    ("mul", (TINY, 1.5), FP32, 2 * TINY),  # 1.5 * 2**-149: a tie, to even
    ("mul", (TINY, 0.5), FP32, 0.0),  # a tie between 0 and 2**-149, to even
    ("mul", (-TINY, 0.75), FP32, -TINY),
    ("mul", (1 + 2.0**-12, 1 + 2.0**-12), FP32, 1 + 2.0**-11),  # 1 + 2**-11 + 2**-24: tie
    ("fma", (1 + 2.0**-12, 1 + 2.0**-12, -(1 + 2.0**-11)), FP32, 2.0**-24),
    ("fma", (TINY, 0.5, 2.0**-140), FP32, 2.0**-140),  # the product a tie far below
    ("div", (3 * TINY, 2.0), FP32, 2 * TINY),  # 1.5 * 2**-149, to even
    ("div", (TINY, 3.0), FP32, 0.0),
    ("div", (1.0, 2.0**-130), FP32, 2.0**130),  # overflows: inf
    ("maximum", (-TINY, -0.0), FP32, -0.0),
    ("maximum", (TINY, 0.0), FP32, TINY),
    ("add", (1.0, 2.0**-8), BF16, 1.0),  # a tie, to even
    ("add", (1.0, 2.0**-8 + 2.0**-30), BF16, 1 + 2.0**-7),  # just above the tie
    ("mul", (2.0**-133, 0.75), BF16, 2.0**-133),  # bf16's smallest subnormal * 0.75
]


@pytest.mark.parametrize("case", BY_HAND, ids=lambda c: f"{c[0]}{c[1]}")
def test_results_rounded_by_hand(case):
    op, operands, fmt, want = case
    args = (jnp.asarray(np.full(N, f32(x))) for x in operands)  # N: the compiled shape
    got = np.asarray(getattr(ops32, op)(*args, fmt))
    assert got.view(np.uint32)[0] == f32([want]).view(np.uint32)[0], (got[0], want)


@pytest.mark.parametrize("op", ["add", "fma"])
def test_vmapped_ops_give_the_float64_ops_bits(op):
    fmt = get_format("bf16")
    operands = [x.reshape(64, -1) for x in operands_for(op, fmt, seed=2)]
    fn = jax.jit(jax.vmap(lambda *xs: getattr(ops32, op)(*xs, fmt)))
    got = fn(*(jnp.asarray(x) for x in operands))
    want = reference(op, *(x.ravel() for x in operands), fmt=fmt).reshape(64, -1)
    assert_same_bits(got, want, *operands, what=f"vmap {op}")


@pytest.mark.parametrize("op", ["add", "mul", "div"])
def test_traced_format_widths_give_the_concrete_formats_bits(op):
    """Formats whose widths are traced (one program for every mantissa width)."""
    a, b = operand_pairs(FP32, seed=3)
    widths = [2, 10, 23]

    def run(a, b, m):
        return getattr(ops32, op)(a, b, custom(8, m))

    got = jax.jit(jax.vmap(run, in_axes=(None, None, 0)))(a, b, jnp.array(widths, jnp.int32))
    for m, row in zip(widths, got):
        assert_same_bits(row, reference(op, a, b, fmt=custom(8, m)), a, b, what=f"e8m{m}")


def test_results_do_not_depend_on_x64():
    """The same bits with jax_enable_x64 off (a float32-only program)."""
    fmt = get_format("bf16")
    pairs, triples = operand_pairs(fmt, seed=4), operand_triples(fmt, seed=4)
    with_x64 = jax.jit(every_op(fmt))(pairs, triples)
    jax.config.update("jax_enable_x64", False)
    try:
        without = jax.jit(every_op(fmt))(pairs, triples)
    finally:
        jax.config.update("jax_enable_x64", True)
    for op in ALL_OPS:
        x, y = np.asarray(with_x64[op]), np.asarray(without[op])
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=op)


def _lowered(fmt, ops_=ALL_OPS):
    x = jnp.zeros(8, jnp.float32)
    return jax.jit(every_op(fmt, ops_)).lower((x, x), (x, x, x))


def test_programs_have_no_64_bit_types_without_x64():
    jax.config.update("jax_enable_x64", False)
    try:
        text = _lowered(FP32).as_text()
    finally:
        jax.config.update("jax_enable_x64", True)
    assert not wide_names(text)


def test_compiled_programs_have_no_64_bit_types_under_x64():
    """With x64 on (inputs float32) nothing 64-bit is left once XLA has folded the
    constants."""
    text = _lowered(get_format("bf16")).compile().as_text()
    assert text is not None and not wide_names(text)


def test_lowered_programs_have_no_64_bit_types_under_x64():
    assert not wide_names(_lowered(FP32, ("add",)).as_text())


def test_the_64_bit_check_sees_arrays_and_scalars_but_not_attributes():
    """The check above finds what it looks for: a float64 program's arrays."""
    x = jnp.zeros(8, jnp.float64)
    assert "f64" in wide_names(jax.jit(lambda x: x + 1).lower(x).as_text())
    assert wide_names("tensor<2x?xui64> tensor<i64> s64[3]") == ["ui64", "i64", "s64"]
    assert not wide_names("slice_sizes = array<i64: 1>")


def test_float64_carriers_are_refused():
    with pytest.raises(TypeError, match="expected float32 carrier arrays, got float64"):
        ops32.add(jnp.ones(2), jnp.ones(2, jnp.float32), "bf16")


@pytest.mark.parametrize("fmt", [FP64, custom(9, 4), custom(8, 24)], ids=lambda f: f.name)
def test_formats_that_do_not_fit_float32_are_refused(fmt):
    x = jnp.ones(2, jnp.float32)
    with pytest.raises(ValueError, match="expected a format that fits a float32 carrier"):
        ops32.mul(x, x, fmt)


def test_cast_is_round_to():
    x = jnp.asarray(float32_bits(N, np.random.default_rng(5)))
    for fmt in JIT_FORMATS:
        want = np.asarray(ops.cast(np.asarray(x).astype(np.float64), fmt))
        assert_same_bits(ops32.cast(x, fmt), want, np.asarray(x), what=fmt.name)


SMALL = [get_format(n) for n in ("e5m2", "e4m3fn", "e4m3fnuz", "e3m2fn", "e2m1fn")]


def _all_codes(fmt) -> np.ndarray:
    """Every value of a format of at most 8 bits, as float32 (NaNs quiet)."""
    dtype = fmt.dtype
    codes = np.arange(2**fmt.bits, dtype=np.uint8).view(dtype)
    return quiet(codes.astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
@pytest.mark.parametrize("op", BINARY)
def test_every_pair_of_codes_of_small_formats(op, fmt):
    v = _all_codes(fmt)
    a, b = (x.ravel() for x in np.meshgrid(v, v))
    got = jax.jit(getattr(ops32, op), static_argnums=2)(a, b, fmt)
    assert_same_bits(got, reference(op, a, b, fmt=fmt), a, b, what=f"{op} {fmt.name}")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [get_format("e2m1fn"), get_format("e3m2fn")], ids=lambda f: f.name)
def test_fma_on_every_triple_of_codes(fmt):
    v = _all_codes(fmt)
    a, b, c = (x.ravel() for x in np.meshgrid(v, v, v))
    got = jax.jit(ops32.fma, static_argnums=3)(a, b, c, fmt)
    assert_same_bits(got, reference("fma", a, b, c, fmt=fmt), a, b, c, what=f"fma {fmt.name}")


@pytest.mark.slow
@pytest.mark.parametrize("op", ALL_OPS)
def test_every_bf16_value_against_random_float32(op):
    """Each of the 2**16 bf16 codes with 16 arbitrary float32 partners, rounded to bf16."""
    v = quiet(np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32))
    rng = np.random.default_rng(7)
    a = np.repeat(v, 16)
    others = [float32_bits(a.size, rng) for _ in range(2 if op == "fma" else 1)]
    operands = [a, *others]
    got = jax.jit(getattr(ops32, op), static_argnums=len(operands))(*operands, BF16)
    assert_same_bits(got, reference(op, *operands, fmt=BF16), *operands, what=op)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("op", ALL_OPS)
def test_many_more_operands_under_jit(op, fmt):
    for seed in range(10, 14):
        operands = operands_for(op, fmt, seed=seed)
        n = len(operands)
        fn = jax.jit(getattr(ops32, op), static_argnums=n)
        got = fn(*(jnp.asarray(x) for x in operands), fmt)
        assert_same_bits(got, reference(op, *operands, fmt=fmt), *operands, what=op)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["add", "mul", "div", "fma"])
def test_random_float32_operands_to_fp32_and_bf16(op):
    rng = np.random.default_rng(6)
    n = 1 << 20
    operands = [float32_bits(n, rng) for _ in range(3 if op == "fma" else 2)]
    for fmt in (FP32, get_format("bf16")):
        got = jax.jit(getattr(ops32, op), static_argnums=len(operands))(*operands, fmt)
        assert_same_bits(got, reference(op, *operands, fmt=fmt), *operands, what=op)
