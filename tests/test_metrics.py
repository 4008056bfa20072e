"""fa_jax.metrics against plain numpy float64 / scipy, brute-force ULP enumeration, and the
jit / vmap contracts."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.stats
from helpers import x64_enabled
from hypothesis import given
from hypothesis import strategies as st

from fa_jax import BF16, FP16, FP32, FP64, custom, registered_formats, round_to
from fa_jax import metrics as M
from fa_jax.encoding import decode

ELEMENTWISE = ["max_abs_diff", "mean_abs_diff", "std_abs_diff", "rmse", "max_rel_diff"]


def np_reference(name, a, b):
    """The metric in plain numpy float64."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    d = np.abs(a - b)
    if name == "max_abs_diff":
        return d.max()
    if name == "mean_abs_diff":
        return d.mean()
    if name == "std_abs_diff":
        return d.std(ddof=0)
    if name == "rmse":
        return np.sqrt(np.mean(d**2))
    if name == "max_rel_diff":
        return (d / np.maximum(np.abs(b), np.finfo(np.float64).tiny)).max()
    raise ValueError(name)


def sample_pair(seed, shape=(7, 33)):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(shape)
    a = b + rng.standard_normal(shape) * 1e-3
    return a, b


# -- elementwise statistics --------------------------------------------------------


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_float64_matches_numpy(name, x64):
    a, b = sample_pair(0)
    got = getattr(M, name)(a, b)
    assert got.dtype == jnp.float64 and got.shape == ()
    np.testing.assert_allclose(float(got), np_reference(name, a, b), rtol=1e-12)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_float32_is_computed_in_float32(name):
    a, b = (x.astype(np.float32) for x in sample_pair(1))
    got = getattr(M, name)(a, b)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), np_reference(name, a, b), rtol=2e-5)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_narrow_inputs_are_widened_not_measured_in_their_format(name):
    a, b = sample_pair(2)
    a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(np.float16)
    got = getattr(M, name)(jnp.asarray(a16), jnp.asarray(b16))
    assert got.dtype == jnp.float32
    want = np_reference(name, a16.astype(np.float64), b16.astype(np.float64))
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


def test_mixed_widths_use_the_wider(x64):
    a, b = sample_pair(3)
    assert M.rmse(a.astype(np.float32), b).dtype == jnp.float64


