"""ops.tanh and the tanh models of a softcap (fa_jax.tanh_models): correctly rounded
against 60-digit tanh on every FP16 and BF16 value and on random FP32 ones; the
registry; the softcap's arguments and its golden numbers against plain float64."""

import decimal
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from attention_plain import plain_attention
from helpers import x64_enabled
from oracle import round_exact

from fa_jax import BF16, FP16, FP32, ops
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.presets import fa2_kernel, golden
from fa_jax.tanh_models import (
    CORRECTLY_ROUNDED,
    TanhModel,
    get_tanh_model,
    register_tanh_model,
    tanh_models,
)


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def _tanh(x: float) -> Fraction:
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        if abs(x) < 1e-6:  # e^2x − 1 would cancel: the series to well past 60 digits
            d = decimal.Decimal(x)
            return Fraction(d - d**3 / 3 + 2 * d**5 / 15 - 17 * d**7 / 315)
        d = decimal.Decimal(x)
        e = (-2 * abs(d)).exp()  # e^-2|x|: no overflow (tanh is odd)
        return Fraction(decimal.Decimal(1).copy_sign(d) * (1 - e) / (1 + e))


def _every_finite(dtype) -> np.ndarray:
    values = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    finite = np.isfinite(values.astype(np.float32))
    return values[finite].astype(np.float64)


@pytest.mark.parametrize(
    "fmt, values",
    [
        (FP16, lambda: _every_finite(np.float16)),
        (BF16, lambda: _every_finite(ml_dtypes.bfloat16)),
        (FP32, lambda: np.random.default_rng(0).standard_normal(20000).astype(np.float32) * 3),
    ],
    ids=["fp16-all", "bf16-all", "fp32-random"],
)
def test_tanh_is_correctly_rounded(fmt, values):
    x = np.asarray(values(), np.float64)
    got = np.asarray(jax.jit(ops.tanh, static_argnums=1)(jnp.asarray(x), fmt))
    want = np.array([round_exact(_tanh(float(v)), fmt) if v else v for v in x])
    bad = np.flatnonzero(got != want)
    assert not bad.size, (bad.size, x[bad[:3]], got[bad[:3]], want[bad[:3]])


def test_tanh_needs_a_float64_carrier():
    with pytest.raises(ValueError, match=r"ops\.tanh: expected a float64 carrier"):
        ops.tanh(jnp.ones(3, jnp.float32), BF16)


def test_registry():
    assert get_tanh_model("correctly_rounded") is CORRECTLY_ROUNDED
    assert fa2_kernel(BF16).tanh_model is CORRECTLY_ROUNDED
    model = TanhModel("test_truncating", lambda x, fmt: ops.cast(jnp.tanh(x), fmt))
    register_tanh_model(model)
    assert "test_truncating" in tanh_models() and get_tanh_model(model) is model
    assert fa2_kernel(BF16).replace(tanh_model="test_truncating").tanh_model is model
    with pytest.raises(ValueError, match="expected a new name"):
        register_tanh_model(TanhModel("test_truncating", lambda x, fmt: x))
    with pytest.raises(ValueError, match="tanh model: expected a TanhModel or one of"):
        get_tanh_model("fast")


def test_softcap_errors_name_it():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 4)) for _ in range(3))
    for bad in (0, -1.0, float("inf"), float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"reference_attention: softcap: expected a finite"):
            reference_attention(q, k, v, golden(), softcap=bad)
    exp2 = golden().replace(scale="exp2", exp_model="exp2_correctly_rounded")
    with pytest.raises(ValueError, match="flash_attention: softcap: expected a policy whose"):
        flash_attention(q, k, v, exp2, Blocks(2, 2), softcap=30.0)


@pytest.mark.slow  # flash's softcap with golden: tests/test_masking.py
@pytest.mark.parametrize("kind", ["reference", "flash"])
def test_golden_softcap_equals_plain_float64(kind):
    """Golden O, lse and gradients with softcap 3 (scores scaled up so that it bites)
    equal c tanh(s / c) attention in plain float64 and its autodiff to 1e-12."""
    rng = np.random.default_rng(1)
    q, k, v, d_o = (rng.standard_normal((2, 9, 8)) * 2 for _ in range(4))
    d_lse = rng.standard_normal((2, 9))

    def fn(q, k, v):
        if kind == "flash":
            return flash_attention(q, k, v, golden(), Blocks(3, 4), causal=True, softcap=3.0)
        return reference_attention(q, k, v, golden(), causal=True, softcap=3.0, return_lse=True)

    def plain(q, k, v):
        return plain_attention(q, k, v, causal=True, softcap=3.0)

    def vjp(f):
        out, back = jax.vjp(f, q, k, v)
        return (*out, *back((d_o, d_lse)))

    for name, g, w in zip(("O", "lse", "dQ", "dK", "dV"), jax.jit(lambda: vjp(fn))(), vjp(plain)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.max(np.abs(g - w)) / np.max(np.abs(w)) <= 1e-12, name
