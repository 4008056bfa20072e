"""fa_jax.bounds: gamma and summation counts, the shape of the softmax bounds, and the
empirical check that they hold for the exact op sequences they are derived for.

The op sequences are run by the numpy simulation in tests/softmax_sim.py (SAFE and
ONLINE of fa_jax/bounds.py under the accumulation models of fa_jax/accumulation.py,
every op correctly rounded once to the format); tests/test_softmax.py checks that
fa_jax.softmax computes exactly the same bits.

Run with ``-s`` to see how loose the bounds are (bound / measured).
"""

import itertools
import math
import operator
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
import softmax_sim as sim
from helpers import largest_n_below, x64_enabled
from hypothesis import given, settings
from hypothesis import strategies as st
from softmax_sim import exact_softmax, online_softmax, rnd, safe_softmax

from fa_jax import (
    BF16,
    FP16,
    FP32,
    FP64,
    Blocks,
    custom,
    fa2_kernel,
    flash_attention,
    get_format,
    golden,
    paper_uniform,
    reference_attention,
    round_to,
)
from fa_jax import bounds as B
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked, get_accumulation
from fa_jax.inputs import make_inputs

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
    """Measured errors and bounds of SAFE and ONLINE for every row; asserts each bound
    is below 1 (a check) and holds.
    Returns [(algorithm, R, measured, bound), ...]."""
    n = X.shape[1]
    out = []
    Rs = spread(X)
    runs = [
        (
            "safe",
            safe_softmax(X, fmt, model),
            lambda R: B.softmax_bound(n, R, fmt, accumulation=model),
        )
    ]
    runs.append(
        (
            f"online b={block}",
            online_softmax(X, fmt, model, block),
            lambda R: B.online_softmax_bound(n, R, fmt, block=block, accumulation=model),
        )
    )
    for name, Y, bound_of in runs:
        err = max_rel_err(Y, X)
        for R, e in zip(Rs, err):
            bound = bound_of(float(R))
            assert bound < 1, f"{name} {fmt.name} {model} n={n} R={R}: bound {bound} checks nothing"
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
    v = np.concatenate(
        [
            rng.standard_normal(2000) * np.exp(rng.uniform(-12, 12, 2000)),
            rng.uniform(-1, 1, 200) * fmt.tiny,  # subnormal range
            [0.0, 1.0, -1.0, fmt.max, -fmt.tiny],
        ]
    )
    v = v[np.abs(v) <= fmt.max]
    with x64_enabled():
        want = np.asarray(round_to(jnp.asarray(v, jnp.float64), fmt))
    np.testing.assert_array_equal(rnd(v, fmt), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_fraction_agrees_with_rnd(fmt):
    rng = np.random.default_rng(10)
    v = np.concatenate(
        [
            rng.standard_normal(500) * np.exp(rng.uniform(-12, 12, 500)),
            rng.uniform(-1, 1, 100) * fmt.tiny,
            [0.0, fmt.max],
        ]
    )
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
    b[:200] = rnd(a[:200] * (1 + rng.integers(-4, 5, 200) * 2.0 ** -(fmt.man_bits + 2)), fmt)
    for op, exact_op in (
        (sim.add, operator.add),
        (sim.sub, operator.sub),
        (sim.mul, operator.mul),
        (sim.div, operator.truediv),
    ):
        want = [
            sim.round_fraction(exact_op(Fraction(x), Fraction(y)), fmt)
            for x, y in zip(a.tolist(), b.tolist())
        ]
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
                want = fl(Fraction(want) + sum(terms[j : j + k]))
        assert g == want


@pytest.mark.parametrize(
    "op,exact_op,a,b",
    [
        (sim.add, operator.add, 256.0, 1.0 + 2.0**-52),  # float64: exactly 257
        (sim.sub, operator.sub, 256.0, -(1.0 + 2.0**-52)),
        (sim.mul, operator.mul, 1.0 + 2.0**-52, 1.0 + 2.0**-8 - 2.0**-52),  # 1 + 2**-8
        (sim.div, operator.truediv, 1.0 + 3 * 2.0**-8 - 2.0**-52, 1.0 - 2.0**-53),  # 1 + 3 2**-8
    ],
    ids=["add", "sub", "mul", "div"],
)
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
        np.testing.assert_allclose(online_softmax(X, FP64, SEQUENTIAL, block), ref, rtol=1e-13)


def test_online_with_one_block_is_safe():
    rng = np.random.default_rng(3)
    X = make_rows(rng, BF16, 100, 8.0, "uniform", 4)
    for model in ALL_MODELS:
        np.testing.assert_array_equal(
            online_softmax(X, BF16, model, 100), safe_softmax(X, BF16, model)
        )


# -- empirical validity ---------------------------------------------------------------

# The largest spread R of the drawn rows per format: fp16's exp(-R) underflows for
# R > 9.7 (an infinite bound, tested separately); bf16's and e8m4's bounds pass 1
# at wide spreads and a few dozen (bf16) or a few (e8m4) scores.
MAX_RANGE = {BF16.name: 20.0, FP16.name: 9.0, FP32.name: 50.0, E8M4.name: 1.0}
LO_MAX = 30.0  # make_rows' rows start in [-LO_MAX, LO_MAX]


def _max_range(fmt):
    return MAX_RANGE[fmt.name]


def _row_spread_max(fmt):
    """A row's spread after its scores in [lo, lo + R] are rounded to fmt: at most
    R plus two ulps at |lo| + R."""
    top = LO_MAX + _max_range(fmt)
    return _max_range(fmt) + 2 * 2.0 ** (math.floor(math.log2(top)) - fmt.man_bits)


def _worst_bound(n, R, fmt):
    """The largest softmax or online bound over ALL_MODELS and BLOCKS."""
    return max(
        max(
            B.softmax_bound(n, R, fmt, accumulation=m),
            *(B.online_softmax_bound(n, R, fmt, block=b, accumulation=m) for b in BLOCKS),
        )
        for m in ALL_MODELS
    )


def _longest_meaningful_row(fmt, longest=4096):
    """The largest n <= longest whose bounds are all below 1 at the format's largest
    row spread (the bounds grow with n and R)."""
    R = _row_spread_max(fmt)
    return largest_n_below(lambda n: _worst_bound(n, R, fmt), longest)


N_MAX = {fmt.name: _longest_meaningful_row(fmt) for fmt in FORMATS}


def test_bound_domains():
    """The rows checked below reach the largest n whose bounds are below 1: a bound
    >= 1 (let alone inf) would make |error| <= bound * exact almost free."""
    assert N_MAX == {BF16.name: 45, FP16.name: 365, FP32.name: 4096, E8M4.name: 5}
    for fmt in FORMATS:
        n, R = N_MAX[fmt.name], _row_spread_max(fmt)
        assert _worst_bound(2, R, fmt) < 1
        if n < 4096:
            assert _worst_bound(n + 1, R, fmt) >= 1


@st.composite
def _random_rows(draw):
    fmt = draw(st.sampled_from(FORMATS))
    n_max = N_MAX[fmt.name]
    n = draw(st.one_of(st.integers(2, min(300, n_max)), st.integers(2, n_max)))
    return fmt, n


@settings(max_examples=settings.default.max_examples * 5 // 3)  # 100 in "ci"
@given(
    fmt_n=_random_rows(),
    frac=st.floats(0.0, 1.0),
    kind=st.sampled_from(["uniform", "ascending", "descending", "ties", "outlier"]),
    block=st.sampled_from(BLOCKS),
    model=st.sampled_from(ALL_MODELS),
    seed=st.integers(0, 2**32 - 1),
)
def test_bounds_hold_random_rows(fmt_n, frac, kind, block, model, seed):
    fmt, n = fmt_n
    R = 0.1 + frac * (_max_range(fmt) - 0.1)
    X = make_rows(np.random.default_rng(seed), fmt, n, R, kind, rows=3)
    check_rows(X, fmt, model, block)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_bounds_hold_long_rows_and_report_looseness(fmt):
    """The longest rows with bounds below 1 (n = 4096 for fp32), every block size and
    accumulation model; prints bound / measured."""
    rng = np.random.default_rng(4)
    n = N_MAX[fmt.name]
    top = _max_range(fmt)
    Rs = [R for R in (0.1, 1.0, 5.0, 20.0) if R < top] + [top]
    X = np.concatenate(
        [make_rows(rng, fmt, n, R, kind, rows=1) for R in Rs for kind in ("uniform", "ascending")]
    )
    lines = []
    for model in MODELS:
        for block in BLOCKS:
            for name, R, e, bound in check_rows(X, fmt, model, block):
                if name == "safe" and block != BLOCKS[0]:
                    continue  # the same SAFE rows for every block size
                lines.append(
                    f"  {fmt.name:9s} {model!s:10s} {name:12s} R={R:6.2f} "
                    f"measured={e:9.3e} bound={bound:9.3e} "
                    f"ratio={bound / e if e else math.inf:9.3g}"
                )
    print(f"\n[looseness, n={n}] bound / measured:\n" + "\n".join(lines))


@pytest.mark.parametrize("n,block", [(1, 1), (2, 1), (5, 16), (64, 64), (65, 64)])
def test_bounds_hold_short_rows_edge_cases(n, block):
    """Every format whose bounds at n are below 1 (fp16 and fp32 at all these n)."""
    rng = np.random.default_rng(5)
    kept = [fmt for fmt in FORMATS if n <= N_MAX[fmt.name]]
    assert {FP16, FP32} <= set(kept)
    for fmt in kept:
        for model in MODELS:
            X = make_rows(rng, fmt, n, min(3.0, _max_range(fmt)), "ascending", rows=4)
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
    assert all(a < b for a, b in itertools.pairwise(g))
    for n in range(0, 200, 7):  # (1 + u)^n - 1 <= gamma_n (Higham Lemma 3.1)
        assert (1 + u) ** n - 1 <= g[n] * (1 + 1e-15)
        assert 1 - (1 - u) ** n <= g[n] * (1 + 1e-15)


@pytest.mark.parametrize("n,u", [(256, 2.0**-8), (300, 2.0**-8), (2, 0.5), (4, 0.25)])
def test_gamma_raises_when_nu_reaches_one(n, u):
    with pytest.raises(ValueError, match=rf"n={n}.*u={u!r}"):
        B.gamma(n, u)


@pytest.mark.parametrize("n,u", [(-1, 0.1), (1.5, 0.1), (True, 0.1), (3, -0.1)])
def test_gamma_rejects_bad_arguments(n, u):
    with pytest.raises(ValueError, match=r"gamma: (n|u): expected"):
        B.gamma(n, u)


def test_unit_roundoff():
    assert B.unit_roundoff(BF16) == 2.0**-8
    assert B.unit_roundoff("fp16") == 2.0**-11
    assert B.unit_roundoff(FP32) == 2.0**-24


def test_default_exp_error():
    assert B.default_exp_error(BF16.unit_roundoff) == 2.0**-21
    assert B.default_exp_error(FP16.unit_roundoff) == 2.0**-21
    assert B.default_exp_error(FP32.unit_roundoff) == 2.0**-50


@pytest.mark.parametrize(
    "n,model,want",
    [
        (1, "sequential", 0),
        (1, "exact", 0),
        (1, "chunked(4)", 0),
        (10, "sequential", 9),
        (10, "exact", 1),
        (10, "chunked(1)", 9),
        (10, "chunked(4)", 3),
        (10, "chunked(10)", 1),
        (10, "chunked(64)", 1),
        (4096, "chunked(16)", 256),
        (4096, "chunked", 256),
        (9, "chunked(8)", 2),
        (8, "chunked(8)", 1),
        (8, "pairwise", 3),  # a tree: the most nodes from a leaf to the root
        (9, "pairwise", 4),
        (10, "lanes(4)", 4),  # lane 0 holds 3 terms (2 nodes), then 2 halving levels
    ],
)
def test_summation_roundings(n, model, want):
    assert B.summation_roundings(n, model) == want
    # The models of fa_jax.accumulation, and their names, are interchangeable.
    assert B.summation_roundings(n, get_accumulation(model)) == want


def test_summation_roundings_default_is_exact():
    assert B.summation_roundings(10) == B.summation_roundings(10, EXACT) == 1
    assert B.summation_bound(10, 2.0**-8) == B.summation_bound(10, 2.0**-8, EXACT)
    assert B.softmax_bound(50, 2.0, BF16) == B.softmax_bound(50, 2.0, BF16, accumulation=EXACT)
    assert B.online_softmax_bound(50, 2.0, BF16, block=4) == B.online_softmax_bound(
        50, 2.0, BF16, block=4, accumulation="exact"
    )


def test_summation_roundings_errors():
    with pytest.raises(ValueError, match="accumulation: expected"):
        B.summation_roundings(3, "nope")
    with pytest.raises(ValueError, match="accumulation: expected"):
        B.softmax_bound(3, 1.0, 0.01, accumulation="chunked(x)")
    with pytest.raises(TypeError):
        B.summation_roundings(3, "chunked", chunk=2)  # the chunk lives in the model
    with pytest.raises(
        ValueError, match="summation_roundings: n: expected a positive integer, got 0"
    ):
        B.summation_roundings(0)


def test_summation_bound_holds_for_sequential_sums():
    rng = np.random.default_rng(6)
    # n where the sequential bound gamma(n - 1) is still below 1
    for fmt, n in ((BF16, 100), (E8M4, 12)):
        E = rnd(rng.uniform(0, 1, size=(20, n)), fmt)
        exact = np.array([math.fsum(r) for r in E.tolist()])
        for model in ALL_MODELS:
            got = sim.sums(E, fmt, model)
            bound = B.summation_bound(n, fmt, model)
            assert bound < 1, (fmt.name, model, bound)
            assert (np.abs(got - exact) <= bound * exact).all()
    assert B.summation_bound(10, 2.0**-8, "exact") == pytest.approx(2.0**-8, rel=1e-12)
    assert B.summation_bound(10, 2.0**-8, "sequential") <= B.gamma(9, 2.0**-8)


# -- the shape of the softmax bounds ----------------------------------------------------


def test_first_order_is_blanchard_higham_higham():
    u = 2.0**-8
    for n, R in [(1, 0.0), (10, 3.0), (4096, 20.0)]:
        assert B.softmax_bound_first_order(n, R, u, accumulation=SEQUENTIAL) == pytest.approx(
            (n + 2 + 2 * R) * u
        )
    assert B.softmax_bound_first_order(10, 3.0, u) == pytest.approx((1 + 3 + 6) * u)  # EXACT
    assert B.softmax_bound_first_order(10, 3.0, u, accumulation="chunked(4)") == pytest.approx(
        (3 + 3 + 6) * u
    )


def test_online_first_order_formula():
    u, eta = 2.0**-11, 1e-7
    n, R, b = 1000, 4.0, 16
    K = 63
    got = B.online_softmax_bound_first_order(
        n, R, u, block=b, exp_error=eta, accumulation="sequential"
    )
    assert got == pytest.approx((15 + 3 * K + 2 * R) * u + (K + 1) * eta)
    got = B.online_softmax_bound_first_order(n, R, u, block=b, exp_error=eta)  # EXACT
    assert got == pytest.approx((1 + 3 * K + 2 * R) * u + (K + 1) * eta)
    got = B.online_softmax_bound_first_order(
        n, R, u, block=b, exp_error=eta, accumulation=chunked(8)
    )
    assert got == pytest.approx((2 + 3 * K + 2 * R) * u + (K + 1) * eta)
    assert B.online_softmax_bound_first_order(n, R, u, block=1) == pytest.approx(
        (3 * n + 2 * R) * u
    )


@pytest.mark.parametrize("model", [*ALL_MODELS, "chunked", "chunked(8)"], ids=str)
def test_online_with_one_block_equals_safe(model):
    for u in (2.0**-8, FP16, FP32):
        for n in (1, 7, 300):
            kw = dict(accumulation=model)
            assert B.online_softmax_bound(n, 2.5, u, block=n, **kw) == B.softmax_bound(
                n, 2.5, u, **kw
            )
            assert B.online_softmax_bound(n, 2.5, u, block=10**6, **kw) == B.softmax_bound(
                n, 2.5, u, **kw
            )
            assert B.online_softmax_bound_first_order(
                n, 2.5, u, block=n, **kw
            ) == B.softmax_bound_first_order(n, 2.5, u, **kw)


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
        100, 3.0, u, accumulation="sequential"
    )


def test_gamma_closed_form_dominates_rigorous_bound():
    """The documented closed form (1 + gamma_{r_b+3K}) e^{2uR} (1+eta)/(1-eta)^K - 1."""
    for n, R, b, u in [
        (100, 5.0, 1, 2.0**-11),
        (4096, 20.0, 64, 2.0**-24),
        (500, 3.0, 16, 2.0**-8),
    ]:
        eta = B.default_exp_error(u)
        K = -(-n // b)
        r_b = B.summation_roundings(min(b, n))
        closed = (1 + B.gamma(r_b + 3 * K, u)) * math.exp(2 * u * R) * (1 + eta) / (
            1 - eta
        ) ** K - 1
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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=0, x_range=1.0, u=0.01), "online_softmax_bound: n: expected a positive integer"),
        (dict(n=2.0, x_range=1.0, u=0.01), "n: expected a positive integer, got 2.0"),
        (dict(n=4, x_range=-1.0, u=0.01), "x_range: expected"),
        (dict(n=4, x_range=math.nan, u=0.01), "x_range: expected"),
        (dict(n=4, x_range=1.0, u=0.0), "u: expected a unit roundoff"),
        (dict(n=4, x_range=1.0, u=1.5), "u: expected a unit roundoff"),
        (dict(n=4, x_range=1.0, u="nope"), "unknown format"),
        (
            dict(n=4, x_range=1.0, u=0.01, block=0),
            "online_softmax_bound: block: expected a positive integer, got 0",
        ),
        (dict(n=4, x_range=1.0, u=0.01, exp_error=1.0), "exp_error: expected"),
        (dict(n=4, x_range=1.0, u=0.01, accumulation="nope"), "accumulation: expected"),
    ],
)
def test_bound_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        B.online_softmax_bound(**kwargs)


