"""fa_jax.kernels.ggml.vec's AVX2 code against a literal scalar transcription of ggml's C.

Each reference below follows its C source line by line (ggml 0.25.3, ggml-cpu,
built with AVX2, FMA and F16C): one Python float per lane, every operation rounded
to FP32 once by the exact rational oracle (an FMA rounds once), the bit tricks of
``ggml_v_expf`` done on the FP32 bit patterns.  The vectorised model must give the
same bits; the AVX-512 description must not (the lanes and the sums' order differ).
"""

from __future__ import annotations

import struct
from fractions import Fraction

import jax
import numpy as np
import pytest
from oracle import round_exact

from fa_jax._x64 import float64_enabled
from fa_jax.formats import FP32, get_format
from fa_jax.kernels.ggml import vec as gv
from fa_jax.rounding import round_to


def _r(v) -> float:
    return round_exact(Fraction(v), FP32)


def _add(a, b):
    return _r(Fraction(a) + Fraction(b))


def _mul(a, b):
    return _r(Fraction(a) * Fraction(b))


def _fma(a, b, c):
    """fl32(a·b + c), one rounding (_mm256_fmadd_ps)."""
    return _r(Fraction(a) * Fraction(b) + Fraction(c))


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _hsum_hadd(x):
    """GGML_F32x8_REDUCE's last lines (simd-mappings.h:616): t0 = low + high half,
    t1 = hadd(t0, t0), hadd(t1, t1)[0]."""
    t0 = [_add(x[i], x[i + 4]) for i in range(4)]
    t1 = [_add(t0[0], t0[1]), _add(t0[2], t0[3])]
    return _add(t1[0], t1[1])


def _hsum_movehl(x):
    """_mm_add_ps(high, low); + _mm_movehl_ps; _mm_add_ss(g, _mm_movehdup_ps(g))."""
    g = [_add(x[i + 4], x[i]) for i in range(4)]
    g = [_add(g[0], g[2]), _add(g[1], g[3])]
    return _add(g[0], g[1])


def _dot_f32_ref(x, y):
    """ggml_vec_dot_f32 (vec.cpp:11), GGML_F32_STEP 32, EPR 8, ARR 4."""
    n = len(x)
    np_ = n & ~31
    acc = [[0.0] * 8 for _ in range(4)]
    for i in range(0, np_, 32):
        for j in range(4):
            for lane in range(8):
                e = i + 8 * j + lane
                acc[j][lane] = _fma(x[e], y[e], acc[j][lane])
    for j in range(2):  # offset 2, then 1
        acc[j] = [_add(a, b) for a, b in zip(acc[j], acc[j + 2])]
    acc[0] = [_add(a, b) for a, b in zip(acc[0], acc[1])]
    s = _hsum_hadd(acc[0])
    for i in range(np_, n):
        s = _add(s, _mul(x[i], y[i]))
    return s


def _dot_f16_ref(x, y):
    """ggml_vec_dot_f16 (vec.cpp:264): the same steps, leftovers in double."""
    n = len(x)
    np_ = n & ~31
    s = Fraction(_dot_f32_ref(x[:np_], y[:np_]))
    for i in range(np_, n):
        s += Fraction(x[i]) * Fraction(y[i])  # exact: FP16 products, few terms
    return _r(s)


def _dot_bf16_ref(x, y):
    """ggml_vec_dot_bf16's AVX2 branch (vec.cpp:172): c_j = x·y + c_j, then
    (c1 + c3) + (c2 + c4), the movehl/movehdup sum, leftovers in double."""
    n = len(x)
    c = [[0.0] * 8 for _ in range(4)]
    i = 0
    while i + 32 <= n:
        for j in range(4):
            for lane in range(8):
                e = i + 8 * j + lane
                c[j][lane] = _add(_mul(x[e], y[e]), c[j][lane])
        i += 32
    c1 = [_add(_add(a, b), _add(p, q)) for a, b, p, q in zip(c[0], c[2], c[1], c[3])]
    s = Fraction(_hsum_movehl(c1))
    for e in range(i, n):
        s += Fraction(x[e]) * Fraction(y[e])
    return _r(s)


_C = ("0x1.ffffecp-1", "0x1.fffdb6p-2", "0x1.555e66p-3", "0x1.573e2ep-5", "0x1.0e4020p-7")


