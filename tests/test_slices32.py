"""The digit-slice dots of ``fa_jax.carrier32.slices``: exact float32 dots, a sound loss
bound, and the rounding ``fa_jax.carrier32.sums`` makes of them against an exact oracle.

Where the fast path's loss bound decides an output, its rounding must be the
exact sum (``fractions.Fraction``) rounded once; the pieces must miss less than
the bound says; and on the values attention multiplies (formats of a few bits,
no huge spread) every output must take the fast path.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled
from oracle import exact_matmul, exactly_rounded_matmul, round_exact

from fa_jax import get_format
from fa_jax.carrier32 import limbs
from fa_jax.carrier32 import slices as slices32
from fa_jax.carrier32 import sums as sum32
from fa_jax.rounding import round_to

FP32, BF16 = get_format("fp32"), get_format("bf16")


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def draw(kind: str, shape, rng) -> np.ndarray:
    """float32 operands: bf16 or FP32 normals, a wide spread, attention-like
    probabilities, subnormals, full significands of one sign and binade (digit
    dots as large as they can be); a row and a column of zeros."""
    x = rng.standard_normal(shape)
    if kind == "positive":
        x = rng.uniform(1, 2, shape)
    elif kind == "wide":
        x = x * 2.0 ** rng.integers(-60, 20, shape)
    elif kind == "probabilities":
        x = np.exp(-rng.exponential(8, shape))
    elif kind == "subnormal":
        x = x * 2.0**-140
    x = np.asarray(x, np.float32)
    if kind in ("bf16", "probabilities"):
        x = np.array(round_to(jnp.asarray(x), BF16))
    x[..., 0, :] = 0
    return x


def test_the_plans_keep_every_float32_sum_exact_and_int32_in_range():
    for k in range(1, slices32._longest(slices32.supports) + 1):
        c, q, beta, s = slices32._plan(k)
        assert q * c >= k and c * ((1 << beta) - 1) ** 2 < 1 << 24 and s * beta >= 36, k
        assert slices32._diagonal_bound(k) < 1 << 31, k
    assert not slices32.supports(slices32._longest(slices32.supports) + 1)
    for n in range(1, slices32._longest(slices32.supports_sum) + 1, 7):
        c, q, beta, s = slices32._sum_plan(n)
        assert q * c >= n and c * ((1 << beta) - 1) < 1 << 24 and s * beta >= 36, n
        assert q * c * ((1 << beta) - 1) < 1 << 31, n
    assert not slices32.supports(0) and not slices32.supports_sum(0)


KINDS = ["bf16", "fp32", "wide", "probabilities", "subnormal", "positive"]
DECIDED = {"bf16", "subnormal", "positive"}  # kinds whose every output must take the fast path


def pieces_sum(s: slices32.Sliced, index) -> Fraction:
    fields = (np.asarray(x)[(slice(None), *index)] for x in (s.neg, s.lsb, s.mag))
    return sum(
        ((-1 if neg else 1) * int(mag) * Fraction(2) ** int(lsb) for neg, lsb, mag in zip(*fields)),
        Fraction(0),
    )


def check_pieces(s: slices32.Sliced, truth: Fraction, index) -> None:
    """The pieces are exact where not ``inexact``, else within the loss bound."""
    err = abs(truth - pieces_sum(s, index))
    if np.asarray(s.inexact)[index]:
        assert err < Fraction(2) ** int(np.asarray(s.base + s.lost)[index]), index
    else:
        assert err == 0, index


def check_rounding(r, truth: Fraction, fmt, index) -> None:
    if np.asarray(r.safe)[index] and truth != 0:
        want = np.float32(round_exact(truth, fmt))
        assert np.asarray(r.value)[index].view(np.uint32) == want.view(np.uint32), (fmt, index)


def slow(*values):
    return [pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.mark.parametrize("k", [65, *slow(1, 5, 64, 300)])
def test_the_fast_path_rounds_the_exact_sum_where_it_decides(k):
    rng = np.random.default_rng(k)
    a = np.stack([draw(kind, (6, k), rng) for kind in KINDS])  # row 0 zero
    b = np.stack(
        [draw("bf16" if kind == "probabilities" else kind, (5, k), rng) for kind in KINDS]
    ).transpose(0, 2, 1)  # column 0 zero
    s = jax.jit(slices32.sliced_dot)(limbs.operand(jnp.asarray(a)), limbs.operand(jnp.asarray(b)))
    matmul = lambda x, y, f: sum32._sliced_matmul(x, y, f)  # noqa: E731
    rounded = {fmt: jax.jit(matmul, static_argnums=2)(a, b, fmt) for fmt in (FP32, BF16)}
    for w, kind in enumerate(KINDS):
        for (i, j), truth in np.ndenumerate(np.asarray(exact_matmul(a[w], b[w]), object)):
            check_pieces(s, truth, (w, i, j))
            for fmt, r in rounded.items():
                check_rounding(r, truth, fmt, (w, i, j))
        for fmt, r in rounded.items():
            share = np.asarray(r.safe)[w].mean()
            assert share == 1 if kind in DECIDED else share >= 0.9 or kind != "fp32", (kind, fmt)


@pytest.mark.parametrize("n", [3, 1000, *slow(1, 256)])
def test_the_fast_sum_rounds_the_exact_sum_where_it_decides(n):
    rng = np.random.default_rng(n)
    x = np.concatenate([draw(kind, (7, n), rng) for kind in KINDS]).T.copy()  # (n, 7 per kind)
    s = jax.jit(slices32.sliced_sum)(limbs.operand(jnp.asarray(x.T)))
    r = jax.jit(lambda v: sum32._rounded_slices(slices32.sliced_sum(limbs.operand(v)), FP32))(x.T)
    for j in range(x.shape[1]):
        truth = sum((Fraction(float(v)) for v in x[:, j]), Fraction(0))
        check_pieces(s, truth, (j,))
        check_rounding(r, truth, FP32, (j,))
        if KINDS[j // 7] in DECIDED | {"fp32", "probabilities"}:
            assert np.asarray(r.safe)[j], j


@pytest.mark.slow
def test_sum32_takes_the_fast_path_eagerly_too():
    rng = np.random.default_rng(3)
    a, b = draw("bf16", (8, 64), rng), draw("bf16", (64, 8), rng)
    eager = sum32.matmul(jnp.asarray(a), jnp.asarray(b), FP32)
    jitted = jax.jit(lambda x, y: sum32.matmul(x, y, FP32))(a, b)
    want = exactly_rounded_matmul(a, b, FP32)
    assert (np.asarray(eager).view(np.uint32) == want.view(np.uint32)).all()
    assert (np.asarray(jitted).view(np.uint32) == want.view(np.uint32)).all()


def test_unsupported_lengths_are_refused():
    x = limbs.operand(jnp.ones((2, 0), jnp.float32))
    with pytest.raises(ValueError, match="contraction terms expected, got 0"):
        slices32.sliced_dot(x, limbs.operand(jnp.ones((0, 2), jnp.float32)))
    with pytest.raises(ValueError, match="terms expected, got 0"):
        slices32.sliced_sum(limbs.operand(jnp.ones((2, 0), jnp.float32)))
