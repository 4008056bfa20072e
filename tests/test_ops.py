"""The emulated op layer against exact rational arithmetic, bit for bit.

Each op's result must equal the exact result (Fraction; 60-digit Decimal for exp)
rounded once to the output format, for operands of mixed formats.
"""

import decimal
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_jax import BF16, E4M3FN, FP16, FP32, FP64, custom, ops
from fa_jax import testing as fst
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked

from conftest import x64_enabled
from oracle import round_exact


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
    return st.lists(st.tuples(fst.representable(fa, **finite), fst.representable(fb, **finite)),
                    min_size=1, max_size=N)


def as_arrays(pairs):
    pairs = pairs + [pairs[-1]] * (N - len(pairs))  # one shape: one compile per combo
    a, b = (np.array(c, np.float64) for c in zip(*pairs))
    return a, b


def exact(op, a, b):
    fa, fb = Fraction(float(a)), Fraction(float(b))
    return {"add": fa + fb, "sub": fa - fb, "mul": fa * fb, "div": fa / fb if fb else None,
            "maximum": max(fa, fb)}[op]


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
        assert (math.isnan(want) and math.isnan(g)) or np.float64(want).view(np.uint64) == np.float64(g).view(np.uint64), (
            f"{op}({x!r}, {y!r}) -> {fmt.name}: want {want!r}, got {g!r}")


OPS = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div, "maximum": ops.maximum}
compiled = {name: jax.jit(fn, static_argnums=2) for name, fn in OPS.items()}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f.name for f in c))
@pytest.mark.parametrize("op", sorted(OPS))
@settings(max_examples=25)
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


def test_div_resolves_midpoint_quotients():
    """Quotients whose float64 value is a midpoint of the target but whose exact value
    is not (found by search), against the oracle."""
    rng = np.random.default_rng(0)
    a = np.asarray(ops.cast(jnp.asarray(rng.standard_normal(200000)), FP32))
    b = np.asarray(ops.cast(jnp.asarray(rng.standard_normal(200000)), FP32))
    q = a / b
    lo = np.asarray(ops.cast(jnp.asarray(q), custom(8, 6)))  # BF16 with 6 bits: many ties
    got = np.asarray(ops.div(a, b, custom(8, 6)))
    checked = 0
    for i in np.flatnonzero(lo != q)[:400]:
        want = round_exact(Fraction(float(a[i])) / Fraction(float(b[i])), custom(8, 6))
        assert got[i] == want, (a[i], b[i], got[i], want)
        checked += 1
    assert checked == 400


def test_exp_matches_a_60_digit_reference():
    decimal.getcontext().prec = 60
    rng = np.random.default_rng(1)
    for fmt in (BF16, FP16, FP32, E4M3FN):
        x = np.asarray(ops.cast(jnp.asarray(rng.uniform(-20, 5, 2000)), fmt))
        got = np.asarray(ops.exp(x, fmt))
        for xi, gi in zip(x, got):
            want = round_exact(Fraction(decimal.Decimal(float(xi)).exp()), fmt)
            assert gi == want, (fmt.name, xi, gi, want)


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
        chunks = [sum(terms[i:i + 8], Fraction(0)) for i in range(0, len(terms), 8)]
        assert c == sequential_reference(chunks, fmt)
        assert e == round_exact(sum(terms, Fraction(0)), fmt)  # float64 sum is exact here


@pytest.mark.parametrize("model", [SEQUENTIAL, chunked(4), EXACT], ids=str)
def test_matmul_models_against_exact_loops(model):
    rng = np.random.default_rng(3)
    a = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 3, 10))), BF16))
    b = np.asarray(ops.cast(jnp.asarray(rng.standard_normal((2, 10, 4))), BF16))
    got = np.asarray(ops.matmul(a, b, BF16, accumulation=model))
    for i in np.ndindex(got.shape):
        terms = [Fraction(float(a[i[0], i[1], t])) * Fraction(float(b[i[0], t, i[2]])) for t in range(10)]
        if model.kind == "sequential":
            want = sequential_reference(terms, BF16)
        elif model.kind == "chunked":
            want = sequential_reference([sum(terms[j:j + 4], Fraction(0)) for j in range(0, 10, 4)], BF16)
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
    with pytest.raises(TypeError, match="expected float64 carrier arrays"):
        ops.add(np.ones(2, np.float32), np.ones(2, np.float32), BF16)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        ops.matmul(np.ones((2, 3)), np.ones((4, 2)), BF16)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="jax_enable_x64"):
            ops.carrier(np.ones(2, np.float32))
    finally:
        jax.config.update("jax_enable_x64", previous)
