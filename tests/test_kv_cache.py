"""fa_jax.kv_cache: narrow KV caches, against numpy + ml_dtypes and through attention.

The cache is checked on its own (scales and codes of every format and scaling
against numpy's float32 division and ml_dtypes' casts, bit for bit) and then
through attention.  There the reference is attention without a cache on K', V'
dequantized here in numpy: dequantization is elementwise (x'_ij depends only on
x̂_ij and its group's scale), so reading every K_j, V_j block through the cache
inside the loop gives the bits of reading all of K', V' up front, and what is
left after K', V' is attention that the uncached tests (and tests/attention_sim.py,
op by op, one case here) already hold to its equations.  The gradients pass
straight through the cache, so dK, dV with a cache are the uncached gradients at
K', V'.  Under golden() the cache's values are exact rationals rounded once and
attention meets plain float64 (tests/attention_plain.py).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from attention_plain import plain_attention
from attention_sim import flash_backward as sim_backward
from attention_sim import flash_forward as sim_forward
from helpers import x64_enabled
from oracle import round_exact

from fa_jax import BF16, FP16, FP32, custom
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.kv_cache import dequantize_kv, kv_scales, quantize_kv, read_kv
from fa_jax.policy import Policy
from fa_jax.presets import fa2_kernel, golden

ML = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}
MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
NAME = {"e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2", "int8": "int8"}
FORMATS = ("e4m3fn", "e5m2", "int8")
SCALINGS = ("tensor", "head", "token")


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def _bf16(x):
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _kv_array(seed, shape=(2, 2, 7, 8)):
    """BF16 values with an outlier, an all-zero head and an all-zero token."""
    x = np.random.default_rng(seed).standard_normal(shape) * 3.0
    x[0, 0, 1, 2] = 300.0
    x[1, 1] = 0.0
    x[0, 1, 3] = 0.0
    return _bf16(x)


# -- the numpy reference -----------------------------------------------------------


def numpy_amax(x, scaling, kv_lengths=None, groups=1):
    a = np.abs(x)
    if kv_lengths is not None and scaling != "token":
        lead = x.shape[:-2]
        q_lead = (*lead[:-1], lead[-1] * groups)
        lengths = np.broadcast_to(kv_lengths, q_lead).reshape(*lead, groups).max(-1)
        a = np.where(np.arange(x.shape[-2])[:, None] < lengths[..., None, None], a, 0.0)
    if scaling == "tensor":
        return a.max()
    if scaling == "token":
        return a.max(-1, keepdims=True)
    return a.max(axis=tuple(i for i in range(a.ndim) if i != a.ndim - 3), keepdims=True)


def numpy_cache(x, fmt: str, scaling: str, inputs: Any = "bfloat16", **lengths):
    """(codes, scales, x') of x (FP32 values) by numpy float32 division and ml_dtypes;
    x' rounded to ``inputs`` by ml_dtypes (a name) or the exact oracle (a Format)."""
    fmt = NAME[fmt]
    if scaling == "none":
        s = np.float32(1.0)
        codes = x.astype(ML[fmt]).astype(np.float64)
    else:
        amax = np.asarray(numpy_amax(x, scaling, **lengths), np.float32)
        s = amax / np.float32(MAX[fmt])
        s = np.where(s == 0, np.float32(1.0), s)
        y = x.astype(np.float32) / s  # IEEE float32 division: correctly rounded
        if fmt == "int8":
            codes = np.clip(np.rint(y), -127, 127).astype(np.int8).astype(np.float64)
        else:
            codes = y.astype(ML[fmt]).astype(np.float64)
    deq = codes * np.asarray(s, np.float64)  # exact: <= 8 and 24 significand bits
    if isinstance(inputs, str):
        return codes, np.asarray(s, np.float64), deq.astype(ML[inputs]).astype(np.float64)
    return codes, np.asarray(s, np.float64), np.vectorize(lambda t: round_exact(t, inputs))(deq)


def exact_cache(x, fmt: str, scaling: str):
    """x' under golden(): float64 x, every FP32 quotient an exact rational rounded once."""

    def fp32_quotient(a, b):
        return round_exact(Fraction(float(a)) / Fraction(float(b)), FP32)

    amax = np.asarray(numpy_amax(x, scaling))
    s = np.vectorize(fp32_quotient)(amax, MAX[NAME[fmt]])
    s = np.where(s == 0, 1.0, s)
    y = np.vectorize(fp32_quotient)(x, np.broadcast_to(s, x.shape))
    codes = y.astype(np.float32).astype(ML[NAME[fmt]]).astype(np.float64)
    return codes * np.broadcast_to(s, x.shape)  # exact, and FP64 rounds nothing


# -- the cache on its own ------------------------------------------------------------


CACHES = [(f, sc) for f in FORMATS for sc in ("none", *SCALINGS) if (f, sc) != ("int8", "none")]
# Each format and each scaling once by default; every pair in `-m slow`.
DEFAULT_CACHES = [("e4m3fn", "none"), ("e4m3fn", "head"), ("e5m2", "tensor"), ("int8", "token")]


@pytest.mark.parametrize(
    "caches",
    [
        DEFAULT_CACHES,
        pytest.param([c for c in CACHES if c not in DEFAULT_CACHES], marks=pytest.mark.slow),
    ],
)
def test_codes_scales_and_dequantized_values_match_numpy_and_ml_dtypes(caches):
    """Formats and scalings: codes, scales and fl_bf16(x̂ · s) bit for bit; each scale
    group's amax element maps to ±max; an int8 zero is +0."""
    x = _kv_array(0)
    for fmt, scaling in caches:
        codes, s = quantize_kv(x, fmt, scaling)
        deq = dequantize_kv(codes, s, BF16)
        what = f"{fmt} {scaling}"
        want_codes, want_s, want_x = numpy_cache(x, fmt, scaling)
        np.testing.assert_array_equal(np.asarray(codes), want_codes, err_msg=what)
        np.testing.assert_array_equal(np.broadcast_to(s, np.shape(want_s)), want_s, what)
        np.testing.assert_array_equal(np.asarray(deq), want_x, err_msg=what)
        if fmt == "int8":
            assert not np.signbit(np.asarray(codes)[np.asarray(codes) == 0]).any()
        if scaling != "none":
            big = (np.abs(x) == np.broadcast_to(numpy_amax(x, scaling), x.shape)) & (x != 0)
            assert np.all(np.abs(np.asarray(codes))[big] == MAX[NAME[fmt]]), what
    # the scales' shapes: one per tensor, per K/V head (every batch entry), per key
    assert kv_scales(x, "e4m3fn", "tensor").shape == ()
    assert kv_scales(x, "e4m3fn", "head").shape == (1, 2, 1, 1)
    assert kv_scales(x, "e4m3fn", "token").shape == (2, 2, 7, 1)


def test_zero_groups_and_underflowing_scales_give_no_nan():
    """An all-zero head or token has s = 1 and codes 0; a group whose amax / max
    underflows FP32 (amax = 2^-149, FP32's least value) also gets s = 1 instead of
    dividing by 0."""
    x = _kv_array(1)
    x[:, 1] = 0.0  # head 1 of every batch entry
    for scaling, zero in (("head", (0, 1)), ("token", (0, 1, 3))):
        codes, s = quantize_kv(x, "e4m3fn", scaling)
        assert np.all(np.asarray(s)[zero] == 1.0) and not np.any(np.asarray(codes)[zero])
    tiny = np.zeros((1, 1, 2, 4), np.float32)
    tiny[0, 0, 0, 0] = np.float32(2.0**-149)
    for fmt in ("e4m3fn", "int8"):
        codes, s = quantize_kv(tiny, fmt, "token")
        assert np.asarray(s).dtype == np.float32 and np.all(np.asarray(s) == 1.0)
        assert not np.isnan(np.asarray(codes)).any() and not np.any(np.asarray(codes))


def test_non_finite_values():
    """A concrete array with inf or NaN raises; under jit such a group's scale is NaN
    and only that group dequantizes to NaN."""
    x = _kv_array(2)
    bad = x.copy()
    bad[0, 0, 4, 1] = np.inf
    with pytest.raises(ValueError, match="quantize_kv: expected finite values, got 1 non-finite"):
        quantize_kv(bad, "e4m3fn", "token")
    codes, s = jax.jit(lambda t: quantize_kv(t, "e4m3fn", "token"))(jnp.asarray(bad))
    nan = np.isnan(np.asarray(dequantize_kv(codes, s, BF16)))
    assert nan[0, 0, 4].all() and nan.sum() == x.shape[-1]


# -- read_kv: the policy's cache as attention reads it -------------------------------

Q_SHAPE, KV_SHAPE = (2, 4, 5, 8), (2, 2, 7, 8)  # grouped-query: H = 4, H_kv = 2
LENGTHS = np.array([[7], [4]])  # keys past 4 of batch 1 hold garbage: no scale sees them


def _problem(seed):
    rng = np.random.default_rng(seed)
    q = _bf16(rng.standard_normal(Q_SHAPE))
    k, v = _kv_array(seed + 10), _kv_array(seed + 20)
    k[1, :, 4:], v[1, :, 4:] = 2.0**20, -(2.0**20)
    d_o = rng.standard_normal(Q_SHAPE)
    return q, k, v, d_o, rng.standard_normal(Q_SHAPE[:-1])


def test_read_kv_jit_eager_vmap_and_float32_carrier_agree():
    """read_kv, the one step a policy's cache adds to attention, gives numpy's K', V'
    compiled, called directly, vmapped over the batch (per-head scales then span one
    entry: FlashAttention-3's (batch, H_kv) descale) and in float32 carriers; op by
    op (jax.disable_jit) in `-m slow`."""
    _, k, v, _, _ = _problem(0)
    policy = fa2_kernel(BF16).replace(kv="int8", kv_scaling="head")
    kj, vj = jnp.asarray(k), jnp.asarray(v)
    want = [numpy_cache(t, "int8", "head", kv_lengths=LENGTHS, groups=2)[2] for t in (k, v)]
    read = jax.jit(lambda k, v: read_kv(k, v, policy, kv_lengths=LENGTHS, groups=2))
    direct = read_kv(kj, vj, policy, kv_lengths=LENGTHS, groups=2)
    narrow = read(kj.astype(jnp.float32), vj.astype(jnp.float32))
    assert narrow[0].dtype == jnp.float32
    for got in (read(kj, vj), direct, narrow):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float64), w)
    batched = jax.jit(jax.vmap(lambda k, v: read_kv(k, v, policy)))(kj, vj)
    for b in range(2):
        for g, t in zip(batched, (k, v)):
            np.testing.assert_array_equal(np.asarray(g[b]), numpy_cache(t[b], "int8", "head")[2])
    assert not np.array_equal(np.asarray(batched[0]), want[0])  # the garbage moved batch 1's


