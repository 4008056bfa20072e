"""fa_jax.nn.dot_product_attention: jax.nn's interface routed bit for bit to
flash_attention / reference_attention; jax.nn's semantics (masks, bias, lengths,
windows, GQA, the unbatched form) checked element for element against
jax.nn.dot_product_attention in float64 on inputs where both compute exactly, and
the (query, key) pairs that influence each other compared through gradients; dtype
conversion; errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, FP16, FP32, Blocks, fa2_kernel, golden
from fa_jax import nn as fnn
from fa_jax.attention import flash_attention, reference_attention


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


def test_routes_bit_for_bit_with_transposes_and_rounds_to_the_query_dtype():
    """bf16 arrays under fa2_kernel(FP32): the output is flash_attention's on the
    (B, N, T, H) arrays, rounded once to bfloat16 (ml_dtypes' float64 cast); every
    argument reaches it."""
    rng = np.random.default_rng(0)
    b, t, s, n, kv, h = 2, 9, 11, 4, 2, 8
    q = rng.standard_normal((b, t, n, h)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((b, s, kv, h)).astype(ml_dtypes.bfloat16) for _ in range(2))
    bias = rng.standard_normal((b, 1, t, s))
    mask = rng.random((b, n, t, s)) < 0.8
    ql, kl = np.array([7, 9], np.int32), np.array([11, 5], np.int32)
    policy, blocks = fa2_kernel(FP32), Blocks(4, 4)
    kwargs = dict(is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl)
    kwargs.update(local_window_size=(5, 2), scale=0.3, policy=policy, blocks=blocks)

    eager = fnn.dot_product_attention(q, k, v, bias, mask, **kwargs)
    wide = [jnp.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v)]
    direct = flash_attention(
        *wide,
        policy,
        blocks,
        causal=True,
        q_lengths=ql[:, None],
        kv_lengths=kl[:, None],
        window=(5, 2),
        scale=0.3,
        bias=bias,
        mask=mask,
    )[0]
    expected = np.asarray(jnp.swapaxes(direct, 1, 2)).astype(ml_dtypes.bfloat16)
    assert eager.dtype == jnp.bfloat16 and eager.shape == q.shape
    assert not np.array_equal(expected, np.asarray(jnp.swapaxes(direct, 1, 2)))  # rounded
    np.testing.assert_array_equal(np.asarray(eager), expected)


def test_reference_algorithm_and_the_default_policy():
    """algorithm="reference" is reference_attention, under jit and eager; a bf16
    output of a bf16 policy converts exactly; the default policies and tiles."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
    wide = [jnp.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v)]
    policy = fa2_kernel(BF16)

    def ours(q, k, v):
        return fnn.dot_product_attention(q, k, v, policy=policy, algorithm="reference")

    expected = np.asarray(jnp.swapaxes(reference_attention(*wide, policy), 1, 2))
    for out in (ours(q, k, v), jax.jit(ours)(q, k, v)):
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out, np.float64), expected)
    assert fnn.default_policy(jnp.bfloat16) == policy
    assert fnn.default_policy(jnp.float16) == fa2_kernel(FP16)
    assert fnn.default_policy(jnp.float64) == golden()
    assert [fnn.default_blocks(d) for d in (64, 65, 128, 256)] == [
        Blocks(128, 128),
        Blocks(128, 64),
        Blocks(128, 64),
        Blocks(64, 64),
    ]


@pytest.mark.slow
def test_by_default_fa2_with_default_blocks_under_default_policy():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)).astype(np.float16) for _ in range(3))
    wide = [jnp.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v)]
    flash = flash_attention(*wide, fa2_kernel(FP16), fnn.default_blocks(8))[0]
    out = fnn.dot_product_attention(q, k, v)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out, np.float64), np.swapaxes(flash, 1, 2))


