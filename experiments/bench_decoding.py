"""Split-KV decoding speed: one query against a long key axis, S = 1 beside S splits.

Times ``flash_attention`` under ``fa2_kernel(BF16)`` for one query over M keys
(d = 128, key blocks Bc = 128, FlashAttention-2's split-KV block for d = 128)
with ``num_splits`` 1 (one pass over the key blocks, in order) and S (the splits
side by side, then combined: :mod:`fa_jax.split_kv`).  Prints, per S, the cold
time (first call: tracing and compiling included) and the warm time (best of
the repeats), and the largest difference between the two outputs in units of
BF16's spacing at the output.

    python experiments/bench_decoding.py                  # M = 131072, S = 16
    python experiments/bench_decoding.py --m 32768 --splits 4 --carrier float32

Target: warm < 2 s for M = 131072, S = 16.  Results: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from fa_jax import BF16, Blocks, fa2_kernel, flash_attention


def timed(fn, *args, repeats: int) -> tuple[float, float, object]:
    """(cold seconds, best warm seconds, the output)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    cold = time.perf_counter() - t0
    warm = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        warm = min(warm, time.perf_counter() - t0)
    return cold, warm, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=131072, help="keys")
    p.add_argument("--d", type=int, default=128, help="head dimension")
    p.add_argument("--bc", type=int, default=128, help="key block Bc")
    p.add_argument("--splits", type=int, default=16, help="num_splits S to set beside S = 1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--carrier",
        choices=("float64", "float32"),
        default="float64",
        help="the emulation's carrier (float64 enables jax_enable_x64)",
    )
    args = p.parse_args(argv)
    if args.carrier == "float64":
        jax.config.update("jax_enable_x64", True)
    policy = fa2_kernel(BF16).replace(carrier=args.carrier)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, args.d))
    k = rng.standard_normal((1, args.m, args.d))
    v = rng.standard_normal((1, args.m, args.d))
    blocks = Blocks(1, args.bc)
    print(
        f"decoding: 1 query, M = {args.m}, d = {args.d}, Bc = {args.bc}, "
        f"{policy.name}, carrier {args.carrier}, {jax.devices()[0].platform}"
    )
    print(f"{'S':>4} {'cold s':>8} {'warm s':>8}")
    outs = {}
    for s in (1, args.splits):

        def run(q, k, v, s=s):
            return flash_attention(q, k, v, policy, blocks, num_splits=s)

        cold, warm, outs[s] = timed(run, q, k, v, repeats=args.repeats)
        print(f"{s:>4} {cold:8.2f} {warm:8.2f}")
    o1, o_s = (np.asarray(outs[s][0], np.float64) for s in (1, args.splits))
    spacing = np.spacing(np.abs(o1).astype(np.float32)) * 2.0 ** (23 - BF16.man_bits)
    print(
        f"max |O(S={args.splits}) - O(S=1)| = {np.max(np.abs(o_s - o1) / spacing):.0f} BF16 "
        f"spacings; {np.mean(o_s == o1):.1%} of the outputs identical"
    )


if __name__ == "__main__":
    main()
