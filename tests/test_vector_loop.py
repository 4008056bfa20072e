"""fa_jax.kernels.torch_cpu.vector_loop: the lane sums and GEMM blocks of PyTorch's CPU flash loop,
each against a float32 loop written from ATen's source (``functional_base.h``'s
``vec_reduce_all``, ``vec_base.h``'s generic build)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import FP32, ops
from fa_jax.kernels.torch_cpu.vector_loop import (
    LANES,
    MKL_INTEL_LANES,
    Lanes,
    gemm_accumulate,
    gemm_k_blocks,
    intel_sgemm_blocks,
    intel_takes_lanes,
    lane_sum,
)


def _reduce_all(v: np.ndarray, lanes: Lanes) -> np.float32:
    """Lane 0 of ``vec_reduce_all(+, v)`` for one float32 vector, as the source does it."""
    v = v.astype(np.float32)
    if lanes.combine == "in_order":  # acc_vec + (lane i, 0, ...), i = 1 .. size - 1
        total = v[0]
        for x in v[1:]:
            total = np.float32(total + x)
        return total
    while len(v) > 1:  # the shuffles pair lane i with lane i + half
        half = len(v) // 2
        v = (v[:half] + v[half:]).astype(np.float32)
    return v[0]


def _loop_sum(e: np.ndarray, lanes: Lanes, accumulators: int, vector_tail: bool):
    """The kernels' loops in float32: full vectors into ``accumulators`` vector
    accumulators, their sum reduced, the tail one by one (flash) or as a partial
    vector (the softmax's ``reduce_all``)."""
    width, n = lanes.count, len(e)
    e = e.astype(np.float32)
    if vector_tail and n < width:
        total = np.float32(0)
        for x in e:
            total = np.float32(total + x)
        return total
    acc = [np.zeros(width, np.float32) for _ in range(accumulators)]
    full = width * (n // width)
    for j in range(0, full, width):
        a = (j // width) % accumulators
        acc[a] = (acc[a] + e[j : j + width]).astype(np.float32)
    if vector_tail and full < n:
        acc[0][: n - full] = (acc[0][: n - full] + e[full:]).astype(np.float32)
    total_vec = acc[0]
    for a in acc[1:]:
        total_vec = (total_vec + a).astype(np.float32)
    total = _reduce_all(total_vec, lanes)
    if not vector_tail:
        for x in e[full:]:
            total = np.float32(total + x)
    return total


# One loop per build: the other variants have a build's lanes, other GEMMs.
@pytest.mark.parametrize("variant", sorted(v for v, lanes in LANES.items() if lanes.gemm == "blas"))
@pytest.mark.parametrize("accumulators, vector_tail", [(2, False), (1, True)])
def test_lane_sum_is_the_kernels_loop(variant, accumulators, vector_tail):
    """Terms spread over 2^-20 .. 2^20 so that any other order rounds differently;
    lengths below one vector, a few vectors and a tail, an odd count of vectors."""
    lanes = LANES[variant]
    rng = np.random.default_rng(3)
    for n in (5, 45, 100):
        e = (rng.random((24, n)) * 2.0 ** rng.integers(-20, 20, (24, n))).astype(np.float32)
        want = [_loop_sum(row, lanes, accumulators, vector_tail) for row in e]
        with x64_enabled():
            fn = jax.jit(
                lambda x, lanes=lanes: lane_sum(
                    x, lanes, FP32, accumulators=accumulators, vector_tail=vector_tail
                )
            )
            got = np.asarray(fn(jnp.asarray(e, jnp.float64)))
        np.testing.assert_array_equal(got, np.asarray(want, np.float64), err_msg=f"n={n}")


def test_lanes_differ_between_builds():
    assert LANES["torch_default"] == Lanes(8, "in_order", fused=False)
    assert LANES["torch_avx2"] == Lanes(8, "halving", fused=True)
    assert LANES["torch_avx512"] == Lanes(16, "halving", fused=True)
    assert LANES["torch_avx512_amx"] == Lanes(16, "halving", fused=True, gemm="amx")
    for build in ("torch_default", "torch_avx2", "torch_avx512"):
        assert LANES[f"{build}_intel"].gemm == "mkl_intel"
        assert dataclasses.replace(LANES[f"{build}_intel"], gemm="blas") == LANES[build]
    with pytest.raises(ValueError, match=r"Lanes\.gemm"):
        Lanes(16, "halving", fused=True, gemm="mkl")
    with pytest.raises(ValueError, match=r"Lanes\.count"):
        Lanes(12, "halving", fused=True)
    with pytest.raises(ValueError, match=r"Lanes\.combine"):
        Lanes(8, "tree", fused=True)
    with pytest.raises(TypeError, match="lanes"):
        lane_sum(jnp.zeros((2, 8)), 8, FP32)  # pyright: ignore[reportArgumentType]


def test_gemm_k_blocks_as_measured():
    assert gemm_k_blocks(100) == [(0, 100)]
    assert gemm_k_blocks(192) == [(0, 192)]
    assert gemm_k_blocks(250) == [(0, 125), (125, 250)]
    assert gemm_k_blocks(333) == [(0, 166), (166, 332), (332, 333)]  # the odd product alone
    assert gemm_k_blocks(400) == [(0, 192), (192, 384), (384, 392), (392, 400)]
    assert gemm_k_blocks(512) == [(0, 192), (192, 384), (384, 512)]
    for k in range(1, 1200):
        blocks = gemm_k_blocks(k)
        assert blocks[0][0] == 0 and blocks[-1][1] == k
        assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))


def test_gemm_accumulate_sums_each_block_from_zero():
    """c + a @ b: each block an FMA chain from 0 in index order, added into c in turn."""
    rng = np.random.default_rng(0)
    k = 333
    a = rng.random((4, k)).astype(np.float32)
    b = rng.standard_normal((k, 3)).astype(np.float32)
    c = rng.standard_normal((4, 3)).astype(np.float32)
    want = c.astype(np.float64)
    for start, stop in [(0, 166), (166, 332), (332, 333)]:
        block = np.zeros((4, 3))
        for j in range(start, stop):  # products exact in float64; one rounding each step
            block = (block + a[:, j : j + 1].astype(np.float64) * b[j]).astype(np.float32)
            block = block.astype(np.float64)
        want = (want + block).astype(np.float32).astype(np.float64)
    with x64_enabled():
        got = jax.jit(lambda c, a, b: gemm_accumulate(c, a, b, FP32))(
            *(jnp.asarray(t, jnp.float64) for t in (c, a, b))
        )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_amx_gemms_are_tile_dots():
    """``gemm`` "amx": Q Kᵀ the tile dots from 0, P V from o, on every row (the last
    query block's 1 to 3 included: no MKL small-matrix path)."""
    from test_tile_dot import _bf16, _loop

    from fa_jax.kernels.torch_cpu.vector_loop import torch_pv, torch_qk
    from fa_jax.presets import fa2_kernel

    policy = fa2_kernel("bf16")
    rng = np.random.default_rng(2)
    q, k_t = _bf16(rng, (33, 40)), _bf16(rng, (40, 70))  # 33 rows: 32 and 1
    p, v, o = _bf16(rng, (33, 70)), _bf16(rng, (70, 24)), _bf16(rng, (33, 24))
    with x64_enabled():
        qk = jax.jit(lambda q, k_t: torch_qk(q, k_t, policy, "amx"))
        pv = jax.jit(lambda o, p, v: torch_pv(o, p, v, policy, "amx"))
        got_s = np.asarray(qk(*(jnp.asarray(t, jnp.float64) for t in (q, k_t))))
        got_o = np.asarray(pv(*(jnp.asarray(t, jnp.float64) for t in (o, p, v))))
    np.testing.assert_array_equal(got_s, _loop(q, k_t, None, 20))
    np.testing.assert_array_equal(got_o, _loop(p, v, o, 14))


def test_intel_sgemm_blocks_as_measured():
    assert intel_sgemm_blocks(1) == [(0, 1)]
    assert intel_sgemm_blocks(384) == [(0, 384)]
    assert intel_sgemm_blocks(385) == [(0, 193), (193, 385)]
    assert intel_sgemm_blocks(768) == [(0, 384), (384, 768)]
    for bad in (0, 769):
        with pytest.raises(ValueError, match=r"expected 1 <= k <= 768, got"):
            intel_sgemm_blocks(bad)


def _chains(a: np.ndarray, b: np.ndarray, c: np.ndarray, blocks) -> np.ndarray:
    """c + a @ b in float32: per block an FMA chain from 0, the block sums added into c."""
    out = c.astype(np.float32)
    for lo, hi in blocks:
        block = np.zeros(out.shape, np.float32)
        for j in range(lo, hi):  # products exact in float64; one rounding each step
            block = (block + a[:, j : j + 1].astype(np.float64) * b[j]).astype(np.float32)
        out = (out + block).astype(np.float32)
    return out


def _mkl_intel_lanes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in MKL's 16 FP32 lanes (a zero-padded partial last vector), the four
    128-bit quarters added lane by lane in order, then lanes (0 + 1) + (2 + 3)."""
    k = a.shape[1]
    pad = -k % 16
    a, b = np.pad(a, ((0, 0), (0, pad))), np.pad(b, ((0, pad), (0, 0)))
    lanes = np.zeros((16, a.shape[0], b.shape[1]), np.float32)
    for j in range(k + pad):
        lanes[j % 16] = (lanes[j % 16] + a[:, j : j + 1].astype(np.float64) * b[j]).astype(
            np.float32
        )
    quarter = lanes[0:4]
    for q in (1, 2, 3):
        quarter = (quarter + lanes[4 * q : 4 * q + 4]).astype(np.float32)
    return ((quarter[0] + quarter[1]).astype(np.float32) + (quarter[2] + quarter[3])).astype(
        np.float32
    )


def _vdpbf16ps(acc, a, b, j: int):
    """acc + the products of terms j + 1 then j (a zero past the end), each added in FP32."""
    for t in (j + 1, j):
        if t < a.shape[-1]:
            acc = (acc + a[..., t : t + 1].astype(np.float64) * b[t]).astype(np.float32)
    return acc


def _gemv_qk(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (1, K) @ b: pair i of each 32 terms in lane i mod 16, the lanes then added
    i + 8, i + 1, i + 2, i + 4 (MKL's BF16 matrix-vector product on an Intel CPU)."""
    lanes = [np.zeros((1, b.shape[1]), np.float32) for _ in range(16)]
    for j in range(0, a.shape[1], 2):
        lanes[(j // 2) % 16] = _vdpbf16ps(lanes[(j // 2) % 16], a, b, j)
    for step in (8, 1, 2, 4):
        for i in range(16):
            if i % (2 * step if step < 8 else 16) < step:
                lanes[i] = (lanes[i] + lanes[i + step]).astype(np.float32)
    return lanes[0]


def _gemv_pv(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """c + a (1, K) @ b: each 8 terms a chain of pairs from 0, added into c in order."""
    out = c.astype(np.float32)
    for lo in range(0, a.shape[1], 8):
        block = np.zeros(out.shape, np.float32)
        for j in range(lo, min(lo + 8, a.shape[1]), 2):
            block = _vdpbf16ps(block, a, b, j)
        out = (out + block).astype(np.float32)
    return out


def test_intel_gemms_are_mkls():
    """``gemm`` "mkl_intel", against float32 loops of what MKL was measured to do on
    an Intel Xeon: BF16 on AMX's tile dots (K in blocks of 32, the last shorter),
    Q Kᵀ from 0 and P V from o, on 2 or 3 rows too, a last query block of 1 row in
    ``vdpbf16ps`` pairs; FP16 in intel_sgemm_blocks, but Q Kᵀ over 16 lanes on a
    last query block of r = 2 to 15 rows from d = 24 r."""
    from test_tile_dot import _bf16, _loop

    from fa_jax.kernels.torch_cpu.vector_loop import torch_pv, torch_qk
    from fa_jax.presets import fa2_kernel

    rng = np.random.default_rng(5)
    bf16, fp16 = fa2_kernel("bf16"), fa2_kernel("fp16")

    def run(fn, *arrays):
        with x64_enabled():
            return np.asarray(jax.jit(fn)(*(jnp.asarray(t, jnp.float64) for t in arrays)))

    q, k_t = _bf16(rng, (34, 40)), _bf16(rng, (40, 70))  # 34 rows: 32 and 2
    p, v, o = _bf16(rng, (34, 70)), _bf16(rng, (70, 24)), _bf16(rng, (34, 24))
    got_s = run(lambda q, k_t: torch_qk(q, k_t, bf16, "mkl_intel"), q, k_t)
    np.testing.assert_array_equal(got_s, _loop(q, k_t, None, 32))
    got_o = run(lambda o, p, v: torch_pv(o, p, v, bf16, "mkl_intel"), o, p, v)
    np.testing.assert_array_equal(got_o, _loop(p, v, o, 32))
    # 33 rows: 32 and 1, the last row MKL's matrix-vector product
    got_s = run(lambda q, k_t: torch_qk(q, k_t, bf16, "mkl_intel"), q[:33], k_t)
    np.testing.assert_array_equal(got_s[:32], _loop(q[:32], k_t, None, 32))
    np.testing.assert_array_equal(got_s[32:], _gemv_qk(q[32:33], k_t))
    got_o = run(lambda o, p, v: torch_pv(o, p, v, bf16, "mkl_intel"), o[:33], p[:33], v)
    np.testing.assert_array_equal(got_o[:32], _loop(p[:32], v, o[:32], 32))
    np.testing.assert_array_equal(got_o[32:], _gemv_pv(o[32:33], p[32:33], v))

    def fp16_values(shape):
        x = rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 6, shape)
        return x.astype(np.float16).astype(np.float32)

    # last blocks of 2 rows (from d = 48 in lanes) and of 1; the 15- and 16-row
    # bounds by intel_takes_lanes below
    for n, d in [(66, 48), (66, 47), (33, 100)]:
        q, k_t = fp16_values((n, d)), fp16_values((d, 20))
        rows = n - 32 * ((n - 1) // 32) if n < 192 else n - 64 * ((n - 1) // 64)
        want = _chains(q, k_t, np.zeros((n, 20)), intel_sgemm_blocks(d))
        if 2 <= rows <= 15 and d >= 24 * rows:
            want[n - rows :] = _mkl_intel_lanes(q[n - rows :], k_t)
        got = run(lambda q, k_t: torch_qk(q, k_t, fp16, "mkl_intel"), q, k_t)
        np.testing.assert_array_equal(got, want, err_msg=f"Q Kᵀ {(n, d)}")
    # FP32 values (torch-math's): FMA chains from 0, the first product rounded
    a = (rng.standard_normal((3, 100)) * 2.0 ** rng.integers(-6, 6, (3, 100))).astype(np.float32)
    b = rng.standard_normal((100, 5)).astype(np.float32)
    got = run(lambda a, b: ops.matmul(a, b, FP32, accumulation=MKL_INTEL_LANES), a, b)
    np.testing.assert_array_equal(got, _mkl_intel_lanes(a, b))
    assert [intel_takes_lanes(r, 24 * r) for r in (1, 2, 15, 16)] == [False, True, True, False]
    assert not intel_takes_lanes(15, 24 * 15 - 1)
    p, v, o = fp16_values((3, 390)), fp16_values((390, 8)), fp16_values((3, 8))
    got_o = run(lambda o, p, v: torch_pv(o, p, v, fp16, "mkl_intel"), o, p, v)
    np.testing.assert_array_equal(got_o, _chains(p, v, o, [(0, 195), (195, 390)]))


@pytest.mark.parametrize(
    "variant",
    [
        "torch_avx2",
        pytest.param("torch_default", marks=pytest.mark.slow),
        pytest.param("torch_avx512", marks=pytest.mark.slow),
    ],
)
def test_the_loop_over_many_key_blocks_is_attention_under_the_golden_policy(variant):
    """19 keys in blocks of 4 (five blocks, the last of 3): each block's rescale of
    l and o by α = exp(m_old − m_new) and the final O = o / l give plain float64
    attention under the golden policy, within the error of α (the loop's scalar
    exp is glibc's expf even there: FP32, within an ulp, 2^-23), so a wrong
    rescale between key blocks fails here, where one block would hide it;
    registered as a flash_attention variant (fa_jax.attention.kernel_loops)."""
    from attention_plain import plain_attention

    from fa_jax import golden
    from fa_jax.attention import Blocks, flash_attention, kernel_loops

    assert variant in kernel_loops()
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) * 3 for s in ((2, 3, 8), (2, 19, 8), (2, 19, 8)))
    with x64_enabled():
        got = flash_attention(q, k, v, golden(), Blocks(3, 4), variant=variant)
        want = plain_attention(q, k, v)
    for name, g, w in zip(("O", "L"), got, want):
        err = np.max(np.abs(np.asarray(g) - np.asarray(w))) / np.max(np.abs(np.asarray(w)))
        assert err <= 5 * 2.0**-23, (name, err)
