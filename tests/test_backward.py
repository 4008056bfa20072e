"""The emulated backward pass: golden gradients against float64 autodiff, the
flash-attention repo's 3x rule for gradients, jit vs eager, vmap over formats,
masked rows and keys."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, custom
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.presets import fa2_kernel, golden, paper_uniform, torch_math
from fa_jax.rounding import round_to


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def plain_attention(q, k, v, *, causal=False, q_lengths=None, kv_lengths=None, scale=None):
    """(O, lse) of float64 attention in plain jnp, differentiable by jax.grad; fully
    masked rows give O = 0 and lse = -inf."""
    n, m = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...id,...jd->...ij", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    i, j = jnp.arange(n)[:, None], jnp.arange(m)[None, :]
    keep = jnp.ones(s.shape, bool)
    if causal:
        keep &= j <= i
    if q_lengths is not None:
        keep &= i < jnp.asarray(q_lengths)[..., None, None]
    if kv_lengths is not None:
        keep &= j < jnp.asarray(kv_lengths)[..., None, None]
    shift = jax.lax.stop_gradient(jnp.max(jnp.where(keep, s, -jnp.inf), -1, keepdims=True))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    e = jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - shift), 0.0)
    l = jnp.sum(e, -1, keepdims=True)
    live = l > 0
    l = jnp.where(live, l, 1.0)
    o = jnp.einsum("...ij,...jd->...id", e / l, v, precision=jax.lax.Precision.HIGHEST)
    return o, jnp.where(live[..., 0], (shift + jnp.log(l))[..., 0], -jnp.inf)


def problem(seed, lead=(2,), n=12, m=12, d=8):
    rng = np.random.default_rng(seed)
    q, k, v, d_o = (rng.standard_normal((*lead, x, d)) for x in (n, m, m, n))
    return q, k, v, d_o, rng.standard_normal((*lead, n))


def vjp_of(fn, q, k, v, d_o, d_lse):
    """(dQ, dK, dV) of fn(q, k, v) -> (O, lse) for the cotangents (dO, dlse)."""
    return jax.vjp(fn, q, k, v)[1]((d_o, d_lse))


jit_vjp_of = jax.jit(vjp_of, static_argnums=0)  # eager jax ops compile one by one: slower


def max_rel(got, want):
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


# One jitted vjp per case: compile time dominates these tests.
GOLDEN_CASES = [  # (kind, variant, bc, causal, masked, scale)
    ("flash", "fa2", 5, True, True, "scores"),  # Bc does not divide N = 12
    ("flash", "fa1", 4, False, True, "scores"),
    ("flash", "rowwise", 6, True, False, "q"),
    ("reference", None, None, True, True, "q"),  # scale="scores": the 3x test below
]


@pytest.mark.parametrize("kind, variant, bc, causal, masked, scale", GOLDEN_CASES)
def test_golden_gradients_match_float64_autodiff(kind, variant, bc, causal, masked, scale):
    """Under golden() dQ, dK, dV (from dO and the lse cotangent) equal jax's gradient of
    plain float64 attention to 1e-12; masked rows and keys (NaN there) get exactly 0."""
    q, k, v, d_o, d_lse = problem(0)
    masks = {"causal": causal}
    if masked:
        masks.update(q_lengths=np.array([9, 10]), kv_lengths=np.array([0, 10]))
    pol = golden().replace(scale=scale)

    def fn(q, k, v):
        if kind == "flash":
            return flash_attention(q, k, v, pol, Blocks(3, bc), variant=variant, **masks)
        return reference_attention(q, k, v, pol, return_lse=True, **masks)

    want = jit_vjp_of(lambda q, k, v: plain_attention(q, k, v, **masks), q, k, v, d_o, d_lse)
    if masked:  # garbage past the lengths must not reach any gradient
        q, k, v = q.copy(), k.copy(), v.copy()
        q[:, 10:], k[0], v[0], k[1, 10:], v[1, 10:] = np.nan, np.nan, np.nan, np.nan, np.nan
    got = jit_vjp_of(fn, q, k, v, d_o, d_lse)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert not np.isnan(g).any()
        assert max_rel(g, np.asarray(w)) <= 1e-12
    if masked:
        d_q, d_k, d_v = (np.asarray(g) for g in got)
        assert (d_q[0] == 0).all() and (d_k[0] == 0).all() and (d_v[0] == 0).all()
        assert (d_q[1, 10:] == 0).all() and (d_k[1, 10:] == 0).all() and (d_v[1, 10:] == 0).all()


@pytest.mark.extended  # 9 s
def test_fa2_kernel_bf16_gradients_within_3x_of_torch_math():
    """flash-attention's rule for gradients: each of dQ, dK, dV deviates from the exact
    gradient by at most 3x the same-precision PyTorch reference's deviation.  All
    three see the same BF16 Q, K, V and dO; the exact gradient is golden()'s."""
    blocks = Blocks(64, 32)

    def grads(pol, flash):
        def fn(q, k, v):
            if flash:
                return flash_attention(q, k, v, pol, blocks)[0]
            return reference_attention(q, k, v, pol)

        return jax.jit(lambda q, k, v, d_o: jax.vjp(fn, q, k, v)[1](d_o))

    gold, base, kernel = (
        grads(golden(), False),
        grads(torch_math(BF16), False),
        grads(fa2_kernel(BF16), True),
    )
    for seed in (0, 1):
        q, k, v, d_o, _ = problem(seed, lead=(1, 2), n=128, m=128, d=32)
        q, k, v, d_o = (round_to(jnp.asarray(t), BF16) for t in (q, k, v, d_o))
        want = gold(q, k, v, d_o)
        exact = jit_vjp_of(plain_attention, q, k, v, d_o, jnp.zeros(q.shape[:-1]))
        assert all(max_rel(w, e) <= 1e-12 for w, e in zip(want, exact))
        for name, g, t, w in zip("QKV", kernel(q, k, v, d_o), base(q, k, v, d_o), want):
            err_flash = float(jnp.max(jnp.abs(g - w)))
            err_torch = float(jnp.max(jnp.abs(t - w)))
            assert 0 < err_flash <= 3 * err_torch, (seed, f"d{name}", err_flash, err_torch)


