"""fa_jax.vector_loop: the lane sums and GEMM blocks of PyTorch's CPU flash loop,
each against a float32 loop written from ATen's source (``functional_base.h``'s
``vec_reduce_all``, ``vec_base.h``'s generic build)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import FP32
from fa_jax.vector_loop import LANES, Lanes, gemm_accumulate, gemm_k_blocks, lane_sum


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


@pytest.mark.parametrize("variant", sorted(LANES))
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

    from fa_jax.presets import fa2_kernel
    from fa_jax.vector_loop import torch_pv, torch_qk

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