def test_a_kv_heads_length_is_its_longest_query_heads():
    """Query heads of one group with different lengths: a K/V head's scale sees the
    keys before its group's longest length (head 1 of batch 0: query heads 2 and 3,
    lengths 2 and 6, so its key 5 counts and key 6 does not), under each scaling."""
    lengths = np.array([[7, 3, 2, 6], [4, 4, 1, 5]])
    k = _kv_array(3)
    k[0, 1, 5, 0], k[0, 1, 6, 0] = 2.0**10, 2.0**20  # in group 1's keys, and past them
    k[1, 0, 4:] = 2.0**20  # past both lengths of batch 1's group 0
    for scaling in ("head", "tensor"):
        policy = fa2_kernel(BF16).replace(kv="int8", kv_scaling=scaling)
        got = jax.jit(lambda k, p=policy: read_kv(k, k, p, kv_lengths=lengths, groups=2))(k)[0]
        want = numpy_cache(k, "int8", scaling, kv_lengths=lengths, groups=2)[2]
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=scaling)
        shorter = numpy_cache(k, "int8", scaling, kv_lengths=lengths.min(-1, keepdims=True))
        assert not np.array_equal(np.asarray(got), shorter[2]), scaling


@pytest.mark.slow
def test_read_kv_op_by_op_equals_compiled():
    _, k, v, _, _ = _problem(0)
    policy = fa2_kernel(BF16).replace(kv="e4m3fn", kv_scaling="tensor")
    kj, vj = jnp.asarray(k), jnp.asarray(v)
    jitted = jax.jit(lambda k, v: read_kv(k, v, policy, kv_lengths=LENGTHS, groups=2))(kj, vj)
    with jax.disable_jit():
        eager = read_kv(kj, vj, policy, kv_lengths=LENGTHS, groups=2)
    for g, w in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_golden_cache_is_exact():
    """Under golden() (FP64 inputs) K', V' of an e4m3fn per-token cache are x̂ · s exactly,
    each FP32 quotient an exact rational rounded once."""
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(2))
    policy = golden().replace(kv="e4m3fn", kv_scaling="token")
    got = jax.jit(lambda k, v: read_kv(k, v, policy))(k, v)
    for g, t in zip(got, (k, v)):
        np.testing.assert_array_equal(np.asarray(g), exact_cache(t, "e4m3fn", "token"))


