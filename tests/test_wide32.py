"""Sequential FP32 accumulation on float64 hardware (``fa_jax.wide32``).

Where every step stays in float32's normal range the result must be the bits of
the exact emulation it replaces (``ops.matmul``, "sequential", FP32), for
products exact in float64 but not in float32; where a step leaves that range
(a partial sum below 2**-126, an overflow) the fallback must run.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import get_format, ops, wide32

FP32 = get_format("fp32")
SENTINEL = -12345.0  # what the fallback returns: it ran


def emulated(a, b):
    return np.asarray(jax.jit(lambda a, b: ops.matmul(a, b, FP32, accumulation="sequential"))(a, b))


def fast(a, b, *, jit=True, fallback=None):
    def f(a, b):
        fb = fallback or (lambda: jnp.full((*a.shape[:-1], b.shape[-1]), SENTINEL))
        return wide32.sequential_matmul(a, b, fb)

    return np.asarray((jax.jit(f) if jit else f)(a, b))


def fp32_values(rng, shape, lo_exp=-8, hi_exp=8):
    """FP32 values (24-bit significands) of both signs, with zeros."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(lo_exp, hi_exp, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32).astype(np.float64)


def bits(x):
    return np.asarray(x, np.float64).view(np.uint64)


def test_fp32_products_match_the_emulation_bit_for_bit():
    """FP32 x FP32 (48-bit products) and FP32 x bf16, with cancelling sums."""
    rng = np.random.default_rng(0)
    with x64_enabled():
        a = fp32_values(rng, (2, 7, 67))
        b = fp32_values(rng, (2, 67, 9))
        b[:, 34:, :] = -b[:, :33, :][:, ::-1][:, : 67 - 34, :]  # sums pass near zero
        v = b.astype(ml_dtypes.bfloat16).astype(np.float64)
        for x, y in ((a, b), (np.abs(a) / 64, v)):
            got = fast(jnp.asarray(x), jnp.asarray(y))
            assert (got != SENTINEL).all()  # the fast path ran
            assert np.array_equal(bits(got), bits(emulated(jnp.asarray(x), jnp.asarray(y))))


@pytest.mark.parametrize("jit", [True, False])
def test_zero_sums_are_positive_zero_as_emulated(jit):
    with x64_enabled():
        a = jnp.asarray([[1.5, -1.5, 0.0], [-0.0, -0.0, -0.0]])
        b = jnp.asarray([[2.0], [2.0], [-0.0]])
        got = fast(a, b, jit=jit)
        assert np.array_equal(bits(got), bits(emulated(a, b)))
        assert (bits(got) == 0).all()  # +0, never -0


@pytest.mark.parametrize("scale", [2.0**-70, 2.0**70])
def test_leaving_float32_normals_runs_the_fallback(scale):
    """Partial sums below 2**-126 (which the hardware's conversion may flush) or
    past FLT_MAX: the fallback runs, and with the real one the bits are exact."""
    rng = np.random.default_rng(1)
    with x64_enabled():
        a = jnp.asarray(fp32_values(rng, (3, 20), 0, 2) * scale)
        b = jnp.asarray(fp32_values(rng, (20, 4), 0, 2) * scale)
        assert (fast(a, b) == SENTINEL).all()

        def exact():
            return ops.matmul(a, b, FP32, accumulation="sequential")

        got = fast(a, b, fallback=exact)
        assert np.array_equal(bits(got), bits(emulated(a, b)))


def test_vmap_takes_one_path_for_the_batch():
    rng = np.random.default_rng(2)
    with x64_enabled():
        a = fp32_values(rng, (2, 4, 10))
        b = fp32_values(rng, (2, 10, 3))
        a[1] *= 2.0**-70  # only the second configuration leaves the range
        b[1] *= 2.0**-70
        f = jax.vmap(
            lambda a, b: wide32.sequential_matmul(a, b, lambda: jnp.full((4, 3), SENTINEL))
        )
        got = np.asarray(jax.jit(f)(jnp.asarray(a), jnp.asarray(b)))
        assert (got == SENTINEL).all()


def test_float32_carriers_are_refused():
    a = jnp.ones((2, 2), jnp.float32)
    with pytest.raises(TypeError, match="float64 carriers"):
        wide32.sequential_matmul(a, a, lambda: a)
