"""Policy and presets: stage formats, pytree behaviour, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa_jax import BF16, E4M3FN, E5M2, FP16, FP32, FP64, STAGES, Policy, custom, round_to
from fa_jax.accumulation import SEQUENTIAL, chunked
from fa_jax.policy import BACKWARD_STAGES, FORWARD_STAGES
from fa_jax.presets import fa2_kernel, get_policy, golden, paper_uniform, torch_math
from fa_jax.quantization import INT8


def test_presets_name_the_documented_stage_formats():
    u = paper_uniform("bf16")
    assert all(getattr(u, s) is BF16 for s in STAGES)
    k = fa2_kernel(BF16)
    assert (k.inputs, k.p, k.out) == (BF16, BF16, BF16)
    assert all(
        getattr(k, s) is FP32 for s in ("qk_acc", "scores", "stats", "exp", "pv_acc", "o_acc")
    )
    t = torch_math(FP16)
    assert (t.scores, t.p, t.out, t.stats, t.exp, t.qk_acc) == (FP16, FP16, FP16, FP32, FP32, FP32)
    assert all(getattr(golden(), s) is FP64 for s in STAGES)


def test_presets_name_the_documented_backward_formats():
    k = fa2_kernel(BF16)  # FP32 registers and accumulators; dO, P, dS and the gradients BF16
    assert (k.d_out, k.d_acc, k.d_p, k.d_stats, k.d_s, k.grads) == (
        BF16,
        FP32,
        FP32,
        FP32,
        BF16,
        BF16,
    )
    t = torch_math(FP16)  # every stored tensor FP16, the softmax backward computed in FP32
    assert (t.d_out, t.d_acc, t.d_p, t.d_stats, t.d_s, t.grads) == (
        FP16,
        FP32,
        FP16,
        FP32,
        FP16,
        FP16,
    )
    assert STAGES == FORWARD_STAGES + BACKWARD_STAGES


def test_backward_stages_left_out_follow_their_forward_stages():
    """Nine forward formats suffice; each backward stage then takes its documented
    forward stage's format, and every preset agrees with that rule."""
    forward = [BF16, FP32, FP16, FP32, FP32, BF16, FP32, FP32, FP16]
    p = Policy(*forward)
    assert (p.d_out, p.d_acc, p.d_p, p.d_stats, p.d_s, p.grads) == (
        BF16,
        FP32,
        FP16,
        FP32,
        BF16,
        FP16,
    )
    for preset in (paper_uniform(BF16), fa2_kernel(BF16), torch_math(FP16), golden()):
        derived = Policy(
            *(getattr(preset, s) for s in FORWARD_STAGES),
            accumulation=preset.accumulation,
            name=preset.name,
        )
        assert derived == preset
    q = p.replace(d_s=FP32, inputs=FP32)  # replace changes only what it names
    assert (q.d_s, q.inputs, q.d_out) == (FP32, FP32, BF16)
    assert Policy(*forward, d_acc="fp64").d_acc is FP64


def test_get_policy_and_replace():
    assert get_policy("paper_uniform", "fp16") == paper_uniform(FP16)
    assert get_policy("golden") == golden()
    p = fa2_kernel(BF16).replace(p=FP16, accumulation="sequential")
    assert p.p is FP16 and p.accumulation == SEQUENTIAL and p.inputs is BF16
    assert paper_uniform(BF16, accumulation=chunked(8)).accumulation == chunked(8)
    with pytest.raises(ValueError, match="unknown policy 'fa3'"):
        get_policy("fa3", "bf16")
    with pytest.raises(ValueError, match="needs a format"):
        get_policy("fa2_kernel")
    with pytest.raises(ValueError, match=r"unknown fields \['qk'\]"):
        golden().replace(qk=FP16)
    with pytest.raises(ValueError, match=r"Policy\.scale: expected one of"):
        golden().replace(scale="k")
    with pytest.raises(ValueError, match="unknown format"):
        paper_uniform("bf61")


