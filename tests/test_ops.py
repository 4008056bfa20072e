"""The emulated op layer against exact rational arithmetic, bit for bit.

Each op's result must equal the exact result (Fraction; 60-digit Decimal for exp)
rounded once to the output format, for operands of mixed formats.
"""

import builtins
import decimal
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import round_exact

from fa_jax import BF16, E4M3FN, FP16, FP32, FP64, Format, custom, ops
from fa_jax import accumulation as acc
from fa_jax import testing as fst
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked, tensor_core, tensor_core_model


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


# (operand format a, operand format b, result format): mixed on purpose.
COMBOS = [
    (BF16, BF16, BF16),
    (FP32, FP32, BF16),
    (FP32, BF16, FP16),
    (FP16, FP32, FP32),
    (E4M3FN, BF16, E4M3FN),
    (custom(5, 4), FP32, custom(4, 2)),
]
N = 64


def operands(fa, fb):
    finite = dict(allow_nan=False, allow_infinity=False)
    return st.lists(
        st.tuples(fst.representable(fa, **finite), fst.representable(fb, **finite)),
        min_size=1,
        max_size=N,
    )


def as_arrays(pairs):
    pairs = pairs + [pairs[-1]] * (N - len(pairs))  # one shape: one compile per combo
    a, b = (np.array(c, np.float64) for c in zip(*pairs))
    return a, b


def exact(op, a, b):
    fa, fb = Fraction(float(a)), Fraction(float(b))
    return {
        "add": fa + fb,
        "sub": fa - fb,
        "mul": fa * fb,
        "div": fa / fb if fb else None,
        "maximum": max(fa, fb),
    }[op]


def _ieee_zero_is_negative(op, x, y) -> bool:
    """IEEE 754 sign of an exact zero result (round to nearest)."""
    sx, sy = math.copysign(1, x) < 0, math.copysign(1, y) < 0
    if op in ("mul", "div"):
        return sx != sy
    if op == "add":
        return sx and sy  # x + (-x) = +0; -0 + -0 = -0
    if op == "sub":
        return sx and not sy
    return False


def check(op, pairs, fmt, got):
    a, b = as_arrays(pairs)
    for x, y, g in zip(a, b, np.asarray(got)):
        v = exact(op, x, y)
        if v is None:  # division by zero: IEEE results from the float64 quotient
            continue
        want = round_exact(v, fmt, negative_zero=_ieee_zero_is_negative(op, x, y))
        if op == "maximum" and want == 0:  # max(-0, +0) may be either zero
            assert g == 0, (x, y, g)
            continue
        assert (math.isnan(want) and math.isnan(g)) or np.float64(want).view(
            np.uint64
        ) == np.float64(g).view(np.uint64), (
            f"{op}({x!r}, {y!r}) -> {fmt.name}: want {want!r}, got {g!r}"
        )


