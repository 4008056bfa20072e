"""The float32 carrier beside the float64 one, in one run: the same bits, how fast.

Times, on both carriers, each emulated op that has its own float32 path
(``exp``, ``sum``, ``matmul`` with the "exact" and "sequential" models,
``log_sum``) and attention under ``fa2_kernel(BF16)`` (reference and flash,
forward), jitted: the first call (trace + compile + run) and the best warm
call.  Prints float32 / float64 ratios (below 1: the float32 carrier is
faster) and checks that both carriers gave the same bits.

    python experiments/bench_carrier.py                  # attention at BH=4, N=256, d=64
    python experiments/bench_carrier.py --bh 8 --n 512

Goal: the float32 carrier no slower than float64.  Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from fa_jax import BF16, FP32, Blocks, fa2_kernel, flash_attention, ops, reference_attention


def timed(fn, args, repeats: int):
    """(first call seconds, best warm seconds, result) of jit(fn)(*args)."""
    f = jax.jit(fn)
    start = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - start)
    return first, best, out


def cases(bh: int, n: int, d: int):
    """name -> (fn of carrier arrays, float32 values of its arguments)."""
    rng = np.random.default_rng(0)

    def values(*shape, fmt=BF16):
        return np.asarray(ops.cast(ops.carrier(rng.standard_normal(shape)), fmt)).astype("f4")

    def attention(fn, carrier):
        policy = fa2_kernel(BF16).replace(carrier=carrier)
        return lambda q, k, v: fn(q, k, v, policy)

    qkv = [values(bh, n, d) for _ in range(3)]
    flash = lambda q, k, v, p: flash_attention(q, k, v, p, Blocks(64, 64))[0]  # noqa: E731
    return {
        "exp (2^20 values)": (lambda c: lambda x: ops.exp(x, BF16), [-abs(values(2**20))]),
        "sum exact (256 x 1024)": (
            lambda c: lambda x: ops.sum(x, FP32),
            [values(256, 1024, fmt=FP32)],
        ),
        "sum sequential (256 x 1024)": (
            lambda c: lambda x: ops.sum(x, FP32, accumulation="sequential"),
            [values(256, 1024, fmt=FP32)],
        ),
        "matmul exact (8x128x64 @ 8x64x128)": (
            lambda c: lambda a, b: ops.matmul(a, b, FP32),
            [values(8, 128, 64), values(8, 64, 128)],
        ),
        "matmul sequential (same)": (
            lambda c: lambda a, b: ops.matmul(a, b, FP32, accumulation="sequential"),
            [values(8, 128, 64), values(8, 64, 128)],
        ),
        "log_sum (2^16 rows)": (
            lambda c: lambda m, l: ops.log_sum(m, l, FP32),
            [values(2**16, fmt=FP32), 1 + abs(values(2**16, fmt=FP32))],
        ),
        f"reference attention (BH={bh}, N={n}, d={d})": (
            lambda c: attention(lambda q, k, v, p: reference_attention(q, k, v, p), c),
            qkv,
        ),
        "flash attention fa2, Bc=64 (same)": (lambda c: attention(flash, c), qkv),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bh", type=int, default=4, help="batch x heads of attention")
    parser.add_argument("--n", type=int, default=256, help="sequence length of attention")
    parser.add_argument("--d", type=int, default=64, help="head dimension of attention")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # the float64 carrier beside the float32 one
    print(f"{'case':<44} {'f64 first':>9} {'f32 first':>9} {'f64 warm':>9} {'f32 warm':>9} ratio")
    for name, (make, values) in cases(args.bh, args.n, args.d).items():
        runs = {}
        for carrier, dtype in (("float64", np.float64), ("float32", np.float32)):
            carried = [ops.carrier(v, dtype) for v in values]
            runs[carrier] = timed(make(carrier), carried, args.repeats)
        (f64_first, f64_warm, a), (f32_first, f32_warm, b) = runs["float64"], runs["float32"]
        same = np.array_equal(np.asarray(a).astype("f4").view("u4"), np.asarray(b).view("u4"))
        print(
            f"{name:<44} {f64_first:9.3f} {f32_first:9.3f} {f64_warm:9.4f} {f32_warm:9.4f} "
            f"{f32_warm / f64_warm:5.2f}x{'' if same else '  BITS DIFFER'}"
        )


if __name__ == "__main__":
    main()