# -- semantics against jax.nn.dot_product_attention ---------------------------------
#
# "Winner" inputs: every logit is 104 times an integer, and the integers of one row
# are distinct (the last of Q's 4 coordinates is 1 and K's holds 208 × a permutation
# of the keys).  Both computations then form the logits exactly, and the kept key with
# the largest logit beats every other kept key by at least 104: exp(-104) vanishes
# next to 1 in float64 and flushes to 0 in jax.nn's float32 softmax, so each output
# row is exactly V's row of that key (V holds nonzero small integers).  A mistake in
# which keys a query keeps changes the winner and so the output.

H = 4  # scale 1/√H = 1/2, exact


def _winner_problem(seed, b, t, s, n, kv):
    rng = np.random.default_rng(seed)
    q = np.ones((b, t, n, H))
    q[..., :3] = rng.integers(-3, 4, (b, t, n, 3))
    k = np.zeros((b, s, kv, H))
    k[..., :3] = 3328 * rng.integers(-3, 4, (b, s, kv, 3))
    k[..., 3] = 208 * np.stack([[rng.permutation(s) for _ in range(kv)] for _ in range(b)], -1)
    v = rng.integers(1, 9, (b, s, kv, H)) * rng.choice([-1, 1], (b, s, kv, H))
    return q, k, v.astype(np.float64), rng


