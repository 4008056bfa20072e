"""Grouped-query and multi-query attention (fa_jax.heads): bit for bit the attention
of repeated K/V heads forward; dK, dV the group sums of the repeated heads'
gradients, rounded as documented; errors."""

import jax
import numpy as np
import pytest
from helpers import x64_enabled
from hypothesis import given, settings
from hypothesis import strategies as st

from fa_jax import BF16, FP32
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.heads import kv_groups
from fa_jax.presets import fa2_kernel
from fa_jax.rounding import round_to


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


POLICY = fa2_kernel(BF16)


def _problem(seed, h, h_kv, n=9, m=11, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, h, n, d))
    k, v = (rng.standard_normal((2, h_kv, m, d)) for _ in range(2))
    return q, k, v, rng.standard_normal((2, h, n, d)), rng.standard_normal((2, h, n))


def _fn(kind):
    if kind == "reference":
        return lambda q, k, v: reference_attention(q, k, v, POLICY, causal=True, return_lse=True)
    return lambda q, k, v: flash_attention(q, k, v, POLICY, Blocks(4, 4), causal=True)


@jax.jit
def _ref_vjp(q, k, v, d_o, d_lse):
    out, vjp = jax.vjp(_fn("reference"), q, k, v)
    return (*out, *vjp((d_o, d_lse)))


@jax.jit
def _flash_vjp(q, k, v, d_o, d_lse):
    out, vjp = jax.vjp(_fn("flash"), q, k, v)
    return (*out, *vjp((d_o, d_lse)))


# Compiling dominates: GQA in flash by default, MQA and the reference slow.
CASES = [
    ("flash", 2),
    pytest.param("reference", 1, marks=pytest.mark.slow),
    pytest.param("flash", 1, marks=pytest.mark.slow),
    pytest.param("reference", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, h_kv", CASES)
@given(seed=st.integers(0, 2**31))
@settings(max_examples=3, deadline=None)
def test_gqa_equals_repeated_heads_bitwise(kind, h_kv, seed):
    """O, lse and dQ of 4 query heads on H_kv K/V heads equal those of K and V
    repeated to 4 heads, bit for bit; dK, dV equal fl_grads(fl_d_acc(Σ_group)) of
    the repeated heads' dK, dV (the sum of two or four BF16 values is exact in
    float64, so the oracle rounds it once to d_acc = FP32, then to grads = BF16)."""
    q, k, v, d_o, d_lse = _problem(seed, 4, h_kv)
    g = 4 // h_kv
    run = {"reference": _ref_vjp, "flash": _flash_vjp}[kind]
    got = [np.asarray(x) for x in run(q, k, v, d_o, d_lse)]
    rep = [np.asarray(x) for x in run(q, np.repeat(k, g, 1), np.repeat(v, g, 1), d_o, d_lse)]
    for name, a, b in zip(("O", "lse", "dQ"), got[:3], rep[:3]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for name, a, b in zip(("dK", "dV"), got[3:], rep[3:]):
        total = b.reshape(2, h_kv, g, *b.shape[2:]).sum(axis=2)
        want = np.asarray(round_to(round_to(total, FP32), BF16))
        assert a.shape == (2, h_kv, *b.shape[2:])
        np.testing.assert_array_equal(a, want, err_msg=name)


def test_kv_groups_and_its_errors():
    assert kv_groups("f", (2, 8, 5, 4), (2, 2, 7, 4), (2, 2, 7, 3)) == 4
    assert kv_groups("f", (8, 5, 4), (1, 7, 4), (1, 7, 4)) == 8
    assert kv_groups("f", (5, 4), (7, 4), (7, 4)) == 1
    for k_shape, v_shape in [((2, 3, 7, 4), (2, 3, 7, 4)), ((2, 2, 7, 4), (2, 4, 7, 4))]:
        with pytest.raises(ValueError, match=r"f: leading dimensions differ: .*H_kv divides"):
            kv_groups("f", (2, 8, 5, 4), k_shape, v_shape)
    with pytest.raises(ValueError, match="got q \\(1, 8, 5, 4\\), k \\(2, 2, 7, 4\\)"):
        kv_groups("f", (1, 8, 5, 4), (2, 2, 7, 4), (2, 2, 7, 4))
