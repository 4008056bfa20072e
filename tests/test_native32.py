"""The sequential FP32 accumulation on float32 hardware (``fa_jax.carrier32.native``).

Where its checks pass, the result must be numpy's float32 loop (IEEE binary32
with subnormals, so no flush can hide); where any check fails for any
configuration of a batch, the caller's fallback must run.  Through ``ops`` and
``sum32`` on both carriers, the bits must equal the emulation the fast path
replaces.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import get_format, ops
from fa_jax.carrier32 import native as native32
from fa_jax.carrier32 import sums as sum32

FP32 = get_format("fp32")
SENTINEL = -12345.0  # what the fallback returns: it ran


def on(carrier: str):
    """The setting a carrier runs under: x64 for float64, JAX's default for float32."""
    return x64_enabled() if carrier == "float64" else contextlib.nullcontext()


def bf16_values(rng, shape, lo_exp=-20, hi_exp=20):
    """Random bf16 values (8-bit significands) of both signs over 2**lo_exp..2**hi_exp,
    with zeros, as float32."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(lo_exp, hi_exp, shape))
    x[rng.random(shape) < 0.1] = 0.0
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def numpy_matmul(a, b, start):
    """acc_k = fl32(acc_{k-1} + a_k b_k) in numpy float32; the products are exact."""
    acc = start.astype(np.float32).copy()
    for k in range(a.shape[-1]):
        p = a[..., :, k : k + 1].astype(np.float64) * b[..., k : k + 1, :].astype(np.float64)
        assert np.array_equal(p.astype(np.float32).astype(np.float64), p)  # exact
        acc = acc + p.astype(np.float32)
    return acc


def fallback(shape, dtype):
    return lambda: jnp.full(shape, SENTINEL, dtype)


def run_matmul(a, b, start, *, jit=True):
    f = lambda a, b, c: native32.sequential_matmul(a, b, c, fallback(c.shape, c.dtype))  # noqa: E731
    return np.asarray((jax.jit(f) if jit else f)(a, b, start))


def cancelling(rng, n=6, k=40, m=5):
    """bf16 operands whose running sums cancel: b's second half repeats the first,
    negated, so each sum passes near zero; start of FP32 values or 0."""
    a = bf16_values(rng, (n, k))
    half = bf16_values(rng, (k // 2, m))
    b = np.concatenate([half, -half[::-1]])
    a[:, k // 2 :] = a[:, : k // 2][:, ::-1]
    start = (rng.standard_normal((n, m)) * 2.0**-10).astype(np.float32)
    start[0] = 0.0
    return a, b, start


@pytest.mark.parametrize(
    ("carrier", "jit"), [("float32", True), ("float64", True), ("float32", False)]
)
def test_hardware_path_is_the_float32_loop(carrier, jit):
    rng = np.random.default_rng(0)
    for a, b, start in [
        (bf16_values(rng, (6, 33)), bf16_values(rng, (33, 7)), np.zeros((6, 7), np.float32)),
        cancelling(rng),
    ]:
        want = numpy_matmul(a, b, start)
        with on(carrier):
            dt = np.dtype(carrier)
            got = run_matmul(a.astype(dt), b.astype(dt), start.astype(dt), jit=jit)
        assert got.dtype == dt
        assert not np.any(got == SENTINEL)
        np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32), want.view(np.uint32))


def test_the_boundaries_of_the_checks_still_take_the_hardware_path():
    """Smallest products of exactly 2**-102 and a start of 2**-103 are allowed; the two
    products cancel to 2**-113, a normal."""
    a = np.array([[2.0**-51 * (1 + 2.0**-11), 2.0**-51]], np.float32)
    b = np.array([[2.0**-51], [-(2.0**-51)]], np.float32)
    for start in (0.0, 2.0**-103):
        c = np.array([[start]], np.float32)
        got = run_matmul(a, b, c)
        np.testing.assert_array_equal(got, numpy_matmul(a, b, c))
    assert got[0, 0] != SENTINEL and got[0, 0] == np.float32(2.0**-113 + 2.0**-103)


def one_failing(case):
    """Operands passing every check but the one named by ``case``."""
    a, b, start = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), np.zeros((2, 2))
    start = start.astype(np.float32)
    if case == "13-bit significand":
        a[0, 0] = 1 + 2.0**-12
    elif case == "subnormal operand":
        a[0, 0] = 2.0**-130
    elif case == "nan operand":
        b[1, 1] = np.nan
    elif case == "inf operand":
        b[1, 1] = np.inf
    elif case == "products below 2**-102":
        a[0, 0], b[0, 0] = 2.0**-52, 2.0**-51
    elif case == "product overflow":
        a[0, 0], b[0, 0] = 2.0**64, 2.0**64
    elif case == "start below 2**-103":
        start[1, 0] = 2.0**-104
    elif case == "nan start":
        start[1, 0] = np.nan
    return a, b, start


CASES = [
    "13-bit significand",
    "subnormal operand",
    "nan operand",
    "inf operand",
    "products below 2**-102",
    "product overflow",
    "start below 2**-103",
    "nan start",
]


@pytest.mark.parametrize("case", CASES)
def test_each_check_sends_the_matmul_to_the_fallback(case):
    a, b, start = one_failing(case)
    assert np.all(run_matmul(a, b, start) == SENTINEL)


def test_a_float64_operand_not_exact_in_float32_takes_the_fallback(x64):
    a, b, start = np.ones((2, 3)), np.ones((3, 2)), np.zeros((2, 2))
    a[1, 2] = 1 + 2.0**-30
    assert np.all(run_matmul(a, b, start) == SENTINEL)
    a[1, 2] = 1 + 2.0**-7
    assert np.all(run_matmul(a, b, start) != SENTINEL)


def test_under_vmap_one_configuration_failing_sends_the_batch_to_the_fallback():
    good = one_failing("none")
    bad = one_failing("products below 2**-102")
    stacked = [np.stack([g, x]) for g, x in zip(good, bad)]
    f = jax.vmap(lambda a, b, c: native32.sequential_matmul(a, b, c, fallback(c.shape, c.dtype)))
    assert "cond" in str(jax.make_jaxpr(f)(*stacked))  # a branch, not a select
    assert np.all(np.asarray(jax.jit(f)(*stacked)) == SENTINEL)
    both_good = [np.stack([g, g]) for g in good]
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*both_good)), np.full((2, 2, 2), 3.0))


def test_is_binary32_only_for_ieee_fp32_with_concrete_fields():
    assert native32.is_binary32(FP32)
    assert not native32.is_binary32(get_format("bf16"))
    assert not native32.is_binary32(dataclasses.replace(FP32, overflow="saturate"))
    assert not native32.is_binary32(dataclasses.replace(FP32, subnormals=False))


@pytest.fixture(params=["float32", "float64"])
def carrier(request):
    with on(request.param):
        yield np.dtype(request.param)


def operand_sets(rng):
    """bf16 operands (hardware path), with signed zeros (-0 products from 0 start),
    cancelling sums, and 2**±60 spreads (the fallback)."""
    a, b = bf16_values(rng, (5, 9)), bf16_values(rng, (9, 4))
    a[0] = -0.0
    yield a, b
    yield cancelling(rng)[:2]
    yield bf16_values(rng, (5, 9), -60, 60), bf16_values(rng, (9, 4), -60, 60)
    yield np.array([[0.0]], np.float32), np.array([[-1.0]], np.float32)  # +0 + (-0) = +0


def test_ops_give_the_bits_of_the_emulation(carrier, monkeypatch):
    rng = np.random.default_rng(2)
    calls = {
        "matmul": lambda a, b: ops.matmul(a, b, FP32, accumulation="sequential"),
    }
    for a, b in operand_sets(rng):
        a, b = a.astype(carrier), b.astype(carrier)
        for name, f in calls.items():
            fast = np.asarray(jax.jit(f)(a, b))
            with monkeypatch.context() as m:
                m.setattr(native32, "is_binary32", lambda fmt: False)
                emulated = np.asarray(jax.jit(f)(a, b))
            np.testing.assert_array_equal(
                fast.view(f"u{carrier.itemsize}"), emulated.view(f"u{carrier.itemsize}"), name
            )


def test_sum32_takes_the_hardware_path(monkeypatch):
    """The float32 carrier's own entry points use it too (a spy on the fast path)."""
    seen = []
    real = native32.sequential_matmul
    monkeypatch.setattr(native32, "sequential_matmul", lambda *a: seen.append(1) or real(*a))
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(
        np.asarray(sum32.matmul(x, x.T, FP32, accumulation="sequential")), np.full((2, 2), 3.0)
    )
    assert seen