# -- attention ---------------------------------------------------------------------------

ATTN_BC = 8
U64 = 2.0**-53


def _attention_inputs(fmt, n, d=16, seed=0):
    with x64_enabled():
        return tuple(
            np.asarray(round_to(jnp.asarray(t[0, 0]), fmt)) for t in make_inputs(seed, n, d=d)
        )


def _old_script_bound(fmt, n, q, k, v, bc):
    """The attention bound as experiments/bounds_vs_error.py computed it before it moved
    into fa_jax.bounds (its text, with W from numpy instead of golden attention)."""

    def g64(k_):
        return k_ * U64 / (1 - k_ * U64)

    u, eta = fmt.unit_roundoff, B.default_exp_error(fmt.unit_roundoff)
    sig = fmt.smallest_subnormal if fmt.subnormals else fmt.tiny
    c = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.T) * c
    a = (np.abs(q) @ np.abs(k).T) * c
    delta = (((1 + u) ** 2 - 1) * np.abs(s) + ((1 + u) ** 2 + 1) * g64(q.shape[-1]) * a).max(1)
    delta = delta + sig
    R = s.max(axis=1) - s.min(axis=1) + 2 * delta
    p = np.exp(s - s.max(axis=1, keepdims=True))
    W = (p / p.sum(axis=1, keepdims=True)) @ np.abs(v)
    slack = 4 * g64(max(n, q.shape[-1]))
    K = -(-n // bc) if bc else 1
    vmax = float(np.abs(v).max())
    Fs, Zs = [], []
    for R_i, d_i in zip(R.tolist(), delta.tolist()):
        if bc is None:
            eps = B.softmax_bound(n, R_i, fmt)
            hi = (1 + eps) * math.exp(2 * d_i) * (1 + u) ** 2 * (1 + g64(n))
            lo = (1 - eps) * math.exp(-2 * d_i) * (1 - u) ** 2 * (1 - g64(n))
            Fs.append(max(hi - 1, 1 - lo) + slack)
            Zs.append(sig)
            continue
        n_u = 1 + B.summation_roundings(bc) + 3 * (K - 1)
        n_o = 3 * K + 1
        d_hi = math.exp(u * R_i + K * math.log1p(eta) + n_u * math.log1p(u))
        d_lo = math.exp(-u * R_i + K * math.log1p(-eta) + n_u * math.log1p(-u))
        t_hi = math.exp(u * R_i + K * math.log1p(eta) + n_o * math.log1p(u) + math.log1p(g64(bc)))
        t_lo = math.exp(
            -u * R_i + K * math.log1p(-eta) + n_o * math.log1p(-u) + math.log1p(-g64(bc))
        )
        F = max(
            t_hi * (1 + u) * math.exp(2 * d_i) / d_lo - 1,
            1 - t_lo * (1 - u) * math.exp(-2 * d_i) / d_hi,
        )
        if math.isinf(B.online_softmax_bound(n, R_i, fmt, block=bc)) or (
            n * d_hi * t_hi * vmax > fmt.max
        ):
            F = math.inf
        Fs.append(F + slack)
        Zs.append(K * sig * (1 + u) ** (3 * K + 1) / d_lo + sig / 2)
    return np.asarray(Fs)[:, None] * W + np.asarray(Zs)[:, None], np.asarray(Fs)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bc", [None, 8, 32])
@pytest.mark.parametrize("n", [16, 40])
def test_attention_bound_equals_the_scripts_formula(fmt, bc, n):
    """d = 16: the scale 1/4 is exact, where the old formula needed no scale term.  The
    float64 reference's own error is now bounded (the old ``4 gamma_max(n, d)``
    was an estimate), which moves the bound by far less than a float32 ulp of it."""
    f = get_format(fmt)
    q, k, v = _attention_inputs(f, n)
    got = B.attention_bound(q, k, v, f, bc=bc)
    want, want_factor = _old_script_bound(f, n, q, k, v, bc)
    np.testing.assert_allclose(got.bound, want, rtol=1e-7)
    np.testing.assert_allclose(got.factor, want_factor, rtol=1e-7)
    assert (got.factor < 1).all()


ATTN_CHECKED = ["bf16", "fp16", "fp32"]  # formats whose bound is below 1 at ATTN_N
# Each format compiles four attention programs: bf16 and fp16 (the two 16-bit widths of
# the paper) run by default, fp32 (the same code with a smaller unit roundoff) in
# `-m slow`.
ATTN_DEFAULT = ["bf16", "fp16"]
ATTN_N = 40  # five key blocks of ATTN_BC; one length, as compiling dominates the cost


def _attention_cases(formats):
    """(format, policy, bc, n, measured |O_hat - O_golden|, AttentionBound) for
    reference and FA2 flash attention under paper_uniform and fa2_kernel."""
    cases = []
    with x64_enabled():
        for name in formats:
            fmt = get_format(name)
            n = ATTN_N
            q, k, v = _attention_inputs(fmt, n, seed=n)
            gold = np.asarray(reference_attention(q, k, v, golden()))
            bounds = {bc: B.attention_bound(q, k, v, fmt, bc=bc) for bc in (None, ATTN_BC)}
            for policy in (paper_uniform(fmt), fa2_kernel(fmt)):
                for bc, bound in bounds.items():
                    if bc is None:
                        o = reference_attention(q, k, v, policy)
                    else:
                        o = flash_attention(q, k, v, policy, Blocks(ATTN_BC, bc))[0]
                    err = np.abs(np.asarray(o) - gold)
                    cases.append((fmt, policy, bc, n, err, bound))
    return cases


@pytest.fixture(scope="module")
def attention_cases():
    return _attention_cases(ATTN_DEFAULT)


def _check_bound_holds(cases):
    """Every case is a check: F < 1, so the bound is finite and below W."""
    for _fmt, policy, bc, n, err, bound in cases:
        assert np.isfinite(err).all()
        assert (bound.factor < 1).all(), (policy.name, bc, n, bound.factor.max())
        assert (bound.bound < bound.weights).all(), (policy.name, bc, n)
        bad = ~(err <= bound.bound)
        assert not bad.any(), (
            f"{policy.name} bc={bc} n={n}: {int(bad.sum())} entries above the bound, "
            f"worst err/bound {float((err / bound.bound).max())!r}"
        )


def _check_bound_is_meaningful(cases):
    """The bound is not loose by more than a few hundred at these sizes."""
    for _fmt, policy, bc, n, err, bound in cases:
        assert err.max() > 0 and bound.bound.max() < 1000 * err.max(), (policy.name, bc, n)


def test_attention_bound_holds_for_emulated_attention(attention_cases):
    assert len(attention_cases) == len(ATTN_DEFAULT) * 2 * 2  # policies x bc
    _check_bound_holds(attention_cases)


def test_attention_bound_is_meaningful(attention_cases):
    _check_bound_is_meaningful(attention_cases)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(set(ATTN_CHECKED) - set(ATTN_DEFAULT)))
