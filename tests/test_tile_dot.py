"""fa_jax.kernels.x86.tile_dot: AMX's BF16 tile dot in ATen's chunks, against a float32 loop
written from the SDM's ``tdpbf16ps`` (two chains per output, added, then added
into the accumulator)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import FP32
from fa_jax.kernels.x86.tile_dot import TERMS, chunk, tile_dot


def _loop(a: np.ndarray, b: np.ndarray, c: np.ndarray | None, w: int) -> np.ndarray:
    """C + a @ b, chunk by chunk of ``w`` terms (K padded to even), one output at a time."""
    f32 = np.float32
    n, k = a.shape
    out = np.zeros((n, b.shape[1]), np.float32) if c is None else c.astype(np.float32).copy()
    padded = k + k % 2
    for i in range(n):
        for j in range(b.shape[1]):
            acc = out[i, j]
            for lo in range(0, padded, w):
                chains = [f32(0), f32(0)]
                for t in range(lo, min(lo + w, k)):  # the products are exact in float32
                    chains[t % 2] = f32(chains[t % 2] + f32(a[i, t]) * f32(b[t, j]))
                acc = f32(acc + f32(chains[0] + chains[1]))
            out[i, j] = acc
    return out


def _bf16(rng, shape) -> np.ndarray:
    """bf16 values over 2^-12 .. 2^12, either sign: any other order rounds otherwise."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_chunk_is_the_largest_even_divisor_up_to_32():
    """As measured on PyTorch's packed flash loop (docs/kernels.md)."""
    assert TERMS == 32
    got = {k: chunk(k) for k in (2, 32, 35, 36, 40, 64, 74, 80, 98, 300, 512)}
    want = {2: 2, 32: 32, 35: 18, 36: 18, 40: 20, 64: 32, 74: 2, 80: 20, 98: 14, 300: 30}
    assert got == {**want, 512: 32}
    assert chunk(1) == 2  # one term and a zero
    for bad in (0, -4, 2.0):
        with pytest.raises(ValueError, match=r"chunk: expected an inner dimension k >= 1, got"):
            chunk(bad)  # pyright: ignore[reportArgumentType]


def test_blocks_are_32_terms_the_last_shorter():
    """oneDNN's brgemm as OpenVINO calls it: 80 = 32 + 32 + 16."""
    assert [chunk(k, "blocks") for k in (1, 16, 35, 80, 512)] == [2, 16, 32, 32, 32]
    with pytest.raises(ValueError, match=r"chunking: expected one of \('divisor', 'blocks'\)"):
        chunk(8, "tiles")


@pytest.mark.parametrize(
    "k, start, chunking",
    [
        (35, False, "divisor"),
        (80, True, "divisor"),
        (74, False, "divisor"),
        (300, True, "divisor"),
        (1, True, "divisor"),
        (80, False, "blocks"),
        (35, True, "blocks"),
    ],
)
def test_tile_dot_is_the_sdm_loop(k, start, chunking):
    """Bit for bit with the loop, float64 and float32 carriers, jitted (and op by op
    once, float64: each op compiles on its own there); from 0 and from an
    accumulator (P V's rescaled o)."""
    rng = np.random.default_rng(k)
    a, b = _bf16(rng, (5, k)), _bf16(rng, (k, 3))
    c = _bf16(rng, (5, 3)) if start else None
    want = _loop(a, b, c, chunk(k, chunking))
    fn = lambda a, b, c: tile_dot(a, b, FP32, chunking=chunking, initial=c)  # noqa: E731
    for jit in (False, True) if (k, chunking) == (80, "divisor") else (True,):
        run = jax.jit(fn) if jit else fn
        if jit:  # op by op: once, on the float64 carrier
            got32 = run(jnp.asarray(a), jnp.asarray(b), None if c is None else jnp.asarray(c))
            np.testing.assert_array_equal(np.asarray(got32), want, err_msg="float32")
        with x64_enabled():
            args = (jnp.asarray(t, jnp.float64) for t in (a, b))
            got = run(*args, None if c is None else jnp.asarray(c, jnp.float64))
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"float64, jit={jit}")


def test_other_chunks_add_otherwise():
    """The inputs tell the measured chunks from chunks of 32 with a short last one
    (80 = 32 + 32 + 16), and from one chain per chunk: a wrong rule fails above."""
    rng = np.random.default_rng(80)
    a, b = _bf16(rng, (16, 80)), _bf16(rng, (80, 16))
    got = np.asarray(jax.jit(tile_dot, static_argnums=2)(jnp.asarray(a), jnp.asarray(b), FP32))
    assert np.any(got != _loop(a, b, None, 32))
    one_chain = np.zeros_like(got)
    for t in range(80):
        one_chain = (one_chain + np.outer(a[:, t], b[t])).astype(np.float32)
    assert np.any(got != one_chain)


def test_tile_dot_broadcasts_and_vmaps():
    """Leading dimensions broadcast (one K for several heads); vmap over a batch is
    the loop per member."""
    rng = np.random.default_rng(1)
    a, b = _bf16(rng, (2, 3, 4, 36)), _bf16(rng, (36, 5))
    got = np.asarray(jax.jit(tile_dot, static_argnums=2)(jnp.asarray(a), jnp.asarray(b), FP32))
    assert got.shape == (2, 3, 4, 5)
    np.testing.assert_array_equal(got[1, 2], _loop(a[1, 2], b, None, 18))
    mapped = jax.jit(jax.vmap(lambda x: tile_dot(x, jnp.asarray(b), FP32)))(jnp.asarray(a[0]))
    np.testing.assert_array_equal(np.asarray(mapped), got[0])


def test_tile_dot_names_bad_shapes():
    with pytest.raises(ValueError, match=r"expected a \(\.\.\., n, K\) and b \(\.\.\., K, m\)"):
        tile_dot(jnp.zeros((2, 3)), jnp.zeros((4, 2)), FP32)
    with pytest.raises(ValueError, match=r"got a \(3,\), b \(3, 2\)"):
        tile_dot(jnp.zeros(3), jnp.zeros((3, 2)), FP32)