OPS = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div, "maximum": ops.maximum}
compiled = {name: jax.jit(fn, static_argnums=2) for name, fn in OPS.items()}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f.name for f in c))
@pytest.mark.parametrize("op", sorted(OPS))
@settings(max_examples=max(5, settings.default.max_examples * 5 // 12))  # 25 in "ci"
@given(data=st.data())
def test_binary_ops_round_the_exact_result_once(op, combo, data):
    fa, fb, fout = combo
    pairs = data.draw(operands(fa, fb))
    if op == "div":
        pairs = [(x, y) for x, y in pairs if y != 0] or [(1.0, 3.0)]
    a, b = as_arrays(pairs)
    check(op, pairs, fout, compiled[op](a, b, fout))


def test_add_resolves_float64_midpoints():
    """1 + (2**-8 + 2**-60): float64 gives exactly 1 + 2**-8, a BF16 midpoint; the
    exact sum lies above it, so it rounds up, not to even."""
    a = np.array([1.0, 1.0, -1.0, 1.0])
    b = np.array([2.0**-8 + 2.0**-60, -(2.0**-9 + 2.0**-61), -(2.0**-8 + 2.0**-60), 2.0**-8])
    got = np.asarray(ops.add(a, b, BF16))
    np.testing.assert_array_equal(got, [1 + 2.0**-7, 1 - 2.0**-8, -(1 + 2.0**-7), 1.0])


DIV_FORMATS = [BF16, FP16, E4M3FN, custom(5, 4)]


def _midpoints(rng, fmt, n):
    """n midpoints (lo + hi) / 2 of neighbours of fmt, both signs, from the
    subnormals to max."""
    tiny = 2.0 ** (fmt.emin - fmt.man_bits)
    mags = np.exp(rng.uniform(np.log(tiny), np.log(fmt.max), n))
    out = []
    for x in mags * rng.choice([-1.0, 1.0], n):
        lo, hi = round_exact(float(x), fmt, "down"), round_exact(float(x), fmt, "up")
        if lo != hi and math.isfinite(lo) and math.isfinite(hi):
            out.append((lo + hi) / 2)
    return np.array(out)


def _assert_div_is_exactly_rounded(a, b, fmt):
    got = np.asarray(ops.div(a, b, fmt))
    for x, y, g in zip(a, b, got):
        want = round_exact(Fraction(float(x)) / Fraction(float(y)), fmt)
        assert g == want, (fmt.name, x, y, g, want)


@pytest.mark.parametrize("fmt", DIV_FORMATS, ids=lambda f: f.name)
def test_div_rounds_exact_midpoint_quotients_to_even(fmt):
    """a / b exactly a midpoint m of fmt (a = m * b, b an FP32 value, both signs):
    ties to even."""
    rng = np.random.default_rng(10)
    m = _midpoints(rng, fmt, 400)
    b = np.array(ops.cast(jnp.asarray(rng.uniform(1, 2, m.size)), FP32))
    b *= rng.choice([-1.0, 1.0], m.size) * 2.0 ** rng.integers(-6, 7, m.size)
    a = m * b  # exact: <= man_bits + 2 bits times 24 bits
    exact_midpoints = sum(
        Fraction(float(x)) / Fraction(float(y)) == Fraction(float(v)) for x, y, v in zip(a, b, m)
    )
    assert exact_midpoints == m.size > 100
    _assert_div_is_exactly_rounded(a, b, fmt)


@pytest.mark.parametrize("fmt", DIV_FORMATS, ids=lambda f: f.name)
def test_div_resolves_quotients_that_float64_rounds_onto_a_midpoint(fmt):
    """a / b a hair above or below a midpoint m of fmt, where the float64 quotient
    is m: a is one float64 ulp off fl(m * b), with b a full float64 significand
    (a divisor of <= 27 bits never gives such a quotient: the fix's branch).
    Without the fix half of them round to even, the wrong way."""
    rng = np.random.default_rng(11)
    m = _midpoints(rng, fmt, 1500)
    b = rng.uniform(1, 2, m.size) * rng.choice([-1.0, 1.0], m.size)
    b *= 2.0 ** rng.integers(-6, 7, m.size)
    step = rng.choice([-np.inf, np.inf], m.size)
    a = np.nextafter(m * b, step)
    false_midpoint = a / b == m
    a, b, m = a[false_midpoint], b[false_midpoint], m[false_midpoint]
    above = sum(
        Fraction(float(x)) / Fraction(float(y)) > Fraction(float(v)) for x, y, v in zip(a, b, m)
    )
    below = sum(
        Fraction(float(x)) / Fraction(float(y)) < Fraction(float(v)) for x, y, v in zip(a, b, m)
    )
    assert above > 10 and below > 10 and above + below == m.size, (above, below)
    _assert_div_is_exactly_rounded(a, b, fmt)


def _near_midpoint_products(rng, fmt, n):
    """(a, b) with a full float64 significand each and fl64(a * b) exactly a midpoint
    of fmt, while the exact product lies above, below or on it."""
    m = _midpoints(rng, fmt, n)
    b = rng.uniform(1, 2, m.size) * 2.0 ** rng.integers(-6, 7, m.size)
    a = m / b
    a = a + rng.integers(-2, 3, a.size) * np.spacing(a)
    keep = (a * b == m) & (m != 0)
    return a[keep], b[keep]


@pytest.mark.parametrize("fmt", DIV_FORMATS, ids=lambda f: f.name)
def test_mul_of_full_float64_operands_rounds_once(fmt):
    """Operands of 53 bits (a stage raised to FP64 feeding a narrower one): the float64
    product lands on a midpoint of fmt while the exact product does not; rounding
    that product again would go to even, half the time the wrong way."""
    rng = np.random.default_rng(12)
    a, b = _near_midpoint_products(rng, fmt, 1500)
    exact_products = [Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a, b)]
    off_midpoint = sum(v != Fraction(float(x * y)) for v, x, y in zip(exact_products, a, b))
    assert off_midpoint > 100, off_midpoint
    for fn in (ops.mul, compiled["mul"]):
        got = np.asarray(fn(a, b, fmt))
        want = np.array([round_exact(v, fmt) for v in exact_products])
        np.testing.assert_array_equal(got, want)


def test_mul_and_div_of_operands_at_float64_extremes():
    """Significands are split after frexp, so operands near float64's range limits
    (whose Veltkamp split would overflow) still give exact results."""
    big, small = 2.0**1000 * 1.3, 2.0**-1000 * 1.7
    for fmt in (BF16, FP32):
        got = np.asarray(ops.mul(np.array([big, -big]), np.array([small, small]), fmt))
        want = [round_exact(s * Fraction(big) * Fraction(small), fmt) for s in (1, -1)]
        np.testing.assert_array_equal(got, want)
        got = np.asarray(ops.div(np.array([big]), np.array([2.0**990 * 1.1]), fmt))
        np.testing.assert_array_equal(
            got, [round_exact(Fraction(big) / Fraction(2.0**990 * 1.1), fmt)]
        )


@pytest.mark.parametrize("fmt", DIV_FORMATS, ids=lambda f: f.name)
def test_div_by_full_float64_divisors_resolves_midpoints(fmt):
    """a and b with full float64 significands and fl64(a / b) a midpoint of fmt: the
    residual a - q b is not exact in float64, so its sign comes from Dekker's product."""
    rng = np.random.default_rng(13)
    m = _midpoints(rng, fmt, 1500)
    b = rng.uniform(1, 2, m.size) * rng.choice([-1.0, 1.0], m.size)
    a = m * b
    a = a + rng.integers(-3, 4, a.size) * np.spacing(a)
    keep = (a / b == m) & (m != 0)
    a, b, m = a[keep], b[keep], m[keep]
    off_midpoint = sum(Fraction(float(x)) / Fraction(float(y)) != v for x, y, v in zip(a, b, m))
    assert off_midpoint > 100, off_midpoint
    _assert_div_is_exactly_rounded(a, b, fmt)
    want = [round_exact(Fraction(float(x)) / Fraction(float(y)), fmt) for x, y in zip(a, b)]
    np.testing.assert_array_equal(np.asarray(compiled["div"](a, b, fmt)), want)


# (format, divisor format) with P_fmt + P_divisor <= 53: the last pair exactly 53.
ROUNDS_ONCE = [(BF16, BF16), (FP16, FP32), (FP32, FP32), (custom(8, 28), FP32)]


def _near_midpoint_quotients(rng, fmt, divisor, n):
    """(a, b): b values of ``divisor``, a = fl64(m b) and up to 3 float64 ulps either
    side for midpoints m of fmt, so that a / b is m or lies a hair from it."""
    m = _midpoints(rng, fmt, n)
    b = rng.uniform(1, 2, m.size) * rng.choice([-1.0, 1.0], m.size)
    b = np.asarray(ops.cast(jnp.asarray(b * 2.0 ** rng.integers(-6, 7, m.size)), divisor))
    a = m * b
    return a + rng.integers(-3, 4, a.size) * np.spacing(a), b


@pytest.mark.parametrize("fmt, divisor", ROUNDS_ONCE, ids=lambda f: f.name)
def test_a_stated_divisor_format_rounds_the_quotient_once(fmt, divisor):
    """With b's format stated and P_fmt + P_divisor <= 53, ops.div rounds the float64
    quotient once (ops._quotient_rounds_once, proved in its docstring): exact on
    quotients that are midpoints of fmt and on those a few ulps from one, eagerly
    and under jit."""
    assert ops._quotient_rounds_once(fmt, divisor)
    rng = np.random.default_rng(14)
    a, b = _near_midpoint_quotients(rng, fmt, divisor, 1500)
    exact_q = [Fraction(float(x)) / Fraction(float(y)) for x, y in zip(a, b)]
    assert sum(q == Fraction(float(x / y)) for q, x, y in zip(exact_q, a, b)) > 100
    want = np.array([round_exact(q, fmt) for q in exact_q])
    divide = jax.jit(lambda x, y: ops.div(x, y, fmt, divisor=divisor))
    for got in (ops.div(a, b, fmt, divisor=divisor), divide(a, b)):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(
    "fmt, divisor", [(BF16, FP64), (custom(8, 28), custom(8, 24)), (BF16, custom(11, 10))]
)
def test_a_divisor_too_wide_keeps_the_midpoint_fix(fmt, divisor):
    """P_fmt + P_divisor > 53, or a divisor format reaching float64's subnormals: the
    quotient may round onto a midpoint, and the fix stays (full float64 divisors
    that give such quotients are resolved exactly)."""
    assert not ops._quotient_rounds_once(fmt, divisor)
    if divisor is not FP64:
        return
    rng = np.random.default_rng(15)
    m = _midpoints(rng, fmt, 1500)
    b = rng.uniform(1, 2, m.size) * rng.choice([-1.0, 1.0], m.size)
    a = m * b + rng.integers(-3, 4, m.size) * np.spacing(m * b)
    keep = (a / b == m) & (m != 0)
    a, b = a[keep], b[keep]
    want = [round_exact(Fraction(float(x)) / Fraction(float(y)), fmt) for x, y in zip(a, b)]
    assert sum(w != r for w, r in zip(want, np.asarray(ops.cast(jnp.asarray(a / b), fmt)))) > 10
    np.testing.assert_array_equal(np.asarray(ops.div(a, b, fmt, divisor=divisor)), want)


@pytest.mark.parametrize("jit", [False, True])
def test_float32_carriers_go_to_ops32_with_the_same_bits(jit):
    """The elementwise ops take float32 carriers too (fa_jax.carrier32.elementwise, no float64 in
    their programs): the same bits as the float64 carrier's."""
    rng = np.random.default_rng(5)
    a, b, c = (np.asarray(ops.cast(jnp.asarray(rng.normal(0, 4, 64)), BF16)) for _ in range(3))
    calls = {
        "cast": lambda x, y, z: ops.cast(x, E4M3FN),
        "add": lambda x, y, z: ops.add(x, y, BF16),
        "sub": lambda x, y, z: ops.sub(x, y, FP16),
        "mul": lambda x, y, z: ops.mul(x, y, BF16),
        "fma": lambda x, y, z: ops.fma(x, y, z, FP32),
        "div": lambda x, y, z: ops.div(x, y, BF16),
        "maximum": lambda x, y, z: ops.maximum(x, y, BF16),
    }
    for name, call in calls.items():
        fn = jax.jit(call) if jit else call
        want = np.asarray(fn(a, b, c))
        got = np.asarray(fn(*(t.astype(np.float32) for t in (a, b, c))))
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=name)