def test_no_cache_is_todays_attention():
    """kv=None (every preset's) passes K and V through untouched, so attention's
    programs and bits are today's; a cache of the inputs format with no scaling
    rounds nothing; replace(inputs=...) keeps no cache."""
    _, k, v, _, _ = _problem(4)
    base = fa2_kernel(BF16)
    assert base.kv is None and base.kv_scaling == "none"
    kj, vj = jnp.asarray(k), jnp.asarray(v)
    got = read_kv(kj, vj, base)
    assert got[0] is kj and got[1] is vj
    same = jax.jit(lambda k, v: read_kv(k, v, base.replace(kv=BF16)))(kj, vj)
    for g, t in zip(same, (k, v)):
        np.testing.assert_array_equal(np.asarray(g), t)
    assert base.replace(inputs=FP16).kv is None


def test_a_plain_cast_cache_vmaps_over_its_widths():
    """kv_scaling "none" is a cast, which takes traced widths: one program for
    several cache formats equals one call per format."""
    _, k, v, _, _ = _problem(7)
    kj, vj = jnp.asarray(k), jnp.asarray(v)
    base = fa2_kernel(BF16)
    batched = jax.jit(jax.vmap(lambda m: read_kv(kj, vj, base.replace(kv=custom(5, m)))))(
        jnp.array([1, 2])
    )
    for i, m in enumerate((1, 2)):
        want = numpy_cache(k, "e5m2", "none")[2] if m == 2 else None
        got = read_kv(kj, vj, base.replace(kv=custom(5, m)))
        np.testing.assert_array_equal(np.asarray(batched[0][i]), np.asarray(got[0]))
        np.testing.assert_array_equal(np.asarray(batched[1][i]), np.asarray(got[1]))
        if want is not None:
            np.testing.assert_array_equal(np.asarray(got[0]), want)