def test_float64_without_x64_is_refused():
    a, b = sample_pair(4)
    with pytest.raises(TypeError, match="jax_enable_x64 is off"):
        M.max_abs_diff(a, b.astype(np.float32))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_shape_mismatch_and_empty_are_errors(name):
    fn = getattr(M, name)
    with pytest.raises(ValueError, match=r"same shape, got \(3,\) and \(4,\)"):
        fn(jnp.zeros(3), jnp.zeros(4))
    with pytest.raises(ValueError, match="non-empty"):
        fn(jnp.zeros((0, 2)), jnp.zeros((0, 2)))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_jit_equals_eager(name):
    a, b = (jnp.asarray(x, jnp.float32) for x in sample_pair(5))
    fn = getattr(M, name)
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(a, b)), np.asarray(fn(a, b)), rtol=1e-6)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_vmap_over_leading_axis(name, x64):
    a, b = sample_pair(6, shape=(5, 4, 9))
    fn = getattr(M, name)
    got = np.asarray(jax.vmap(fn)(jnp.asarray(a), jnp.asarray(b)))
    want = [np_reference(name, a[i], b[i]) for i in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_nan_propagates(name):
    a = jnp.array([1.0, jnp.nan, 3.0])
    assert jnp.isnan(getattr(M, name)(a, jnp.ones(3)))


def test_identical_inputs_give_zero():
    a = jnp.array([[0.0, -2.5], [1e-30, 7.0]])
    for name in ELEMENTWISE:
        assert float(getattr(M, name)(a, a)) == 0.0


def test_rmse_neither_overflows_nor_underflows():
    big = jnp.array([3e30, -4e30], jnp.float32)  # squares overflow float32
    np.testing.assert_allclose(float(M.rmse(big, jnp.zeros(2))), math.sqrt(12.5e60), rtol=1e-6)
    small = jnp.array([3e-30, 4e-30], jnp.float32)  # squares underflow float32
    np.testing.assert_allclose(float(M.rmse(small, jnp.zeros(2))), math.sqrt(12.5e-60), rtol=1e-6)
    assert float(M.rmse(jnp.array([jnp.inf, 1.0]), jnp.zeros(2))) == math.inf


def test_max_rel_diff_zero_reference():
    tiny = float(jnp.finfo(jnp.float32).tiny)
    # 0 vs 0 contributes 0; a normal reference is its own denominator.
    assert float(M.max_rel_diff(jnp.array([0.0, 1.5]), jnp.array([0.0, 1.0]))) == 0.5
    # a != 0 where b == 0: |a| / tiny, overflowing float32 to inf for |a| >= 4.
    assert float(M.max_rel_diff(jnp.array([1e-3]), jnp.array([0.0]))) == pytest.approx(
        1e-3 / tiny, rel=1e-6
    )
    assert float(M.max_rel_diff(jnp.array([10.0]), jnp.array([0.0]))) == math.inf
    got = float(M.max_rel_diff(jnp.array([tiny]), jnp.array([0.0])))
    assert got == 1.0
    # an explicit floor
    assert float(
        M.max_rel_diff(jnp.array([1e-3, 0.0]), jnp.array([0.0, 0.0]), eps=1e-2)
    ) == pytest.approx(0.1)
    # the default floor is the tiny of b's dtype
    b16 = jnp.array([0.0], jnp.float16)
    got16 = float(M.max_rel_diff(jnp.array([2.0**-14], jnp.float32), b16))
    assert got16 == 1.0  # float16 tiny = 2**-14
    with pytest.raises(ValueError, match="eps > 0, got 0"):
        M.max_rel_diff(jnp.ones(2), jnp.ones(2), eps=0)


def test_summary():
    a, b = (jnp.asarray(x, jnp.float32) for x in sample_pair(7))
    s = M.summary(a, b)
    assert sorted(s) == sorted(ELEMENTWISE)
    for k, v in s.items():
        assert float(v) == float(getattr(M, k)(a, b))
    sj = jax.jit(M.summary)(a, b)
    for k in s:
        np.testing.assert_allclose(float(sj[k]), float(s[k]), rtol=1e-6)
    sv = jax.vmap(M.summary)(a, b)
    assert all(v.shape == (a.shape[0],) for v in sv.values())


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_abs_diff_summary_is_each_function_bit_for_bit(dtype, x64):
    """The sweep's CSV holds these values: they must be the public functions' own,
    on random pairs, identical pairs, and pairs with inf and NaN differences."""
    a, b = sample_pair(11, (4, 1024, 8))
    identical = (b, b)
    with_inf = (np.where(np.arange(a.size).reshape(a.shape) == 5, np.inf, a), b)
    with_nan = (np.where(np.arange(a.size).reshape(a.shape) == 7, np.nan, a), b)
    for x, y in ((a, b), identical, with_inf, with_nan):
        x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
        got = M.abs_diff_summary(x, y)
        assert sorted(got) == ["max_abs_diff", "mean_abs_diff", "rmse", "std_abs_diff"]
        for name, value in got.items():
            want = np.asarray(getattr(M, name)(x, y))
            bits = f"u{want.itemsize}"
            np.testing.assert_array_equal(np.asarray(value).view(bits), want.view(bits), name)


def test_squares_never_contract_into_the_sums(x64):
    """std and rmse square each element and sum the squares by the stated tree.
    Fused into one loop, a compiler may contract a square and the first addition
    into an FMA (one rounding instead of two); on random rows of widely spread
    magnitudes that changed about 2% of std values.  Every path (eager, jit,
    vmap) must give the numpy tree's bits, which round each square."""
    rng = np.random.default_rng(5)
    n = 371
    a = rng.standard_normal((200, n)) * 10.0 ** rng.integers(-5, 5, (200, 1))
    b = a + rng.standard_normal((200, n)) * 1e-3
    d = np.abs(a - b)
    mean = np.array([np_tree_sum(r) / n for r in d])
    std = np.array([np.sqrt(np_tree_sum(np.square(r - m)) / n) for r, m in zip(d, mean)])
    s = d.max(axis=1)
    rms = np.array([m * np.sqrt(np_tree_sum(np.square(r / m)) / n) for r, m in zip(d, s)])
    for name, want in (("std_abs_diff", std), ("rmse", rms)):
        f = getattr(M, name)
        vmapped = np.asarray(jax.vmap(f)(a, b))
        jitted = np.asarray([jax.jit(f)(x, y) for x, y in zip(a[:20], b[:20])])
        np.testing.assert_array_equal(vmapped.view("u8"), want.view("u8"), name)
        np.testing.assert_array_equal(jitted.view("u8"), want[:20].view("u8"), name)


@pytest.mark.parametrize("n", [1, 5, 64, 65, 100, 128])
def test_a_padded_summary_is_the_unpadded_one(n, x64):
    """abs_diff_summary(..., length=n) of arrays padded to 128 elements, whatever the
    padding holds (zeros, NaN, inf), is abs_diff_summary of the first n, bit for bit:
    eagerly, and under jit with n traced (one program for every n)."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 4, n)
    b = a + rng.standard_normal(n) * 1e-3
    a[n // 2] = np.inf if n > 4 else a[n // 2]
    want = M.abs_diff_summary(a, b)
    summary = jax.jit(lambda x, y, k: M.abs_diff_summary(x, y, length=k))
    for fill in (0.0, np.nan, np.inf):
        pa, pb = np.full((2, 128), fill)
        pa[:n], pb[:n] = a, b
        for got in (M.abs_diff_summary(pa, pb, length=n), summary(pa, pb, n)):
            for name, value in want.items():
                np.testing.assert_array_equal(
                    np.asarray(got[name]).view("u8"), np.asarray(value).view("u8"), name
                )


@pytest.mark.parametrize("length", [0, 11, -1])
def test_a_length_outside_the_arrays_is_refused(length):
    with pytest.raises(ValueError, match=r"expected a length in \[1, 10\].*got"):
        M.abs_diff_summary(np.zeros(10, np.float32), np.ones(10, np.float32), length=length)


# -- ULP distance --------------------------------------------------------------------


SMALL = [f for f in registered_formats() if f.dtype is not None and f.bits <= 8]


def positions(values: np.ndarray):
    """Brute force: position of each value in the sorted set of distinct non-NaN values
    (±0 are one value; ±inf sit beyond ±max), -1 for NaN."""
    distinct = np.unique(values[~np.isnan(values)])
    pos = np.searchsorted(distinct, values).astype(np.int64)
    return np.where(np.isnan(values), -1, pos)


def assert_all_pairs(values: np.ndarray, fmt, dtype=np.float32):
    """ulp_distance over every pair of the given values of fmt vs brute force."""
    pos = positions(values.astype(np.float64))
    A, Bv = np.meshgrid(values, values, indexing="ij")
    PA, PB = np.meshgrid(pos, pos, indexing="ij")
    got = np.asarray(M.ulp_distance(jnp.asarray(A, dtype), jnp.asarray(Bv, dtype), fmt))
    sentinel = np.iinfo(got.dtype).max
    want = np.where((PA < 0) | (PB < 0), sentinel, np.abs(PA - PB))
    bad = got != want
    assert not bad.any(), (
        f"{bad.sum()} mismatches, e.g. a={A[bad][:3]} b={Bv[bad][:3]} "
        f"got={got[bad][:3]} want={want[bad][:3]}"
    )


@pytest.mark.parametrize("fmt", SMALL, ids=lambda f: f.name)
def test_ulp_distance_exhaustive_small_formats(fmt):
    codes = np.arange(2**fmt.bits, dtype=np.uint8)
    values = codes.view(fmt.dtype).astype(np.float32)
    assert_all_pairs(values, fmt)


@pytest.mark.parametrize(
    "fmt",
    [
        custom(5, 4),
        custom(4, 3, subnormals=False),
        custom(3, 2, specials="finite"),
        custom(4, 2, bias=3),
        custom(8, 3, bias=135),  # reaches below float32's normal range: carrier subnormals
        custom(8, 2, bias=133, subnormals=False),
    ],
    ids=lambda f: repr(f),
)
def test_ulp_distance_exhaustive_custom_formats(fmt):
    values = np.array([decode(c, fmt) for c in range(2**fmt.bits)], np.float32)
    assert_all_pairs(values, fmt)


def ordinal_from_codes(codes: np.ndarray, bits: int) -> list[int]:
    """IEEE formats: the magnitude code is the position; negate for the sign bit."""
    sign = 1 << (bits - 1)
    return [-(int(c) & (sign - 1)) if int(c) & sign else int(c) for c in codes]


@pytest.mark.parametrize(
    "fmt,uint,fdtype",
    [
        (BF16, np.uint16, ml_dtypes.bfloat16),
        (FP16, np.uint16, np.float16),
        (FP32, np.uint32, np.float32),
    ],
    ids=["bf16", "fp16", "fp32"],
)
def test_ulp_distance_random_codes(fmt, uint, fdtype):
    rng = np.random.default_rng(8)
    bits = 8 * np.dtype(uint).itemsize
    ca = rng.integers(0, 2**bits, size=20000, dtype=np.uint64).astype(uint)
    cb = rng.integers(0, 2**bits, size=20000, dtype=np.uint64).astype(uint)
    cb[:5000] = ca[:5000] + rng.integers(-3, 4, size=5000).astype(uint)  # near neighbours
    va, vb = ca.view(fdtype).astype(np.float32), cb.view(fdtype).astype(np.float32)
    got = np.asarray(M.ulp_distance(va, vb, fmt))
    assert got.dtype == np.uint32
    oa, ob = ordinal_from_codes(ca, bits), ordinal_from_codes(cb, bits)
    nan = np.isnan(va) | np.isnan(vb)
    want = np.array([abs(x - y) for x, y in zip(oa, ob)], dtype=np.uint64)
    want[nan] = 2**32 - 1
    np.testing.assert_array_equal(got.astype(np.uint64), want)


def test_ulp_distance_fp32_extremes():
    big = np.float32(3.4028235e38)
    got = M.ulp_distance(jnp.array([-big, -np.inf, 0.0]), jnp.array([big, np.inf, -0.0]), FP32)
    np.testing.assert_array_equal(np.asarray(got), [2 * 0x7F7FFFFF, 2 * 0x7F800000, 0])


def test_ulp_distance_float64(x64):
    rng = np.random.default_rng(9)
    ca = rng.integers(0, 2**64, size=3000, dtype=np.uint64)
    cb = ca.copy()
    cb[:1000] = rng.integers(0, 2**64, size=1000, dtype=np.uint64)
    cb[1000:2000] ^= np.uint64(1 << 63)  # opposite signs, same magnitude
    va, vb = ca.view(np.float64), cb.view(np.float64)
    got = np.asarray(M.ulp_distance(va, vb, FP64))
    assert got.dtype == np.uint64
    oa, ob = ordinal_from_codes(ca, 64), ordinal_from_codes(cb, 64)
    nan = np.isnan(va) | np.isnan(vb)
    for g, x, y, isnan in zip(got.tolist(), oa, ob, nan):
        assert g == (2**64 - 1 if isnan else abs(x - y))


def test_ulp_distance_neighbours_and_sign():
    x = jnp.array([1.0, 1.0, 1.0, -1.0, 0.0, 2.0**-24])
    y = jnp.array([1.0, 1.0 + 2.0**-7, 1.0 - 2.0**-8, 1.0, -0.0, -(2.0**-24)])
    i1 = 127 * 128  # bf16: index of 1.0 = code of 1.0 = 0x3F80
    np.testing.assert_array_equal(
        np.asarray(M.ulp_distance(x, y, BF16)), [0, 1, 1, 2 * i1, 0, 2 * 0x3380]
    )
    assert int(M.ulp_distance(jnp.array(1.0), jnp.array(2.0), "fp16")) == 1024


def test_ulp_distance_sentinel_for_non_values():
    S = 2**32 - 1
    one = jnp.ones(6)
    bad = jnp.array([1.0 + 2.0**-9, jnp.nan, 2.0**-140, 500.0, jnp.inf, 1.0])
    got = np.asarray(M.ulp_distance(bad, one, "e4m3fn"))
    # not on the grid, NaN, below the smallest subnormal, above max, inf without infs
    np.testing.assert_array_equal(got, [S, S, S, S, S, 0])
    got = np.asarray(M.ulp_distance(jnp.array([jnp.inf]), jnp.array([57344.0]), "e5m2"))
    np.testing.assert_array_equal(got, [1])  # inf is one step past max
    assert int(jnp.max(M.ulp_distance(bad, one, "e4m3fn"))) == S


def test_ulp_distance_of_rounded_values_is_zero_and_neighbours_one():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal(1000) * 100, jnp.float32)
    r = round_to(x, BF16)
    up = round_to(r * (1 + 2.0**-8) + jnp.sign(r) * 1e-40, BF16, mode="up")
    assert int(jnp.max(M.ulp_distance(r, r, BF16))) == 0
    d = np.asarray(M.ulp_distance(r, up, BF16))
    assert set(d.tolist()) <= {0, 1, 2}


def test_ulp_distance_jit_vmap_and_narrow_inputs():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((4, 50)).astype(ml_dtypes.float8_e4m3fn)
    b = rng.standard_normal((4, 50)).astype(ml_dtypes.float8_e4m3fn)
    eager = M.ulp_distance(jnp.asarray(a), jnp.asarray(b), "e4m3fn")
    jitted = jax.jit(M.ulp_distance, static_argnums=2)(jnp.asarray(a), jnp.asarray(b), "e4m3fn")
    mapped = jax.vmap(lambda p, q: M.ulp_distance(p, q, "e4m3fn"))(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(mapped))
    assert int(jnp.max(eager)) < 2**32 - 1


def test_float32_subnormals_survive_widening_to_float64(x64):
    """XLA's float32 -> float64 convert flushes subnormals on CPU; the metrics must not."""
    sub = np.array([1e-45, -3e-40, 1e-39], np.float32)
    np.testing.assert_array_equal(
        float(M.max_abs_diff(sub, np.zeros(3))), float(np.abs(sub.astype(np.float64)).max())
    )
    got = np.asarray(M.ulp_distance(sub, np.zeros(3), FP64))
    want = M.ulp_distance(sub.astype(np.float64), np.zeros(3), FP64)  # numpy's exact cast
    np.testing.assert_array_equal(got, np.asarray(want))
    assert got[0] == 874 * 2**52  # 2**-149 = 2**(E) with E - emin + 1 = 874 binades up
    assert float(M.wasserstein_1d(sub[:1], np.zeros(1))) == float(sub[0])


def test_ulp_distance_errors():
    with pytest.raises(ValueError, match="same shape"):
        M.ulp_distance(jnp.zeros(2), jnp.zeros(3), BF16)
    with pytest.raises(ValueError, match="float64 carrier"):
        M.ulp_distance(jnp.zeros(2), jnp.zeros(2), FP64)


# -- Wasserstein ------------------------------------------------------------------------


samples = st.one_of(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=200),
    st.lists(st.integers(-5, 5).map(float), min_size=1, max_size=200),  # many ties
)