def test_exp_matches_a_60_digit_reference():
    decimal.getcontext().prec = 60
    rng = np.random.default_rng(1)
    for fmt in (BF16, FP16, FP32, E4M3FN):
        x = np.asarray(ops.cast(jnp.asarray(rng.uniform(-20, 5, 2000)), fmt))
        got = np.asarray(ops.exp(x, fmt))
        for xi, gi in zip(x, got):
            want = round_exact(Fraction(decimal.Decimal(float(xi)).exp()), fmt)
            assert gi == want, (fmt.name, xi, gi, want)


def test_exp2_matches_a_60_digit_reference():
    decimal.getcontext().prec = 60
    ln2 = decimal.Decimal(2).ln()
    rng = np.random.default_rng(2)
    for fmt in (BF16, FP16, FP32, E4M3FN):
        x = np.asarray(ops.cast(jnp.asarray(rng.uniform(-28, 7, 2000)), fmt))
        got = np.asarray(ops.exp2(x, fmt))
        for xi, gi in zip(x, got):
            want = round_exact(Fraction((decimal.Decimal(float(xi)) * ln2).exp()), fmt)
            assert gi == want, (fmt.name, xi, gi, want)
    # integers: exact powers of two, subnormal ones too
    np.testing.assert_array_equal(
        np.asarray(ops.exp2(jnp.array([-133.0, -1.0, 0.0, 5.0]), BF16)), [2.0**-133, 0.5, 1, 32]
    )