def _keep(b, n, t, s, *, mask=None, causal=False, ql=None, kl=None, window=None):
    """jax.nn's kept (query, key) pairs, from its docstring, in numpy."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    keep = np.ones((b, n, t, s), bool)
    if mask is not None:
        keep &= mask
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & (j <= i + window[1])
    if ql is not None:
        keep &= i < ql[:, None, None, None]
    if kl is not None:
        keep &= j < kl[:, None, None, None]
    return keep


def _winners(q, k, v, keep, bias):
    """Each row's output: V's row of its kept key with the largest logit, 0 where
    none is kept; and the rows that keep none."""
    g = q.shape[2] // k.shape[2]
    kr, vr = (np.repeat(x, g, axis=2) for x in (k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, kr) / 2 + (0 if bias is None else bias)
    best = np.argmax(np.where(keep, logits, -np.inf), axis=-1)  # (B, N, T)
    out = np.take_along_axis(np.moveaxis(vr, 1, 2), best[..., None], axis=2)  # (B, N, T, H)
    empty = ~keep.any(-1)
    return np.moveaxis(np.where(empty[..., None], 0.0, out), 1, 2), np.moveaxis(empty, 1, 2)


CASES = {
    # GQA; a per-head boolean mask, a bias broadcast over heads, causal, both lengths.
    "mask-bias-causal-lengths-gqa": dict(algorithm="fa2", kv=2, mask=True, bias=True, causal=True),
    # MQA, unbatched; a window with a negative side (keys strictly before the query).
    "window-unbatched-mqa": dict(algorithm="reference", kv=1, window=(3, -1)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_equals_jax_nn_where_both_compute_exactly(case):
    b, t, s, n = (1 if case.get("window") else 2), 7, 8, 4
    q, k, v, rng = _winner_problem(3, b, t, s, n, case["kv"])
    mask = rng.random((b, n, t, s)) < 0.7 if case.get("mask") else None
    bias = 1664.0 * rng.integers(-5, 6, (b, 1, t, s)) if case.get("bias") else None
    causal, window = case.get("causal", False), case.get("window")
    ql = kl = None
    if case.get("causal"):
        ql, kl = np.array([6, 7], np.int32), np.array([8, 2], np.int32)
    kwargs = dict(
        is_causal=causal,
        query_seq_lengths=ql,
        key_value_seq_lengths=kl,
        local_window_size=window,
    )
    keep = _keep(b, n, t, s, mask=mask, causal=causal, ql=ql, kl=kl, window=window)
    if window is None:
        args = (q, k, v, bias, mask)
    else:  # the unbatched (T, N, H) form
        args = (q[0], k[0], v[0], bias, mask)
    blocks = Blocks(4, 3) if case["algorithm"] != "reference" else None
    ours = fnn.dot_product_attention(
        *args, policy=golden(), blocks=blocks, algorithm=case["algorithm"], **kwargs
    )
    theirs = jax.nn.dot_product_attention(*args, **kwargs)
    ours, theirs = (np.asarray(x).reshape(q.shape) for x in (ours, theirs))
    expected, empty = _winners(q, k, v, keep, bias)
    past = np.zeros((b, t), bool) if ql is None else np.arange(t)[None, :] >= ql[:, None]
    live, past = ~empty, past[..., None]
    assert live.sum() > 0.5 * live.size and (empty & ~past).any()
    assert ours.dtype == np.float64
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(theirs[live], expected[live])
    np.testing.assert_array_equal(theirs[np.broadcast_to(past, empty.shape)], 0.0)
    # A row that keeps no key: 0 here, the mean of V over all keys in jax.nn.
    mean = np.repeat(v.mean(axis=1, keepdims=True), n // case["kv"], axis=2)
    rows = empty & ~past
    np.testing.assert_array_equal(theirs[rows], np.broadcast_to(mean, theirs.shape)[rows])


@pytest.mark.extended  # the structure is checked against Flax by default
def test_the_same_keys_influence_each_query_as_in_jax_nn():
    """∂O[i, n] / ∂V[j, n // G] is P_ij: nonzero exactly for the kept pairs, in both
    (random inputs; causal, a window given as one int, key lengths, GQA), read off one
    compiled VJP each, called once per output row.  dQ and dK of the whole output are
    nonzero where jax.nn's are (dQ is 0 on a row keeping one key), in float64."""
    rng = np.random.default_rng(5)
    b, t, s, n, kv = 2, 5, 6, 2, 1
    q = rng.standard_normal((b, t, n, H))
    k, v = (rng.standard_normal((b, s, kv, H)) for _ in range(2))
    kl = np.array([6, 4], np.int32)
    kwargs = dict(is_causal=True, local_window_size=1, key_value_seq_lengths=kl)  # (1, 1)

    def vjp_of(fn):
        def grads(q, k, v, d_o):
            return jax.vjp(lambda q, k, v: fn(q, k, v, **kwargs), q, k, v)[1](d_o)

        return jax.jit(grads)

    ours = vjp_of(lambda *a, **kw: fnn.dot_product_attention(*a, **kw, blocks=Blocks(2, 2)))
    theirs = vjp_of(jax.nn.dot_product_attention)
    keep = _keep(b, n, t, s, causal=True, kl=kl, window=(1, 1))  # (B, N, T, S)
    for bi, i, ni in np.ndindex(b, t, n):
        d_o = np.zeros(q.shape)
        d_o[bi, i, ni] = 1.0
        d_v, d_v_nn = (np.asarray(f(q, k, v, d_o)[2]) != 0 for f in (ours, theirs))
        np.testing.assert_array_equal(d_v, d_v_nn)
        np.testing.assert_array_equal(d_v[bi, :, 0].any(-1), keep[bi, ni, i])
        assert not d_v[1 - bi].any()
    d_o = np.ones(q.shape)
    for g, g_nn in zip(ours(q, k, v, d_o)[:2], theirs(q, k, v, d_o)[:2]):
        assert g.dtype == np.float64 and np.any(np.asarray(g) != 0)
        np.testing.assert_array_equal(np.asarray(g) != 0, np.asarray(g_nn) != 0)


# -- errors ---------------------------------------------------------------------------


def _arrays(b=2, t=3, s=5, n=4, kv=2, h=8):
    return np.ones((b, t, n, h)), np.ones((b, s, kv, h)), np.ones((b, s, kv, h))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(algorithm="fa3"), r"algorithm: expected one of"),
        (dict(query=np.ones((3, 4, 8))), r"query \(B, T, N, H\).*got query \(3, 4, 8\)"),
        (
            dict(key=np.ones((2, 5, 3, 8)), value=np.ones((2, 5, 3, 8))),
            r"K dividing query's N = 4, got K = 3",
        ),
        (dict(value=np.ones((2, 6, 2, 8))), r"value \(B, S, K, H_v\).*value \(2, 6, 2, 8\)"),
        (dict(key=np.ones((2, 5, 2, 8), np.float32)), r"one floating dtype, got float64, float32"),
        (dict(query_seq_lengths=np.array([1, 2, 3])), r"query_seq_lengths: expected integers of"),
        (dict(key_value_seq_lengths=np.array([1.0, 2.0])), r"key_value_seq_lengths: expected"),
        (dict(local_window_size=(1, 2, 3)), r"local_window_size: expected an int or a"),
        (dict(local_window_size=1.5), r"local_window_size: .* got 1.5"),
        (dict(mask=np.ones((2, 4, 3, 5))), r"mask: expected a boolean array"),
        (dict(mask=np.ones((2, 3, 3, 5), bool)), r"mask: expected an array broadcastable"),
        (dict(bias=np.ones((2, 4, 3, 6))), r"bias: expected an array broadcastable"),
        (dict(algorithm="reference", blocks=Blocks(2, 2)), r"blocks: expected None with"),
        (dict(q_offset="bottom-right"), r"q_offset: .* expected causal=True or a window"),
        (dict(q_offset="left", is_causal=True), r"q_offset: expected one of \('top-left'"),
    ],
)
def test_errors_name_the_argument(change, match):
    q, k, v = _arrays()
    arrays = dict(query=q, key=k, value=v)
    arrays.update({a: change.pop(a) for a in list(change) if a in arrays})
    with pytest.raises(ValueError, match=match):
        fnn.dot_product_attention(**arrays, policy=golden(), **change)


