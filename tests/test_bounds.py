"""fa_jax.bounds: gamma and summation counts, the shape of the softmax bounds, and the
empirical check that they hold for the exact op sequences they are derived for.

The op sequences are run by the numpy simulation in tests/softmax_sim.py (SAFE and
ONLINE of fa_jax/bounds.py under the accumulation models of fa_jax/accumulation.py,
every op correctly rounded once to the format); tests/test_softmax.py checks that
fa_jax.softmax computes exactly the same bits.

Run with ``-s`` to see how loose the bounds are (bound / measured).
"""

import math
import operator
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_jax import BF16, FP16, FP32, FP64, custom, round_to
from fa_jax import bounds as B
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked, get_accumulation

import softmax_sim as sim
from helpers import x64_enabled
from softmax_sim import exact_softmax, online_softmax, rnd, safe_softmax

E8M4 = custom(8, 4)
FORMATS = [BF16, FP16, FP32, E8M4]
BLOCKS = [1, 16, 64]
MODELS = [SEQUENTIAL, EXACT]
ALL_MODELS = [SEQUENTIAL, EXACT, chunked(8)]


def max_rel_err(Y, X):
    ref = exact_softmax(X)
    return (np.abs(Y - ref) / ref).max(axis=1)


def make_rows(rng, fmt, n, R, kind, rows):
    """Rows of n scores with spread about R, rounded to fmt.  [rows, n]."""
    lo = rng.uniform(-30, 30, size=(rows, 1))
    Z = sim.row_shapes(rng, kind, rows, n)
    return rnd(lo + R * Z, fmt)


def spread(X):
    return X.max(axis=1) - X.min(axis=1)


def check_rows(X, fmt, model, block):
    """Measured errors and bounds of SAFE and ONLINE for every row; asserts validity.
    Returns [(algorithm, R, measured, bound), ...]."""
    n = X.shape[1]
    out = []
    Rs = spread(X)
    runs = [("safe", safe_softmax(X, fmt, model),
             lambda R: B.softmax_bound(n, R, fmt, accumulation=model))]
    runs.append((f"online b={block}", online_softmax(X, fmt, model, block),
                 lambda R: B.online_softmax_bound(n, R, fmt, block=block, accumulation=model)))
    for name, Y, bound_of in runs:
        err = max_rel_err(Y, X)
        for R, e in zip(Rs, err):
            bound = bound_of(float(R))
            assert e <= bound, (
                f"{name} {fmt.name} {model} n={n} R={R}: measured {e!r} > bound {bound!r}"
            )
            out.append((name, float(R), float(e), bound))
    return out