def test_attention_bound_holds_and_is_meaningful_in_more_formats(fmt):
    cases = _attention_cases([fmt])
    _check_bound_holds(cases)
    _check_bound_is_meaningful(cases)


@pytest.mark.parametrize("n", [16, 40])
def test_attention_bound_is_infinite_where_e4m3fn_exponentials_may_underflow(n):
    """e4m3fn: some rows' exponentials may underflow, so F = inf (no relative bound)."""
    fmt = get_format("e4m3fn")
    q, k, v = _attention_inputs(fmt, n, seed=n)
    for bc in (None, ATTN_BC):
        assert np.isinf(B.attention_bound(q, k, v, fmt, bc=bc).factor).any(), bc


def test_attention_bound_fields():
    fmt = get_format("bf16")
    q, k, v = _attention_inputs(fmt, 16)
    b = B.attention_bound(q[:5], k, v[:, :3], fmt, bc=4)
    assert b.bound.shape == b.weights.shape == (5, 3)
    assert b.factor.shape == b.absolute.shape == b.score_error.shape == b.x_range.shape == (5,)
    np.testing.assert_array_equal(b.bound, b.factor[:, None] * b.weights + b.absolute[:, None])
    s = (q[:5] @ k.T) / 4
    np.testing.assert_allclose(b.x_range, s.max(1) - s.min(1), rtol=1e-15)
    # Each row's factor dominates the scalar function's, which leaves out the golden's error.
    for i in range(5):
        F = B.attention_bound_factor(
            16,
            float(b.x_range[i]),
            fmt,
            bc=4,
            score_error=float(b.score_error[i]),
            v_max=float(np.abs(v).max()),
        )
        assert F < b.factor[i] < F * (1 + 1e-9)


