"""fa_jax.exponential's polynomial exps against independent numpy float32
evaluations of the published algorithms (tests/exp_reference.py), bit for bit.

A one-ulp change in a polynomial coefficient changes about one output in 10^4
to 10^6 (fewer the higher its degree), so the default run compares 2^21 random
inputs and, densely, the neighbourhood of every point the code branches on: the
binade edges (multiples of ln 2 / 2, where floor or rint of x log2 e steps), the
underflow and overflow thresholds, the clamps, the flush to zero, ±0, ±inf and
NaN.  The slow run sweeps a strided walk through every float32 bit pattern in
[-110, 90].  Coefficients too small to change any of these outputs (the
highest-degree ones of Sleef and YNNPACK, fexp_u20's constant term) are held to
the source's literals directly.
"""

from __future__ import annotations

import exp_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import BF16, FP32, ops
from fa_jax import exponential as E

MODELS = {
    "exp_u20": (E.exp_u20, ref.exp_u20),
    "fexp_u20": (E.fexp_u20, ref.fexp_u20),
    "sleef_expf_u10": (E.sleef_expf_u10, ref.sleef_expf_u10),
    "ynnpack_exp": (E.ynnpack_exp, ref.ynnpack_exp),
}
# The reference follows the models' NaN rule (NaN in, NaN out, or 0 for fexp_u20);
# the vector min/max of exp_u20 and fexp_u20's integer conversion treat NaN
# otherwise on the hardware, and no softmax feeds them NaN: left out for those two.
NAN_KEPT = {"sleef_expf_u10", "ynnpack_exp"}

_FLT_TINY = float(np.finfo(np.float32).tiny)


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 -> int64 in the order of the values (so ±k steps are ±k ulps)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.int64)
    return np.where(b >= 2**31, -(b - 2**31), b)


def _unordered(k: np.ndarray) -> np.ndarray:
    b = np.where(k < 0, (-k) + 2**31, k).astype(np.uint32)
    return b.view(np.float32)


def around(values, ulps: int) -> np.ndarray:
    """The float32 values within ``ulps`` ulps of each of ``values``."""
    k = _ordered(np.asarray(values, np.float32))[:, None] + np.arange(-ulps, ulps + 1)[None, :]
    k = np.clip(k, -0x7F800000, 0x7F800000)
    return np.unique(_unordered(k.ravel()))


def edges() -> np.ndarray:
    """Every branch point of the four models, each with its neighbours."""
    half_ln2 = np.arange(-310, 260) * (np.log(2.0) / 2)  # floor/rint of x log2 e step here
    thresholds = [
        ref.LN_FLT_MIN,
        ref.LN_FLT_MAX,
        -104.0,
        100.0,
        *ref.YNN_CLAMP,
        np.log(_FLT_TINY),  # YNNPACK's flush to zero
        127.5 * np.log(2.0),  # YNNPACK's 2^b overflows
        -126.5 * np.log(2.0),  # exp_u20's 2^(n-1) leaves the normal range
        -149.5 * np.log(2.0),  # Sleef's smallest subnormal
        0.0,
    ]
    near = np.concatenate([around(half_ln2, 24), around(thresholds, 600)])
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45, 200.0, -200.0],
        np.float32,
    )
    return np.concatenate([near, specials]).astype(np.float32)


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-110.0, 90.0, n).astype(np.float32)


def _run(fn, x: np.ndarray, jit: bool = True) -> np.ndarray:
    f = jax.jit(fn) if jit else fn
    return np.asarray(f(jnp.asarray(x, jnp.float64))).astype(np.float32)


def assert_same_bits(name: str, x: np.ndarray, jit: bool = True) -> None:
    model, reference = MODELS[name]
    if name not in NAN_KEPT:
        x = x[~np.isnan(x)]
    got, want = _run(model, x, jit), reference(x)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    if not same.all():
        bad = np.flatnonzero(~same)[:8]
        rows = [f"x={x[i]!r}: got {got[i]!r}, want {want[i]!r}" for i in bad]
        pytest.fail(f"{name}: {(~same).sum()} of {x.size} differ:\n" + "\n".join(rows))


@pytest.mark.parametrize("name", MODELS)
def test_random_inputs_match_the_published_algorithm(x64, name):
    """2^21 inputs: a one-ulp change of any coefficient that moves one of 2^20 random
    outputs moves some of these (the least visible, YNNPACK's third highest, 3)."""
    assert_same_bits(name, _random(1 << 21))


