"""The float32-carrier reductions against the float64 op layer and an exact oracle.

``fa_jax.carrier32.sums.sum`` / ``matmul`` must give the bits of ``fa_jax.ops.sum`` /
``matmul`` on float64 carriers for every accumulation model, and for "exact" the
exact sum (``fractions.Fraction``) rounded once: huge cancellation, ties broken
by a tiny last term, subnormal terms and results, signed zeros, inf and NaN.
The programs hold no 64-bit type, with ``jax_enable_x64`` on or off.
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import wide_tensors, x64_enabled
from oracle import exact_matmul, exactly_rounded_matmul, round_exact

from fa_jax import custom, get_format, ops
from fa_jax.carrier32 import sums as sum32
from fa_jax.rounding import round_to

FP32, BF16, FP16 = get_format("fp32"), get_format("bf16"), get_format("fp16")
E4M3FN = get_format("e4m3fn")
MODELS = [
    "exact",
    "sequential",
    "chunked(4)",
    "chunked(1)",
    "tensor_core(v100)",
    "tensor_core(a100)",
    "tensor_core(a100_tf32)",
    "tensor_core(k=4, extra_bits=3, normalization=nearest_even)",
    "tensor_core(k=4, extra_bits=2, normalization=up, fused_accumulator=false)",
    "tensor_core(k=3, extra_bits=0, normalization=down)",
    "tree(pairwise)",
    "tree(halving)",
    "tree(fused)",
    "tree(lanes(4))",
    "tree(vector(4, pairwise))",
    "tree(blocked(4, fused))",
    "tree(split_k(3))",
    "tree(halves(4, pairwise, align=2))",
    "tree(sequential(3))",
    "tree(sequential(from_zero))",
    "tree(rounded(pairwise))",
]


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def values(fmt, shape, rng, spread=8) -> np.ndarray:
    """Random values of ``fmt`` (normal, times 2**±spread) as float32."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread, shape)
    return np.asarray(round_to(jnp.asarray(x.astype(np.float32)), fmt))


def bits(x) -> np.ndarray:
    """float32 bits of a float32 or float64 result (float64 narrowed exactly)."""
    x = np.asarray(x)
    return (x.astype(np.float32) if x.dtype == np.float64 else x).view(np.uint32)


def assert_same(got, want, what=""):
    got = np.asarray(got)
    assert got.dtype == np.float32, got.dtype
    g, w = bits(got), bits(want)
    nan = np.isnan(got) & np.isnan(np.asarray(want, np.float64))
    bad = np.flatnonzero((g != w) & ~nan)
    shown = [(float(got.ravel()[i]), float(np.asarray(want).ravel()[i])) for i in bad[:5]]
    assert bad.size == 0, f"{what}: {bad.size} of {g.size} differ, e.g. {shown}"


def f64(x):
    return None if x is None else jnp.asarray(np.asarray(x, np.float64))


def check_sum(x, fmt, model, initial=None, axis=-1):
    fn = jax.jit(lambda x, i: sum32.sum(x, fmt, axis=axis, accumulation=model, initial=i))
    got = fn(jnp.asarray(x), None if initial is None else jnp.asarray(initial))
    want = ops.sum(f64(x), fmt, axis=axis, accumulation=model, initial=f64(initial))
    assert_same(got, want, f"sum {model} {getattr(fmt, 'name', fmt)}")


def check_matmul(a, b, fmt, model, initial=None):
    fn = jax.jit(lambda a, b, i: sum32.matmul(a, b, fmt, accumulation=model, initial=i))
    got = fn(jnp.asarray(a), jnp.asarray(b), None if initial is None else jnp.asarray(initial))
    want = ops.matmul(f64(a), f64(b), fmt, accumulation=model, initial=f64(initial))
    assert_same(got, want, f"matmul {model} {getattr(fmt, 'name', fmt)}")


# -- the float64 path, model by model -----------------------------------------------


@pytest.mark.parametrize(
    "model",
    ["exact", pytest.param("sequential", marks=pytest.mark.slow)]
    + [pytest.param(m, marks=pytest.mark.slow) for m in ("chunked(4)", "tree(pairwise)")],
)
def test_sum_gives_the_float64_bits(model):
    rng = np.random.default_rng(1)
    x = values(BF16, (6, 37), rng, spread=40)
    check_sum(x, FP32, model, initial=values(FP32, (6,), rng))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tensor_core(a100)", "tree(fused)"])
