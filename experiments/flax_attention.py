"""Flax's nnx.MultiHeadAttention with its attention run by fa_jax under a policy.

The module takes ``attention_fn=fa_jax.nn.flax_attention_fn(policy=..., blocks=...,
algorithm=...)``; its projections stay Flax's.  One seeded causal self-attention
module (float64 parameters, B=2, T=``--seq``, 4 heads over 2 key/value heads) is
run with Flax's own attention (jax.nn.dot_product_attention, softmax in float32)
and with fa_jax's under golden() (FP64 throughout), fa2_kernel(bf16) and
torch_math(bf16); printed: max |out - out_golden| and its size relative to
max |out_golden| (needs flax: ``pip install fa-jax[flax]``).

    python experiments/flax_attention.py
    python experiments/flax_attention.py --seq 128 --bc 32 --algorithm fa1
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from fa_jax import BF16, Blocks, fa2_kernel, golden, torch_math
from fa_jax import nn as fnn


def module_with(nnx, attention_fn, features: int, seed: int):
    """A 4-head (2 key/value heads) nnx.MultiHeadAttention, float64 parameters,
    the same weights for every ``attention_fn`` (the same seed)."""
    extra = {} if attention_fn is None else dict(attention_fn=attention_fn)
    return nnx.MultiHeadAttention(
        num_heads=4,
        num_kv_heads=2,
        in_features=features,
        decode=False,
        param_dtype=np.float64,
        rngs=nnx.Rngs(seed),
        **extra,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=64, help="sequence length T")
    p.add_argument("--features", type=int, default=64, help="model width (16 per head)")
    p.add_argument("--bc", type=int, default=16, help="flash attention's key tile Bc")
    p.add_argument("--algorithm", default="fa2", choices=fnn.ALGORITHMS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from flax import nnx  # the optional extra, needed only here

    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    x = np.random.default_rng(args.seed + 1).standard_normal((2, args.seq, args.features))
    blocks = None if args.algorithm == "reference" else Blocks(args.bc, args.bc)

    def output(attention_fn):
        module = module_with(nnx, attention_fn, args.features, args.seed)
        return np.asarray(module(x, is_causal=True))

    def fa_jax_fn(policy):
        return fnn.flax_attention_fn(policy=policy, blocks=blocks, algorithm=args.algorithm)

    golden_out = output(fa_jax_fn(golden()))
    scale = np.abs(golden_out).max()
    print(
        f"nnx.MultiHeadAttention, B=2 T={args.seq} features={args.features}, causal; "
        f"fa_jax attention {args.algorithm}"
        + ("" if blocks is None else f" (Bc={args.bc})")
        + "; deviation from fa_jax under golden()"
    )
    print(f"{'attention':<34}{'max|Δout|':>11}{'rel':>10}")
    runs = [("flax default (jax.nn, float64)", None)]
    runs += [(f"fa_jax {pol.name}", fa_jax_fn(pol)) for pol in (fa2_kernel(BF16), torch_math(BF16))]
    for label, fn in runs:
        dev = np.abs(output(fn) - golden_out).max()
        print(f"{label:<34}{dev:11.3e}{dev / scale:10.2e}")
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