def test_attention_bound_counts_the_rounded_scale():
    """d = 3: 1/sqrt(3) is not a value of bf16; its rounding enters the score error."""
    fmt = get_format("bf16")
    q, k, v = _attention_inputs(fmt, 8, d=3)
    b = B.attention_bound(q, k, v, fmt)
    c = 1 / math.sqrt(3)
    s = np.abs((q @ k.T) * c).max(axis=1)
    with x64_enabled():
        rho = abs(float(round_to(jnp.float64(c), fmt)) - c) / c
    assert rho > 0
    assert (b.score_error >= rho * s).all()
    assert (b.factor < 1).all()
    with x64_enabled():
        o = np.asarray(reference_attention(q, k, v, paper_uniform(fmt)))
        gold = np.asarray(reference_attention(q, k, v, golden()))
    assert (np.abs(o - gold) <= b.bound).all()


@pytest.mark.parametrize("bc", [None, 1, 16])
def test_attention_bound_factor_monotone(bc):
    f = B.attention_bound_factor
    kw = dict(bc=bc, score_error=0.01, v_max=4.0)
    Fs = [f(n, 5.0, BF16, **kw) for n in (1, 2, 16, 17, 64, 256, 1000, 4096)]
    assert all(a <= b for a, b in itertools.pairwise(Fs)), Fs
    assert Fs[0] < Fs[-1]
    assert f(64, 3.0, BF16, **kw) < f(64, 4.0, BF16, **kw)  # range
    assert f(64, 3.0, BF16, bc=bc, score_error=0.0) < f(64, 3.0, BF16, bc=bc, score_error=0.01)
    assert f(64, 3.0, FP16, **kw) < f(64, 3.0, BF16, **kw)  # u
    for u in (FP16, FP32, 2.0**-11):
        assert 0 < f(64, 3.0, u, **kw) < 1
    # bf16 with one key per block: 3K roundings of 2**-8 each, K = 64: vacuous.
    assert (f(64, 3.0, BF16, **kw) < 1) == (bc != 1)


