"""ops.sum under the chunked model when a chunk's float64 sum is inexact.

test_ops.py sums values of the target format, whose float64 chunk sums are exact;
here a chunk's float64 sum lands on a midpoint of the format and only its rounding
error (carried into the sequential additions) says which way the true sum lies.
"""

from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled
from oracle import round_exact

from fa_jax import get_format, ops
from fa_jax.accumulation import chunked

FP32 = get_format("fp32")
BF16 = get_format("bf16")


def _chunked_reference(terms, k: int, fmt) -> float:
    """acc_j = fl(acc_{j-1} + exact sum of chunk j), from acc_0 = 0."""
    acc = Fraction(0)
    for i in range(0, len(terms), k):
        acc = Fraction(round_exact(acc + sum(terms[i : i + k], Fraction(0)), fmt))
    return float(acc)


@pytest.mark.parametrize("fmt", [FP32, BF16], ids=lambda f: f.name)
def test_chunked_sum_carries_each_chunks_rounding_error(fmt):
    mid = 1.0 + 2.0 ** -(fmt.man_bits + 1)  # a midpoint of fmt, exact in float64
    tiny = 2.0**-80  # lost in float64 next to mid, kept as the chunk's error
    x = np.array(
        [
            [mid, tiny, 0.0, 0.0],
            [mid, -tiny, 0.0, 0.0],
            [0.0, 0.0, -mid, tiny],
            [0.5, 0.25, mid, -tiny],
        ]
    )
    with x64_enabled():
        got = np.asarray(ops.sum(jnp.asarray(x), fmt, accumulation=chunked(2)))
    for row, g in zip(x, got):
        want = _chunked_reference([Fraction(float(t)) for t in row], 2, fmt)
        assert np.float64(g).view(np.uint64) == np.float64(want).view(np.uint64), (row, g, want)
    assert got[0] != got[1]  # the two sides of the midpoint round apart