def test_matmul_gives_the_float64_bits(model):
    rng = np.random.default_rng(2)
    a, b = values(FP16, (2, 3, 21), rng), values(FP16, (2, 21, 4), rng)
    check_matmul(a, b, FP32, model, initial=values(FP32, (2, 3, 4), rng))


def test_exact_matmul_gives_the_float64_bits_where_its_dot_is_exact():
    # bf16 values within 2**±8: the float64 dot of 64 products is exact.
    rng = np.random.default_rng(3)
    a, b = values(BF16, (3, 5, 64), rng), values(BF16, (3, 64, 6), rng)
    check_matmul(a, b, FP32, "exact")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    "inputs, acc",
    [(BF16, FP32), (FP16, BF16), (FP32, FP16), (E4M3FN, E4M3FN), (FP32, FP32)],
    ids=lambda f: f.name,
)
def test_every_model_gives_the_float64_bits(model, inputs, acc):
    rng = np.random.default_rng(4)
    spread = 4 if inputs in (FP32, FP16) else 8  # float64 dots of these stay exact
    x = values(inputs, (5, 41), rng, spread)
    for initial in (None, values(acc, (5,), rng)):
        check_sum(x, acc, model, initial)
    a, b = values(inputs, (2, 3, 19), rng, spread), values(inputs, (2, 19, 4), rng, spread)
    for initial in (None, values(acc, (2, 3, 4), rng)):
        check_matmul(a, b, acc, model, initial)


# -- exact sums against the rational oracle -----------------------------------------


def exact_rounding(rows, fmt) -> np.ndarray:
    """Each row's exact sum rounded once (+0 for an exact zero of several terms)."""
    out = []
    for row in rows:
        total = sum((Fraction(float(v)) for v in row), Fraction(0))
        neg_zero = len(row) == 1 and math.copysign(1.0, float(row[0])) < 0
        out.append(round_exact(total, fmt, negative_zero=neg_zero))
    return np.asarray(out, np.float64)


def adversarial(fmt, rng) -> np.ndarray:
    """Rows of 8 float32 terms whose exact sums are hard: cancellations far below
    the largest term, exact midpoints broken (or not) by a tiny last term,
    subnormal terms and sums, signed zeros."""
    tiny = float(np.float32(2.0**-149))
    q = 2.0 ** (-fmt.man_bits)  # the quantum of fmt at 1
    rows = [
        [2.0**100, 1.0, -(2.0**100), 0, 0, 0, 0, 0],
        [2.0**127, -(2.0**127), 2.0**-149, 0, 0, 0, 0, 0],
        [1.0, q / 2, 0, 0, 0, 0, 0, 0],  # a tie: to even
        [1.0 + q, q / 2, 0, 0, 0, 0, 0, 0],  # a tie: up to even
        [1.0, q / 2, tiny, 0, 0, 0, 0, 0],  # a tie broken upward
        [1.0, q / 2, -tiny, 0, 0, 0, 0, 0],  # a tie broken downward
        [1.0, q / 2, 2.0**90, -(2.0**90), tiny, -tiny, -tiny, 0],
        [2.0**-126, -(2.0**-149), 0, 0, 0, 0, 0, 0],  # a float32 subnormal result
        [tiny, tiny, tiny, -tiny, 0, 0, 0, 0],
        [fmt.smallest_subnormal, fmt.smallest_subnormal / 2, 0, 0, 0, 0, 0, 0],
        [fmt.tiny, -fmt.smallest_subnormal / 2, 0, 0, 0, 0, 0, 0],
        [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0],
        [1.0, -1.0, -0.0, 0, 0, 0, 0, 0],
        [3.0, 2.0**-30, -(2.0**-60), 2.0**-90, -(2.0**-120), 2.0**-149, 0, 0],
        [-3.0, 2.0**60, -(2.0**60), -(2.0**-149), 0, 0, 0, 0],
        [fmt.max, fmt.max, -fmt.max, 0, 0, 0, 0, 0],
        [2.0**127 * 1.5, 2.0**127 * 1.5, 0, 0, 0, 0, 0, 0],  # past float32's range
    ]
    # a random mix: huge, ordinary and tiny terms of both signs, and their negations
    for _ in range(40):
        e = rng.integers(-149, 128, 4)
        v = rng.choice([-1, 1], 4) * rng.uniform(1, 2, 4) * 2.0 ** e.astype(np.float64)
        v = np.asarray(v, np.float32).astype(np.float64)
        rows.append([*v, -v[0], -v[1], rng.uniform(-1, 1), 0])
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize(
    "fmt",
    [FP32] + [pytest.param(f, marks=pytest.mark.slow) for f in (BF16, FP16, E4M3FN)],
    ids=lambda f: f.name,
)
def test_exact_sum_is_the_exact_sum_rounded_once(fmt):
    rng = np.random.default_rng(5)
    with np.errstate(over="ignore"):
        rows = adversarial(fmt, rng)
    got = jax.jit(lambda x: sum32.sum(x, fmt))(jnp.asarray(rows))
    assert_same(got, exact_rounding(rows, fmt), f"exact {fmt.name}")
    # and each row's terms in any order, as a one-output matmul with ones
    perm = rows[:, rng.permutation(rows.shape[1])]
    ones = jnp.ones((rows.shape[0], perm.shape[1], 1), jnp.float32)
    got = jax.jit(lambda a: sum32.matmul(a, ones, fmt))(jnp.asarray(perm[:, None, :]))
    assert_same(got[:, 0, 0], exact_rounding(rows, fmt), f"exact matmul {fmt.name}")