@given(a=samples, b=samples)  # the profile's max_examples (60 in "ci")
def test_wasserstein_matches_scipy(a, b):
    with x64_enabled():
        got = float(M.wasserstein_1d(np.array(a), np.array(b)))
    want = scipy.stats.wasserstein_distance(a, b)
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (got, want)


def test_wasserstein_properties(x64):
    rng = np.random.default_rng(12)
    a = rng.standard_normal(300)
    assert float(M.wasserstein_1d(a, a)) == 0.0
    assert float(M.wasserstein_1d(a, a + 2.5)) == pytest.approx(2.5, rel=1e-12)
    b = rng.standard_normal(77) * 3
    assert float(M.wasserstein_1d(a, b)) == pytest.approx(float(M.wasserstein_1d(b, a)), rel=1e-14)
    # shapes are flattened
    assert float(M.wasserstein_1d(a.reshape(3, 100), b)) == float(M.wasserstein_1d(a, b))
    assert float(M.wasserstein_1d([0.0, 1.0, 3.0], [5.0, 6.0, 8.0])) == pytest.approx(5.0)


def test_wasserstein_jit_vmap_float32():
    rng = np.random.default_rng(13)
    a = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
    eager = np.array([float(M.wasserstein_1d(a[i], b[i])) for i in range(3)])
    np.testing.assert_allclose(np.asarray(jax.vmap(M.wasserstein_1d)(a, b)), eager, rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(M.wasserstein_1d)(a[0], b[0])), eager[0], rtol=1e-6)
    want = scipy.stats.wasserstein_distance(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_allclose(eager[0], want, rtol=1e-5)
    assert M.wasserstein_1d(a[0], b[0]).dtype == jnp.float32


def test_wasserstein_large_unequal_sizes_use_the_float_path():
    """len(a) * len(b) beyond int32: the CDF difference is formed in floats."""
    rng = np.random.default_rng(14)
    a = rng.standard_normal(50_000).astype(np.float32)
    b = (rng.standard_normal(50_001) * 1.1 + 0.2).astype(np.float32)
    got = float(M.wasserstein_1d(a, b))
    want = scipy.stats.wasserstein_distance(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_wasserstein_errors_and_nan():
    with pytest.raises(ValueError, match="non-empty"):
        M.wasserstein_1d(jnp.zeros(0), jnp.zeros(3))
    assert jnp.isnan(M.wasserstein_1d(jnp.array([1.0, jnp.nan]), jnp.array([0.0])))


# -- the order of the sums -----------------------------------------------------------


def np_tree_sum(x: np.ndarray) -> np.ndarray:
    """Pairwise summation in the metrics' stated order: zeros to a power of two, then
    halves added elementwise (numpy, one IEEE rounding per add)."""
    x = np.concatenate([x, np.zeros((1 << max(0, (x.size - 1).bit_length())) - x.size, x.dtype)])
    while x.size > 1:
        x = x[: x.size // 2] + x[x.size // 2 :]
    return x[0]


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4096, 65537])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_follow_the_stated_tree_bit_for_bit(n, dtype, x64):
    """mean, std and rmse are the pairwise tree's bits divided by N (so no thread
    count changes them), eagerly, under jit and under vmap; rmse divides by its
    scale elementwise."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal((2, n)).astype(dtype)
    b = (a + rng.standard_normal((2, n)) * 1e-3).astype(dtype)
    d = np.abs(a - b)
    mean = [np_tree_sum(r) / dtype(n) for r in d]
    std = [np.sqrt(np_tree_sum(np.square(r - m)) / dtype(n)) for r, m in zip(d, mean)]
    s = d.max(axis=1)
    rms = [m * np.sqrt(np_tree_sum(np.square(r / m)) / dtype(n)) for r, m in zip(d, s)]
    want = {"mean_abs_diff": mean, "std_abs_diff": std, "rmse": rms}
    bits = f"u{np.dtype(dtype).itemsize}"
    for name, values in want.items():
        f = getattr(M, name)
        values = np.asarray(values, dtype)
        eager = np.asarray([f(x, y) for x, y in zip(a, b)], dtype)
        jitted = np.asarray([jax.jit(f)(x, y) for x, y in zip(a, b)], dtype)
        vmapped = np.asarray(jax.vmap(f)(a, b), dtype)
        for got in (eager, jitted, vmapped):
            np.testing.assert_array_equal(got.view(bits), values.view(bits), name)
