"""Input distributions of the experiments: seeded float64 Q, K, V.

For each (seed, seq_len) the inputs come from ``numpy.random.default_rng([seed,
seq_len])`` (a SeedSequence of both), drawn independently of every other length,
in the order q, k, v, each of shape ``(batch, heads, seq_len, d)``:

``"normal"``    N(0, 1), as Golden et al. 2024 §4;
``"uniform"``   U(-1, 1);
``"outliers"``  N(0, 1) + N(0, 10²)·Bernoulli(0.001), FlashAttention-3 §4.3
                (per tensor: the normal part, then the Bernoulli mask, then
                the outlier values).

The draws are raw float64: a study rounds them to its input format itself, so
that its FP64 golden reference sees the same values as the emulated runs.
"""

from __future__ import annotations

import numpy as np

from fa_jax._checks import non_negative_int, one_of, positive_int

__all__ = ["DISTRIBUTIONS", "OUTLIER_PROBABILITY", "OUTLIER_STD", "make_inputs"]

DISTRIBUTIONS = ("normal", "uniform", "outliers")
OUTLIER_PROBABILITY = 0.001  # FlashAttention-3 §4.3
OUTLIER_STD = 10.0


def make_inputs(
    seed: int,
    seq_len: int,
    *,
    batch: int = 1,
    heads: int = 1,
    d: int = 64,
    distribution: str = "normal",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw float64 numpy (q, k, v), each (batch, heads, seq_len, d), drawn from
    ``numpy.random.default_rng([seed, seq_len])`` (module docstring)."""
    non_negative_int(seed, "make_inputs: seed")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("heads", heads), ("d", d)):
        positive_int(value, f"make_inputs: {name}")
    one_of(distribution, DISTRIBUTIONS, "make_inputs: distribution")
    rng = np.random.default_rng([seed, seq_len])
    shape = (batch, heads, seq_len, d)

    def one() -> np.ndarray:
        if distribution == "uniform":
            return rng.uniform(-1.0, 1.0, shape)
        x = rng.standard_normal(shape)
        if distribution == "outliers":
            mask = rng.random(shape) < OUTLIER_PROBABILITY
            x = x + mask * rng.normal(0.0, OUTLIER_STD, shape)
        return x

    q, k, v = (one() for _ in range(3))
    return q, k, v