# -- through attention ---------------------------------------------------------------


def _attention(kind, policy, **kw):
    if kind == "reference":
        return lambda q, k, v: reference_attention(q, k, v, policy, return_lse=True, **kw)
    return lambda q, k, v: flash_attention(q, k, v, policy, Blocks(2, 3), variant=kind, **kw)


def _vjp(fn, q, k, v, d_o, d_lse):
    (o, lse), pull = jax.vjp(fn, q, k, v)
    return (o, lse, *pull((d_o, d_lse)))


def _assert_bitwise(got, want, what):
    for name, g, w in zip(("O", "L", "dQ", "dK", "dV"), got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what}: {name}")


# The default run: the reference with the per-head amax under GQA and key lengths;
# the flash variants, formats and scalings in `-m slow`.
ATTENTION_CASES = [
    ("reference", "e4m3fn", "head"),
    *(
        pytest.param(kind, fmt, scaling, marks=pytest.mark.slow)
        for kind in ("reference", "fa1", "fa2", "rowwise")
        for fmt, scaling in CACHES
        if (kind, fmt, scaling) != ("reference", "e4m3fn", "head")
    ),
]


@pytest.mark.parametrize("kind, fmt, scaling", ATTENTION_CASES)
def test_attention_with_a_cache_equals_attention_on_numpy_dequantized_kv(kind, fmt, scaling):
    """O, lse, dQ, dK, dV with the cache equal those without it on K', V' from numpy,
    bit for bit (the gradients straight through), under key lengths (garbage past
    them) and GQA."""
    q, k, v, d_o, d_lse = _problem(0)
    base = fa2_kernel(BF16)
    policy = base.replace(kv=fmt, kv_scaling=scaling)
    lengths = {"kv_lengths": LENGTHS, "groups": 2}
    k_x, v_x = (numpy_cache(t, fmt, scaling, **lengths)[2] for t in (k, v))
    got = _vjp(_attention(kind, policy, kv_lengths=LENGTHS), q, k, v, d_o, d_lse)
    want = _vjp(_attention(kind, base, kv_lengths=LENGTHS), q, k_x, v_x, d_o, d_lse)
    _assert_bitwise(got, want, f"{kind} {fmt} {scaling}")
    assert not np.isnan(np.asarray(got[0])).any()
    assert not np.array_equal(k_x, k) and not np.array_equal(v_x, v)  # the cache moved K, V


