"""``fa_jax._fusion.materialised``: the same bits, computed once.

It must return every bit pattern unchanged (NaN payloads, -0, subnormals that
XLA's CPU arithmetic would flush), jitted, eager and under ``vmap``; and in a
compiled CPU program a rounding read by two reductions must appear once with it
and twice without it (the duplication it exists to stop).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import get_format
from fa_jax._fusion import materialised
from fa_jax.rounding import round_to

PATTERNS = {
    np.float32: np.array(
        [0, 0x80000000, 1, 0x807FFFFF, 0x3F800000, 0x7F800000, 0xFF800000, 0x7FC00001, 0xFFA00000],
        np.uint32,
    ),
    np.float64: np.array(
        [
            0,
            1 << 63,
            1,
            0x000FFFFFFFFFFFFF,
            0x3FF0000000000001,
            0x7FF0000000000000,
            0x7FF8000000000123,
        ],
        np.uint64,
    ),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_bit_pattern_comes_back(dtype):
    bits = PATTERNS[dtype]
    with x64_enabled():
        x = jnp.asarray(bits.view(dtype))
        for f in (materialised, jax.jit(materialised), jax.vmap(materialised)):
            got = np.asarray(f(x))
            assert got.dtype == dtype
            np.testing.assert_array_equal(got.view(bits.dtype), bits)


def test_its_derivative_is_the_identitys():
    x = jnp.arange(1.0, 5.0, dtype=jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(materialised(x) ** 2))
    np.testing.assert_array_equal(np.asarray(grad(x)), 2 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(grad)(x)), 2 * np.asarray(x))


def test_a_rounding_read_twice_is_computed_once():
    """Flash's pattern: e read by a row sum and, rounded once more, by a dot.  Each
    rounding has one count-leading-zeros; with ``materialised`` there are two in the
    compiled program (e's and P's), without it e's is copied into both consumers."""
    # Formats rounded by the integer path in float32 (not in float arithmetic).
    e_fmt, p_fmt = get_format("bf16"), get_format("tf32")
    w = jnp.ones((64, 64), jnp.float32)

    def flash_like(x, once):
        e = round_to(x * np.float32(1.5), e_fmt)
        e = materialised(e) if once else e
        return jnp.sum(e, axis=-1), jnp.matmul(round_to(e, p_fmt), w)

    x = jnp.ones((64, 64), jnp.float32)
    counts = []
    for once in (False, True):
        text = jax.jit(flash_like, static_argnums=1).lower(x, once).compile().as_text()
        assert text is not None
        counts.append(text.count("count-leading-zeros("))
    assert counts == [3, 2], counts