def test_attention_flash_factor_grows_with_the_number_of_blocks():
    f = B.attention_bound_factor
    assert f(256, 5.0, BF16, bc=256) < f(256, 5.0, BF16, bc=64) < f(256, 5.0, BF16, bc=1)
    # One block: flash's F exceeds the reference's (two more roundings, gamma_bc), barely.
    ref, one = f(256, 5.0, BF16), f(256, 5.0, BF16, bc=256)
    assert ref < one < ref + 4 * BF16.unit_roundoff


def test_attention_bound_factor_first_order():
    """Small u: F is (2R' + n_o + n_u + 1) u + 2K eta + 2 delta to first order (flash)
    and eps + 2u + 2 delta (reference), R' = x_range + 2 delta."""
    u, R, delta, n, bc = 2.0**-30, 4.0, 1e-12, 256, 16
    K = n // bc
    R2 = R + 2 * delta
    want = (2 * R2 + 3 * K + 1 + 1 + 1 + 3 * (K - 1) + 1) * u + 2 * delta
    got = B.attention_bound_factor(n, R, u, bc=bc, score_error=delta, exp_error=0.0)
    assert got == pytest.approx(want, rel=1e-6)
    got = B.attention_bound_factor(n, R, u, score_error=delta, exp_error=0.0)
    assert got == pytest.approx((1 + 3 + 2 * R2) * u + 2 * u + 2 * delta, rel=1e-6)


