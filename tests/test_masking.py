"""Masks (fa_jax.masking) and every feature together under the golden policy against
plain float64 attention, forward and backward; the window's skipped key blocks
leave the bits as they were; the causal mask and window aligned by q_offset
(bottom-right, behind a KV cache) are their boolean masks; jit = eager = vmap;
errors."""

import jax
import numpy as np
import pytest
from attention_plain import plain_attention
from helpers import x64_enabled

import fa_jax
from fa_jax import BF16
from fa_jax.attention import Blocks, flash_attention, reference_attention
from fa_jax.masking import check_window, q_offset_of, window_end
from fa_jax.presets import fa2_kernel, golden
from fa_jax.score_mods import alibi_bias, alibi_slopes


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


H, H_KV, N, M, D = 4, 2, 10, 13, 8


def _problem(seed):
    """GQA (4 query heads, 2 K/V heads), an ALiBi bias plus a random one, a random
    boolean mask, lengths that leave rows and keys out (batch 0 keeps no key)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, H, N, D))
    k, v = (rng.standard_normal((2, H_KV, M, D)) for _ in range(2))
    bias = alibi_bias(alibi_slopes(H), N, M) + rng.standard_normal((2, H, N, M))
    mask = rng.random((H, N, M)) < 0.8
    lengths = dict(q_lengths=np.array([[N], [8]]), kv_lengths=np.array([[0], [11]]))
    d_o, d_lse = rng.standard_normal((2, H, N, D)), rng.standard_normal((2, H, N))
    return (q, k, v, d_o, d_lse), dict(bias=bias, mask=mask, **lengths)


def _vjp(fn, q, k, v, d_o, d_lse):
    out, vjp = jax.vjp(fn, q, k, v)
    return (*out, *vjp((d_o, d_lse)))


GOLDEN_CASES = [  # (kind, variant, causal, window, softcap)
    ("flash", "fa2", True, (3, -1), 2.5),
    pytest.param("reference", None, False, (2, 1), None, marks=pytest.mark.slow),
    pytest.param("flash", "fa1", False, (0, 2), None, marks=pytest.mark.slow),
    pytest.param("flash", "rowwise", False, (-1, 0), 1.5, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, variant, causal, window, softcap", GOLDEN_CASES)
def test_golden_features_equal_plain_float64(kind, variant, causal, window, softcap):
    """GQA, bias (ALiBi + random), boolean mask, window, causal, lengths and a
    softcap at once: golden O, lse, dQ, dK, dV equal plain float64 attention and
    its autodiff to 1e-12; rows keeping no key give O = 0, lse = -inf and zero
    gradients."""
    (q, k, v, d_o, d_lse), extra = _problem(1)
    pol = golden()
    extra = dict(extra, softcap=softcap)

    def fn(q, k, v):
        if kind == "flash":
            return flash_attention(
                q, k, v, pol, Blocks(4, 3), variant=variant, causal=causal, window=window, **extra
            )
        return reference_attention(
            q, k, v, pol, causal=causal, window=window, return_lse=True, **extra
        )

    def plain(q, k, v):
        return plain_attention(q, k, v, causal=causal, window=window, **extra)

    got = jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, d_o, d_lse)
    want = jax.jit(lambda *a: _vjp(plain, *a))(q, k, v, d_o, d_lse)
    for name, g, w in zip(("O", "lse", "dQ", "dK", "dV"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, name
        assert not np.isnan(g).any(), name
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
        err = np.max(np.abs(g[finite] - w[finite])) / np.max(np.abs(w[finite]))
        assert err <= 1e-12, (name, err)
    lse = np.asarray(got[1])
    assert (lse[0] == -np.inf).all() and (np.asarray(got[0])[0] == 0).all()
    assert (np.asarray(got[3])[0] == 0).all() and (np.asarray(got[2])[0] == 0).all()


@pytest.mark.parametrize("variant", ["fa2", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_skipped_key_blocks_leave_the_bits(variant):
    """A window (1, 2) visits 10 + 2 = 12 of 13 keys (4 of 5 blocks); the same
    pairs kept by a boolean mask visit every block: FA2 and the row-wise loop give
    the same bits (a block no row keeps rescales by exactly 1 and adds zeros)."""
    (q, k, v, _, _), _ = _problem(2)
    pol, blocks = fa2_kernel(BF16), Blocks(4, 3)
    assert window_end(N, M, (1, 2)) == 12
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    as_mask = (j >= i - 1) & (j <= i + 2)
    a = flash_attention(q, k, v, pol, blocks, variant=variant, window=(1, 2))
    b = flash_attention(q, k, v, pol, blocks, variant=variant, mask=as_mask)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_vmap_equals_separate_calls():
    """vmap over a batch of (Q, K, V, bias), window and mask fixed, forward and
    backward, gives each separate call's bits."""
    (q, k, v, d_o, d_lse), extra = _problem(3)
    pol = fa2_kernel(BF16)

    def one(q, k, v, bias, d_o, d_lse):
        def fn(q, k, v):
            return flash_attention(
                q, k, v, pol, Blocks(4, 3), window=(2, 2), bias=bias, mask=extra["mask"]
            )

        return _vjp(fn, q, k, v, d_o, d_lse)

    batched = jax.jit(jax.vmap(one))(q, k, v, extra["bias"], d_o, d_lse)
    single = jax.jit(one)
    for b in range(2):
        each = single(q[b], k[b], v[b], extra["bias"][b], d_o[b], d_lse[b])
        for x, y in zip(batched, each):
            np.testing.assert_array_equal(np.asarray(x)[b], np.asarray(y))


