"""fa_jax.softmax: bit-exact against the numpy op-by-op simulation, the online-vs-safe
error bounds of fa_jax.bounds, golden agreement, overflow and masking, jit vs eager.

The simulation (tests/softmax_sim.py) computes every op exactly and rounds it once,
independently of fa_jax.ops; fa_jax must reproduce it bit for bit.

Compile time dominates here (about 0.6 s per (policy, block, shape)), so every test
uses one of two fixed shapes, (ROWS, WIDTH) and (ROWS, LONG): a row of n < width
scores is padded with -inf (masked) entries at its end, which change no bit of the
result: the running max, the chunk partition of the sums and the blocks of the
online recurrence are the same up to n, masked entries add exact zeros, and a
block of masked entries rescales by exp(0) = 1 and adds 0.
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import softmax_sim as sim
from helpers import largest_n_below, x64_enabled
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import round_exact

from fa_jax import BF16, E4M3FN, FP16, FP32, custom
from fa_jax import bounds as B
from fa_jax.accumulation import EXACT, SEQUENTIAL, chunked
from fa_jax.presets import golden, paper_uniform
from fa_jax.softmax import (
    exp2_factor,
    naive_softmax,
    online_softmax,
    rescale_factor,
    safe_softmax,
    shifted_exp,
)

ROWS, WIDTH, LONG = 4, 300, 4096
BLOCKS = [1, 7, 64]
SIM_FORMATS = [BF16, FP16, E4M3FN]
MODELS = [EXACT, SEQUENTIAL, chunked(8)]
E8M4 = custom(8, 4)
BOUND_FORMATS = [BF16, FP16, FP32, E8M4]
KINDS = ("uniform", "normal", "ascending", "descending", "ties", "outlier")


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def _examples(fraction):
    """A share of the loaded hypothesis profile's max_examples (60 in "ci")."""
    return max(5, int(settings.default.max_examples * fraction))


def make_rows(seed, kind, n, spread, loc, fmt, rows=ROWS):
    """``rows`` rows of n scores in [loc, loc + spread] (each row its own spread,
    between 0.3 and 1 times ``spread``), rounded to fmt: [rows, n] float64."""
    rng = np.random.default_rng(seed)
    Z = sim.row_shapes(rng, kind, rows, n)
    spreads = spread * rng.uniform(0.3, 1.0, size=(rows, 1))
    return sim.rnd(loc + spreads * Z, fmt)


def pad(X, width):
    """X [rows, n] padded with -inf (masked) entries to [rows, width]."""
    return np.concatenate([X, np.full((X.shape[0], width - X.shape[1]), -np.inf)], axis=1)


def log_uniform(lo, hi):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


SPREADS = log_uniform(0.1, 30.0)


def _rows_strategy(n, spread=SPREADS, loc=None):
    """Keyword arguments of make_rows (less the format)."""
    return st.fixed_dictionaries(
        {
            "seed": st.integers(0, 2**32 - 1),
            "kind": st.sampled_from(KINDS),
            "n": n,
            "spread": spread,
            "loc": st.floats(-20.0, 20.0) if loc is None else loc,
        }
    )


# -- (a) bit for bit against the simulation --------------------------------------------


@pytest.mark.parametrize("model", MODELS, ids=str)
@pytest.mark.parametrize("fmt", SIM_FORMATS, ids=lambda f: f.name)
@settings(max_examples=_examples(1 / 3), deadline=None)
@given(params=_rows_strategy(st.integers(1, WIDTH)))
def test_bit_exact_against_simulation(fmt, model, params):
    """paper_uniform(fmt, accumulation=model): safe_softmax and online_softmax(block)
    equal the simulated op sequences bit for bit, and padding gives exact zeros (also
    in E4M3FN, which has no infinities: the -inf padding is a mask, never rounded)."""
    X = make_rows(fmt=fmt, **params)
    n = X.shape[1]
    policy = paper_uniform(fmt, accumulation=model)
    Xp = pad(X, WIDTH)
    runs = [("safe", safe_softmax(Xp, policy), lambda: sim.safe_softmax(X, fmt, model))]
    runs += [
        (
            f"online block={b}",
            online_softmax(Xp, policy, block=b),
            lambda b=b: sim.online_softmax(X, fmt, model, b),
        )
        for b in BLOCKS
    ]
    for name, got, want in runs:
        got = np.asarray(got, np.float64)
        where = f"{name}, {policy.name}, {model}, n={n}"
        np.testing.assert_array_equal(got[:, n:], 0.0, err_msg=f"padding: {where}")
        np.testing.assert_array_equal(got[:, :n], want(), err_msg=where)


