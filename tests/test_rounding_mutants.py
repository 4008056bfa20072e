"""Stochastic rounding below S, decided bit for bit.

Below S, the smallest positive value of the format, round_to rounds |x| away (to
S) exactly when the low M_c + 1 bits of the element's random word fall below
t = |x| / S * 2**(M_c + 1) (24 bits for a float32 carrier).  test_rounding.py
measures the resulting probabilities statistically, which cannot see a threshold
off by one draw in 2**24; here x is chosen so that t equals the drawn bits (or one
more), and the result must be 0 (or S) exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import get_format, round_to

FP16 = get_format("fp16")
S = 2.0**-24  # fp16's smallest subnormal
BITS = 24  # M_c + 1 for a float32 carrier


def test_stochastic_below_s_rounds_away_exactly_when_the_draw_is_below_the_threshold():
    key = jax.random.key(11)
    shape = (4096,)
    draws = np.asarray(jax.random.bits(key, shape, jnp.uint32)) & np.uint32((1 << BITS) - 1)
    draws = np.minimum(draws, (1 << BITS) - 2).astype(np.float64)  # t + 1 stays below S
    sign = np.where(np.arange(shape[0]) % 2 == 0, 1.0, -1.0)
    for offset, want in ((0, 0.0), (1, S)):
        t = draws + offset
        x = (sign * t * (S / 2.0**BITS)).astype(np.float32)
        assert (np.abs(x.astype(np.float64)) / S * 2.0**BITS == t).all(), "x inexact"
        got = np.asarray(round_to(jnp.asarray(x), FP16, "stochastic", key=key))
        np.testing.assert_array_equal(np.abs(got), want, err_msg=f"t = draw + {offset}")