# -- the oracles themselves --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_rnd_is_correct_rounding(fmt):
    """rnd agrees with fa_jax.round_to on float64 (correctly rounded there)."""
    rng = np.random.default_rng(0)
    v = np.concatenate([
        rng.standard_normal(2000) * np.exp(rng.uniform(-12, 12, 2000)),
        rng.uniform(-1, 1, 200) * fmt.tiny,  # subnormal range
        [0.0, 1.0, -1.0, fmt.max, -fmt.tiny],
    ])
    v = v[np.abs(v) <= fmt.max]
    with x64_enabled():
        want = np.asarray(round_to(jnp.asarray(v, jnp.float64), fmt))
    np.testing.assert_array_equal(rnd(v, fmt), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_fraction_agrees_with_rnd(fmt):
    rng = np.random.default_rng(10)
    v = np.concatenate([rng.standard_normal(500) * np.exp(rng.uniform(-12, 12, 500)),
                        rng.uniform(-1, 1, 100) * fmt.tiny, [0.0, fmt.max]])
    v = v[np.abs(v) <= fmt.max]
    got = np.array([sim.round_fraction(Fraction(x), fmt) for x in v.tolist()])
    np.testing.assert_array_equal(got, rnd(v, fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_sim_ops_match_a_fraction_oracle(fmt):
    """+ - * / of values of fmt, a third of them near ties and cancellations."""
    rng = np.random.default_rng(11)
    N = 600
    a = rnd(rng.choice([-1, 1], N) * np.exp(rng.uniform(-3, 3, N)), fmt)
    b = rnd(rng.choice([-1, 1], N) * np.exp(rng.uniform(-3, 3, N)), fmt)
    b[:200] = rnd(a[:200] * (1 + rng.integers(-4, 5, 200) * 2.0**-(fmt.man_bits + 2)), fmt)
    for op, exact_op in ((sim.add, operator.add), (sim.sub, operator.sub),
                         (sim.mul, operator.mul), (sim.div, operator.truediv)):
        want = [sim.round_fraction(exact_op(Fraction(x), Fraction(y)), fmt)
                for x, y in zip(a.tolist(), b.tolist())]
        np.testing.assert_array_equal(op(a, b, fmt), want, err_msg=op.__name__)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("model", ALL_MODELS, ids=str)
def test_sums_follow_the_accumulation_model(fmt, model):
    """sim.sums against Fraction arithmetic written out per model."""
    rng = np.random.default_rng(1)
    E = rnd(np.exp(rng.uniform(-30, 0, size=(3, 37))), fmt)
    E[0, :2] = [1.0, fmt.eps / 2]  # a tie: 1 + eps/2 rounds to 1 (even)
    E[0, 2:] = 0.0
    got = sim.sums(E, fmt, model)
    assert got[0] == 1.0

    def fl(v):
        return sim.round_fraction(v, fmt)

    for row, g in zip(E.tolist(), got):
        terms = [Fraction(v) for v in row]
        if model.kind == "exact":
            want = fl(sum(terms))
        else:
            k = 1 if model.kind == "sequential" else model.chunk
            want = 0.0  # acc_0 = 0; acc = fl(acc + exact chunk sum)
            for j in range(0, len(terms), k):
                want = fl(Fraction(want) + sum(terms[j:j + k]))
        assert g == want


@pytest.mark.parametrize("op,exact_op,a,b", [
    (sim.add, operator.add, 256.0, 1.0 + 2.0**-52),  # float64: exactly 257
    (sim.sub, operator.sub, 256.0, -(1.0 + 2.0**-52)),
    (sim.mul, operator.mul, 1.0 + 2.0**-52, 1.0 + 2.0**-8 - 2.0**-52),  # 1 + 2**-8
    (sim.div, operator.truediv, 1.0 + 3 * 2.0**-8 - 2.0**-52, 1.0 - 2.0**-53),  # 1 + 3 2**-8
], ids=["add", "sub", "mul", "div"])
def test_sim_ops_are_correctly_rounded_where_float64_double_rounds(op, exact_op, a, b):
    """The float64 result is a bf16 midpoint and the exact result is not: rounding
    the float64 result (ties to even) is wrong, the sim's exact fallback is right."""
    want = sim.round_fraction(exact_op(Fraction(a), Fraction(b)), BF16)
    assert rnd(exact_op(a, b), BF16) != want
    assert op(a, b, BF16) == want


def test_sim_sums_are_exact_where_float64_sums_are_not():
    t = 2.0**-100  # lost in a float64 sum with 257; decides the rounding of 257
    ones = np.array([1.0] * 257 + [t])
    assert sim.sums(np.array([256.0, 1.0, t]), BF16, "exact") == 258.0
    assert sim.sums(ones, BF16, EXACT) == 258.0
    assert sim.sums(ones, BF16, chunked(8)) == 258.0  # acc = 256, then fl(256 + 1 + t)
    assert sim.sums(ones, BF16, SEQUENTIAL) == 256.0  # stalls: fl(256 + 1) = 256


def test_simulators_are_exact_in_float64():
    """With the identity rounding (FP64), both simulators reproduce softmax."""
    rng = np.random.default_rng(2)
    X = rng.uniform(-5, 5, size=(3, 257))
    ref = exact_softmax(X)
    np.testing.assert_allclose(safe_softmax(X, FP64, SEQUENTIAL), ref, rtol=1e-13)
    for block in (1, 16, 300):
        np.testing.assert_allclose(online_softmax(X, FP64, SEQUENTIAL, block), ref,
                                   rtol=1e-13)


def test_online_with_one_block_is_safe():
    rng = np.random.default_rng(3)
    X = make_rows(rng, BF16, 100, 8.0, "uniform", 4)
    for model in ALL_MODELS:
        np.testing.assert_array_equal(online_softmax(X, BF16, model, 100),
                                      safe_softmax(X, BF16, model))


# -- empirical validity ---------------------------------------------------------------


def _max_range(fmt):
    # fp16: exp(-R) underflows for R > 9.7 and the bound is inf (tested separately).
    return 9.0 if fmt is FP16 else 50.0


@settings(max_examples=100, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    n=st.one_of(st.integers(1, 300), st.integers(1, 4096)),
    frac=st.floats(0.0, 1.0),
    kind=st.sampled_from(["uniform", "ascending", "descending", "ties", "outlier"]),
    block=st.sampled_from(BLOCKS),
    model=st.sampled_from(ALL_MODELS),
    seed=st.integers(0, 2**32 - 1),
)
def test_bounds_hold_random_rows(fmt, n, frac, kind, block, model, seed):
    R = 0.1 + frac * (_max_range(fmt) - 0.1)
    X = make_rows(np.random.default_rng(seed), fmt, n, R, kind, rows=3)
    check_rows(X, fmt, model, block)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bounds_hold_long_rows_and_report_looseness(fmt):
    """n = 4096, every block size and accumulation model; prints bound / measured."""
    rng = np.random.default_rng(4)
    n = 4096
    top = _max_range(fmt)
    Rs = [0.1, 1.0, 5.0, top] if top < 20 else [0.1, 1.0, 5.0, 20.0, top]
    X = np.concatenate([make_rows(rng, fmt, n, R, kind, rows=1)
                        for R in Rs for kind in ("uniform", "ascending")])
    lines = []
    for model in MODELS:
        for block in BLOCKS:
            for name, R, e, bound in check_rows(X, fmt, model, block):
                if name == "safe" and block != BLOCKS[0]:
                    continue  # the same SAFE rows for every block size
                lines.append(f"  {fmt.name:9s} {str(model):10s} {name:12s} R={R:6.2f} "
                             f"measured={e:9.3e} bound={bound:9.3e} "
                             f"ratio={bound / e if e else math.inf:9.3g}")
    print(f"\n[looseness, n={n}] bound / measured:\n" + "\n".join(lines))


@pytest.mark.parametrize("n,block", [(1, 1), (2, 1), (5, 16), (64, 64), (65, 64)])
def test_bounds_hold_short_rows_edge_cases(n, block):
    rng = np.random.default_rng(5)
    for fmt in FORMATS:
        for model in MODELS:
            X = make_rows(rng, fmt, n, 3.0, "ascending", rows=4)
            check_rows(X, fmt, model, block)


def test_fp16_wide_range_underflows_and_gets_no_finite_bound():
    """exp(-50) is below fp16's smallest subnormal: probabilities become 0 (relative
    error 1), so the only valid relative bound is trivial; the bound says inf."""
    X = rnd(np.array([[0.0, 50.0, 20.0, 49.0]]), FP16)
    err = max_rel_err(safe_softmax(X, FP16, SEQUENTIAL), X)
    assert err[0] == 1.0
    assert B.softmax_bound(4, 50.0, FP16) == math.inf
    assert B.online_softmax_bound(4, 50.0, FP16, block=1) == math.inf
    assert math.isfinite(B.softmax_bound(4, 50.0, FP16.unit_roundoff))  # no range: finite


# -- gamma and summation ----------------------------------------------------------------


def test_gamma_values():
    assert B.gamma(0, 0.1) == 0.0
    assert B.gamma(1, 2.0**-8) == pytest.approx(2.0**-8 / (1 - 2.0**-8), rel=1e-15)
    assert B.gamma(10, 0.05) == pytest.approx(1.0)
    u = 2.0**-24
    assert B.gamma(1000, u) == pytest.approx(1000 * u, rel=1e-4)


def test_gamma_monotone_and_dominates_product():
    u = 2.0**-8
    g = [B.gamma(n, u) for n in range(0, 200)]
    assert all(a < b for a, b in zip(g, g[1:]))
    for n in range(0, 200, 7):  # (1 + u)^n - 1 <= gamma_n (Higham Lemma 3.1)
        assert (1 + u) ** n - 1 <= g[n] * (1 + 1e-15)
        assert 1 - (1 - u) ** n <= g[n] * (1 + 1e-15)


@pytest.mark.parametrize("n,u", [(256, 2.0**-8), (300, 2.0**-8), (2, 0.5), (4, 0.25)])
def test_gamma_raises_when_nu_reaches_one(n, u):
    with pytest.raises(ValueError, match=rf"n={n}.*u={u!r}"):
        B.gamma(n, u)


@pytest.mark.parametrize("n,u", [(-1, 0.1), (1.5, 0.1), (True, 0.1), (3, -0.1)])
def test_gamma_rejects_bad_arguments(n, u):
    with pytest.raises(ValueError, match="gamma: expected"):
        B.gamma(n, u)


def test_unit_roundoff():
    assert B.unit_roundoff(BF16) == 2.0**-8
    assert B.unit_roundoff("fp16") == 2.0**-11
    assert B.unit_roundoff(FP32) == 2.0**-24


def test_default_exp_error():
    assert B.default_exp_error(BF16.unit_roundoff) == 2.0**-21
    assert B.default_exp_error(FP16.unit_roundoff) == 2.0**-21
    assert B.default_exp_error(FP32.unit_roundoff) == 2.0**-50


@pytest.mark.parametrize("n,model,want", [
    (1, "sequential", 0), (1, "exact", 0), (1, "chunked(4)", 0),
    (10, "sequential", 9), (10, "exact", 1),
    (10, "chunked(1)", 9), (10, "chunked(4)", 3), (10, "chunked(10)", 1),
    (10, "chunked(64)", 1), (4096, "chunked(16)", 256), (4096, "chunked", 256),
    (9, "chunked(8)", 2), (8, "chunked(8)", 1),
])
def test_summation_roundings(n, model, want):
    assert B.summation_roundings(n, model) == want
    # The models of fa_jax.accumulation, and their names, are interchangeable.
    assert B.summation_roundings(n, get_accumulation(model)) == want


def test_summation_roundings_default_is_exact():
    assert B.summation_roundings(10) == B.summation_roundings(10, EXACT) == 1
    assert B.summation_bound(10, 2.0**-8) == B.summation_bound(10, 2.0**-8, EXACT)
    assert B.softmax_bound(50, 2.0, BF16) == B.softmax_bound(50, 2.0, BF16, accumulation=EXACT)
    assert B.online_softmax_bound(50, 2.0, BF16, block=4) == B.online_softmax_bound(
        50, 2.0, BF16, block=4, accumulation="exact")


def test_summation_roundings_errors():
    with pytest.raises(ValueError, match="accumulation: expected"):
        B.summation_roundings(3, "pairwise")
    with pytest.raises(ValueError, match="accumulation: expected"):
        B.softmax_bound(3, 1.0, 0.01, accumulation="chunked(x)")
    with pytest.raises(TypeError):
        B.summation_roundings(3, "chunked", chunk=2)  # the chunk lives in the model
    with pytest.raises(ValueError, match="n to be an integer >= 1"):
        B.summation_roundings(0)


def test_summation_bound_holds_for_sequential_sums():
    rng = np.random.default_rng(6)
    for fmt in (BF16, E8M4):
        E = rnd(rng.uniform(0, 1, size=(20, 200)), fmt)
        exact = np.array([math.fsum(r) for r in E.tolist()])
        for model in ALL_MODELS:
            got = sim.sums(E, fmt, model)
            bound = B.summation_bound(200, fmt, model)
            assert (np.abs(got - exact) <= bound * exact).all()
    assert B.summation_bound(10, 2.0**-8, "exact") == pytest.approx(2.0**-8, rel=1e-12)
    assert B.summation_bound(10, 2.0**-8, "sequential") <= B.gamma(9, 2.0**-8)


# -- the shape of the softmax bounds ----------------------------------------------------


def test_first_order_is_blanchard_higham_higham():
    u = 2.0**-8
    for n, R in [(1, 0.0), (10, 3.0), (4096, 20.0)]:
        assert B.softmax_bound_first_order(n, R, u, accumulation=SEQUENTIAL) == pytest.approx(
            (n + 2 + 2 * R) * u)
    assert B.softmax_bound_first_order(10, 3.0, u) == pytest.approx((1 + 3 + 6) * u)  # EXACT
    assert B.softmax_bound_first_order(10, 3.0, u, accumulation="chunked(4)") == pytest.approx(
        (3 + 3 + 6) * u)


def test_online_first_order_formula():
    u, eta = 2.0**-11, 1e-7
    n, R, b = 1000, 4.0, 16
    K = 63
    got = B.online_softmax_bound_first_order(n, R, u, block=b, exp_error=eta,
                                             accumulation="sequential")
    assert got == pytest.approx((15 + 3 * K + 2 * R) * u + (K + 1) * eta)
    got = B.online_softmax_bound_first_order(n, R, u, block=b, exp_error=eta)  # EXACT
    assert got == pytest.approx((1 + 3 * K + 2 * R) * u + (K + 1) * eta)
    got = B.online_softmax_bound_first_order(n, R, u, block=b, exp_error=eta,
                                             accumulation=chunked(8))
    assert got == pytest.approx((2 + 3 * K + 2 * R) * u + (K + 1) * eta)
    assert B.online_softmax_bound_first_order(n, R, u, block=1) == pytest.approx(
        (3 * n + 2 * R) * u)


@pytest.mark.parametrize("model", ALL_MODELS + ["chunked", "chunked(8)"], ids=str)
def test_online_with_one_block_equals_safe(model):
    for u in (2.0**-8, FP16, FP32):
        for n in (1, 7, 300):
            kw = dict(accumulation=model)
            assert B.online_softmax_bound(n, 2.5, u, block=n, **kw) == B.softmax_bound(
                n, 2.5, u, **kw)
            assert B.online_softmax_bound(n, 2.5, u, block=10**6, **kw) == B.softmax_bound(
                n, 2.5, u, **kw)
            assert B.online_softmax_bound_first_order(
                n, 2.5, u, block=n, **kw) == B.softmax_bound_first_order(n, 2.5, u, **kw)


def test_rigorous_dominates_first_order_and_converges_to_it():
    for n, R, b in [(1, 0.0, 1), (100, 5.0, 1), (4096, 20.0, 64), (50, 50.0, 16)]:
        for u in (2.0**-5, 2.0**-8, 2.0**-11, 2.0**-24):
            eta = B.default_exp_error(u)
            rig = B.online_softmax_bound(n, R, u, block=b)
            first = B.online_softmax_bound_first_order(n, R, u, block=b, exp_error=eta)
            assert rig >= first
    # u -> 0: the second-order terms vanish relative to the first.
    n, R = 1000, 10.0
    for u in (2.0**-30, 2.0**-40):
        rig = B.softmax_bound(n, R, u, exp_error=0.0)
        assert rig == pytest.approx(B.softmax_bound_first_order(n, R, u), rel=1e3 * n * u)


def test_bounds_monotone():
    u = 2.0**-8
    f = B.online_softmax_bound
    assert f(100, 3.0, u, block=4) < f(200, 3.0, u, block=4)  # n
    assert f(100, 3.0, u, block=4) < f(100, 4.0, u, block=4)  # range
    assert f(100, 3.0, 2.0**-11, block=4) < f(100, 3.0, u, block=4)  # u
    assert f(4096, 3.0, u, block=64) < f(4096, 3.0, u, block=16) < f(4096, 3.0, u, block=1)
    assert B.softmax_bound(100, 3.0, u) < B.softmax_bound(100, 3.0, u, accumulation="chunked(8)")
    assert B.softmax_bound(100, 3.0, u, accumulation="chunked(8)") < B.softmax_bound(
        100, 3.0, u, accumulation="sequential")


def test_gamma_closed_form_dominates_rigorous_bound():
    """The documented closed form (1 + gamma_{r_b+3K}) e^{2uR} (1+eta)/(1-eta)^K - 1."""
    for n, R, b, u in [(100, 5.0, 1, 2.0**-11), (4096, 20.0, 64, 2.0**-24),
                       (500, 3.0, 16, 2.0**-8)]:
        eta = B.default_exp_error(u)
        K = -(-n // b)
        r_b = B.summation_roundings(min(b, n))
        closed = (1 + B.gamma(r_b + 3 * K, u)) * math.exp(2 * u * R) * (1 + eta) / (
            1 - eta) ** K - 1
        assert B.online_softmax_bound(n, R, u, block=b, exp_error=eta) <= closed * (1 + 1e-12)


def test_format_argument_checks_range():
    # Within range the format only adds the subnormal-quotient term.
    assert B.softmax_bound(64, 3.0, BF16) == B.softmax_bound(64, 3.0, BF16.unit_roundoff)
    assert B.softmax_bound(4096, 9.0, FP16) > B.softmax_bound(4096, 9.0, FP16.unit_roundoff)
    assert B.softmax_bound(4, 10.0, FP16) == math.inf  # exp(-10) < fp16 tiny
    # (1 + u)^4095 overflows e8m4
    assert B.softmax_bound(4096, 5.0, E8M4, accumulation="sequential") == math.inf
    assert math.isfinite(B.softmax_bound(4096, 5.0, E8M4))
    assert B.softmax_bound(64, 3.0, "bf16") == B.softmax_bound(64, 3.0, BF16)


def test_huge_arguments_give_inf_not_overflow_errors():
    assert B.online_softmax_bound(10**7, 1e6, 2.0**-5, block=1) == math.inf
    assert B.softmax_bound(10**9, 0.0, 0.25, accumulation="sequential") == math.inf


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=0, x_range=1.0, u=0.01), "n to be an integer >= 1"),
    (dict(n=2.0, x_range=1.0, u=0.01), "n to be an integer"),
    (dict(n=4, x_range=-1.0, u=0.01), "x_range"),
    (dict(n=4, x_range=math.nan, u=0.01), "x_range"),
    (dict(n=4, x_range=1.0, u=0.0), "unit roundoff"),
    (dict(n=4, x_range=1.0, u=1.5), "unit roundoff"),
    (dict(n=4, x_range=1.0, u="nope"), "unknown format"),
    (dict(n=4, x_range=1.0, u=0.01, block=0), "block to be an integer >= 1"),
    (dict(n=4, x_range=1.0, u=0.01, exp_error=1.0), "exp_error"),
    (dict(n=4, x_range=1.0, u=0.01, accumulation="pairwise"), "accumulation: expected"),
])
def test_bound_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        B.online_softmax_bound(**kwargs)