@pytest.mark.slow
def test_attention_with_a_cache_jit_equals_eager():
    """Op-by-op execution gives the compiled program's bits, forward and backward."""
    q, k, v, d_o, d_lse = (t[:1, :2, :4] for t in _problem(1))
    fn = _attention("fa2", fa2_kernel(BF16).replace(kv="e5m2", kv_scaling="token"))
    jitted = _vjp(fn, q, k, v, d_o, d_lse)
    with jax.disable_jit():
        eager = _vjp(fn, q, k, v, d_o, d_lse)
    _assert_bitwise(eager, jitted, "eager")


@pytest.mark.slow
def test_attention_with_a_cache_vmaps_over_the_batch():
    q, k, v, _, _ = _problem(2)
    policy = fa2_kernel(BF16).replace(kv="e4m3fn", kv_scaling="head")
    batched = jax.jit(jax.vmap(lambda q, k, v: reference_attention(q, k, v, policy)))(q, k, v)
    for b in range(q.shape[0]):
        one = np.asarray(reference_attention(q[b], k[b], v[b], policy))
        np.testing.assert_array_equal(np.asarray(batched[b]), one)
        k_x, v_x = (numpy_cache(t[b], "e4m3fn", "head")[2] for t in (k, v))
        want = reference_attention(q[b], k_x, v_x, fa2_kernel(BF16))
        np.testing.assert_array_equal(one, np.asarray(want))


@pytest.mark.slow
def test_attention_with_a_cache_in_float32_carriers():
    q, k, v, _, _ = (t[:1, :2] for t in _problem(5))
    policy = fa2_kernel(BF16).replace(kv="int8", kv_scaling="token")
    wide = reference_attention(q, k, v, policy.replace(carrier="float64"))
    q, k, v = (t.astype(np.float32) for t in (q, k, v))
    narrow = np.asarray(reference_attention(q, k, v, policy.replace(carrier="float32")))
    assert narrow.dtype == np.float32
    np.testing.assert_array_equal(narrow.astype(np.float64), np.asarray(wide))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["reference", "fa2"])
def test_golden_attention_with_a_cache_meets_plain_float64(kind):
    """golden() with an e4m3fn per-token cache: O, lse, dQ, dK, dV meet plain float64
    attention on the exact K', V' to 1e-12 (the golden tests' bound)."""
    rng = np.random.default_rng(3)
    q, k, v, d_o = (rng.standard_normal((1, 2, 6, 4)) for _ in range(4))
    d_lse = rng.standard_normal((1, 2, 6))
    policy = golden().replace(kv="e4m3fn", kv_scaling="token")
    k_x, v_x = (exact_cache(t, "e4m3fn", "token") for t in (k, v))
    want = _vjp(lambda q, k, v: plain_attention(q, k, v), q, k_x, v_x, d_o, d_lse)
    got = _vjp(_attention(kind, policy), q, k, v, d_o, d_lse)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert np.max(np.abs(np.asarray(g) - w)) <= 1e-12 * np.max(np.abs(w))


