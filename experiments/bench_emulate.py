"""Cold and warm time of one kernel model's emulation (``fa_jax.kernels.emulate``).

    python experiments/bench_emulate.py KERNEL FORMAT B H N D [--causal]

Runs in this fresh process with JAX's persistent compilation cache pointed at an
empty temporary folder (every program compiles): the first call on seed-0
inputs is "cold", a second call of the same shape on seed-1 inputs "warm".
Prints, per call, the wall-clock seconds, this process's CPU seconds (all
threads; less sensitive to other jobs on a shared machine) and the split into
JAX's tracing, XLA's compiling and the rest (running the programs, a model's
probes of the real kernel), from :class:`fa_jax.studies.profile.CallProfile`.
Figures: docs/performance.md, "Kernel emulation speed".
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax

from fa_jax import kernels
from fa_jax.formats import get_format
from fa_jax.kernels.registry import timed_calls
from fa_jax.studies.profile import CallProfile
from fa_jax.studies.validation import Shape, validation_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("kernel")
    parser.add_argument("format")
    for dim in ("B", "H", "N", "D"):
        parser.add_argument(dim, type=int)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="fa_jax_bench_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    fmt = get_format(args.format)
    b, h, n, d = args.B, args.H, args.N, args.D
    shape = Shape(batch=b, heads=h, n=n, d=d)
    profile = CallProfile()
    with timed_calls(profile.call):
        for label, seed in (("cold", 0), ("warm", 1)):
            q, k, v = validation_inputs(fmt, shape, seed)
            wall, cpu = time.perf_counter(), time.process_time()
            with profile.call(label):
                kernels.emulate(args.kernel, q, k, v, fmt=fmt, causal=args.causal)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"{args.kernel} {fmt.name} ({b},{h},{n},{d}) causal={args.causal} {label}: "
                f"{wall:.1f} s wall, {cpu:.1f} s CPU",
                flush=True,
            )
    print(profile.table())


if __name__ == "__main__":
    main()
