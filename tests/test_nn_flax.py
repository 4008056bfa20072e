"""fa_jax.nn.flax_attention_fn as the attention_fn of Flax's nnx.MultiHeadAttention:
the module's output is the emulation's on its own projections, bit for bit; the
input tokens that influence each output token are those of Flax's default
attention; dropout and sowing the weights are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64_enabled

from fa_jax import BF16, Blocks, fa2_kernel, golden
from fa_jax import nn as fnn

nnx = pytest.importorskip("flax.nnx", reason="flax is an optional extra (pip install fa-jax[flax])")


@pytest.fixture(autouse=True)
def _x64():
    with x64_enabled():
        yield


B, T, S, F = 2, 5, 6, 8


def _module(attention_fn=None, **kwargs):
    fn = {} if attention_fn is None else dict(attention_fn=attention_fn)
    return nnx.MultiHeadAttention(
        num_heads=4,
        num_kv_heads=2,
        in_features=F,
        qkv_features=16,
        decode=False,
        param_dtype=jnp.float64,
        rngs=nnx.Rngs(0),
        **fn,
        **kwargs,
    )


def _mask():
    """Flax's float masks: causal (top-left) and keys past each batch's length."""
    lengths = np.array([6, 3])
    causal = nnx.make_causal_mask(jnp.ones((B, S)))[:, :, :T, :]
    padding = nnx.make_attention_mask(jnp.ones((B, T)), jnp.arange(S)[None] < lengths[:, None])
    return nnx.combine_masks(causal, padding)


def _inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((B, T, F)), rng.standard_normal((B, S, F))


@pytest.mark.extended  # 6 s: for the default run's time only
def test_module_output_is_the_emulation_on_its_projections():
    policy, blocks = fa2_kernel(BF16), Blocks(2, 4)
    module = _module(fnn.flax_attention_fn(policy=policy, blocks=blocks))
    x_q, x_kv = _inputs()
    mask = _mask()
    out = module(x_q, x_kv, mask=mask)
    q, k, v = module.query(x_q), module.key(x_kv), module.value(x_kv)
    o = fnn.dot_product_attention(q, k, v, mask=mask != 0, policy=policy, blocks=blocks)
    expected = module.out(o)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.extended  # 6 s
def test_the_same_tokens_influence_each_output_as_with_flax_attention():
    """∂out[b, i] / ∂x_kv[b, j] is nonzero exactly where the mask keeps (i, j) for
    some head, with fa_jax's reference attention under golden() and with Flax's
    default attention (one compiled VJP each, called once per output token)."""
    x_q, x_kv = _inputs()
    mask = _mask()

    def vjp_of(module):
        graph, state = nnx.split(module)

        def grads(x_q, x_kv, d_out):
            call = lambda x_kv: nnx.merge(graph, state)(x_q, x_kv, mask=mask)  # noqa: E731
            return jax.vjp(call, x_kv)[1](d_out)[0]

        return jax.jit(grads)

    ours = vjp_of(_module(fnn.flax_attention_fn(policy=golden(), algorithm="reference")))
    theirs = vjp_of(_module())
    keep = np.asarray(mask[:, 0] != 0)  # (B, T, S)
    for b, i in np.ndindex(B, T):
        d_out = np.zeros((B, T, F))  # out_features = in_features
        d_out[b, i] = 1.0
        influence, influence_flax = (np.asarray(f(x_q, x_kv, d_out)) != 0 for f in (ours, theirs))
        np.testing.assert_array_equal(influence, influence_flax)
        np.testing.assert_array_equal(influence[b].any(-1), keep[b, i])


def test_dropout_and_sown_weights_are_refused():
    module = _module(fnn.flax_attention_fn(policy=golden()), dropout_rate=0.1)
    x_q, x_kv = _inputs()
    with pytest.raises(ValueError, match=r"dropout_rate: expected 0 or deterministic=True"):
        module(x_q, x_kv, deterministic=False, rngs=nnx.Rngs(1))
    module = _module(fnn.flax_attention_fn(policy=golden()))
    with pytest.raises(ValueError, match=r"module: expected None"):
        module(x_q, x_kv, sow_weights=True)


@pytest.mark.slow
def test_several_or_no_batch_dimensions_as_flax_takes_them():
    """(2, 3, T, N, H) arrays with a (3, N, T, S) mask give the flattened (6, ...)
    call's output; unbatched (T, N, H) arrays that of a batch of one."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 4, 2, 8)) for _ in range(3))
    mask = (rng.random((3, 2, 4, 4)) < 0.7).astype(np.float32)
    fn = fnn.flax_attention_fn(policy=golden(), algorithm="reference")
    out = fn(q, k, v, mask=mask)
    flat = fnn.dot_product_attention(
        *(x.reshape(6, 4, 2, 8) for x in (q, k, v)),
        mask=np.broadcast_to(mask != 0, (2, 3, 2, 4, 4)).reshape(6, 2, 4, 4),
        policy=golden(),
        algorithm="reference",
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(flat).reshape(q.shape))
    one = fn(q[0, 0], k[0, 0], v[0, 0], mask=mask[0])
    np.testing.assert_array_equal(np.asarray(one), np.asarray(flat[0]))