def sequential_reference(terms, fmt):
    acc = Fraction(0)
    for t in terms:
        acc = Fraction(round_exact(acc + t, fmt))
    return float(acc)


@pytest.mark.parametrize("fmt", [BF16, FP16, FP32], ids=lambda f: f.name)
def test_sum_models_against_exact_loops(fmt):
    rng = np.random.default_rng(2)
    x = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((8, 37)) * 10), fmt))
    seq = np.asarray(ops.sum(x, fmt, accumulation=SEQUENTIAL))
    ch = np.asarray(ops.sum(x, fmt, accumulation=chunked(8)))
    ex = np.asarray(ops.sum(x, fmt, accumulation=EXACT))
    for row, s, c, e in zip(x, seq, ch, ex):
        terms = [Fraction(float(t)) for t in row]
        assert s == sequential_reference(terms, fmt)
        chunks = [sum(terms[i : i + 8], Fraction(0)) for i in range(0, len(terms), 8)]
        assert c == sequential_reference(chunks, fmt)
        assert e == round_exact(sum(terms, Fraction(0)), fmt)  # float64 sum is exact here


@pytest.mark.parametrize("model", [SEQUENTIAL, chunked(4), EXACT], ids=str)
def test_matmul_models_against_exact_loops(model):
    rng = np.random.default_rng(3)
    a = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 3, 10))), BF16))
    b = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 10, 4))), BF16))
    got = np.asarray(ops.matmul(a, b, BF16, accumulation=model))
    for i in np.ndindex(got.shape):
        terms = [
            Fraction(float(a[i[0], i[1], t])) * Fraction(float(b[i[0], t, i[2]])) for t in range(10)
        ]
        if model.kind == "sequential":
            want = sequential_reference(terms, BF16)
        elif model.kind == "chunked":
            want = sequential_reference(
                [sum(terms[j : j + 4], Fraction(0)) for j in range(0, 10, 4)], BF16
            )
        else:
            want = round_exact(sum(terms, Fraction(0)), BF16)
        assert got[i] == want, (i, got[i], want)


def test_fp64_ops_are_plain_float64():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal(1000), rng.standard_normal(1000)
    np.testing.assert_array_equal(np.asarray(ops.add(a, b, FP64)), a + b)
    np.testing.assert_array_equal(np.asarray(ops.div(a, b, FP64)), a / b)
    np.testing.assert_array_equal(np.asarray(ops.mul(a, b, FP64)), a * b)


def test_inf_and_nan_pass_through():
    a = np.array([np.inf, -np.inf, np.nan, 1.0, 1.0])
    b = np.array([1.0, 1.0, 1.0, np.inf, -np.inf])
    got = np.asarray(ops.add(a, b, BF16))
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])
    assert got[3] == np.inf and got[4] == -np.inf
    assert np.asarray(ops.sub(np.array([-np.inf]), np.array([3.0]), BF16))[0] == -np.inf


def test_errors():
    with pytest.raises(TypeError, match="expected float64 or float32 carrier arrays"):
        ops.exp(np.ones(2, np.int32), BF16)
    with pytest.raises(TypeError, match="expected operands of one carrier"):
        ops.add(np.ones(2, np.float32), np.ones(2), BF16)
    with pytest.raises(TypeError, match="expected operands of one carrier"):
        ops.matmul(np.ones((2, 2), np.float32), np.ones((2, 2)), BF16)
    with pytest.raises(TypeError, match="expected float64 or float32 carrier arrays"):
        ops.add(np.ones(2, np.int32), np.ones(2, np.int32), BF16)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        ops.matmul(np.ones((2, 3)), np.ones((4, 2)), BF16)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="jax_enable_x64"):
            ops.carrier(np.ones(2, np.float32), np.float64)
        assert ops.carrier(np.ones(2, np.float32)).dtype == np.float32  # "auto" without x64
    finally:
        jax.config.update("jax_enable_x64", previous)


