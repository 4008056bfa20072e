"""XLA's attention kernel against fa_jax's model of it, bit for bit, and XLA CPU's
float32 exp against its model over the float32 inputs softmax feeds it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

import fa_jax
from fa_jax import kernels
from fa_jax.kernels import xla


def _inputs(shape, fmt, seed):
    rng = np.random.default_rng(seed)
    with x64_enabled():
        return [np.asarray(fa_jax.round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def _golden(q, k, v, causal):
    with x64_enabled():
        return np.asarray(fa_jax.reference_attention(q, k, v, fa_jax.golden(), causal=causal))


@pytest.mark.parametrize(("shape", "causal"), [((1, 2, 256, 64), True), ((1, 2, 512, 64), False)])
def test_xla_bf16_is_bit_identical_to_its_model(shape, causal):
    q, k, v = _inputs(shape, fa_jax.BF16, seed=0)
    real = kernels.real("xla", q, k, v, fmt="bf16", causal=causal)
    emulated = kernels.emulate("xla", q, k, v, fmt="bf16", causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), "bf16")
    assert c.identical_share >= 0.9999, c.summary()
    assert c.max_ulp <= 1, c.summary()


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 512, 64), (2, 4, 1024, 128), (1, 1, 4096, 64)])
@pytest.mark.parametrize("seed", [0, 1])
def test_xla_bf16_model_at_larger_shapes(shape, causal, seed):
    q, k, v = _inputs(shape, fa_jax.BF16, seed)
    real = kernels.real("xla", q, k, v, fmt="bf16", causal=causal)
    emulated = kernels.emulate("xla", q, k, v, fmt="bf16", causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), "bf16")
    # Misses come from the YNNPACK exp and, at 2048 keys and more, the softmax sum
    # (module docstring of fa_jax.kernels.xla); a miss on a near-zero output can be
    # many ulps.
    assert c.identical_share >= 0.999, c.summary()


def test_platform_names_versions_and_the_exp():
    facts = kernels.get("xla").platform()
    assert facts["jax"] == jax.__version__ and "jaxlib" in facts
    assert "xla_cpu_exp" in facts["exp_model"]


def _exp_against_xla(x: np.ndarray) -> int:
    real = np.asarray(jax.jit(jnp.exp)(jnp.asarray(x, jnp.float32)))
    with x64_enabled():
        model = np.asarray(xla.xla_cpu_exp(jnp.asarray(x, jnp.float64)))
    assert np.array_equal(model.astype(np.float32).astype(np.float64), model)
    return int(np.count_nonzero(model.astype(np.float32) != real))


def _float32_range(lo: float, hi: float, stride: int) -> np.ndarray:
    """Every ``stride``-th float32 in [lo, hi] (lo < 0 <= hi), by bit pattern."""
    top = np.array([lo], np.float32).view(np.uint32)[0]
    bits = np.arange(0x80000000, top + 1, stride, dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's exp")
def test_xla_cpu_exp_is_bit_exact_on_a_strided_subset():
    assert _exp_against_xla(_float32_range(-104.0, 0.0, 997)) == 0


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's exp")
def test_xla_cpu_exp_is_bit_exact_on_every_float32_in_minus_104_to_0():
    x = _float32_range(-104.0, 0.0, 1)
    for start in range(0, x.size, 1 << 24):
        assert _exp_against_xla(x[start : start + (1 << 24)]) == 0


def test_xla_cpu_exp_as_an_exp_model():
    exponential = pytest.importorskip("fa_jax.exponential")
    m = xla.xla_cpu_exp_model()
    assert isinstance(m, exponential.ExpModel) and m.name == "xla_cpu"
    with x64_enabled():
        x = jnp.asarray([-1.5, -0.25, 0.0])
        assert np.array_equal(np.asarray(m.fn(x, fa_jax.FP32)), np.asarray(xla.xla_cpu_exp(x)))