def test_attention_bound_factor_range():
    # fp16: exp(-R) underflows for R > 9.7, as for the softmax bounds.
    assert B.attention_bound_factor(64, 10.0, FP16) == math.inf
    assert B.attention_bound_factor(64, 10.0, FP16, bc=8) == math.inf
    assert math.isfinite(B.attention_bound_factor(64, 10.0, FP16.unit_roundoff, bc=8))
    # o (and P V) may overflow when |v| is near the format's max.
    assert B.attention_bound_factor(64, 1.0, FP16, bc=8, v_max=60000.0) == math.inf
    assert B.attention_bound_factor(64, 1.0, FP16, v_max=65504.0) == math.inf
    assert math.isfinite(B.attention_bound_factor(64, 1.0, FP16, bc=8, v_max=100.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n=0, x_range=1.0, u=0.01), "attention_bound_factor: n: expected a positive integer"),
        (dict(n=True, x_range=1.0, u=0.01), "n: expected a positive integer, got True"),
        (dict(n=4, x_range=1.0, u=0.01, bc=0), "bc: expected a positive integer, got 0"),
        (dict(n=4, x_range=1.0, u=0.01, bc=2.0), "bc: expected a positive integer"),
        (dict(n=4, x_range=-1.0, u=0.01), "x_range: expected"),
        (dict(n=4, x_range=1.0, u=0.01, score_error=math.nan), "score_error: expected"),
        (dict(n=4, x_range=1.0, u=0.01, score_error=-1.0), "score_error: expected"),
        (dict(n=4, x_range=1.0, u=0.01, v_max=math.inf), "v_max: expected"),
        (dict(n=4, x_range=1.0, u=1.5), "u: expected a unit roundoff"),
        (dict(n=4, x_range=1.0, u=0.01, exp_error=-0.1), "exp_error: expected"),
    ],
)
def test_attention_bound_factor_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        B.attention_bound_factor(**kwargs)