def _v_expf_ref(x: float) -> float:
    """ggml_v_expf(__m256) (vec.h:1234) on one lane."""
    c0, c1, c2, c3, c4 = (float.fromhex(h) for h in _C)
    r = float.fromhex("0x1.8p23")
    z = _fma(x, float.fromhex("0x1.715476p+0"), r)
    n = _add(z, -r)
    b = _fma(-n, float.fromhex("0x1.7f7d1cp-20"), _fma(-n, float.fromhex("0x1.62e4p-1"), x))
    e = (_bits(z) << 23) & 0xFFFFFFFF
    k = _float(e + _bits(1.0))
    u = _mul(b, b)
    j = _fma(_fma(_fma(c4, b, c3), u, _fma(c2, b, c1)), u, _mul(c0, b))
    if not abs(n) > 126:
        return _fma(k, j, k)
    g = 0x82000000 if n <= 0 else 0
    s1 = _float(g + 0x7F000000)
    s2 = _float(e - g)
    if abs(n) > 192:
        return _mul(s1, s1)
    return _mul(_fma(s2, j, s2), s1)


def _mixed(rng, shape, fmt="fp32"):
    """Values of many magnitudes (so that the order of the sums shows), in ``fmt``."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)
    with float64_enabled():
        return np.asarray(round_to(x, get_format(fmt)))


@pytest.mark.parametrize(
    ("name", "ref", "fmt"),
    [
        ("dot_f32", _dot_f32_ref, "fp32"),
        ("dot_f16", _dot_f16_ref, "fp16"),
        ("dot_bf16", _dot_bf16_ref, "bf16"),
    ],
)
@pytest.mark.parametrize(
    "n", [80, *(pytest.param(n, marks=pytest.mark.extended) for n in (64, 37))]
)
def test_avx2_dots_follow_the_c_code(name, ref, fmt, n):
    rng = np.random.default_rng(n)
    x, y = _mixed(rng, (24, n), fmt), _mixed(rng, (24, n), fmt)
    want = np.array([ref(list(a), list(b)) for a, b in zip(x, y)])
    fn = getattr(gv, name)
    with float64_enabled():
        got = np.asarray(jax.jit(fn, static_argnums=2)(x, y, gv.AVX2))
        avx512 = np.asarray(jax.jit(fn, static_argnums=2)(x, y, gv.AVX512))
    np.testing.assert_array_equal(got, want)
    if n >= 64:
        assert not np.array_equal(avx512, want)  # 16 lanes sum in another order


def test_avx2_reduce_adds_adjacent_lanes_last():
    """GGML_F32x8_REDUCE: (l0 + l1) + (l2 + l3) of the 4-lane sums; the soft max's
    and the BF16 dot's 8-lane sums: (l0 + l2) + (l1 + l3)."""
    lanes = np.array([[2.0**24, 1.0, -(2.0**24), 1.0, 0.0, 0.0, 0.0, 0.0]])
    with float64_enabled():
        hadd = float(gv._vec_reduce(lanes, gv.AVX2)[0])
        tree = float(gv.reduce_add(lanes, gv.AVX2)[0])
    assert hadd == _hsum_hadd(list(lanes[0])) == 1.0  # 2^24 + 1 rounds to 2^24
    assert tree == _hsum_movehl(list(lanes[0])) == 2.0


# Where fl(fl(2^(n+125)·(1 + j)) · 2^-125) is not fl(2^n·(1 + j)): n < -126, the
# AVX2 exp's two roundings show.
_TWICE = ("-0x1.6035eep+6", "-0x1.6033d4p+6", "-0x1.6aff12p+6", "-0x1.60a586p+6")


def test_avx2_v_expf_follows_the_c_code_over_its_ranges():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            [float.fromhex(h) for h in _TWICE],
            [0.0, -0.0, 2.0**-30, -1e-3, 88.0, 88.7, 89.0, -87.0, -150.0, -133.5, -140.0],
            rng.uniform(-10, 10, 200),
            rng.uniform(-140, -80, 400),
            rng.uniform(80, 140, 100),
        ]
    ).astype(np.float32)
    x = x.astype(np.float64)
    want = np.array([_v_expf_ref(float(t)) for t in x])
    with float64_enabled():
        got = np.asarray(jax.jit(gv.v_expf, static_argnums=1)(x, gv.AVX2))
    np.testing.assert_array_equal(got, want)
    assert np.all((got[: len(_TWICE)] > 0) & (got[: len(_TWICE)] < 2.0**-126))  # subnormal


def test_codes_are_named_as_cpu_isa_names_them():
    from fa_jax.kernels.x86 import cpu

    assert set(gv.CODES) <= set(cpu.ISAS)
    assert gv.AVX512.step == 64 and gv.AVX2.step == 32
