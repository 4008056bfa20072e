"""How far a pre-LN transformer block's output moves when its attention runs under a policy.

A plain-JAX block (no framework): y = x + Attn(LN(x)), out = y + MLP(LN(y)), with
grouped-query causal self-attention (N query heads, K key/value heads) through
:func:`fa_jax.nn.dot_product_attention`, a GELU MLP of width 4D, and seeded
random weights.  Everything outside the attention runs in float64, so the
printed deviation is the attention's alone: max |out - out_golden| and its size
relative to max |out_golden|, where out_golden is the same block with the
attention under ``golden()`` (FP64 throughout), for fa2_kernel(bf16) and
torch_math(bf16) under reference attention and flash attention (FA2, tiles
Bc = ``--bc``).  With ``--grad``, the gradient of sum(out²) with respect to the
query weights is compared the same way (the emulated backward).

    python experiments/transformer_block.py                  # B=2, T=64, D=64, N=4, K=2
    python experiments/transformer_block.py --seq 256 --bc 32 --grad
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import BF16, Blocks, fa2_kernel, golden, torch_math
from fa_jax import nn as fnn


def init_params(seed: int, dim: int, heads: int, kv_heads: int) -> dict:
    """Seeded weights: projections N(0, 1/D), LN gains 1 and biases 0."""
    rng = np.random.default_rng(seed)
    h = dim // heads

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]))

    return dict(
        wq=w(dim, heads, h),
        wk=w(dim, kv_heads, h),
        wv=w(dim, kv_heads, h),
        wo=w(heads * h, dim),
        w1=w(dim, 4 * dim),
        w2=w(4 * dim, dim),
        ln1=jnp.ones(dim),
        ln2=jnp.ones(dim),
    )


def layer_norm(x, gain):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return gain * (x - mu) / jnp.sqrt(var + 1e-6)


def block(params: dict, x, attention):
    """Pre-LN block on x (B, T, D); ``attention(q, k, v)`` on (B, T, N, H) arrays."""
    a = layer_norm(x, params["ln1"])
    q, k, v = (jnp.einsum("btd,dnh->btnh", a, params[w]) for w in ("wq", "wk", "wv"))
    o = attention(q, k, v)
    y = x + o.reshape(*o.shape[:2], -1) @ params["wo"]
    m = layer_norm(y, params["ln2"])
    return y + jax.nn.gelu(m @ params["w1"]) @ params["w2"]


def attention_under(policy, algorithm: str, blocks):
    def attention(q, k, v):
        return fnn.dot_product_attention(
            q, k, v, is_causal=True, policy=policy, algorithm=algorithm, blocks=blocks
        )

    return attention


def run(params, x, attention, grad: bool):
    """(out, d sum(out²) / d wq or None), jitted."""
    if not grad:
        return np.asarray(jax.jit(block, static_argnums=2)(params, x, attention)), None

    def loss(p):
        out = block(p, x, attention)
        return (out**2).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(out), np.asarray(grads["wq"])


def relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="sequence length T")
    p.add_argument("--dim", type=int, default=64, help="model width D")
    p.add_argument("--heads", type=int, default=4, help="query heads N")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads K (dividing N)")
    p.add_argument("--bc", type=int, default=16, help="flash attention's key tile Bc")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad", action="store_true", help="also compare d sum(out²) / d Wq")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    params = init_params(args.seed, args.dim, args.heads, args.kv_heads)
    shape = (args.batch, args.seq, args.dim)
    x = jnp.asarray(np.random.default_rng(args.seed + 1).standard_normal(shape))
    blocks = Blocks(args.bc, args.bc)
    out_g, grad_g = run(params, x, attention_under(golden(), "reference", None), args.grad)
    print(
        f"pre-LN block, B={args.batch} T={args.seq} D={args.dim} N={args.heads} "
        f"K={args.kv_heads}, causal; deviation from the block with golden() attention"
    )
    head = f"{'attention policy':<22}{'algorithm':<11}{'max|Δout|':>11}{'rel':>10}"
    print(head + (f"{'rel dWq':>10}" if args.grad else ""))
    runs = [
        (fa2_kernel(BF16), "reference", None),
        (fa2_kernel(BF16), "fa2", blocks),
        (torch_math(BF16), "reference", None),
    ]
    for policy, algorithm, tiles in runs:
        out, grad = run(params, x, attention_under(policy, algorithm, tiles), args.grad)
        line = f"{policy.name:<22}{algorithm:<11}{np.abs(out - out_g).max():11.3e}"
        line += f"{relative(out, out_g):10.2e}"
        print(line + (f"{relative(grad, grad_g):10.2e}" if args.grad else ""))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