def test_attention_bound_argument_errors():
    fmt = get_format("bf16")
    q, k, v = _attention_inputs(fmt, 8, d=4)
    with pytest.raises(ValueError, match=r"q, k, v: expected shapes \(N, d\)"):
        B.attention_bound(q[None], k, v, fmt)
    with pytest.raises(ValueError, match=r"q, k, v: expected shapes"):
        B.attention_bound(q, k[:, :3], v, fmt)
    with pytest.raises(ValueError, match=r"q, k, v: expected shapes"):
        B.attention_bound(q, k, v[:5], fmt)
    with pytest.raises(ValueError, match=r"q: expected finite values of bfloat16"):
        B.attention_bound(q + 2.0**-12, k, v, fmt)
    with pytest.raises(ValueError, match=r"v: expected finite values"):
        B.attention_bound(q, k, np.where(v > 0, np.inf, v), fmt)
    with pytest.raises(ValueError, match=r"fmt: expected a format of at most FP32's precision"):
        B.attention_bound(q, k, v, FP64)
    with pytest.raises(ValueError, match="bc: expected a positive integer, got 0"):
        B.attention_bound(q, k, v, fmt, bc=0)
    with pytest.raises(ValueError, match="unknown format"):
        B.attention_bound(q, k, v, "nope")