@pytest.mark.parametrize("name", MODELS)
def test_every_branch_point_and_its_neighbours(x64, name):
    """Binade edges, thresholds, clamps and specials, jitted; op by op for Sleef's
    model by default (each op compiles once eagerly), for all under -m slow."""
    x = edges()
    assert_same_bits(name, x)
    if name == "sleef_expf_u10":
        assert_same_bits(name, x[::7], jit=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_every_branch_point_op_by_op(x64, name):
    assert_same_bits(name, edges()[::7], jit=False)


@pytest.mark.parametrize("name", MODELS)
def test_specials(x64, name):
    """What the models document at the edges of the float32 range."""
    model, _ = MODELS[name]
    y = _run(model, np.array([0.0, -0.0, -np.inf, -200.0, np.inf], np.float32))
    assert (y[2:4] == 0).all() and not np.signbit(y[2:4]).any()
    assert y[0] == y[1] == (1 - 2.0**-14 + 2.0**-17 if name == "fexp_u20" else 1.0)
    if name == "exp_u20":
        assert y[4] == np.inf  # clamped to ln FLT_MAX, 2^127 · p · 2 overflows
    else:
        assert y[4] == np.inf
    if name in NAN_KEPT:
        assert np.isnan(_run(model, np.array([np.nan], np.float32))).all()


def test_the_models_hold_the_sources_constants():
    """The FP32 values of the sources' literals, the ones no output on a feasible
    number of inputs shows included (a one-ulp change of Sleef's degree-7
    coefficient moves no output among 2^20 random ones)."""

    def f32s(values):
        return [float(np.float32(v)) for v in values]

    assert [E._LOG2E, E._LN2, E._LN_FLT_MIN, E._LN_FLT_MAX] == f32s(
        [ref.LOG2E, ref.LN2, ref.LN_FLT_MIN, ref.LN_FLT_MAX]
    )
    assert [*E._U20_POLY, E._U20_C1] == f32s(ref.U20)
    assert list(E._FEXP_POLY) == f32s(ref.FEXP)
    assert list(E._SLEEF_POLY) == f32s(ref.SLEEF)
    assert [E._SLEEF_LN2_HI, E._SLEEF_LN2_LO] == f32s(ref.SLEEF_LN2)
    assert list(E._YNN_POLY) == f32s(ref.YNN)
    assert [E._YNN_LN2_HI, E._YNN_LN2_LO] == f32s(ref.YNN_LN2)
    assert [E._YNN_MIN_X, E._YNN_MAX_X] == f32s(ref.YNN_CLAMP)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_a_strided_walk_through_every_float32_in_range(x64, name):
    """Every 61st float32 bit pattern in [-110, 90] (about 3.6e7 inputs)."""
    lo, hi = _ordered(np.array([-110.0, 90.0], np.float32))
    for start in range(int(lo), int(hi), 61 << 22):
        k = np.arange(start, min(start + (61 << 22), int(hi)), 61)
        assert_same_bits(name, _unordered(k))


# -- the vectorised loop: full vectors of lanes, the scalar exp on the rest -----------


def test_vectorised_splits_full_vectors_from_the_tail(x64):
    """For row lengths about multiples of the lanes, entries before
    lanes · floor(n / lanes) take the vector exp and the rest the correctly rounded
    one; then all are rounded to the format."""
    for lanes, n, fmt in [(3, 7, FP32), (8, 8, FP32), (8, 13, BF16)]:
        model = E.vectorised("v", lanes, E.fexp_u20)
        x = -np.linspace(0.05, 7.0, 2 * n, dtype=np.float32).astype(np.float64).reshape(2, n)
        full = lanes * (n // lanes)
        vector = ref.fexp_u20(x.astype(np.float32)).astype(np.float64)
        scalar = np.asarray(ops.exp(jnp.asarray(x), FP32))
        assert (vector != scalar).all()  # fexp_u20 is not the correctly rounded exp here
        want = np.where(np.arange(n) < full, vector, scalar)
        got = np.asarray(jax.jit(model.fn, static_argnums=1)(jnp.asarray(x), fmt))
        np.testing.assert_array_equal(got, np.asarray(ops.cast(jnp.asarray(want), fmt)))
    assert E.TORCH_AVX2.fn(jnp.zeros((3, 0)), FP32).shape == (3, 0)
