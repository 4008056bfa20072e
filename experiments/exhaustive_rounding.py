"""Every float32 input (all 2**32 bit patterns) rounded to bfloat16 and float16 by
fa_jax.round_to, compared with ml_dtypes' cast bit for bit.

NaNs count as equal when both are NaN with the same sign: round_to returns a
quiet NaN and does not keep payloads (numpy's float16 cast keeps signalling
payloads; that difference is counted separately and printed).

    python experiments/exhaustive_rounding.py [--formats bf16 fp16] [--chunk-log2 24]

Exits non-zero on any mismatch.  Run times: see docs/performance.md; results:
docs/fidelity.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from fa_jax import get_format, round_to


def check(fmt, chunk_log2: int) -> tuple[int, int]:
    """(value mismatches, NaN-payload-only differences) over all 2**32 inputs."""
    chunk = 1 << chunk_log2
    rounder = jax.jit(lambda x: round_to(x, fmt))
    mismatches = payload_only = 0
    for start in range(0, 1 << 32, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        got = np.asarray(rounder(x)).view(np.uint32)
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(fmt.dtype).astype(np.float32).view(np.uint32)
        differ = got != want
        if differ.any():
            nan_got = (got & 0x7FFFFFFF) > 0x7F800000
            nan_want = (want & 0x7FFFFFFF) > 0x7F800000
            nan_same_sign = nan_got & nan_want & ((got >> 31) == (want >> 31))
            payload_only += int((differ & nan_same_sign).sum())
            bad = differ & ~nan_same_sign
            if bad.any():
                i = np.flatnonzero(bad)[:3]
                print(
                    f"  {fmt.name}: mismatch at inputs {[hex(v) for v in x.view(np.uint32)[i]]}: "
                    f"want {[hex(v) for v in want[i]]} got {[hex(v) for v in got[i]]}"
                )
            mismatches += int(bad.sum())
    return mismatches, payload_only


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp16"])
    p.add_argument("--chunk-log2", type=int, default=24)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    total = 0
    for name in args.formats:
        fmt = get_format(name)
        t0 = time.perf_counter()
        bad, payload = check(fmt, args.chunk_log2)
        total += bad
        print(
            f"{fmt.name:>10}: {bad} mismatches of 2**32 float32 inputs "
            f"({payload} NaN-payload-only differences), {time.perf_counter() - t0:.0f} s"
        )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
