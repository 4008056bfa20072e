"""Split-KV decoding speed: one query against a long key axis, S = 1 beside S splits.

Times ``flash_attention`` under ``fa2_kernel(BF16)`` for one query over M keys
(d = 128, key blocks Bc = 128, FlashAttention-2's split-KV block for d = 128)
with ``num_splits`` 1 (one pass over the key blocks, in order) and S (the splits
side by side, then combined: :mod:`fa_jax.split_kv`).  Prints, per S, the cold
time (first call: tracing and compiling included) and the warm time (best of
the repeats), each output's largest deviation from the golden (float64) one,
and the share of outputs the two settings give identically.

    python experiments/bench_decoding.py                  # M = 131072, S = 16
    python experiments/bench_decoding.py --m 32768 --splits 4 --carrier float32

Target: warm < 2 s for M = 131072, S = 16.  Results: see docs/fidelity.md
(Split-KV decoding).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from fa_jax import BF16, Blocks, fa2_kernel, flash_attention, golden


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
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--m", type=int, default=131072, help="keys")
    p.add_argument("--d", type=int, default=128, help="head dimension")
    p.add_argument("--bc", type=int, default=128, help="key block Bc")
    p.add_argument("--splits", type=int, default=16, help="num_splits S to set beside S = 1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--carrier",
        choices=("float64", "float32"),
        default="float64",
        help="the emulation's carrier (the golden always runs in float64)",
    )
    args = p.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # for the golden
    policy = fa2_kernel(BF16).replace(carrier=args.carrier)
    rng = np.random.default_rng(0)
    # float32 values: a float32 carrier takes them as they are, float64 exactly
    q, k, v = (rng.standard_normal((1, n, args.d)).astype(np.float32) for n in (1, args.m, args.m))
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
    gold = flash_attention(q, k, v, golden(), blocks)[0]
    gold = np.asarray(gold, np.float64)
    scale = np.abs(gold).max()
    for s, (o, _) in outs.items():
        err = np.abs(np.asarray(o, np.float64) - gold).max()
        print(f"S = {s:>3}: max |O - O_golden| = {err:.3g} ({err / scale:.3g} of max |O_golden|)")
    same = np.mean(np.asarray(outs[1][0]) == np.asarray(outs[args.splits][0]))
    print(f"outputs identical between S = 1 and S = {args.splits}: {same:.1%}")


if __name__ == "__main__":
    main()