@pytest.mark.parametrize("model", MODELS, ids=str)
def test_bit_exact_with_masked_entries(model):
    """-inf scores anywhere (leading, interleaved, whole blocks, whole rows) against
    the simulation, which treats them literally (x - m = -inf, exp = 0)."""
    rng = np.random.default_rng(7)
    X = make_rows(1, "uniform", WIDTH, 12.0, -3.0, BF16)
    X[0, :] = -np.inf  # fully masked
    X[1, :150] = -np.inf  # leading: the first blocks have m = -inf
    X[2, rng.uniform(size=WIDTH) < 0.5] = -np.inf  # interleaved
    X[3, 64:200] = -np.inf  # whole blocks in the middle
    policy = paper_uniform(BF16, accumulation=model)
    np.testing.assert_array_equal(
        np.asarray(safe_softmax(X, policy)), sim.safe_softmax(X, BF16, model)
    )
    for b in BLOCKS:
        np.testing.assert_array_equal(
            np.asarray(online_softmax(X, policy, block=b)),
            sim.online_softmax(X, BF16, model, b),
            err_msg=f"block={b}",
        )


def test_masked_entries_in_a_format_without_infinities():
    """Masked entries are -inf scores (fa_jax.softmax's docstring) in every policy.
    E4M3FN has no infinities: casting the scores to it turns -inf into NaN, and
    the whole row becomes NaN unless the mask survives the cast."""
    X = make_rows(5, "uniform", WIDTH, 2.0, -2.0, E4M3FN)  # naive: sums <= 150 < 448
    X[:, WIDTH // 2 :] = -np.inf
    X[0, :] = -np.inf
    policy = paper_uniform(E4M3FN)
    outs = {"safe": safe_softmax(X, policy), "naive": naive_softmax(X, policy)}
    outs.update({f"online block={b}": online_softmax(X, policy, block=b) for b in BLOCKS})
    for name, y in outs.items():
        y = np.asarray(y)
        assert not np.isnan(y).any(), f"{name}: NaN in {np.isnan(y).sum()} of {y.size}"
        np.testing.assert_array_equal(y[:, WIDTH // 2 :], 0.0, err_msg=name)
        np.testing.assert_array_equal(y[0], 0.0, err_msg=name)
    np.testing.assert_array_equal(
        np.asarray(outs["safe"])[1:, : WIDTH // 2],
        sim.safe_softmax(X[1:, : WIDTH // 2], E4M3FN, EXACT),
    )


def test_sums_are_exact_at_a_midpoint():
    """Exact and chunked sums that float64 does not hold exactly.

    e = [1] * 257 + [fl(exp(-80))]: the exact sum 257 + 2**-115.4 rounds to 258 in
    bf16, but 257 + 2**-115.4 is 257 in float64, a midpoint that ties to 256.  The
    EXACT model promises the exact sum rounded once, and chunked(8) promises
    fl(acc + exact chunk sum) = fl(256 + (1 + 2**-115.4)) = 258 for the last chunk.
    """
    X = np.zeros((ROWS, WIDTH))
    X[:, 257] = -80.0
    X[:, 258:] = -np.inf
    for model in (EXACT, chunked(8)):
        policy = paper_uniform(BF16, accumulation=model)
        want = sim.safe_softmax(X[:, :258], BF16, model)
        assert want[0, 0] == sim.rnd(1 / 258, BF16)
        got = np.asarray(safe_softmax(X, policy))[:, :258]
        np.testing.assert_array_equal(got, want, err_msg=f"{model}: 1/d with d = 256, not 258")


# -- (b) online vs safe within the bounds ---------------------------------------------------

# The largest score spread drawn per format: fp16's exp(x - m) underflows (an infinite
# bound) beyond R = 9.69; e8m4's bound passes 1 beyond a handful of scores.
SPREAD_MAX = {BF16.name: 20.0, FP16.name: 9.0, FP32.name: 40.0, E8M4.name: 1.0}
LOC_MAX = 20.0


def _worst_bound(n, R, fmt):
    """The larger of softmax_bound and online_softmax_bound over BLOCKS."""
    acc = paper_uniform(fmt).accumulation
    online = (B.online_softmax_bound(n, R, fmt, block=b, accumulation=acc) for b in BLOCKS)
    return max(B.softmax_bound(n, R, fmt, accumulation=acc), *online)


def _row_spread_max(fmt):
    """A row's spread after rounding its scores in [loc, loc + spread] to fmt: at most
    SPREAD_MAX plus two ulps at |loc| + spread."""
    top = LOC_MAX + SPREAD_MAX[fmt.name]
    return SPREAD_MAX[fmt.name] + 2 * 2.0 ** (math.floor(math.log2(top)) - fmt.man_bits)


def _longest_meaningful_row(fmt):
    """The largest n <= LONG whose bounds are all below 1 at the largest row spread
    (the bounds grow with n and R): every drawn row is then a check."""
    R = _row_spread_max(fmt)  # test_bound_domains asserts that n = 2 is below 1
    return largest_n_below(lambda n: _worst_bound(n, R, fmt), LONG)


N_MAX = {fmt.name: _longest_meaningful_row(fmt) for fmt in BOUND_FORMATS}


def test_bound_domains():
    """Each format's drawn rows reach the largest n with bounds below 1 (not a bound
    >= 1, which |error| <= bound * exact makes almost free, nor an infinite one)."""
    assert N_MAX == {BF16.name: 45, FP16.name: 367, FP32.name: LONG, E8M4.name: 5}
    for fmt in BOUND_FORMATS:
        n, R = N_MAX[fmt.name], _row_spread_max(fmt)
        assert _worst_bound(2, R, fmt) < 1
        assert _worst_bound(n, R, fmt) < 1
        if n < LONG:
            assert _worst_bound(n + 1, R, fmt) >= 1
    assert math.isinf(B.softmax_bound(4, 9.7, FP16))  # hence fp16's spreads stop at 9


@pytest.mark.parametrize("fmt", BOUND_FORMATS, ids=lambda f: f.name)
@settings(deadline=None)
@given(data=st.data(), block=st.sampled_from(BLOCKS))
def test_online_matches_safe_within_bounds(fmt, data, block):
    """|online - exact| <= online_softmax_bound * exact and |safe - exact| <=
    softmax_bound * exact elementwise, so |online - safe| <= (sum of both) * exact;
    exact is the float64 softmax of the rounded scores.  Rows have n >= 2 scores and
    spreads where every bound is finite and below 1, so every row is a check."""
    n_max = N_MAX[fmt.name]
    params = data.draw(
        _rows_strategy(
            n=st.one_of(st.integers(2, min(64, n_max)), st.integers(2, n_max), st.just(n_max)),
            spread=log_uniform(0.05, SPREAD_MAX[fmt.name]),
            loc=st.floats(-LOC_MAX, LOC_MAX),
        )
    )
    X = make_rows(fmt=fmt, **params)
    n = X.shape[1]
    policy = paper_uniform(fmt)
    Xp = pad(X, LONG)
    safe = np.asarray(safe_softmax(Xp, policy))
    online = np.asarray(online_softmax(Xp, policy, block=block))
    np.testing.assert_array_equal(safe[:, n:], 0.0)
    np.testing.assert_array_equal(online[:, n:], 0.0)
    safe, online = safe[:, :n], online[:, :n]
    exact = sim.exact_softmax(X)
    # The float64 reference is within ~1e-14 relative of the true softmax; allow it.
    slack = 1e-12
    for i in range(X.shape[0]):
        R = float(X[i].max() - X[i].min())
        b_safe = B.softmax_bound(n, R, fmt, accumulation=policy.accumulation)
        b_online = B.online_softmax_bound(n, R, fmt, block=block, accumulation=policy.accumulation)
        where = f"{fmt.name} n={n} R={R} block={block} row {i}"
        assert R <= _row_spread_max(fmt), where
        assert b_safe < 1 and b_online < 1, f"{where}: bounds {b_safe}, {b_online} not below 1"
        e_safe = np.abs(safe[i] - exact[i]) / exact[i]
        e_online = np.abs(online[i] - exact[i]) / exact[i]
        e_diff = np.abs(online[i] - safe[i]) / exact[i]
        assert e_safe.max() <= b_safe + slack, f"safe {where}: {e_safe.max()} > {b_safe}"
        assert e_online.max() <= b_online + slack, f"online {where}: {e_online.max()} > {b_online}"
        assert e_diff.max() <= b_safe + b_online + 2 * slack, f"online - safe {where}"


# -- (c) golden, overflow, masking ------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_golden_online_equals_safe(seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((ROWS, WIDTH)) * np.array([[0.1], [1.0], [10.0], [30.0]])
    policy = golden()
    safe = np.asarray(safe_softmax(X, policy))
    np.testing.assert_allclose(safe, sim.exact_softmax(X), rtol=1e-13, atol=0)
    for b in BLOCKS:
        np.testing.assert_allclose(
            np.asarray(online_softmax(X, policy, block=b)),
            safe,
            rtol=1e-13,
            atol=0,
            err_msg=f"block={b}",
        )


def test_naive_overflows_in_fp16_and_safe_does_not():
    """exp(x) overflows fp16 (max 65504, log = 11.09) once x > 11.1."""
    X = np.full((ROWS, WIDTH), -np.inf)
    X[:, :5] = np.linspace(-2.0, 0.0, 5)
    X[:, 5] = [11.0, 11.125, 12.0, 30.0]  # 11.1 is 11.1015625 in fp16 and also overflows
    policy = paper_uniform(FP16)
    naive = np.asarray(naive_softmax(X, policy))
    safe = np.asarray(safe_softmax(X, policy))
    assert np.isfinite(naive[0]).all()  # exp(11) = 59874 fits
    for i in (1, 2, 3):
        assert not np.isfinite(naive[i]).all(), f"row {i}: {X[i, 5]}"
    assert np.isfinite(safe).all()
    np.testing.assert_allclose(safe.sum(axis=1), 1.0, rtol=1e-2)
    assert (safe[:, 5] > 0.9).all() and (safe[:, 6:] == 0).all()
    x = np.full((ROWS, WIDTH), -np.inf)
    x[:, 0] = 11.1  # rounds to fp16 11.1015625 > log(65504)
    assert not np.isfinite(np.asarray(naive_softmax(x, policy))[:, 0]).any()
    assert (np.asarray(safe_softmax(x, policy))[:, 0] == 1.0).all()


@pytest.mark.parametrize("policy", [golden(), paper_uniform(BF16)], ids=lambda p: p.name)
def test_fully_masked_rows_give_zero(policy):
    X = np.full((ROWS, WIDTH), -np.inf)
    X[1, 3] = 0.5  # one unmasked score: probability 1
    X[2, :10] = np.arange(10.0) / 4
    outs = {"safe": safe_softmax(X, policy), "naive": naive_softmax(X, policy)}
    outs.update({f"online block={b}": online_softmax(X, policy, block=b) for b in BLOCKS})
    for name, y in outs.items():
        y = np.asarray(y)
        assert not np.isnan(y).any(), name
        np.testing.assert_array_equal(y[0], 0.0, err_msg=name)
        np.testing.assert_array_equal(y[3], 0.0, err_msg=name)
        assert y[1, 3] == 1.0 and (np.delete(y[1], 3) == 0).all(), name
        assert (y[2, 10:] == 0).all() and (y[2, :10] > 0).all(), name


# -- (d) jit vs eager -----------------------------------------------------------------------


# Eager mode compiles every primitive for its shapes (seconds): one shape, and a block
# size with few blocks (5, so the rescaling runs).  The default run checks naive
# softmax here; the safe one and the online recurrence run eagerly by default inside
# reference and flash attention (test_attention, test_backward).
@pytest.mark.parametrize(
    "name",
    [
        "naive",
        pytest.param("safe", marks=pytest.mark.slow),
        pytest.param("online", marks=pytest.mark.slow),
    ],
)
def test_jit_equals_eager(name):
    """The default (jitted per configuration) results equal op-by-op eager ones."""
    X = make_rows(3, "normal", WIDTH, 20.0, -5.0, BF16)
    policy = paper_uniform(BF16)
    call = {
        "safe": lambda: safe_softmax(X, policy),
        "online": lambda: online_softmax(X, policy, block=64),
        "naive": lambda: naive_softmax(X, policy),
    }[name]
    jitted = np.asarray(call())
    with jax.disable_jit():
        eager = np.asarray(call())
    np.testing.assert_array_equal(eager, jitted)


@pytest.mark.parametrize("block", [0, -2, True, 1.5, None])
def test_online_block_is_checked(block):
    with pytest.raises(
        ValueError, match=rf"online_softmax: block: expected a positive integer, got {block!r}"
    ):
        online_softmax(np.zeros((1, 4)), paper_uniform(BF16), block=block)


def test_online_block_accepts_numpy_integers():
    x = np.linspace(-2.0, 2.0, 12).reshape(1, 12)
    np.testing.assert_array_equal(
        np.asarray(online_softmax(x, paper_uniform(BF16), block=np.int64(4))),
        np.asarray(online_softmax(x, paper_uniform(BF16), block=4)),
    )


# -- (e) the exp2 placement: the scale folded into one FMA before an exp2 ---------------


def _exp2_policy(fmt):
    return paper_uniform(fmt).replace(
        scale="exp2", exp_model="exp2_correctly_rounded", exp=FP32, stats=FP32
    )


def _exp2_oracle(x, m, c, shift_c):
    """fl32(2^fl32(x c - fl32(m c'))) with the FMA's one rounding taken exactly
    (Fractions) and 2^t from numpy's float64 exp2, correctly rounded to FP32 (the
    float64 -> float32 cast is one rounding)."""
    out = []
    for xi in x:
        shift = round_exact(Fraction(m) * Fraction(shift_c), FP32)
        t = round_exact(Fraction(xi) * Fraction(c) - Fraction(shift), FP32)
        out.append(float(np.float32(np.exp2(t))))
    return np.array(out)


def test_exp2_shifted_exp_and_rescale_bit_exact():
    """e = fl(2^fl(fma(x, c, -fl(m c)))) and α = fl(2^fl(fl(m_old - m_new) c)),
    against exact rational arithmetic, eagerly and jitted."""
    policy = _exp2_policy(BF16)
    rng = np.random.default_rng(7)
    x = sim.rnd(rng.normal(0.0, 6.0, 200), BF16)
    m = float(np.max(x))
    c = float(exp2_factor(1 / math.sqrt(64), FP32))
    assert c == float(np.float32(np.float64(1 / math.sqrt(64)) * math.log2(math.e)))
    want = _exp2_oracle(x, m, c, c)
    got = shifted_exp(jnp.asarray(x), jnp.float64(m), policy, log2_scale=c)  # eagerly
    np.testing.assert_array_equal(np.asarray(got), want)
    jitted = jax.jit(shifted_exp, static_argnums=2)(x, m, policy, log2_scale=c)
    np.testing.assert_array_equal(np.asarray(jitted), want)
    # the backward's shift: the log-sum-exp times fl(log2 e)
    lse, c2 = 3.25, float(exp2_factor(1.0, FP32))
    got = shifted_exp(jnp.asarray(x), jnp.float64(lse), policy, log2_scale=c, shift_scale=c2)
    np.testing.assert_array_equal(np.asarray(got), _exp2_oracle(x, lse, c, c2))
    m_old = x[:50]
    alpha = np.asarray(rescale_factor(jnp.asarray(m_old), jnp.float64(m), policy, log2_scale=c))
    diffs = [round_exact(Fraction(a) - Fraction(m), FP32) for a in m_old]
    want = [float(np.float32(np.exp2(round_exact(Fraction(t) * Fraction(c), FP32)))) for t in diffs]
    np.testing.assert_array_equal(alpha, want)


def test_exp2_masks_and_unchanged_max():
    policy = _exp2_policy(BF16)
    c = exp2_factor(0.125, FP32)
    e = shifted_exp(jnp.array([-jnp.inf, 1.0]), jnp.float64(-jnp.inf), policy, log2_scale=c)
    assert np.asarray(e)[0] == 0.0 and np.isfinite(np.asarray(e)[1])
    alpha = rescale_factor(jnp.array([-jnp.inf, 2.5]), jnp.array([2.5, 2.5]), policy, log2_scale=c)
    np.testing.assert_array_equal(np.asarray(alpha), [0.0, 1.0])


def test_exp2_softmaxes_near_fp64():
    """Scale 1 (c = fl(log2 e)): the three softmaxes under the exp2 placement stay
    near the FP64 softmax."""
    X = make_rows(5, "normal", 64, 10.0, 0.0, BF16)
    policy = _exp2_policy(BF16)
    exact = np.exp(X - X.max(axis=1, keepdims=True))
    exact /= exact.sum(axis=1, keepdims=True)
    for name, got in {
        "safe": safe_softmax(X, policy),
        "online": online_softmax(X, policy, block=16),
        "naive": naive_softmax(X, policy),
    }.items():
        # 2^-8 relative per P entry (bf16), a few ulps of FP32 before it
        rel = np.abs(np.asarray(got) - exact) / np.maximum(exact, 1e-30)
        assert np.max(rel) <= 2**-7, name