# -- the tensor-core accumulation model (fa_jax.accumulation) -----------------------


def _floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > v else e


def tensor_core_reference(terms, fmt, model) -> float:
    """The tensor-core model written out term by term in rational arithmetic
    (fa_jax/accumulation.py, "The tensor-core model"): blocks of k, the
    accumulator c joining the block (fused) or added after it with fl(c + d).
    Once c is ±inf or NaN, IEEE arithmetic carries on: a fused block of finite
    terms keeps it; an unfused block result d is added in float (inf + finite =
    inf, inf + -inf = NaN)."""
    c = Fraction(0)
    for i in range(0, len(terms), model.chunk):
        block = list(terms[i : i + model.chunk])
        if isinstance(c, float) and model.fused_accumulator:
            continue
        T = ([c] if model.fused_accumulator else []) + block
        nonzero = [t for t in T if t != 0]
        if nonzero:
            e_max = max(max(_floor_log2(abs(t)), fmt.emin) for t in nonzero)
            q = Fraction(2) ** (e_max - fmt.man_bits - model.extra_bits)
            S = sum(((abs(t) // q) * q * (1 if t > 0 else -1) for t in T), Fraction(0))
        else:
            S = Fraction(0)
        d = round_exact(S, fmt, model.normalization)
        if not model.fused_accumulator:
            if isinstance(c, float) or math.isinf(d):
                d = float(c) + d
            else:
                d = round_exact(c + Fraction(d), fmt)
        c = d if not math.isfinite(d) else Fraction(d)
    return float(c)


TC_MODELS = [
    tensor_core("v100"),
    tensor_core("a100"),
    tensor_core_model(3, extra_bits=1, normalization="nearest_even", fused_accumulator=False),
]


def _bits(x):
    return np.asarray(x, np.float64).view(np.uint64)


def _spread(rng, shape, fmt):
    """Values of fmt with magnitudes over 2**-12..2**6, signs mixed, some zeros:
    alignment shifts and cancellations at every block."""
    x = rng.choice([-1.0, 1.0], shape) * 2.0 ** rng.uniform(-12, 6, shape)
    x[rng.random(shape) < 0.1] = 0.0
    return np.asarray(ops.cast(jnp.asarray(x), fmt))


@pytest.mark.parametrize("model", TC_MODELS, ids=str)
@pytest.mark.parametrize("infmt", [BF16, FP16], ids=lambda f: f.name)
def test_tensor_core_matmul_matches_the_rational_model(model, infmt):
    rng = np.random.default_rng(7)
    a, b = _spread(rng, (2, 3, 19), infmt), _spread(rng, (19, 4), infmt)
    got = np.asarray(ops.matmul(a, b, FP32, accumulation=model))
    assert (got != np.asarray(ops.matmul(a, b, FP32))).any()  # the model shows
    for i in np.ndindex(got.shape):
        terms = [Fraction(float(a[i[0], i[1], t])) * Fraction(float(b[t, i[2]])) for t in range(19)]
        want = tensor_core_reference(terms, FP32, model)
        assert _bits(got[i]) == _bits(want), (i, got[i], want)


@pytest.mark.parametrize("model", TC_MODELS, ids=str)
@pytest.mark.parametrize("acc", [FP32, BF16], ids=lambda f: f.name)
@settings(max_examples=settings.default.max_examples // 2)  # 30 in "ci"
@given(data=st.data())
def test_tensor_core_sum_matches_the_rational_model(model, acc, data):
    """Values over bf16's whole finite range (subnormals, overflow of the sum)."""
    finite = {"allow_nan": False, "allow_infinity": False}
    xs = data.draw(st.lists(fst.representable(BF16, **finite), min_size=1, max_size=N))
    x = np.array(xs + [0.0] * (N - len(xs)))  # zeros change nothing: one shape
    got = _tc_sum[(str(model), acc.name)](x)
    want = tensor_core_reference([Fraction(float(v)) for v in x], acc, model)
    assert _bits(got) == _bits(want), (xs, float(got), want)


_tc_sum = {
    (str(m), f.name): jax.jit(lambda x, m=m, f=f: ops.sum(x, f, accumulation=m))
    for m in TC_MODELS
    for f in (FP32, BF16)
}


_sum8 = jax.jit(ops.sum, static_argnames=("fmt", "accumulation"))  # 8 terms, zero padded


def test_tensor_core_differs_from_exact_where_truncation_matters():
    """1 - (1 - 2**-24): aligned to 1 without extra bits, the 2**-24 of the second
    term is truncated (V100: 2**-23); three extra bits keep it (A100: 2**-24 = exact)."""
    x = np.array([1.0, -(1 - 2.0**-24)] + [0.0] * 6)
    assert _sum8(x, fmt=FP32, accumulation=EXACT) == 2.0**-24
    assert _sum8(x, fmt=FP32, accumulation=tensor_core("v100")) == 2.0**-23
    assert _sum8(x, fmt=FP32, accumulation=tensor_core("a100")) == 2.0**-24
    # Round toward zero in the normalisation: 2 + 3 * 2**-24 -> 2 (exact model: 2 + 2**-22).
    a, b = np.array([[1.0, 1.0]]), np.array([[2.0], [3 * 2.0**-24]])
    assert ops.matmul(a, b, FP32)[0, 0] == 2 + 2.0**-22
    assert ops.matmul(a, b, FP32, accumulation=tensor_core("a100"))[0, 0] == 2.0


def test_tensor_core_jit_equals_eager():
    rng = np.random.default_rng(8)
    a, b = _spread(rng, (4, 16), BF16), _spread(rng, (16, 3), BF16)
    model = tensor_core("a100")
    eager = ops.matmul(a, b, FP32, accumulation=model)
    jitted = jax.jit(lambda a, b: ops.matmul(a, b, FP32, accumulation=model))(a, b)
    np.testing.assert_array_equal(_bits(jitted), _bits(eager))


def test_tensor_core_vmaps_over_traced_accumulator_widths():
    """One program over (exp_bits, man_bits) pairs equals a call per concrete format;
    FP64 is plain float64 (the exact model) and a too-wide format gives NaN."""
    rng = np.random.default_rng(9)
    a, b = _spread(rng, (3, 13), BF16), _spread(rng, (13, 2), BF16)
    widths = [(8, 7), (5, 10), (8, 23), (11, 52), (11, 48)]
    model = tensor_core("a100")

    def run(e, m, bias):
        return ops.matmul(a, b, Format("acc", e, m, bias=bias), accumulation=model)

    e, m = (jnp.array(w, jnp.int32) for w in zip(*widths))
    got = jax.jit(jax.vmap(run))(e, m, (1 << (e - 1)) - 1)
    for g, (ei, mi) in zip(got[:3], widths):
        want = ops.matmul(a, b, custom(ei, mi), accumulation=model)
        np.testing.assert_array_equal(_bits(g), _bits(want))
    np.testing.assert_array_equal(got[3], ops.matmul(a, b, FP64))
    assert np.isnan(np.asarray(got[4])).all()
    with pytest.raises(ValueError, match=r"span .* = 54 bits, expected <= 53"):
        ops.matmul(a, b, custom(11, 48), accumulation=model)


def test_tensor_core_special_values():
    v100 = tensor_core("v100")

    def tc_sum(*xs, fmt=FP32, model=v100):  # zeros pad to one shape: they change nothing
        x = np.array(xs + (0.0,) * (8 - len(xs)), np.float64)
        return float(_sum8(x, fmt=fmt, accumulation=model))

    assert tc_sum(np.inf, 1.0, -3.0) == np.inf
    assert tc_sum(1.0, 2.0, 3.0, 4.0, -np.inf) == -np.inf  # in the second block
    assert np.isnan(tc_sum(np.inf, 2.0, -np.inf))
    assert np.isnan(tc_sum(1.0, np.nan))
    assert np.isnan(
        float(ops.matmul(np.array([[np.inf]]), np.array([[0.0]]), FP32, accumulation=v100)[0, 0])
    )  # inf * 0
    zero = tc_sum(-0.0, -0.0, 1.0, -1.0, -0.0)
    assert zero == 0 and math.copysign(1, zero) == 1  # an exact zero sum is +0
    tiny = tc_sum(-(2.0**-150), model=tensor_core("a100"))  # -2**-150 -> toward zero: -0
    assert tiny == 0 and math.copysign(1, tiny) == -1
    # Overflow under round toward zero: max, as IEEE 754 directed rounding.
    assert tc_sum(60000.0, 60000.0, fmt=FP16) == 65504.0
    assert (
        tc_sum(60000.0, 60000.0, fmt=FP16, model=tensor_core_model(4, normalization="nearest_even"))
        == np.inf
    )


def test_tensor_core_unfused_overflows_of_opposite_signs_give_nan():
    # Found by hypothesis: one block overflows to -inf, a later one to +inf; the
    # unfused accumulate is an IEEE addition, so -inf + inf = NaN.
    model = TC_MODELS[2]
    x = np.array(
        [0.0] * 7
        + [-(2.0**127), -(2.0**127), 1.4488585154055583e38, 1.9539651538038263e38]
        + [0.0] * (N - 11)
    )
    got = _tc_sum[(str(model), "float32")](x)
    assert np.isnan(got)
    assert np.isnan(tensor_core_reference([Fraction(float(v)) for v in x], FP32, model))


@pytest.mark.parametrize("fmt", [BF16, FP16, E4M3FN, FP32, FP64], ids=lambda f: f.name)
def test_signed_zero_sums_follow_ieee(fmt):
    # Found by hypothesis: renormalising s + e with e = +0 turned -0 + -0 into +0.
    neg, pos = np.array([-0.0]), np.array([0.0])
    assert np.signbit(np.asarray(ops.add(neg, neg, fmt)))[0]  # -0 + -0 = -0
    assert np.signbit(np.asarray(ops.sub(neg, pos, fmt)))[0]  # -0 - +0 = -0
    assert not np.signbit(np.asarray(ops.add(neg, pos, fmt)))[0]  # -0 + +0 = +0
    assert not np.signbit(np.asarray(ops.add(np.array([1.5]), np.array([-1.5]), fmt)))[0]


FMA_COMBOS = [(BF16, FP32), (FP32, FP32), (FP16, BF16), (E4M3FN, custom(4, 2))]
fma_compiled = jax.jit(ops.fma, static_argnums=3)


@pytest.mark.parametrize("combo", FMA_COMBOS, ids=lambda c: "-".join(f.name for f in c))
@settings(max_examples=max(5, settings.default.max_examples * 5 // 12))
@given(data=st.data())
def test_fma_rounds_the_exact_result_once(combo, data):
    """fl(a b + c) against Fraction arithmetic, with c drawn near -a b so that
    cancellation and float64 midpoints are exercised."""
    infmt, outfmt = combo
    finite = dict(allow_nan=False, allow_infinity=False)
    triples = data.draw(
        st.lists(
            st.tuples(
                fst.representable(infmt, **finite),
                fst.representable(infmt, **finite),
                fst.representable(FP32, **finite),
                st.booleans(),
            ),
            min_size=N,
            max_size=N,
        )
    )
    a, b, c = (np.array(col, np.float64) for col in list(zip(*triples))[:3])
    near = np.array([t[3] for t in triples])
    with np.errstate(over="ignore"):
        shifted = -np.float64(np.float32(a * b)) + np.float64(np.float32(c * 2.0**-30))
    c = np.where(near & np.isfinite(shifted), shifted, c)
    got = np.asarray(fma_compiled(a, b, c, outfmt))
    for x, y, z, g in zip(a, b, c, got):
        v = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        negative_zero = v == 0 and math.copysign(1, x * y) < 0 and math.copysign(1, z) < 0
        want = round_exact(v, outfmt, negative_zero=negative_zero)
        assert np.float64(want).view(np.uint64) == np.float64(g).view(np.uint64), (
            f"fma({x!r}, {y!r}, {z!r}) -> {outfmt.name}: want {want!r}, got {g!r}"
        )


def test_fma_differs_from_mul_then_add_where_one_rounding_matters():
    """(1 + 2^-12)^2 - 1 in BF16: the unfused product rounds 2^-11 + 2^-24 away."""
    a = np.array([1 + 2.0**-12])
    got = np.asarray(ops.fma(a, a, np.array([-1.0]), FP32))
    unfused = np.asarray(ops.add(ops.mul(a, a, FP32), np.array([-1.0]), FP32))
    assert got[0] == 2.0**-11 + 2.0**-24
    assert unfused[0] == 2.0**-11


# -- summation trees (fa_jax.accumulation, "Summation trees") --------------------------

SLOW = pytest.mark.slow
TREE_BUILDERS = [
    pytest.param(acc.sequential(), marks=SLOW),
    acc.sequential(3),
    acc.pairwise(),
    pytest.param(acc.halving(), marks=SLOW),
    pytest.param(acc.fused(), marks=SLOW),
    acc.lanes(4),
    pytest.param(acc.lanes(8, "pairwise"), marks=SLOW),
    acc.lanes(4, "sequential", inner="pairwise"),
    pytest.param(acc.blocked(5, "fused", "pairwise"), marks=SLOW),
    pytest.param(acc.split_k(3, inner="halving"), marks=SLOW),
    acc.vector(4, inner=acc.sequential(from_zero=True)),
    pytest.param(acc.halves(4, "pairwise", align=2), marks=SLOW),
    acc.rounded_products(acc.split_k(2)),
    acc.tree(((0, 4), (1, (2, 3, 5)), 6)),
]
TREE_NS = (2, 13)  # 13: no multiple of the lanes, blocks or parts
TREE_NS_SLOW = (1, 7, 32, 100)


def tree_reference(leaves, model, fmt):
    """Walk the model's tree: a binary node of two binary32 values is numpy's IEEE
    binary32 addition, any other node the exact sum of its children rounded once."""
    vals = list(leaves)
    for node in acc.tree_nodes(model, len(leaves)):
        children = [vals[c] for c in node]
        if fmt == FP32 and len(node) == 2 and all(isinstance(c, np.float32) for c in children):
            vals.append(np.float32(children[0] + children[1]))
        else:
            exact_sum = builtins.sum((Fraction(float(c)) for c in children), Fraction(0))
            rounded = round_exact(exact_sum, fmt)
            vals.append(np.float32(rounded) if fmt == FP32 else rounded)
    return float(vals[-1]) if len(vals) > 1 else float(round_exact(Fraction(float(vals[0])), fmt))


@pytest.mark.parametrize(
    "sizes", [TREE_NS, pytest.param(TREE_NS_SLOW, marks=pytest.mark.slow)], ids=["", "more-n"]
)
@pytest.mark.parametrize("model", TREE_BUILDERS, ids=str)
def test_tree_sums_walk_the_same_tree_as_a_binary32_loop(model, sizes):
    rng = np.random.default_rng(7)
    if model.tree.order == "tree":  # an explicit tree has one size
        sizes = (7,)
    x = {n: np.asarray(ops.cast(jnp.asarray(rng.standard_normal((3, n)) * 8), FP32)) for n in sizes}
    run = jax.jit(lambda xs: {n: ops.sum(v, FP32, accumulation=model) for n, v in xs.items()})
    got = run(x)
    for n, rows in x.items():
        for row, g in zip(rows, np.asarray(got[n])):
            want = tree_reference([np.float32(v) for v in row], model, FP32)
            assert g == want, (str(model), n, g, want)


def test_tree_sum_eager_equals_jit_and_vmaps():
    model = acc.lanes(4, "pairwise", inner="sequential")
    x = np.asarray(
        ops.cast(jnp.asarray(np.random.default_rng(8).standard_normal((2, 3, 11))), BF16)
    )
    eager = np.asarray(ops.sum(x, BF16, accumulation=model))
    jitted = np.asarray(jax.jit(lambda v: ops.sum(v, BF16, accumulation=model))(x))
    mapped = np.asarray(jax.vmap(lambda v: ops.sum(v, BF16, accumulation=model))(x))
    assert np.array_equal(eager, jitted) and np.array_equal(eager, mapped)
    for i in np.ndindex(eager.shape):
        assert eager[i] == tree_reference([float(v) for v in x[i]], model, BF16)
    # Along another axis, as for the other models.
    along = np.asarray(ops.sum(np.moveaxis(x, -1, 0), BF16, axis=0, accumulation=model))
    assert np.array_equal(along, eager)


def test_tree_forms_of_the_other_models_agree_with_them():
    x = np.asarray(ops.cast(jnp.asarray(np.random.default_rng(9).standard_normal((4, 37))), FP32))
    pairs = [(acc.sequential(), SEQUENTIAL), (acc.sequential(8), chunked(8)), (acc.fused(), EXACT)]
    run = jax.jit(
        lambda x: [
            (ops.sum(x, FP32, accumulation=t), ops.sum(x, FP32, accumulation=m)) for t, m in pairs
        ]
    )
    for (tree_model, _), (got, want) in zip(pairs, run(x)):
        assert np.array_equal(np.asarray(got), np.asarray(want)), tree_model


@pytest.mark.parametrize("model", [acc.lanes(4, "halving"), acc.split_k(2, "pairwise")], ids=str)
def test_tree_matmul_sums_the_exact_products_by_the_tree(model):
    rng = np.random.default_rng(10)
    a = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 3, 10))), FP32))
    b = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 10, 4))), FP32))
    c = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 3, 4))), FP32))
    run = jax.jit(
        lambda a, b, c: (
            ops.matmul(a, b, FP32, accumulation=model),
            ops.matmul(a, b, FP32, accumulation=model, initial=c),
        )
    )
    got, with_c = (np.asarray(v) for v in run(a, b, c))
    for i in np.ndindex(got.shape):
        products = [
            Fraction(float(a[i[0], i[1], t])) * Fraction(float(b[i[0], t, i[2]])) for t in range(10)
        ]
        assert got[i] == tree_reference(products, model, FP32), i
        assert with_c[i] == tree_reference([Fraction(float(c[i])), *products], model, FP32), i


