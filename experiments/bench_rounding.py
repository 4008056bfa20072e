"""Throughput of fa_jax.round_to beside a plain XLA elementwise op, XLA's own
reduce_precision, and a numpy + ml_dtypes astype round trip, all on the same
float32 array in one run.  Prints elements/second and ratios.

    python experiments/bench_rounding.py [--log2n 24] [--repeats 20] [--formats bf16 fp16 e4m3fn]

Target: round_to at >= 0.5x the plain XLA op's throughput.  Results: see
docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import get_format, round_to


def rate(fn, x, repeats: int) -> float:
    """Best-of-`repeats` elements per second (first call compiles and is discarded)."""
    jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        best = min(best, time.perf_counter() - t0)
    return x.size / best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log2n", type=int, default=24)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp16", "e4m3fn"])
    args = p.parse_args(argv)
    n = 1 << args.log2n
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    x = jnp.asarray(x_np)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), n = 2**{args.log2n} float32")

    plain = rate(jax.jit(lambda v: v * 1.5 + 0.25), x, args.repeats)
    print(f"{'plain XLA op (x*1.5+0.25)':<34} {plain:10.3e} elem/s   1.00x")
    for name in args.formats:
        fmt = get_format(name)
        ours = rate(jax.jit(lambda v, f=fmt: round_to(v, f)), x, args.repeats)
        rows = [(f"round_to {fmt.name}", ours)]
        if fmt.has_inf:  # reduce_precision cannot express fn/fnuz/finite formats
            rp = jax.jit(lambda v, f=fmt: jax.lax.reduce_precision(v, f.exp_bits, f.man_bits))
            rows.append((f"  lax.reduce_precision {fmt.name}", rate(rp, x, args.repeats)))
        host = lambda v, d=fmt.dtype: v.astype(d).astype(np.float32)  # noqa: E731
        rows.append(
            (f"  numpy+ml_dtypes astype {fmt.name}", rate(host, x_np, max(3, args.repeats // 4)))
        )
        for label, r in rows:
            print(f"{label:<34} {r:10.3e} elem/s   {r / plain:.2f}x plain")
        print(f"{'':<34} round_to / numpy+ml_dtypes = {ours / rows[-1][1]:.1f}x")


if __name__ == "__main__":
    main()