def test_policies_are_hashable_pytrees():
    assert hash(fa2_kernel(BF16)) == hash(fa2_kernel("bfloat16"))
    leaves = jax.tree_util.tree_leaves(paper_uniform(BF16))
    assert leaves == [8, 7, 127] * (len(STAGES) + 2)  # the stages, bias and combine


def test_vmap_over_policy_formats():
    """A policy whose formats are traced: one program for several mantissa widths."""
    x = jnp.linspace(-2.0, 2.0, 101, dtype=jnp.float32)

    def apply(m):
        pol = paper_uniform(custom(8, m))
        return round_to(x, pol.scores)

    batched = jax.vmap(apply)(jnp.arange(2, 6))
    for i, m in enumerate(range(2, 6)):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(round_to(x, custom(8, m))))


def test_describe_lists_every_stage():
    text = torch_math(BF16).describe()
    assert all(s in text for s in STAGES) and "torch_math(bfloat16)" in text


def test_exp2_scale_goes_with_a_base_2_exp_model_only():
    pol = fa2_kernel(BF16).replace(scale="exp2", exp_model="exp2_correctly_rounded")
    assert pol.scale == "exp2" and pol.exp_model.base == "2"
    with pytest.raises(ValueError, match="base-2 exp model"):
        fa2_kernel(BF16).replace(scale="exp2")
    with pytest.raises(ValueError, match="base-2 exp model"):
        fa2_kernel(BF16).replace(exp_model="exp2_correctly_rounded")
    with pytest.raises(ValueError, match=r"Policy\.scale"):
        fa2_kernel(BF16).replace(scale="log2")


def test_kv_cache_fields():
    """``kv`` (the KV cache's format, None: no cache) and ``kv_scaling`` (static):
    presets take them through replace, a later replace(inputs=...) keeps no cache,
    they enter equality, hashing, the pytree and describe."""
    base = fa2_kernel(BF16)
    assert base.kv is None and base.kv_scaling == "none"
    assert base.replace(inputs=FP16).kv is None  # no cache follows the inputs
    pol = get_policy("torch_math", "fp16").replace(kv="e4m3fn", kv_scaling="head")
    assert pol.kv is E4M3FN and pol.kv_scaling == "head" and pol.inputs is FP16
    assert pol.replace(kv="int8", kv_scaling="token").kv is INT8
    assert golden().replace(kv="e5m2", kv_scaling="tensor").kv is E5M2
    assert pol != torch_math(FP16) and hash(pol) == hash(pol.replace(name=pol.name))
    assert pol != pol.replace(kv_scaling="token")
    leaves, tree = jax.tree_util.tree_flatten(pol)
    assert leaves == [*jax.tree_util.tree_leaves(torch_math(FP16)), 4, 3, 7]  # kv's widths last
    assert jax.tree_util.tree_unflatten(tree, leaves) == pol
    int8 = base.replace(kv="int8", kv_scaling="token")
    assert jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(int8))) == int8
    assert "kv      float8_e4m3fn  (K and V cached, scaling head)" in pol.describe()
    assert "kv      bfloat16  (K and V as inputs: no cache)" in base.describe()


def test_kv_cache_errors():
    base = fa2_kernel(BF16)
    with pytest.raises(ValueError, match="kv_scaling='token' scales K and V into a cache"):
        base.replace(kv_scaling="token")
    with pytest.raises(ValueError, match=r"Policy\.kv_scaling: an integer cache \(int8\) needs"):
        base.replace(kv="int8")
    with pytest.raises(ValueError, match=r"Policy\.kv_scaling: expected one of \('none', 'tensor'"):
        base.replace(kv="e4m3fn", kv_scaling="block")
    with pytest.raises(ValueError, match="unknown format 'e4m3x'"):
        base.replace(kv="e4m3x")
    with pytest.raises(ValueError, match=r"got kv=float64"):
        base.replace(kv=FP64, kv_scaling="tensor", carrier="float32")
