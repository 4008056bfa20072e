"""fa_jax.inputs: the seeded input distributions of the experiments."""

import numpy as np
import pytest

from fa_jax.inputs import DISTRIBUTIONS, OUTLIER_PROBABILITY, OUTLIER_STD, make_inputs


def test_inputs_deterministic_and_independent_per_length():
    a = make_inputs(3, 16, d=8)
    b = make_inputs(3, 16, d=8)
    c = make_inputs(3, 24, d=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a[0].shape == (1, 1, 16, 8) and a[0].dtype == np.float64
    assert not np.array_equal(a[0], c[0][..., :16, :])


def test_input_distributions():
    (u, _, _) = make_inputs(0, 256, d=64, distribution="uniform")
    assert u.min() >= -1 and u.max() < 1 and u.min() < -0.9
    (n, _, _) = make_inputs(0, 256, batch=4, heads=4, d=64)
    (o, _, _) = make_inputs(0, 256, batch=4, heads=4, d=64, distribution="outliers")
    assert abs(n.std() - 1) < 0.02
    frac = np.mean(np.abs(o) > 6)  # ~0.1% outliers, ~0.05% of them below 6
    assert 0.0004 < frac < 0.002


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_same_seed_and_length_give_the_same_bits(distribution):
    for seed, n in [(0, 1), (7, 33), (2**40, 5)]:
        a = make_inputs(seed, n, batch=2, heads=3, d=4, distribution=distribution)
        b = make_inputs(seed, n, batch=2, heads=3, d=4, distribution=distribution)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_seeds_and_lengths_are_independent():
    """Another seed, or another length, draws other values (not a prefix or a shift)."""
    q0 = make_inputs(0, 32, d=8)[0][0, 0]
    q1 = make_inputs(1, 32, d=8)[0][0, 0]
    q_long = make_inputs(0, 64, d=8)[0][0, 0]
    assert not np.isin(q0, q1).any()
    assert not np.isin(q0, q_long).any()


def test_q_k_v_are_distinct_draws():
    q, k, v = make_inputs(5, 16, d=8)
    assert not np.array_equal(q, k) and not np.array_equal(k, v)
    assert not np.isin(q, v).any()


def test_draws_follow_the_numpy_generator_of_seed_and_length():
    """The documented recipe: default_rng([seed, seq_len]), q then k then v."""
    rng = np.random.default_rng([4, 10])
    want = [rng.standard_normal((1, 1, 10, 2)) for _ in range(3)]
    for got, w in zip(make_inputs(4, 10, d=2), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("batch,heads,n,d", [(1, 1, 1, 1), (2, 3, 5, 7), (1, 4, 16, 64)])
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_shapes_and_dtype(batch, heads, n, d, distribution):
    out = make_inputs(0, n, batch=batch, heads=heads, d=d, distribution=distribution)
    assert len(out) == 3
    for x in out:
        assert x.shape == (batch, heads, n, d) and x.dtype == np.float64
        assert np.isfinite(x).all()


def test_outlier_share_and_size():
    """About OUTLIER_PROBABILITY of the entries carry an N(0, OUTLIER_STD^2) outlier:
    the outliers draw is the normal draw plus a sparse difference."""
    shape = dict(batch=8, heads=8, d=64)
    base = make_inputs(1, 512, **shape)[0]
    out = make_inputs(1, 512, distribution="outliers", **shape)[0]
    np.testing.assert_array_equal(base, make_inputs(1, 512, **shape)[0])
    diff = out - base
    np.testing.assert_array_equal(out.shape, base.shape)
    # The normal part is drawn first, from the same generator state.
    rng = np.random.default_rng([1, 512])
    normal_part = rng.standard_normal(out.shape)
    mask = rng.random(out.shape) < OUTLIER_PROBABILITY
    np.testing.assert_array_equal(normal_part, base)
    share = mask.mean()
    assert abs(share - OUTLIER_PROBABILITY) < 0.2 * OUTLIER_PROBABILITY  # 2M entries
    assert (diff[~mask] == 0).all()
    assert 0.8 * OUTLIER_STD < diff[mask].std() < 1.2 * OUTLIER_STD


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((-1, 16), {}, "make_inputs: seed: expected a non-negative integer, got -1"),
        ((1.5, 16), {}, "make_inputs: seed: expected a non-negative integer"),
        ((True, 16), {}, "make_inputs: seed: expected a non-negative integer"),
        ((0, 0), {}, "make_inputs: seq_len: expected a positive integer, got 0"),
        ((0, 16.0), {}, "make_inputs: seq_len: expected a positive integer"),
        ((0, 16), {"batch": 0}, "make_inputs: batch: expected a positive integer"),
        ((0, 16), {"heads": -2}, "make_inputs: heads: expected a positive integer"),
        ((0, 16), {"d": 0}, "make_inputs: d: expected a positive integer"),
        ((0, 16), {"distribution": "cauchy"}, r"make_inputs: distribution: expected one of"),
    ],
)
def test_argument_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_inputs(*args, **kwargs)


def test_numpy_integers_are_accepted():
    a = make_inputs(np.int64(3), np.int32(16), d=np.int64(8))
    b = make_inputs(3, 16, d=8)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
