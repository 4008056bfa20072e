"""The float32 carrier against the float64 one: attention forward and backward give
the same bits on both, with jax_enable_x64 on and off, and a float32 policy's
programs hold no 64-bit array (each float32 program is checked as it is compiled).

Compiling the float32 programs dominates: the case of fa2 with masks runs in CI's
second stage (``-m extended``); ``-m slow`` runs every attention × preset × format
and every model."""

import jax
import numpy as np
import pytest
from helpers import wide_types, x64_enabled

from fa_jax import accumulation, ops
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.exponential import EXP2, SLEEF_U10, TORCH_AVX2, YNNPACK
from fa_jax.presets import fa2_kernel, golden, paper_uniform, torch_math


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def problem(seed, lead=(2,), n=13, m=11, d=8, spread=1.0):
    """float32 Q, K, V, dO and d lse: the same values on both carriers."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: (rng.standard_normal(shape) * spread).astype(np.float32)  # noqa: E731
    q, k, v = draw(*lead, n, d), draw(*lead, m, d), draw(*lead, m, d)
    return q, k, v, draw(*lead, n, d), draw(*lead, n)


def run(fn, policy, q, k, v, d_o, d_lse, carrier, **kw):
    """(O, lse, dQ, dK, dV) of ``fn`` under ``policy`` on ``carrier``; a float32
    program is checked for 64-bit arrays on its way to running."""
    policy = policy.replace(carrier=carrier)
    dtype = policy.carrier_dtype()
    args = tuple(ops.carrier(t, dtype) for t in (q, k, v, d_o, d_lse))

    def forward_and_backward(q, k, v, d_o, d_lse):
        outs, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, policy, **kw), q, k, v)
        return (*outs, *vjp((d_o, d_lse)))

    lowered = jax.jit(forward_and_backward).lower(*args)
    compiled = lowered.compile()
    if dtype == np.float32 and jax.config.read("jax_enable_x64"):
        assert not wide_types(lowered, compiled)
    return compiled(*args)


def bits(x) -> np.ndarray:
    """float32 bits of carrier values (exact: they are values of formats that fit)."""
    return np.asarray(x).astype(np.float32).view(np.uint32)


def assert_same_bits(fn, policy, *args, **kw):
    wide = run(fn, policy, *args, "float64", **kw)
    narrow = run(fn, policy, *args, "float32", **kw)
    for name, a, b in zip(("O", "lse", "dQ", "dK", "dV"), wide, narrow):
        assert b.dtype == np.float32, name
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


def flash(variant, bc):
    def fn(q, k, v, policy, **kw):
        return flash_attention(q, k, v, policy, Blocks(4, bc), variant=variant, **kw)

    return fn


def reference(q, k, v, policy, **kw):
    return reference_attention(q, k, v, policy, return_lse=True, **kw)


ATTENTION = {
    "reference": reference,
    "fa1": flash("fa1", 4),
    "fa2": flash("fa2", 4),
    "rowwise": flash("rowwise", 5),
}
PRESETS = {"paper_uniform": paper_uniform, "fa2_kernel": fa2_kernel, "torch_math": torch_math}
# int32 lengths: numpy's default int64 would be a 64-bit array of the caller's own.
MASKS = dict(
    causal=True, q_lengths=np.array([13, 6, 1], np.int32), kv_lengths=np.array([11, 0, 4], np.int32)
)


@pytest.mark.extended  # 45 s: the float32 carrier compiles both programs
def test_fa2_kernel_with_masks_gives_the_same_bits():
    assert_same_bits(ATTENTION["fa2"], fa2_kernel("bf16"), *problem(1, lead=(3,)), **MASKS)


@pytest.mark.slow
def test_reference_gives_the_same_bits():
    assert_same_bits(ATTENTION["reference"], paper_uniform("fp16"), *problem(2))


@pytest.mark.slow
def test_extreme_values_give_the_same_bits():
    """Scores far apart (exp underflows to FP32 subnormals and zero) and large
    magnitudes: every value through the integer paths.  Sequential accumulation:
    under such cancellations the float64 carrier's "exact" dot is not exactly
    rounded (its float64 dot rounds first), the float32 carrier's is."""
    policy = paper_uniform("fp32").replace(accumulation=accumulation.SEQUENTIAL)
    assert_same_bits(ATTENTION["rowwise"], policy, *problem(3, spread=30.0))


@pytest.mark.slow
def test_auto_carrier_without_x64_gives_the_float64_bits():
    """jax_enable_x64 off: "auto" is float32, and nothing is narrowed on the way."""
    args = problem(4)
    policy = torch_math("bf16")
    wide = run(ATTENTION["fa1"], policy, *args, "float64")
    jax.config.update("jax_enable_x64", False)
    try:
        assert policy.carrier_dtype() == np.float32
        narrow = run(ATTENTION["fa1"], policy, *args, "auto")
    finally:
        jax.config.update("jax_enable_x64", True)
    for a, b in zip(wide, narrow):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_golden_needs_a_float64_carrier():
    with pytest.raises(ValueError, match="fit float32"):
        golden().replace(carrier="float32")
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(RuntimeError, match="jax_enable_x64"):
            reference_attention(*problem(5)[:3], golden())
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "e4m3fn"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_every_preset_gives_the_same_bits(attention, preset, fmt):
    seed = sorted(ATTENTION).index(attention) + 10 * sorted(PRESETS).index(preset)
    assert_same_bits(ATTENTION[attention], PRESETS[preset](fmt), *problem(seed))


@pytest.mark.slow
@pytest.mark.parametrize("attention", sorted(ATTENTION))
def test_every_attention_with_masks_gives_the_same_bits(attention):
    assert_same_bits(ATTENTION[attention], fa2_kernel("fp16"), *problem(6, lead=(3,)), **MASKS)


MODELS = {
    "sequential": dict(accumulation=accumulation.SEQUENTIAL),
    "chunked": dict(accumulation=accumulation.chunked(3)),
    "tensor_core": dict(accumulation=accumulation.tensor_core("a100")),
    "tree": dict(accumulation=accumulation.lanes(4, combine="pairwise")),
    "exp2": dict(scale="exp2", exp_model=EXP2),
    "q": dict(scale="q"),
    "reciprocal": dict(normalise="reciprocal"),
    "ynnpack": dict(exp_model=YNNPACK),
    "torch_avx2": dict(exp_model=TORCH_AVX2),
    "sleef": dict(exp_model=SLEEF_U10),
}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("attention", ["reference", "fa2"])
def test_every_model_gives_the_same_bits(attention, model):
    policy = fa2_kernel("fp16").replace(**MODELS[model])
    assert_same_bits(ATTENTION[attention], policy, *problem(7))