@pytest.mark.slow
def test_exact_matmul_is_the_exact_sum_of_the_products_rounded_once():
    rng = np.random.default_rng(6)
    a = np.asarray(rng.uniform(1, 2, (4, 6)) * 2.0 ** rng.integers(-149, 127, (4, 6)), np.float32)
    b = np.asarray(rng.uniform(1, 2, (6, 3)) * 2.0 ** rng.integers(-149, 127, (6, 3)), np.float32)
    a = a * rng.choice([-1, 1], a.shape).astype(np.float32)
    a[0] = [1.0, 2.0**-100, -1.0, 2.0**-149, -(2.0**-149), 3.0]  # products below float32
    b[:, 0] = [1.0, 1.0, 1.0, 2.0**-149, 2.0**-149, 2.0**-149]
    got = np.asarray(jax.jit(lambda a, b: sum32.matmul(a, b, FP32))(a, b))
    for (i, j), total in np.ndenumerate(np.asarray(exact_matmul(a, b), object)):
        assert bits(got[i, j]) == bits(np.float32(round_exact(total, FP32))), (i, j)


@pytest.mark.slow
def test_non_finite_terms_give_what_the_float64_path_gives():
    inf, nan = np.inf, np.nan
    rows = np.asarray(
        [[1, inf, 2, 3], [inf, -inf, 1, 1], [nan, 1, 2, 3], [-inf, 1, 2, -5], [0, 0, 0, 0]],
        np.float32,
    )
    for model in ("exact", "chunked(2)", "tensor_core(v100)", "tree(pairwise)", "tree(fused)"):
        check_sum(rows, E4M3FN if model == "exact" else FP32, model)
    a = np.asarray([[1, inf, 0, 2], [nan, 1, 1, 1], [1, 2, 3, 4]], np.float32)
    b = np.asarray([[1, 0], [0, 1], [inf, 2], [1, -inf]], np.float32)
    for model in ("exact", "sequential", "tensor_core(v100)"):
        check_matmul(a, b, FP32, model)


@pytest.mark.slow
def test_signed_zeros_follow_the_float64_path():
    z = np.float32(-0.0)
    for model in ("exact", "sequential", "chunked(2)", "chunked(1)", "tree(pairwise)"):
        for n in (1, 2, 3):
            check_sum(np.full((2, n), z), FP32, model, initial=np.full((2,), z))
            check_sum(np.full((2, n), z), FP32, model)
    a, b = -np.ones((2, 1), np.float32), np.zeros((1, 3), np.float32)
    for model in ("exact", "sequential", "tree(fused)"):
        check_matmul(a, b, FP32, model)
        check_matmul(a, b, FP32, model, initial=np.full((2, 3), z))


