"""XLA's attention kernel against fa_jax's model of it, bit for bit, and XLA's two
float32 exps (its own, and YNNPACK's inside a YNNPACK fusion) against their
models over the float32 inputs softmax feeds them."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

import fa_jax
from fa_jax import kernels
from fa_jax.exponential import CORRECTLY_ROUNDED, YNNPACK, ynnpack_exp
from fa_jax.formats import FP32
from fa_jax.kernels import xla


def _inputs(shape, fmt, seed):
    rng = np.random.default_rng(seed)
    with x64_enabled():
        return [np.asarray(fa_jax.round_to(rng.standard_normal(shape), fmt)) for _ in range(3)]


def _golden(q, k, v, causal):
    with x64_enabled():
        return np.asarray(fa_jax.reference_attention(q, k, v, fa_jax.golden(), causal=causal))


@pytest.mark.parametrize(
    ("shape", "causal", "fmt"),
    [
        ((1, 2, 256, 64), True, "bf16"),
        ((1, 2, 256, 64), True, "fp32"),
        ((1, 2, 32, 16), False, "bf16"),
        ((1, 1, 1024, 16), True, "bf16"),
        # The same concerns again; test_xla_model_at_larger_shapes has 512 keys too.
        pytest.param((1, 2, 512, 64), False, "bf16", marks=pytest.mark.slow),
        pytest.param((1, 2, 512, 64), False, "fp32", marks=pytest.mark.slow),
        pytest.param((1, 1, 1024, 16), False, "fp32", marks=pytest.mark.slow),
    ],
)
def test_xla_is_bit_identical_to_its_model(shape, causal, fmt):
    """Every output bit for bit: YNNPACK's exp at 256 keys and more, XLA's own at 32
    keys in bf16 (where XLA keeps the exp out of the YNNPACK fusions; fp32 at such
    small shapes runs other dots, not modelled).  At d = 16 YNNPACK splits the P V
    dot of 1024 keys into blocks here, which the model reads by probes."""
    q, k, v = _inputs(shape, fa_jax.get_format(fmt), seed=0)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
    emulated = kernels.emulate("xla", q, k, v, fmt=fmt, causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), fmt)
    assert c.identical_share == 1.0, c.summary()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape", [(1, 2, 512, 64), (2, 4, 1024, 128), (1, 1, 2048, 16), (1, 1, 4096, 64)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_xla_model_at_larger_shapes(shape, causal, fmt, seed):
    """Bit for bit where the P V dot runs in one chain (1024 keys, d = 128) and in
    blocks (4096 keys), and where the softmax sum adds several nodes per lane by
    compensated summation (2048 keys and more)."""
    q, k, v = _inputs(shape, fa_jax.get_format(fmt), seed)
    real = kernels.real("xla", q, k, v, fmt=fmt, causal=causal)
    emulated = kernels.emulate("xla", q, k, v, fmt=fmt, causal=causal)
    c = kernels.compare(real, emulated, _golden(q, k, v, causal), fmt)
    assert c.identical_share == 1.0, c.summary()


def test_pv_probes_count_the_terms_the_revealed_order_predicts():
    """The P V probes of keys in key 0's block count what the revealed order
    (tile_k chains, folded pairwise) predicts; the first key of the next block,
    where there is one, counts otherwise."""
    shape = (1, 1024, 16)
    n = shape[1]
    run = xla._attention("float32", False, None)
    tile_k, block = xla._pv_order("float32", shape, False)
    assert tile_k in xla._TILES_K and 2 <= block <= n and block % tile_k == 0
    p = xla._probe_p("float32", shape, False)
    inside = [1, 2, 3, 4, min(block, n - 1) - tile_k]
    want = xla._pv_predicted(n, inside, p, tile_k, n)
    assert np.array_equal(xla._pv_probe_counts(run, shape, inside), want)
    if block < n - 1:
        got = xla._pv_probe_counts(run, shape, [block])
        assert not np.array_equal(got, xla._pv_predicted(n, [block], p, tile_k, n))


def test_compensated_step_corrects_what_plain_addition_loses():
    """Kahan: 1 + 2^-24 + 2^-24 is 1 added plainly, 1 + 2^-23 compensated."""
    with x64_enabled():
        tiny = jnp.asarray(2.0**-24)
        total, error = xla._kahan(jnp.asarray(1.0), jnp.asarray(0.0), jnp.asarray(0.0), FP32)
        total, error = xla._kahan(tiny, total, error, FP32)
        total, error = xla._kahan(tiny, total, error, FP32)
        assert float(total) - float(error) == 1.0 + 2 * float(tiny)


def test_platform_names_versions_and_the_exp():
    facts = kernels.get("xla").platform()
    assert facts["jax"] == jax.__version__ and "jaxlib" in facts
    assert "xla_cpu_exp" in facts["exp_model"] and "ynnpack_exp" in facts["exp_model"]


def test_the_model_runs_the_exp_xlas_program_runs():
    """YNNPACK's where XLA puts the exp in a YNNPACK fusion, XLA's own elsewhere
    (eager fp16, small shapes); an exp chosen by hand is kept."""
    bf16 = xla.model(fa_jax.BF16, 512, 64).policy
    assert bf16.exp_model is YNNPACK
    assert xla._exp_model(bf16, (1, 64, 64), False) is YNNPACK
    assert xla._exp_model(bf16, (1, 16, 8), False) is xla.XLA_CPU_EXP
    fp16 = xla.model(fa_jax.FP16, 512, 64).policy
    assert xla._exp_model(fp16, (1, 512, 64), False) is xla.XLA_CPU_EXP
    chosen = bf16.replace(exp_model=CORRECTLY_ROUNDED)
    assert xla._exp_model(chosen, (1, 16, 8), False) is CORRECTLY_ROUNDED


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


_EYE = np.eye(2, dtype=np.float32)
_FUSED_ROWS = 4096  # XLA keeps the exp below out of YNNPACK fusions for fewer rows


@functools.cache
def _shifted_exp(shift: str):
    def run(a, b):
        s = a @ b
        ref = s.max(-1, keepdims=True) if shift == "max" else s.min(-1, keepdims=True)
        return jnp.exp(s - ref)

    return jax.jit(run)


@functools.cache
def _exp_is_fused(shift: str, rows: int) -> bool:
    a = jax.ShapeDtypeStruct((rows, 2), np.float32)
    text = _shifted_exp(shift).lower(a, _EYE).compile().as_text() or ""
    bodies = xla._computations(text)
    for line in bodies["ENTRY"].splitlines():
        called = re.search(r"calls=%([^,\s]+)", line)
        if called and "exponential(" in bodies.get(called.group(1), ""):
            return "__ynn_fusion" in line
    return False


def _ynnpack_exp_real(x: np.ndarray) -> np.ndarray:
    """exp(x) as XLA's CPU backend computes it inside a YNNPACK fusion: rows (x, 0)
    times the identity, shifted by the row's max (all x <= 0) or min (all x >= 0),
    so that the exp's input is x exactly."""
    shift = "max" if (x <= 0).all() else "min"
    assert shift == "max" or (x >= 0).all()
    a = np.zeros((max(x.size, _FUSED_ROWS), 2), np.float32)
    a[: x.size, 0] = x
    assert _exp_is_fused(shift, a.shape[0]), "XLA no longer fuses the exp with YNNPACK"
    return np.asarray(_shifted_exp(shift)(a, _EYE))[: x.size, 0]


