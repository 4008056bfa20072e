"""Split-KV decoding (fa_jax.split_kv): errors, golden, bounds, jit = eager = vmap.

The bit-for-bit comparison with the op-by-op simulation is in
tests/test_attention_sim.py (``test_split_kv_equals_the_simulation``).  Here:

* ``num_splits`` that is not an int in [1, ceil(M / Bc)], or above 1 for a
  kernel loop, raises ValueError naming it;
* under each scale placement and normalisation, ceil(M / Bc) splits give plain
  float64 attention under the golden policy;
* the combine under the golden policy is the plain float64 numpy formula, bit
  for bit (with the golden's float64 exp), and golden split-KV attention
  (lengths, causal, window and a mask leaving splits and whole rows empty) is
  plain float64 attention within float64's error, with no NaN (slow);
* under ``paper_uniform(fmt)`` the split-KV output stays within a bound derived
  from the rounding steps (:func:`split_bound`), for random inputs (hypothesis);
* jit, eager (``jax.disable_jit``) and vmap give the same bits, forward and
  backward (slow).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_plain import plain_attention
from helpers import x64_enabled
from hypothesis import given, settings

from fa_jax import BF16, FP16, Blocks, custom, fa2_kernel, golden, paper_uniform
from fa_jax.attention import flash_attention
from fa_jax.bounds import attention_bound, default_exp_error, softmax_bound, summation_roundings
from fa_jax.rounding import round_to
from fa_jax.split_kv import combine


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def _qkv(seed: int, lead=(2,), n=3, m=19, d=4, dv=3, spread=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*lead, n, d)) * spread
    k = rng.standard_normal((*lead, m, d)) * spread
    return q, k, rng.standard_normal((*lead, m, dv))


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "4", None])
def test_num_splits_not_a_positive_int_raises(bad):
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"num_splits: expected a positive integer.*got"):
        flash_attention(q, k, v, golden(), Blocks(4, 4), num_splits=bad)


def test_more_splits_than_key_blocks_raises():
    """19 keys in blocks of 4: five blocks, so at most five splits."""
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"num_splits: .*ceil\(19 / 4\) = 5, got 6"):
        flash_attention(q, k, v, golden(), Blocks(4, 4), num_splits=6)


def test_a_kernel_loop_refuses_splits():
    q, k, v = _qkv(0)
    with pytest.raises(ValueError, match=r"num_splits: expected 1 for the kernel loop"):
        flash_attention(q, k, v, fa2_kernel(BF16), Blocks(4, 4), variant="torch_avx2", num_splits=2)


# -- golden ------------------------------------------------------------------------


def _numpy_combine(lse_s, o_s, exp):
    """FlashAttention-2's combine in plain float64 numpy (fa_jax.split_kv), with
    the float64 ``exp`` given."""
    lse_max = lse_s.max(axis=0)
    lse_max = np.where(lse_max == -np.inf, 0.0, lse_max)
    with np.errstate(divide="ignore"):
        total = np.zeros(lse_max.shape)
        for x in lse_s:  # in split order
            total = total + exp(x - lse_max)
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + lse_max, -np.inf)
        acc = np.zeros(o_s.shape[1:])
        for x, o in zip(lse_s, o_s):
            w = np.where(x == -np.inf, 0.0, exp(x - np.where(total > 0, lse, 0.0)))
            acc = w[..., None] * o + acc
    return acc, lse


def _xla_exp(x):
    """XLA's float64 exp: the one the golden policy's exp stage computes."""
    return np.asarray(jax.jit(jnp.exp)(x))


def test_golden_combine_is_the_plain_float64_formula():
    """Five splits, some rows keeping no key of some splits, one row none at all:
    the golden combine is the float64 formula bit for bit with XLA's exp (the
    golden's exp), and within 2 float64 ulps of the output's scale with numpy's
    (the two exps differ in the last bit on some arguments)."""
    rng = np.random.default_rng(3)
    lse_s = rng.standard_normal((5, 2, 7)) * 4
    lse_s[rng.random(lse_s.shape) < 0.3] = -np.inf
    lse_s[:, 1, 2] = -np.inf
    o_s = rng.standard_normal((5, 2, 7, 3))
    got_o, got_lse = (
        np.asarray(x) for x in jax.jit(lambda a, b: combine(a, b, golden()))(lse_s, o_s)
    )
    want_o, want_lse = _numpy_combine(lse_s, o_s, _xla_exp)
    np.testing.assert_array_equal(got_lse, want_lse)
    np.testing.assert_array_equal(got_o, want_o)
    assert got_lse[1, 2] == -np.inf and (got_o[1, 2] == 0).all()
    np_o, np_lse = _numpy_combine(lse_s, o_s, np.exp)
    live = np.isfinite(np_lse)
    np.testing.assert_array_equal(np.isfinite(got_lse), live)
    assert np.max(np.abs(got_lse[live] - np_lse[live])) <= 2 * np.spacing(
        np.abs(np_lse[live]).max()
    )
    assert np.max(np.abs(got_o - np_o)) <= 2 * np.spacing(np.abs(np_o).max())


@pytest.mark.slow
def test_golden_split_kv_is_plain_float64_attention():
    """Causal, a window, a mask and key lengths (head 0 keeps no key) leave whole
    splits of some rows, and every split of batch 0, empty: O and L are plain
    float64 attention's within float64 error, empty rows exactly (0, -inf)."""
    q, k, v = _qkv(1, lead=(2, 2), n=5, m=23)
    mask = np.random.default_rng(2).random((5, 23)) < 0.8
    lengths, window = np.array([0, 21]), (9, 3)
    got = jax.jit(
        lambda q, k, v: flash_attention(
            q,
            k,
            v,
            golden(),
            Blocks(2, 3),
            causal=True,
            window=window,
            kv_lengths=lengths,
            mask=mask,
            num_splits=4,
        )
    )(q, k, v)
    want = plain_attention(q, k, v, causal=True, window=window, kv_lengths=lengths, mask=mask)
    for name, g, w in zip(("O", "L"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert not np.isnan(g).any(), name
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
        err = np.max(np.abs(g[finite] - w[finite])) / np.max(np.abs(w[finite]))
        assert err <= 1e-13, (name, err)
    # kv_lengths broadcast over the heads axis: head 0 keeps no key.
    assert (np.asarray(got[1])[:, 0] == -np.inf).all() and (np.asarray(got[0])[:, 0] == 0).all()


@pytest.mark.parametrize(
    "placement",
    [
        {"scale": "scores"},
        {"scale": "q"},
        {"scale": "exp2", "exp_model": "exp2_correctly_rounded"},
        {"normalise": "reciprocal"},
    ],
    ids=["scores", "q", "exp2", "reciprocal"],
)
def test_golden_split_kv_under_every_scale_placement_is_plain_attention(placement):
    """Each placement of the softmax scale (and the reciprocal normalisation), with
    as many splits as key blocks (ceil(21 / 4) = 6, the upper bound): O and L are
    plain float64 attention's within float64 error, so a combine that reads a
    split's lse or o in another placement's units fails."""
    q, k, v = _qkv(4, n=3, m=21, spread=2.0)
    policy = golden().replace(**placement)
    want = [np.asarray(x) for x in plain_attention(q, k, v, scale=0.37)]
    got = flash_attention(q, k, v, policy, Blocks(2, 4), scale=0.37, num_splits=6)
    for name, g, w in zip(("O", "L"), got, want):
        err = np.max(np.abs(np.asarray(g) - w)) / np.max(np.abs(w))
        assert err <= 1e-13, (name, err)


# -- a bound on the split-KV error -------------------------------------------------


def split_bound(q, k, v, fmt, bc: int, num_splits: int):
    """(B, E_L): per entry |O − O_golden| <= B (N, d_v) and per row |L − L_golden|
    <= E_L (N,) for split-KV flash attention (fa2, ``Policy.normalise`` "divide")
    under ``paper_uniform(fmt)`` with EXACT sums, one head, no mask.

    Split s (keys J_s) is flash attention over J_s: its Ō_s is within
    ``attention_bound(q, k[J_s], v[J_s], fmt, bc)`` = F_s W_s + Z_s of the exact
    split softmax E_s, and e^{m_s} l_s = D_s Z_s e^{±δ} with Z_s = Σ_{J_s} e^{s_j},
    D_s in [D_lo, D_hi] (the online sum's ratio: e^{±uR'} (1 ± η)^K (1 ± u)^{N_u},
    N_u = 1 + r_b + 3(K − 1), K = n_bps blocks, R' = R + 2δ, δ the score error).
    With Λ = max|s| + ln M + 1 bounding every |L_s|, |L| and |L_s − L| / 2:

    * L_s = fl(m_s + ln l_s) = ln Z_s + ln D_s + θ_s, |θ_s| <= δ + ε, ε = (u + 2^-50) Λ;
    * Σ = fl(Σ_s fl(exp(fl(L_s − L_max)))) has ratio τ in e^{±2uΛ} (1 ± η)(1 ± u)^2
      (± S σ / 2 for subnormal terms; the largest term is 1);
    * L = fl(fl(ln Σ) + L_max) = ln Σ_s e^{L_s} + ζ, |ζ| <= |ln τ| + (u + 2^-50)(ln S + 1) + uΛ;
    * w_s = fl(exp(fl(L_s − L))) = λ_s ρ_s (± σ/2), λ_s = Z_s / Z, with
      |ln ρ_s| <= ln(D_hi / D_lo) + 2(δ + ε) + |ζ| + 2uΛ + ln(1 + η) + ln(1 + u);
    * acc = Σ_s w_s Ō_s φ_s, φ_s in (1 ± u)^{S+1} (S FMA roundings and the output's).

    So, as Σ_s λ_s W_s = W (W = softmax(S)|V|, |E_s| <= W_s),
    ``|O − E| <= max(ρ_hi φ_hi − 1, 1 − ρ_lo φ_lo) W + ρ_hi φ_hi Σ_s λ_s (F_s W_s + Z_s)
    + (S + 1)(σ/2)(1 + u)^{S+1} + S (σ/2) max|V|``, plus the golden's own float64 error
    (:func:`fa_jax.bounds.softmax_bound` in float64 and its P V dot, as
    :func:`fa_jax.bounds.attention_bound` counts it); and
    |L − ln Z| <= max(ln D_hi, −ln D_lo) + δ + ε + |ζ|, plus the golden's 2^-45 Λ.
    The bound's own float64 evaluation is covered by a factor 1 + 2^-30."""
    f = fmt
    u, sigma, eta = f.unit_roundoff, f.smallest_subnormal, default_exp_error(f.unit_roundoff)
    n, m = q.shape[0], k.shape[0]
    full = attention_bound(q, k, v, f, bc=bc)
    delta = float(full.score_error.max())
    R = float(full.x_range.max()) + 2 * delta
    s = (q @ k.T) / math.sqrt(q.shape[1])
    lam_big = float(np.abs(s).max()) + math.log(m) + 1
    n_blocks = -(-m // bc)
    per = -(-n_blocks // num_splits)
    K = per
    n_u = 1 + summation_roundings(bc) + 3 * (K - 1)
    d_hi = math.exp(u * R) * (1 + eta) ** K * (1 + u) ** n_u
    d_lo = math.exp(-u * R) * (1 - eta) ** K * (1 - u) ** n_u
    eps = (u + 2.0**-50) * lam_big
    tau = max(
        math.log(math.exp(2 * u * lam_big) * (1 + eta) * (1 + u) ** 2 + num_splits * sigma / 2),
        -math.log(math.exp(-2 * u * lam_big) * (1 - eta) * (1 - u) ** 2 - num_splits * sigma / 2),
    )
    zeta = tau + (u + 2.0**-50) * (math.log(num_splits) + 1) + u * lam_big
    log_rho = math.log(d_hi / d_lo) + 2 * (delta + eps) + zeta + 2 * u * lam_big + math.log1p(eta)
    rho_hi, rho_lo = math.exp(log_rho + math.log1p(u)), math.exp(-log_rho + math.log1p(-u))
    phi_hi, phi_lo = (1 + u) ** (num_splits + 1), (1 - u) ** (num_splits + 1)
    shift = s.max(axis=1, keepdims=True)
    e = np.exp(s - shift)
    w_all = (e / e.sum(axis=1, keepdims=True)) @ np.abs(v)
    split_terms = np.zeros(w_all.shape)
    for first in range(0, n_blocks * bc, per * bc):
        cols = slice(first, min(first + per * bc, m))
        part = attention_bound(q, k[cols], v[cols], f, bc=bc)
        lam = e[:, cols].sum(axis=1) / e.sum(axis=1)
        split_terms += lam[:, None] * part.bound
    eps_64 = softmax_bound(m, R, 2.0**-53, accumulation="sequential", exp_error=2.0**-50)
    g_64 = (1 + eps_64) * (1 + m * 2.0**-53 / (1 - m * 2.0**-53)) - 1
    a = max(rho_hi * phi_hi - 1, 1 - rho_lo * phi_lo)
    absolute = (num_splits + 1) * (sigma / 2) * phi_hi + num_splits * (sigma / 2) * np.abs(v).max()
    bound = (a + g_64) * w_all + rho_hi * phi_hi * split_terms + absolute
    lse_bound = max(math.log(d_hi), -math.log(d_lo)) + delta + eps + zeta + 2.0**-45 * lam_big
    return bound * (1 + 2.0**-30), np.full(n, lse_bound * (1 + 2.0**-30))


def _plain_float64(q, k, v):
    """(O, L) of one head in float64 numpy: the golden, within the float64 error
    that split_bound counts."""
    s = (q @ k.T) * (1.0 / math.sqrt(q.shape[-1]))
    shift = s.max(axis=-1, keepdims=True)
    e = np.exp(s - shift)
    l = e.sum(axis=-1, keepdims=True)
    return (e / l) @ v, (shift + np.log(l))[:, 0]


M_BOUND, BC_BOUND, SPLITS_BOUND = 40, 4, 6  # ten key blocks; six splits of 2, one empty


@pytest.mark.parametrize("fmt", [BF16, pytest.param(FP16, marks=pytest.mark.slow)])
@settings(max_examples=max(4, settings.default.max_examples // 6))  # 10 in "ci"
@given(seed=st.integers(0, 2**32 - 1), spread=st.floats(0.25, 1.0))
def test_split_kv_error_within_the_derived_bound(fmt, seed, spread):
    """|O − O_golden| <= split_bound's B entrywise and |L − L_golden| <= E_L (the golden
    in float64 numpy) under
    paper_uniform(fmt): ten key blocks of 4 in six splits (the last one empty).
    Q and K of standard deviation up to 2 (BF16) or 1 (FP16, whose exponentials
    would otherwise underflow, where the bound is inf)."""
    spread *= 2.0 if fmt == BF16 else 1.0
    q, k, v = (np.asarray(round_to(t, fmt)) for t in _qkv(seed, lead=(), m=M_BOUND, spread=spread))
    blocks = Blocks(1, BC_BOUND)
    o, lse = flash_attention(q, k, v, paper_uniform(fmt), blocks, num_splits=SPLITS_BOUND)
    o_g, lse_g = _plain_float64(q, k, v)
    bound, lse_bound = split_bound(q, k, v, fmt, BC_BOUND, SPLITS_BOUND)
    assert np.isfinite(bound).all()
    err = np.abs(np.asarray(o) - np.asarray(o_g))
    assert (err <= bound).all(), np.max(err / bound)
    lse_err = np.abs(np.asarray(lse) - np.asarray(lse_g))
    assert (lse_err <= lse_bound).all(), np.max(lse_err / lse_bound)


# -- jit = eager = vmap ------------------------------------------------------------


def _forward_backward(fn, q, k, v, d_o, d_lse):
    (o, lse), vjp = jax.vjp(fn, q, k, v)
    return (o, lse, *vjp((d_o, d_lse)))


@pytest.mark.slow
def test_jit_eager_and_vmap_agree_forward_and_backward():
    """fa2_kernel(BF16), causal, 3 splits of 13 keys in blocks of 3 (5 blocks: splits
    of 2, 2 and 1): jitted, op by op, and vmapped over a leading axis, the same bits."""
    q, k, v = _qkv(4, lead=(2,), n=4, m=13)
    rng = np.random.default_rng(5)
    d_o, d_lse = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4))
    pol = fa2_kernel(BF16)

    def fn(q, k, v):
        return flash_attention(q, k, v, pol, Blocks(2, 3), causal=True, num_splits=3)

    jitted = jax.jit(lambda *a: _forward_backward(fn, *a))(q, k, v, d_o, d_lse)
    with jax.disable_jit():
        eager = _forward_backward(fn, q, k, v, d_o, d_lse)
    mapped = jax.jit(jax.vmap(lambda *a: _forward_backward(fn, *(x[None] for x in a))))(
        q, k, v, d_o, d_lse
    )
    for name, a, b, c in zip(("O", "L", "dQ", "dK", "dV"), jitted, eager, mapped):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"eager {name}")
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(c).reshape(np.shape(a)), err_msg=f"vmap {name}"
        )


@pytest.mark.slow
def test_one_split_is_todays_flash_and_formats_vmap():
    """num_splits=1 is the one-pass program; split-KV with the policy's formats
    vmapped (a traced policy, run inside the caller's trace) gives each format's bits."""
    q, k, v = _qkv(6, lead=(1,), n=2, m=17)
    blocks = Blocks(2, 4)
    one = flash_attention(q, k, v, fa2_kernel(BF16), blocks, num_splits=1)
    plain = flash_attention(q, k, v, fa2_kernel(BF16), blocks)
    for a, b in zip(one, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    widths = (3, 6)
    mapped = jax.jit(
        jax.vmap(
            lambda w: flash_attention(q, k, v, paper_uniform(custom(8, w)), blocks, num_splits=3)
        )
    )(jnp.array(widths))
    for i, w in enumerate(widths):
        want = flash_attention(q, k, v, paper_uniform(custom(8, w)), blocks, num_splits=3)
        for a, b in zip(mapped, want):
            np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b))