# -- how it runs ---------------------------------------------------------------------


def test_jit_vmap_eager_and_x64_off_give_the_same_bits():
    rng = np.random.default_rng(7)
    x = jnp.asarray(values(BF16, (3, 4, 9), rng, spread=30))
    f = lambda x: sum32.sum(x, FP16, accumulation="tensor_core(v100)")  # noqa: E731
    jitted = np.asarray(jax.jit(f)(x))
    assert_same(jax.vmap(f)(x), jitted, "vmap")
    assert_same(f(x), jitted, "eager")
    jax.config.update("jax_enable_x64", False)
    try:
        assert_same(jax.jit(f)(x), jitted, "x64 off")
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.mark.slow
def test_a_traced_format_gives_each_formats_bits():
    rng = np.random.default_rng(8)
    x = values(BF16, (4, 33), rng, spread=30)
    formats = [FP32, BF16, FP16, get_format("tf32")]

    def run(e, m):
        return sum32.sum(jnp.asarray(x), custom(e, m), accumulation="tree(pairwise)")

    widths = jnp.asarray([[f.exp_bits, f.man_bits] for f in formats], jnp.int32)
    got = jax.jit(jax.vmap(run))(widths[:, 0], widths[:, 1])
    for f, g in zip(formats, got):
        assert_same(g, ops.sum(f64(x), f, accumulation="tree(pairwise)"), f.name)


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_programs_hold_no_64_bit_type(slow):
    x, a, b = jnp.ones((4, 300), jnp.float32), jnp.ones((2, 3, 19)), jnp.ones((2, 19, 4))
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    for model in MODELS if slow else ("exact", "tensor_core(a100)"):
        text = jax.jit(lambda x, m=model: sum32.sum(x, "bf16", accumulation=m, initial=x[:, 0]))
        text = text.lower(x).as_text()
        text += (
            jax.jit(lambda a, b, m=model: sum32.matmul(a, b, "fp32", accumulation=m))
            .lower(a, b)
            .as_text()
        )
        found = wide_tensors(text, scalars=True)
        assert not found, (model, found[:3])


def test_arguments_are_checked():
    x = jnp.ones((3, 4), jnp.float32)
    with pytest.raises(TypeError, match="float32"):
        sum32.sum(x.astype(jnp.float64), FP32)
    with pytest.raises(ValueError, match="fits a float32"):
        sum32.sum(x, "fp64")
    with pytest.raises(ValueError, match="contraction"):
        sum32.matmul(x, x, FP32)
    with pytest.raises(ValueError, match="<= 53"):
        sum32.sum(x, FP32, accumulation="tensor_core(k=4, extra_bits=30)")


def test_the_fallback_is_exact_in_row_blocks_and_a_branch_under_vmap():
    """Operands spread over 2**±60 defeat the digit slices' loss bound for some
    outputs of one configuration: the limb accumulator then computes every output,
    over blocks of rows (the last one padded), each the exact sum rounded once.
    Under ``vmap`` the predicate is taken over the whole batch, so the fallback
    stays a ``lax.cond`` branch instead of a ``select`` that would run it always."""
    rng = np.random.default_rng(8)
    a = np.array(values(BF16, (3, 23, 40), rng, spread=2))
    b = values(BF16, (3, 40, 100), rng, spread=2)
    a[1] *= 2.0 ** rng.integers(-60, 60, a[1].shape)
    safe = np.asarray(jax.jit(lambda x, y: sum32._sliced_matmul(x, y, FP32).safe)(a, b))
    assert safe[[0, 2]].all() and not safe[1].all()
    assert sum32._FALLBACK_OUTPUTS // (3 * b.shape[-1]) < a.shape[1]  # more than one block
    f = lambda x, y: sum32.matmul(x, y, FP32)  # noqa: E731
    assert "cond[" in str(jax.make_jaxpr(jax.vmap(f))(a, b))
    want = np.stack([exactly_rounded_matmul(x, y, FP32) for x, y in zip(a, b)])
    assert_same(jax.jit(jax.vmap(f))(a, b), want, "vmap")
