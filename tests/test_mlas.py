"""MLAS's sum-exp kernels (:mod:`fa_jax.kernels.x86.mlas`) against their definitions, on any CPU:
the FMA3 kernel's clamp and its +0 below m = -127, and each kernel's lanes summed in
the order the module docstring states, replayed in float32 by numpy.  The bits of
the real kernels are judged in test_kernels_onnxruntime (this CPU's kernel, and the
FMA3 one in the AVX2 lab)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax.kernels.x86 import mlas

F32 = np.float32


_WIDTH = 4096  # every call one shape: one program per kernel


@functools.cache
def _compiled(kernel):
    return jax.jit(lambda x: mlas.sum_exp(x, kernel))


def _sum_exp(x, kernel):
    x = np.asarray(x, np.float64)
    with x64_enabled():
        e = _compiled(kernel)(np.pad(x, (0, _WIDTH - x.size)))
    return np.asarray(e)[: x.size]


def test_fma3_exp_is_zero_from_m_minus_127():
    """2^m built from (m + 127) << 23: +0 at m = -127, which x' <= -87.68312 gives;
    one float32 above it, m = -126 and the AVX-512F kernel's value (p < 1 there:
    a subnormal)."""
    edge = F32(-87.68312)  # 0xC2AF5DC2
    above = np.nextafter(edge, F32(0))
    fma3 = _sum_exp([edge, above, -88.0, -1e30, -95.0], mlas.FMA3)
    avx512f = _sum_exp([edge, above], mlas.AVX512F)
    assert (fma3[[0, 2, 3, 4]] == 0.0).all()  # clamped at -88.376: m = -127
    assert np.signbit(fma3[[0, 2, 3, 4]]).sum() == 0  # +0
    assert fma3[1] == avx512f[1] > 0 and avx512f[0] > 0


def test_the_kernels_agree_above_the_fma3_range():
    """For m >= -126 the two kernels are one formula: the same bits."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-87.68, 0.0, 4000).astype(F32)
    np.testing.assert_array_equal(_sum_exp(x, mlas.FMA3), _sum_exp(x, mlas.AVX512F))


def test_avx512f_clamps_at_its_lower_range():
    """x' = max(x, -103.97): every x below gives the clamp's value; above it, the
    exps reach into the subnormals (m down to -150)."""
    below = _sum_exp([-103.9720840454, -104.5, -1e30, -100.0, -95.0], mlas.AVX512F)
    assert below[0] == below[1] == below[2]
    assert 0 < below[3] < below[4] < np.finfo(F32).tiny


def _lanes_in_order(e: np.ndarray, lanes: int) -> F32:
    """The module docstring's order, step by step in float32."""
    acc = [F32(0)] * lanes
    for i, x in enumerate(e.astype(F32)):
        acc[i % lanes] = F32(acc[i % lanes] + x)
    if lanes == 16:
        acc = [F32(acc[i] + acc[i + 8]) for i in range(8)]
    b = acc
    return F32(F32(F32(b[0] + b[1]) + F32(b[2] + b[3])) + F32(F32(b[4] + b[5]) + F32(b[6] + b[7])))


@pytest.mark.parametrize("kernel", [mlas.AVX512F, mlas.FMA3], ids=lambda k: k.name)
def test_lane_sum_follows_the_kernels_lanes(kernel):
    """Rows of lengths 1 to 301 in one call, zero-padded (+0 leaves every lane as it
    is); magnitudes 2^-20 to 2^20, so that every other order rounds differently."""
    rng = np.random.default_rng(kernel.lanes)
    lengths = (1, 7, 8, 9, 16, 17, 24, 100, 301)
    e = np.exp2(rng.uniform(-20, 20, (len(lengths), 304))).astype(F32)
    e[np.arange(304) >= np.array(lengths)[:, None]] = 0
    with x64_enabled():
        got = np.asarray(mlas.lane_sum(e.astype(np.float64), kernel))
    want = [float(_lanes_in_order(row[:n], kernel.lanes)) for row, n in zip(e, lengths)]
    np.testing.assert_array_equal(got, want)


def test_sum_exp_kernel_checks_its_lanes():
    with pytest.raises(ValueError, match="expected 8 or 16, got 4"):
        mlas.SumExpKernel("x", -88.0, scale_from_bits=True, lanes=4)