@pytest.mark.extended  # 27 s: every op compiled eagerly
def test_jit_equals_eager_bitwise():
    """The backward run op by op (jax.disable_jit: no fusion, no excess precision)
    gives the bits of the compiled forward-and-backward program; a fully masked row
    gets zero gradient, not NaN, and so do masked keys, whose block the forward's
    key loop skips.  The forward too: its key loop stops short in both.  (Eager
    compiles every op for every shape it meets, so the shapes are tiny.)"""
    q, k, v, d_o, d_lse = problem(3, lead=(1,), n=2, m=4, d=2)
    pol, ql, kl = paper_uniform(BF16), np.array([1]), np.array([2])  # row 1, keys 2, 3 masked
    flash = lambda q, k, v: flash_attention(  # noqa: E731
        q, k, v, pol, Blocks(1, 2), q_lengths=ql, kv_lengths=kl
    )
    jitted = (*jax.jit(flash)(q, k, v), *jit_vjp_of(flash, q, k, v, d_o, d_lse))
    with jax.disable_jit():
        eager = (*flash(q, k, v), *vjp_of(flash, q, k, v, d_o, d_lse))
    for a, b in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    d_q, d_k, d_v = (np.asarray(g) for g in jitted[2:])
    assert np.isfinite(d_q).all() and (d_q[:, 1] == 0).all() and (d_q[:, 0] != 0).all()
    assert (d_k[:, 2:] == 0).all() and (d_v[:, 2:] == 0).all()
    assert (d_k[:, :2] != 0).any() and (d_v[:, :2] != 0).all()


@pytest.mark.extended  # for the default run's time only
def test_vmap_over_mantissa_width_equals_separate_calls():
    """jax.grad under a policy whose format widths are traced (vmapped) gives, per
    width, the bits of a call with that format; float32 inputs get float32 gradients."""
    q, k, v, d_o, _ = (t.astype(np.float32) for t in problem(4, lead=(1,), n=6, m=6, d=4))

    def grads(pol):
        loss = lambda q, k, v: jnp.sum(  # noqa: E731
            flash_attention(q, k, v, pol, Blocks(2, 4))[0] * d_o
        )
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    widths = (3, 7)
    batched = jax.jit(jax.vmap(lambda m: grads(paper_uniform(custom(8, m)))))(jnp.array(widths))
    for i, m in enumerate(widths):
        separate = jax.jit(lambda: grads(paper_uniform(custom(8, m))))()  # noqa: B023
        for b, s in zip(batched, separate):
            assert s.dtype == np.float32
            np.testing.assert_array_equal(np.asarray(b[i]), np.asarray(s))
    assert not np.array_equal(np.asarray(batched[0][0]), np.asarray(batched[0][1]))


@pytest.mark.parametrize("n, m", [(7, 12), (12, 7)], ids=["N<M", "N>M"])
@pytest.mark.parametrize(
    "kind, variant",
    # Every flash variant runs FlashAttention-2's backward (fa_jax.attention); fa1's and
    # rowwise's forwards with N != M are checked in test_attention, their gradients
    # here in `-m slow`.
    [
        pytest.param("flash", "fa1", marks=pytest.mark.slow),
        ("flash", "fa2"),
        pytest.param("flash", "rowwise", marks=pytest.mark.slow),
        ("reference", None),
    ],
)
def test_causal_gradients_with_n_not_m_match_float64_autodiff(n, m, kind, variant):
    """Causal, N != M (top-left aligned: query i sees keys j <= i, see
    fa_jax.attention): golden() dQ, dK, dV equal jax.grad of plain float64
    attention to 1e-12; Bc = 5 divides neither length."""
    q, k, v, d_o, d_lse = problem(4, n=n, m=m)

    def fn(q, k, v):
        if kind == "flash":
            return flash_attention(q, k, v, golden(), Blocks(3, 5), variant=variant, causal=True)
        return reference_attention(q, k, v, golden(), causal=True, return_lse=True)

    want = jit_vjp_of(lambda q, k, v: plain_attention(q, k, v, causal=True), q, k, v, d_o, d_lse)
    got = jit_vjp_of(fn, q, k, v, d_o, d_lse)
    for g, w in zip(got, want):
        assert max_rel(g, np.asarray(w)) <= 1e-12
    if n < m:  # keys past the last query see no query: no gradient reaches them
        d_k, d_v = np.asarray(got[1]), np.asarray(got[2])
        assert (d_k[:, n:] == 0).all() and (d_v[:, n:] == 0).all()