@pytest.mark.slow
def test_simulation_op_by_op_on_dequantized_kv():
    """tests/attention_sim.py (every op an exact rational rounded once) on numpy's
    K', V' equals fa_jax with the cache, fa2 forward and backward, under a policy
    whose stages all differ."""
    widths = {
        "inputs": (6, 8),
        "qk_acc": (8, 9),
        "scores": (7, 10),
        "stats": (8, 12),
        "exp": (8, 8),
        "p": (7, 7),
        "pv_acc": (8, 10),
        "o_acc": (8, 11),
        "out": (8, 16),
    }
    inputs = custom(*widths["inputs"])
    stages: dict[str, Any] = {s: custom(*w) for s, w in widths.items()}
    policy = Policy(**stages, name="mixed").replace(kv="e4m3fn", kv_scaling="head")
    rng = np.random.default_rng(6)

    def rounded(shape):
        return np.vectorize(lambda t: round_exact(t, inputs))(rng.standard_normal(shape) * 2)

    q, k, v = (rounded((2, n, 3)) for n in (7, 10, 10))
    d_o, d_lse = rng.standard_normal((2, 7, 3)), rng.standard_normal((2, 7))
    k_x, v_x = (numpy_cache(t, "e4m3fn", "head", inputs)[2] for t in (k, v))
    o, lse, prepared = sim_forward(q, k_x, v_x, policy, 3, "fa2", False)
    want = (o, lse, *sim_backward(prepared, o, lse, d_o, d_lse, policy, 3, False))
    fn = lambda q, k, v: flash_attention(q, k, v, policy, Blocks(3, 3))  # noqa: E731
    _assert_bitwise(_vjp(fn, q, k, v, d_o, d_lse), want, "simulation")


# -- errors ----------------------------------------------------------------------------


def test_errors():
    base = fa2_kernel(BF16)
    with pytest.raises(ValueError, match="kv_scaling='head' scales K and V into a cache"):
        base.replace(kv_scaling="head")
    with pytest.raises(ValueError, match=r"an integer cache \(int8\) needs scales"):
        base.replace(kv="int8")
    with pytest.raises(ValueError, match=r"Policy\.kv_scaling: expected one of"):
        base.replace(kv="e4m3fn", kv_scaling="channel")
    with pytest.raises(ValueError, match="unknown format 'fp9'"):
        base.replace(kv="fp9")
    with pytest.raises(ValueError, match=r"quantize_kv: an integer cache \(int8\) needs scales"):
        quantize_kv(np.ones((2, 3)), "int8", "none")
    with pytest.raises(ValueError, match="quantize_kv: scaling: expected one of"):
        quantize_kv(np.ones((2, 3)), "e4m3fn", "block")
    policy = base.replace(kv="e4m3fn", kv_scaling="head")
    q = np.ones((4, 3))
    with pytest.raises(ValueError, match=r"kv_scaling='head' needs K, V shaped \(\.\.\., H_kv"):
        reference_attention(q, q, q, policy)
    # a scaled cache needs its format's max: not a traced format (vmap over widths)
    with pytest.raises(TypeError, match="needs a concrete kv format"):
        jax.vmap(
            lambda m: read_kv(
                jnp.ones((2, 3)),
                jnp.ones((2, 3)),
                base.replace(kv=custom(4, m), kv_scaling="token"),
            )
        )(jnp.array([2, 3]))
    with pytest.raises(
        ValueError, match="a float32 carrier holds formats that fit float32, got kv"
    ):
        base.replace(kv="fp64", kv_scaling="tensor", carrier="float32")


def test_scales_span_the_batch_per_tensor_and_per_head_only():
    from fa_jax.kv_cache import scales_span_batch

    assert [scales_span_batch(s) for s in ("none", "tensor", "head", "token")] == [
        False,
        True,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="scales_span_batch: scaling"):
        scales_span_batch("row")
