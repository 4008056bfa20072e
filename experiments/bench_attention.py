"""Emulated flash attention beside native float32 attention in XLA, in one run.

Times ``flash_attention`` under ``fa2_kernel(BF16)`` with the "exact" and the
"sequential" accumulation models against a jitted float32 einsum-softmax
attention of the same shapes, and prints the ratios.  Then reports the peak
memory XLA assigns to ``flash_attention`` at a long sequence (its compiled
buffer assignment: arguments + outputs + temporaries), to show it does not
materialise the N x N score matrix.

    python experiments/bench_attention.py                     # BH=16, N=4096, d=64
    python experiments/bench_attention.py --n 1024 --seq-n 256 --long-n 65536

Targets: exact <= 1.5x native, sequential <= 10x native, memory < 1 GiB.
Results: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import BF16, Blocks, fa2_kernel, flash_attention


def native_attention(q, k, v):
    """Plain float32 attention in XLA: einsum, softmax, einsum."""
    scale = q.shape[-1] ** -0.5  # a Python float: weakly typed, float32 even under x64
    s = jnp.einsum("bqd,bkd->bqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    o = jnp.einsum(
        "bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v, precision=jax.lax.Precision.HIGHEST
    )
    assert o.dtype == jnp.float32, o.dtype
    return o


def best_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def inputs(bh, n, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((bh, n, d)), dtype) for _ in range(3))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bh", type=int, default=16, help="batch * heads")
    p.add_argument("--n", type=int, default=4096, help="sequence length for the exact model")
    p.add_argument(
        "--seq-n",
        type=int,
        default=None,
        help="sequence length for the sequential model (default: --n)",
    )
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--bc", type=int, default=128, help="key/value block size Bc")
    p.add_argument("--long-n", type=int, default=65536, help="sequence length for the memory check")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}); BH={args.bh}, d={args.d}, "
        f"Bc={args.bc}"
    )
    blocks = Blocks(64, args.bc)

    for model, n in (("exact", args.n), ("sequential", args.seq_n or args.n)):
        policy = fa2_kernel(BF16, accumulation=model)
        q32, k32, v32 = inputs(args.bh, n, args.d, jnp.float32)
        q, k, v = (x.astype(jnp.float64) for x in (q32, k32, v32))
        emulated = jax.jit(lambda q, k, v, pol=policy: flash_attention(q, k, v, pol, blocks)[0])
        t_emul = best_time(emulated, q, k, v, repeats=args.repeats)
        t_native = best_time(jax.jit(native_attention), q32, k32, v32, repeats=args.repeats)
        print(
            f"N={n:6d}  flash fa2_kernel(bf16) {model:<10} {t_emul:9.3f} s   native f32 "
            f"{t_native:8.3f} s   ratio {t_emul / t_native:7.2f}x"
        )

    n = args.long_n
    policy = fa2_kernel(BF16)
    spec = jax.ShapeDtypeStruct((1, n, args.d), jnp.float64)
    compiled = (
        jax.jit(lambda q, k, v: flash_attention(q, k, v, policy, blocks)[0])
        .lower(spec, spec, spec)
        .compile()
    )
    mem = compiled.memory_analysis()
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    scores = n * n * 8
    print(
        f"N={n} d={args.d}: XLA peak buffers {total / 2**20:.1f} MiB "
        f"(arguments {mem.argument_size_in_bytes / 2**20:.1f}, outputs "
        f"{mem.output_size_in_bytes / 2**20:.1f}, "
        f"temporaries {mem.temp_size_in_bytes / 2**20:.1f}); "
        f"a float64 N x N score matrix alone would be {scores / 2**30:.0f} GiB"
    )


if __name__ == "__main__":
    main()