def test_initial_value_starts_every_accumulator():
    rng = np.random.default_rng(11)
    a, b, c = (
        np.asarray(ops.cast(jnp.asarray(rng.standard_normal(s)), BF16))
        for s in ((3, 9), (9, 2), (3, 2))
    )
    products = a[:, None, :] * np.swapaxes(b, 0, 1)[None]  # exact: (3, 2, 9)
    models = (SEQUENTIAL, EXACT, tensor_core("v100"))

    def run(a, b, c, products):
        out = []
        for model in models:
            got = ops.matmul(a, b, FP32, accumulation=model, initial=c)
            if model.kind == "tensor_core":  # C joins the first block, not as a term
                want = ops.sum(products, FP32, accumulation=model, initial=c)
            else:  # C + a @ b as a sum whose first term is C
                terms = jnp.concatenate([c[..., None], products], -1)
                want = ops.sum(terms, FP32, accumulation=model)
            out.append((got, want))
        return out

    for model, (got, want) in zip(models, jax.jit(run)(a, b, c, products)):
        assert np.array_equal(np.asarray(got), np.asarray(want)), model


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("model", ["sequential", "chunked(4)"])
def test_an_empty_sum_is_its_start_eagerly_as_under_jit(model, dtype):
    """No terms: the accumulator's start (0, or ``initial``), op by op as in the
    compiled program (eagerly, ``lax.scan`` refuses a scan of length zero), on
    both carriers."""
    x = np.zeros((0, 3), dtype)
    for initial in (None, np.array([1.0, -2.5, 0.375], dtype)):
        run = lambda x, i=initial: ops.sum(x, BF16, axis=0, accumulation=model, initial=i)  # noqa: E731
        jitted = np.asarray(jax.jit(run)(x))
        with jax.disable_jit():
            eager = np.asarray(run(x))
        np.testing.assert_array_equal(eager, jitted)
        np.testing.assert_array_equal(jitted, np.zeros(3) if initial is None else initial)