@pytest.mark.slow
def test_eager_equals_jit_bitwise():
    """Op by op (jax.disable_jit) every feature gives the jitted bits, forward and
    backward."""
    (q, k, v, d_o, d_lse), extra = _problem(4)
    pol = fa2_kernel(BF16)

    def fn(q, k, v):
        return flash_attention(q, k, v, pol, Blocks(4, 3), window=(3, 1), causal=True, **extra)

    jitted = jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, d_o, d_lse)
    with jax.disable_jit():
        eager = _vjp(fn, q, k, v, d_o, d_lse)
    for x, y in zip(jitted, eager):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_check_window():
    assert check_window(None) is None and check_window((-1, -1)) is None
    assert check_window((3, 0)) == (3, 0) and check_window([-1, 2]) == (-1, 2)
    for bad in ((-2, 0), (0, -5), (1,), (1, 2, 3), "ab", (1.0, 2), (True, 0), 3):
        with pytest.raises(ValueError, match=r"window: expected \(left, right\) .* got"):
            check_window(bad)
    assert window_end(5, 20, (3, 2)) == 7 and window_end(5, 6, (0, 4)) == 6
    assert window_end(5, 20, (2, -1)) == 20 and window_end(5, 20, None) == 20


def test_errors_name_the_argument():
    (q, k, v, _, _), _ = _problem(5)
    pol = golden()
    with pytest.raises(ValueError, match=r"flash_attention: window: expected .* got \(-3, 0\)"):
        flash_attention(q, k, v, pol, Blocks(4, 3), window=(-3, 0))
    with pytest.raises(ValueError, match=r"reference_attention: window: expected"):
        reference_attention(q, k, v, pol, window=(0, -2))
    with pytest.raises(
        ValueError,
        match=r"mask: expected an array broadcastable to .* \(2, 4, 10, 13\).*\(10, 12\)",
    ):
        reference_attention(q, k, v, pol, mask=np.ones((N, M - 1), bool))
    with pytest.raises(ValueError, match=r"flash_attention: mask: expected a boolean array"):
        flash_attention(q, k, v, pol, Blocks(4, 3), mask=np.ones((N, M)))


def _as_mask(n, m, offset, causal, window):
    """The pairs ``causal`` and ``window`` keep with query i at key position
    i + offset, as a boolean mask (the module docstring's inequalities)."""
    p, j = np.arange(n)[:, None] + offset, np.arange(m)[None, :]
    keep = j <= p if causal else np.ones((n, m), bool)
    if window is not None:
        left, right = window
        keep = (
            keep
            & ((j >= p - left) if left >= 0 else True)
            & ((j <= p + right) if right >= 0 else True)
        )
    return keep