def _ynnpack_mismatches(x: np.ndarray) -> int:
    real = _ynnpack_exp_real(x)
    with x64_enabled():
        model = np.asarray(jax.jit(ynnpack_exp)(jnp.asarray(x, jnp.float64)))
    assert np.array_equal(model.astype(np.float32).astype(np.float64), model)
    return int(np.count_nonzero(model.astype(np.float32) != real))


def _positive_float32s(hi: float, stride: int) -> np.ndarray:
    top = np.array([hi], np.float32).view(np.uint32)[0]
    return np.arange(0, top + 1, stride, dtype=np.uint32).view(np.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's YNNPACK fusions")
def test_ynnpack_exp_is_bit_exact_on_a_strided_subset():
    """Every 997th float32 in [-104, 0] and in [0, 89] (overflow to inf included)."""
    assert _ynnpack_mismatches(_float32_range(-104.0, 0.0, 997)) == 0
    assert _ynnpack_mismatches(_positive_float32s(89.0, 997)) == 0


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's YNNPACK fusions")
def test_ynnpack_exp_is_bit_exact_on_every_float32_in_minus_104_to_0():
    top = int(np.array([-104.0], np.float32).view(np.uint32)[0])
    for start in range(0x80000000, top + 1, 1 << 22):
        bits = np.arange(start, min(start + (1 << 22), top + 1), dtype=np.uint64)
        assert _ynnpack_mismatches(bits.astype(np.uint32).view(np.float32)) == 0, hex(start)


def test_xla_cpu_exp_as_an_exp_model():
    exponential = pytest.importorskip("fa_jax.exponential")
    m = xla.xla_cpu_exp_model()
    assert isinstance(m, exponential.ExpModel) and m.name == "xla_cpu"
    with x64_enabled():
        x = jnp.asarray([-1.5, -0.25, 0.0])
        assert np.array_equal(np.asarray(m.fn(x, fa_jax.FP32)), np.asarray(xla.xla_cpu_exp(x)))


def test_only_ps_conversion_counts_as_p_rounded():
    """P's bf16 conversion is a convert of a multiply (e · (1/l)); converts of the
    inputs (Q, K, V, parameters of the fusion) are not P's."""
    inputs_only = """
  %param_0 = f32[16,2048]{1,0} parameter(0)
  %convert.65 = bf16[16,2048]{1,0} convert(%param_0)
  ROOT %convert.64 = f32[16,2048]{1,0} convert(%convert.65)"""
    with_p = """
  %multiply.1 = f32[1,2,64,64]{3,2,1,0} multiply(%exp.0, %broadcast.9)
  %convert.72 = bf16[1,2,64,64]{3,2,1,0} convert(%multiply.1)
  ROOT %convert.71 = f32[1,2,64,64]{3,2,1,0} convert(%convert.72)"""
    assert not xla._converts_product_to_bf16(inputs_only)
    assert xla._converts_product_to_bf16(with_p)