def test_q_offset_aligns_the_causal_mask_and_the_window_as_a_kv_cache():
    """T = 3 new queries after S - T = 8 cached keys: ``q_offset="bottom-right"``
    keeps key j for query i where j <= i + 8 (and the window, a negative side
    as a mask too), the bits of the same pairs given as a boolean mask."""
    rng = np.random.default_rng(5)
    b, t, s, n, h = 1, 3, 11, 2, 8
    q = rng.standard_normal((b, t, n, h))
    k, v = (rng.standard_normal((b, s, n, h)) for _ in range(2))
    p, j = np.arange(t)[:, None] + s - t, np.arange(s)[None, :]
    for window, kept in [(None, j <= p), ((4, -2), (j <= p) & (j >= p - 4) & (j <= p - 2))]:
        aligned = fnn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            local_window_size=window,
            q_offset="bottom-right",
            policy=fa2_kernel(BF16),
        )
        masked = fnn.dot_product_attention(q, k, v, mask=kept, policy=fa2_kernel(BF16))
        np.testing.assert_array_equal(np.asarray(aligned), np.asarray(masked))
    top_left = fnn.dot_product_attention(q, k, v, is_causal=True, policy=fa2_kernel(BF16))
    assert not np.array_equal(np.asarray(top_left), np.asarray(masked))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(policy="golden"), r"dot_product_attention: policy: expected a Policy .* 'golden'"),
        (dict(blocks=(2, 2)), r"dot_product_attention: blocks: expected Blocks\(br, bc\)"),
    ],
)
def test_policy_and_blocks_types(change, match):
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in _arrays())
    with pytest.raises(TypeError, match=match):
        fnn.dot_product_attention(q, k, v, **change)


@pytest.mark.slow
def test_vmap_over_the_batch_is_the_batched_call():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 5, 2, 4)) for _ in range(3))
    kl = np.array([5, 3], np.int32)

    def one(q, k, v, kl):
        return fnn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=kl[None], blocks=Blocks(2, 2)
        )

    batched = fnn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=kl, blocks=Blocks(2, 2)
    )
    np.testing.assert_array_equal(np.asarray(jax.vmap(one)(q, k, v, kl)), np.asarray(batched))