OFFSET_CASES = [  # (kind, variant, num_splits, causal, window, q_offset, n)
    ("flash", "fa2", 1, True, None, "bottom-right", 4),
    ("reference", None, 1, True, (2, -1), "bottom-right", 4),
    pytest.param("flash", "fa2", 2, True, (3, 1), "bottom-right", 1, marks=pytest.mark.slow),
    pytest.param("flash", "fa1", 1, False, (1, 2), 5, N, marks=pytest.mark.slow),
    pytest.param("flash", "rowwise", 1, True, None, -2, N, marks=pytest.mark.slow),
    pytest.param("flash", "fa2", 1, True, (0, 0), "bottom-right", 16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, variant, num_splits, causal, window, q_offset, n", OFFSET_CASES)
def test_q_offset_is_its_boolean_mask(kind, variant, num_splits, causal, window, q_offset, n):
    """Queries behind a KV cache: the causal mask and window aligned by ``q_offset``
    (bottom-right: query i at key position i + M - N; an int; N > M and a negative
    offset leave rows that keep no key) give the bits, forward and backward, of the
    same pairs kept by a boolean mask, in reference attention, FA2, FA1, the
    row-wise loop and split-KV decoding."""
    (q, k, v, d_o, d_lse), _ = _problem(6)
    q, d_o, d_lse = q[..., :n, :], d_o[..., :n, :], d_lse[..., :n]
    if n > N:
        q = np.concatenate([q, q[..., : n - N, :]], axis=-2)
        d_o = np.concatenate([d_o, d_o[..., : n - N, :]], axis=-2)
        d_lse = np.concatenate([d_lse, d_lse[..., : n - N]], axis=-1)
    pol = fa2_kernel(BF16)
    offset = M - n if q_offset == "bottom-right" else q_offset
    mask = _as_mask(n, M, offset, causal, window)

    def call(**how):
        def fn(q, k, v):
            if kind == "flash":
                return flash_attention(
                    q, k, v, pol, Blocks(4, 3), variant=variant, num_splits=num_splits, **how
                )
            return reference_attention(q, k, v, pol, return_lse=True, **how)

        return jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, d_o, d_lse)

    aligned = call(causal=causal, window=window, q_offset=q_offset)
    masked = call(mask=mask)
    for name, x, y in zip(("O", "lse", "dQ", "dK", "dV"), aligned, masked):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    if not mask.any(axis=-1).all():  # rows that keep no key: O = 0, lse = -inf
        empty = ~mask.any(axis=-1)
        assert (np.asarray(aligned[1])[..., empty] == -np.inf).all()
        assert (np.asarray(aligned[0])[..., empty, :] == 0).all()


def test_bottom_right_over_n_equal_m_is_top_left():
    (q, k, v, _, _), _ = _problem(7)
    q = np.concatenate([q, q[..., : M - N, :]], axis=-2)  # N = M = 13
    pol = fa2_kernel(BF16)
    top = flash_attention(q, k, v, pol, Blocks(4, 3), causal=True, window=(4, 1))
    bottom = flash_attention(
        q, k, v, pol, Blocks(4, 3), causal=True, window=(4, 1), q_offset="bottom-right"
    )
    for x, y in zip(top, bottom):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_q_offset_errors_name_the_argument():
    (q, k, v, _, _), _ = _problem(8)
    pol = golden()
    for bad in ("bottom", 1.5, True, (1,)):
        with pytest.raises(ValueError, match=r"reference_attention: q_offset: expected one of"):
            reference_attention(q, k, v, pol, causal=True, q_offset=bad)
    with pytest.raises(ValueError, match=r"flash_attention: q_offset: .* expected causal=True"):
        flash_attention(q, k, v, pol, Blocks(4, 3), q_offset="bottom-right")
    assert q_offset_of("bottom-right", 3, 10) == 7 and q_offset_of(None, 3, 10) == 0
    assert q_offset_of(np.int64(-2), 3, 10) == -2
    assert window_end(5, 20, (3, 2), 4) == 11 and window_end(5, 20, (3, 2), -9) == 0


def test_alibi_bias_bottom_right_is_flash_attention_2s():
    """FlashAttention-2's alibi_slopes: -slope · |i + M - N - j|."""
    slopes = alibi_slopes(4)
    got = alibi_bias(slopes, 3, 7, q_offset="bottom-right")
    i, j = np.arange(3)[:, None], np.arange(7)[None, :]
    np.testing.assert_array_equal(got, -slopes[:, None, None] * np.abs(i + 7 - 3 - j))
    np.testing.assert_array_equal(alibi_bias(slopes, 3, 7), alibi_bias(slopes, 3, 7, 0))


def _sinks(seed):
    """A sink logit per (batch, head); head 3 has none (-inf)."""
    sinks = np.random.default_rng(seed).standard_normal((2, H)) * 2
    sinks[:, 3] = -np.inf
    return sinks


SINK_CASES = [  # (kind, variant, num_splits)
    ("flash", "fa2", 1),
    pytest.param("reference", None, 1, marks=pytest.mark.slow),
    pytest.param("flash", "fa1", 1, marks=pytest.mark.slow),
    pytest.param("flash", "rowwise", 1, marks=pytest.mark.slow),
    pytest.param("flash", "fa2", 3, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, variant, num_splits", SINK_CASES)
def test_golden_sinks_equal_plain_float64(kind, variant, num_splits):
    """Attention sinks with every other feature: golden O, lse, dQ, dK, dV equal
    plain float64 attention with the sink in the denominator to 1e-12; a row that
    keeps no key gives O = 0 and lse = σ (or -inf without a sink)."""
    (q, k, v, d_o, d_lse), extra = _problem(9)
    extra = dict(extra, sinks=_sinks(9))
    pol = golden()

    def fn(q, k, v):
        if kind == "flash":
            return flash_attention(
                q,
                k,
                v,
                pol,
                Blocks(4, 3),
                variant=variant,
                num_splits=num_splits,
                causal=True,
                q_offset="bottom-right",
                **extra,
            )
        return reference_attention(
            q, k, v, pol, causal=True, q_offset="bottom-right", return_lse=True, **extra
        )

    mask = extra.pop("mask") & _as_mask(N, M, M - N, True, None)
    want = jax.jit(
        lambda *a: _vjp(lambda q, k, v: plain_attention(q, k, v, mask=mask, **extra), *a)
    )(q, k, v, d_o, d_lse)
    extra["mask"] = mask
    got = jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, d_o, d_lse)
    for name, g, w in zip(("O", "lse", "dQ", "dK", "dV"), got, want):
        g, w = np.asarray(g), np.asarray(w)
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
        err = np.max(np.abs(g[finite] - w[finite])) / np.max(np.abs(w[finite]))
        assert err <= 1e-12, (name, err)
    lse = np.asarray(got[1])[0]  # batch 0 keeps no key
    np.testing.assert_array_equal(lse, np.broadcast_to(extra["sinks"][0][:, None], lse.shape))
    assert (np.asarray(got[0])[0] == 0).all()


def test_reference_sink_is_a_first_key_with_zero_value():
    """Under fa2_kernel(BF16): the reference with sinks gives the bits of the
    reference over one more key, first, whose score is σ (a zero key plus a bias
    of σ; BF16 values, exact at every stage) and whose value is zero."""
    (q, k, v, _, _), _ = _problem(10)
    q, k, v = (np.asarray(fa_jax.round_to(x, BF16)) for x in (q, k, v))
    sinks = np.asarray(fa_jax.round_to(_sinks(10), BF16))
    pol = fa2_kernel(BF16)
    with_sinks = reference_attention(q, k, v, pol, sinks=sinks, return_lse=True)
    pad = [(0, 0), (0, 0), (1, 0), (0, 0)]
    bias = np.zeros((2, H, N, M + 1))
    bias[..., 0] = sinks[..., None]
    as_key = reference_attention(q, np.pad(k, pad), np.pad(v, pad), pol, bias=bias, return_lse=True)
    for x, y in zip(with_sinks, as_key):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    no_sink = reference_attention(q, k, v, pol, return_lse=True)
    np.testing.assert_array_equal(np.asarray(with_sinks[0])[:, 3], np.asarray(no_sink[0])[:, 3])


def test_sinks_errors_name_the_argument():
    (q, k, v, _, _), _ = _problem(11)
    with pytest.raises(ValueError, match=r"reference_attention: sinks: expected one logit per"):
        reference_attention(q, k, v, golden(), sinks=np.zeros(3))
    with pytest.raises(ValueError, match=r"flash_attention: sinks: expected finite logits"):
        flash_attention(q, k, v, golden(), Blocks(4, 3), sinks=np.full(H, np.nan))
    exp2 = golden().replace(scale="exp2", exp_model="exp2_correctly_rounded")
    with pytest.raises(ValueError, match=r"sinks: expected a policy whose scores are scaled"):
        reference_attention(q, k, v, exp2, sinks=np.zeros(H))


@pytest.mark.slow
def test_sinks_and_q_offset_jit_eager_and_vmap_agree():
    """Sinks and a bottom-right causal window: op by op (jax.disable_jit), jitted,
    and vmapped over a batch of (Q, K, V, sinks), forward and backward, the same
    bits."""
    (q, k, v, d_o, d_lse), _ = _problem(12)
    q, d_o, d_lse = q[..., :4, :], d_o[..., :4, :], d_lse[..., :4]
    sinks = _sinks(12)
    pol = fa2_kernel(BF16)

    def one(q, k, v, sinks, d_o, d_lse):
        def fn(q, k, v):
            return flash_attention(
                q,
                k,
                v,
                pol,
                Blocks(4, 3),
                causal=True,
                window=(5, 0),
                q_offset="bottom-right",
                sinks=sinks,
            )

        return _vjp(fn, q, k, v, d_o, d_lse)

    args = (q, k, v, sinks, d_o, d_lse)
    batched = jax.jit(jax.vmap(one))(*args)
    for b in range(2):
        each = [x[b] for x in args]
        single = jax.jit(one)(*each)
        with jax.disable_jit():
            eager = one(*each)
        for x, y, z in zip(batched, single, eager):
            np.testing.assert_array_equal(np.asarray(x)[b], np.asarray(y))
            np.testing.assert_array_equal(np.asarray(y), np.asarray(z))
