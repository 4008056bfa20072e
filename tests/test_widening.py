"""widen: exact conversion of every narrow float to float32/float64."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax.widening import widen

NARROW = [
    np.float16,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float4_e2m1fn,
]


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("target", [np.float32, np.float64], ids=["f32", "f64"])
def test_every_code_of_narrow_formats(dtype, target):
    bits = ml_dtypes.finfo(dtype).bits
    codes = np.arange(2**bits, dtype=np.uint8 if bits <= 8 else np.uint16).view(dtype)
    with x64_enabled():
        got = np.asarray(widen(jnp.asarray(codes), target))
    want = codes.astype(np.float64).astype(target)  # numpy/ml_dtypes widen exactly
    u = np.uint32 if target == np.float32 else np.uint64
    same = (got.view(u) == want.view(u)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), codes[~same][:5]


def test_float32_subnormals_survive_widening_to_float64():
    x = np.array([2.0**-149, -(2.0**-140), 1e-40, -0.0, np.inf, np.nan, 3.0], np.float32)
    with x64_enabled():
        got = np.asarray(widen(jnp.asarray(x), np.float64))
        assert float(jnp.asarray(x).astype(jnp.float64)[0]) == 0.0  # XLA's own convert flushes
    want = x.astype(np.float64)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[3])


def test_rejects_narrowing():
    with pytest.raises(ValueError, match="expected float32 or float64 as the target, got float16"):
        widen(np.ones(2, np.float32), np.float16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gradient_is_the_identity(x64, dtype):
    # bfloat16 goes through a bitcast: without its own derivative the gradient was 0.
    x = jnp.asarray([0.5, -3.0, 2.0**-10], dtype)
    for target in (jnp.float32, jnp.float64):
        g = jax.grad(lambda x, t=target: jnp.sum(widen(x, t) * 3.0).astype(jnp.float32))(x)
        assert g.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float64), [3.0, 3.0, 3.0])
        jitted = jax.jit(jax.grad(lambda x, t=target: jnp.sum(widen(x, t)).astype(jnp.float32)))(x)
        np.testing.assert_array_equal(np.asarray(jitted, np.float64), [1.0, 1.0, 1.0])
