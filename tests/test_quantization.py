"""fa_jax.quantization: amax scales, quantize/dequantize against ml_dtypes, block
scales, the Hadamard matrix and the incoherent transform (FlashAttention-3 §3.3)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled
from hypothesis import assume, given
from hypothesis import strategies as st

from fa_jax import quantization as qz
from fa_jax.formats import E4M3FN, E5M2
from fa_jax.inputs import make_inputs

ML = {E4M3FN.name: ml_dtypes.float8_e4m3fn, E5M2.name: ml_dtypes.float8_e5m2}


def fp16_outliers(seed=0, n=64, d=16, heads=2):
    """Outlier-distributed inputs rounded to FP16, as float64 numpy arrays."""
    q, k, v = make_inputs(seed, n, batch=1, heads=heads, d=d, distribution="outliers")
    return tuple(t.astype(np.float16).astype(np.float64) for t in (q, k, v))


def numpy_quantize(x, s, fmt):
    """The reference: float32 x / s (IEEE, correctly rounded), cast by ml_dtypes."""
    s32 = np.asarray(s, np.float32)
    return (x.astype(np.float32) / s32).astype(ML[fmt.name]).astype(np.float64)


def numpy_scale(amax, fmt):
    return np.float32(amax) / np.float32(fmt.max) if amax > 0 else np.float32(1.0)


# -- Hadamard and the incoherent transform -------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64, 256])
def test_hadamard_is_sylvester_and_orthogonal_exactly(d):
    h = qz.hadamard(d)
    assert h.shape == (d, d) and h.dtype == np.float64
    assert set(np.unique(h)) <= {-1.0, 1.0}
    assert np.array_equal(h @ h.T, d * np.eye(d))
    assert np.array_equal(h, h.T) and np.all(h[0] == 1) and np.all(h[:, 0] == 1)
    if d > 1:  # H_2k = [[H_k, H_k], [H_k, -H_k]]
        half = qz.hadamard(d // 2)
        assert np.array_equal(h, np.block([[half, half], [half, -half]]))


@pytest.mark.parametrize("d", [0, 3, 96, -4, 2.0, True, "8"])
def test_hadamard_rejects_non_powers_of_two(d):
    with pytest.raises(ValueError, match="power of 2"):
        qz.hadamard(d)


@pytest.mark.parametrize("d", [16, 64, 256])
def test_incoherent_matrix_is_orthogonal_exactly_for_powers_of_four(x64, d):
    m = np.asarray(qz.incoherent_matrix(jax.random.key(3), d))
    assert np.array_equal(m @ m.T, np.eye(d))  # 1/sqrt(d) is a power of 2: exact
    # D H / sqrt(d) is not its own inverse (H / sqrt(d) is): the check above is the
    # orthogonality of M, not the involution of the unsigned Hadamard matrix.
    assert not np.array_equal(m @ m, np.eye(d))
    signs = np.asarray(qz.random_signs(jax.random.key(3), d))
    assert set(np.unique(signs)) == {-1.0, 1.0}
    assert np.array_equal(m, signs[:, None] * qz.hadamard(d) / np.sqrt(d))


def test_random_signs_are_seeded(x64):
    a, b = (np.asarray(qz.random_signs(jax.random.key(s), 64)) for s in (0, 0))
    c = np.asarray(qz.random_signs(jax.random.key(1), 64))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_incoherent_transform_keeps_qk_and_spreads_outliers(x64, d):
    q, k, _ = fp16_outliers(n=128, d=d)
    tq, tk = (np.asarray(t) for t in qz.incoherent_transform(q, k, jax.random.key(0)))
    s, ts = q @ np.swapaxes(k, -1, -2), tq @ np.swapaxes(tk, -1, -2)
    norms = np.linalg.norm(q, axis=-1)[..., :, None] * np.linalg.norm(k, axis=-1)[..., None, :]
    assert np.max(np.abs(ts - s) / norms) <= 1e-12
    # row norms are kept, the largest entries shrink (the outliers are spread out)
    np.testing.assert_allclose(np.linalg.norm(tq, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-14)
    assert np.max(np.abs(tq)) < np.max(np.abs(q)) and np.max(np.abs(tk)) < np.max(np.abs(k))


def test_incoherent_transform_errors(x64):
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="same d"):
        qz.incoherent_transform(np.ones((4, 8)), np.ones((4, 16)), key)
    with pytest.raises(ValueError, match="power of 2"):
        qz.incoherent_transform(np.ones((4, 12)), np.ones((4, 12)), key)
    with pytest.raises(ValueError, match=r"\(\.\.\., N, d\)"):
        qz.incoherent_transform(np.ones(8), np.ones(8), key)
    with pytest.raises(ValueError, match="finite"):
        qz.incoherent_transform(np.full((4, 8), np.nan), np.ones((4, 8)), key)


# -- scales and quantization -------------------------------------------------------


@pytest.mark.parametrize("fmt", [E4M3FN, E5M2], ids=lambda f: f.name)
def test_per_tensor_quantize_matches_ml_dtypes_bit_for_bit(x64, fmt):
    for x in fp16_outliers(seed=1):
        x_hat, s = qz.quantize_per_tensor(x, fmt)
        s_ref = numpy_scale(np.max(np.abs(x)), fmt)
        assert s.shape == () and float(s) == float(s_ref)
        ref = numpy_quantize(x, s_ref, fmt)
        assert np.array_equal(np.asarray(x_hat), ref)
        deq = np.asarray(qz.dequantize(x_hat, s))
        assert np.array_equal(deq, np.float64(s_ref) * ref)  # exact in float64
        # the amax element maps to +-max exactly, nothing beyond it
        i = np.unravel_index(np.argmax(np.abs(x)), x.shape)
        assert abs(float(x_hat[i])) == fmt.max and float(np.max(np.abs(x_hat))) == fmt.max


@pytest.mark.parametrize("block", [8, 16, 64])
def test_per_block_scales_and_quantize(x64, block):
    x = fp16_outliers(seed=2)[1]  # (1, 2, 64, 16)
    s = np.asarray(qz.per_block_scales(x, E4M3FN, block))
    assert s.shape == (1, 2, 64 // block, 1)
    tiles = x.reshape(1, 2, 64 // block, block * 16)
    expected = np.vectorize(lambda a: numpy_scale(a, E4M3FN))(np.max(np.abs(tiles), -1))
    assert np.array_equal(s[..., 0], expected.astype(np.float64))
    x_hat, s2 = qz.quantize_per_block(x, E4M3FN, block)
    assert np.array_equal(np.asarray(s2), s)
    rows = np.repeat(s, block, axis=-2)
    assert np.array_equal(np.asarray(qz.expand_block_scales(s2, block)), rows)
    assert np.array_equal(np.asarray(x_hat), numpy_quantize(x, rows, E4M3FN))
    # each block's amax maps to max
    block_max = np.max(np.abs(np.asarray(x_hat)).reshape(1, 2, 64 // block, -1), -1)
    assert np.all(block_max == E4M3FN.max)


def test_zero_amax_gives_unit_scale(x64):
    x = np.zeros((1, 8, 4))
    x[0, 4:] = 3.0
    x_hat, s = qz.quantize_per_block(x, E4M3FN, 4)
    assert np.array_equal(np.asarray(s)[0, :, 0], [1.0, np.float32(3.0) / np.float32(448)])
    assert np.array_equal(np.asarray(x_hat)[0, :4], np.zeros((4, 4)))
    assert np.all(np.asarray(x_hat)[0, 4:] == 448.0)
    x_hat, s = qz.quantize_per_tensor(np.zeros((3, 2)), E4M3FN)
    assert float(s) == 1.0 and not np.any(np.asarray(x_hat))


@given(
    st.lists(st.floats(-(2.0**20), 2.0**20, width=32), min_size=16, max_size=16),
    st.integers(-30, 30),
)
def test_quantize_matches_ml_dtypes_on_any_float32_values(values, shift):
    """Any FP32-valued x (scaled by 2**shift: subnormal scales and quotients too)."""
    x = np.ldexp(np.asarray(values, np.float32), shift).reshape(4, 4)
    assume(np.all(np.isfinite(x)))
    x = x.astype(np.float64)
    with x64_enabled():
        x_hat, s = qz.quantize_per_block(x, E4M3FN, 2)
        rows = np.repeat(np.asarray(s), 2, axis=-2)
        assert np.array_equal(np.asarray(x_hat), numpy_quantize(x, rows, E4M3FN), equal_nan=True)


def test_quantize_jit_and_vmap_equal_eager(x64):
    x = fp16_outliers(seed=3)[0]
    for fn in (
        lambda t: qz.quantize_per_tensor(t, E4M3FN),
        lambda t: qz.quantize_per_block(t, E4M3FN, 16),
    ):
        eager = fn(x)
        jitted = jax.jit(fn)(jnp.asarray(x))
        for a, b in zip(eager, jitted):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    # vmapped over heads: one block scale set per head, as a per-head eager call
    x_hat, s = jax.vmap(lambda t: qz.quantize_per_block(t, E4M3FN, 16))(jnp.asarray(x[0]))
    for h in range(2):
        e_hat, e_s = qz.quantize_per_block(x[0, h], E4M3FN, 16)
        assert np.array_equal(np.asarray(x_hat[h]), np.asarray(e_hat))
        assert np.array_equal(np.asarray(s[h]), np.asarray(e_s))


def test_quantization_errors(x64):
    x = np.ones((2, 12, 4))
    with pytest.raises(ValueError, match="block=8 does not divide the sequence length 12"):
        qz.per_block_scales(x, E4M3FN, 8)
    with pytest.raises(ValueError, match="block: expected a positive integer, got 0"):
        qz.quantize_per_block(x, E4M3FN, 0)
    with pytest.raises(ValueError, match=r"expected an array \(\.\.\., N, d\)"):
        qz.per_block_scales(np.ones(4), E4M3FN, 2)
    bad = x.copy()
    bad[0, 3, 1] = np.inf
    bad[1, 0, 0] = np.nan
    for fn in (
        lambda t: qz.per_tensor_scale(t, E4M3FN),
        lambda t: qz.quantize(t, 1.0, E4M3FN),
        lambda t: qz.quantize_per_block(t, E4M3FN, 4),
    ):
        with pytest.raises(ValueError, match="expected finite values, got 2 non-finite"):
            fn(bad)
    # under jit values are unknown: a non-finite amax gives a NaN scale, never a silent number
    s = jax.jit(lambda t: qz.per_tensor_scale(t, E4M3FN))(jnp.asarray(bad))
    assert np.isnan(float(s))


def test_int8_codes_round_ties_to_even_and_clamp_on_both_sides(x64):
    """x / s past ±127 (a scale smaller than amax / 127, or ties at ±127.5) clamps
    to ±127 on each side; ties go to even; a negative value rounding to 0 gives
    +0 (an integer has no -0)."""
    y = np.array([-1e3, -128.0, -127.5, -126.5, -0.5, -0.2, 0.2, 0.5, 1.5, 126.5, 127.5, 1e3])
    want = np.array([-127, -127, -127, -126, 0, 0, 0, 0, 2, 126, 127, 127], np.float64)
    for s in (1.0, 0.25):
        got = np.asarray(qz.quantize(y * s, s, qz.INT8))
        np.testing.assert_array_equal(got, want)
        assert not np.signbit(got[want == 0]).any()
