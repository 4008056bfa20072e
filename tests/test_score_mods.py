"""Score modifications (fa_jax.score_mods): ALiBi's slopes and bias, the bias stage
of a policy, errors.  The bias's numerics against the op-by-op simulation:
tests/test_attention_sim.py; against plain float64: tests/test_masking.py."""

import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, FP16, FP32
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.presets import fa2_kernel, golden, paper_uniform, torch_math
from fa_jax.score_mods import alibi_bias, alibi_slopes


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def _press_slopes(n):
    """get_slopes of Press et al.'s code (github.com/ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(np.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if np.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** int(np.floor(np.log2(n)))
    return power_of_2(closest) + _press_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("h", [1, 2, 6, 8, 12, 16, 20])
def test_alibi_slopes_are_press_et_al(h):
    np.testing.assert_allclose(alibi_slopes(h), _press_slopes(h), rtol=1e-14)
    if h in (8, 16):  # 2^(-8 i / H), exactly
        assert (alibi_slopes(h) == 2.0 ** (-8.0 * np.arange(1, h + 1) / h)).all()


def test_alibi_bias_is_minus_slope_times_distance():
    b = alibi_bias(alibi_slopes(2), 3, 5)
    assert b.shape == (2, 3, 5)
    np.testing.assert_array_equal(b[1], -(2.0**-8) * np.abs(np.arange(3)[:, None] - np.arange(5)))
    with pytest.raises(ValueError, match=r"alibi_bias: slopes: expected shape \(H,\)"):
        alibi_bias(np.ones((2, 2)), 3, 3)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="alibi_slopes: heads: expected a positive int"):
            alibi_slopes(bad)


def test_bias_stage_defaults_to_scores_and_is_its_own():
    for pol in (paper_uniform(FP16), fa2_kernel(BF16), torch_math(BF16), golden()):
        assert pol.bias == pol.scores
    pol = fa2_kernel(BF16).replace(bias=BF16)
    assert pol.bias == BF16 and pol.scores == FP32
    assert "bias" in pol.describe()


def test_a_bias_rounds_in_its_stage():
    """With the bias stage BF16 and the scores FP32, S + B is rounded to BF16, which
    changes the output of the default (FP32) bias stage (the exact bits:
    tests/test_attention_sim.py)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 4)) for _ in range(3))
    bias = rng.standard_normal((6, 6))
    wide = reference_attention(q, k, v, fa2_kernel(BF16), bias=bias)
    narrow = reference_attention(q, k, v, fa2_kernel(BF16).replace(bias=BF16), bias=bias)
    assert not np.array_equal(np.asarray(wide), np.asarray(narrow))


def test_bias_errors():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    with pytest.raises(
        ValueError,
        match=r"reference_attention: bias: expected an array broadcastable to \(\.\.\., N, M\) "
        r"= \(2, 5, 5\), got shape \(3, 5, 5\)",
    ):
        reference_attention(q, k, v, golden(), bias=np.zeros((3, 5, 5)))
    with pytest.raises(ValueError, match=r"flash_attention: bias: .*got shape \(5, 4\)"):
        flash_attention(q, k, v, golden(), Blocks(2, 2), bias=np.zeros((5, 4)))
    exp2 = golden().replace(scale="exp2", exp_model="exp2_correctly_rounded")
    with pytest.raises(ValueError, match="bias: expected a policy whose scores are scaled"):
        reference_attention(q, k, v, exp2, bias=np.zeros((5, 5)))
