"""One sweep on one process with every core against the same sweep on P processes
with one core each (``jax.distributed`` on 127.0.0.1), on the grid of
experiments/bench_sweep.py (72 configurations).

Runs ``python -m fa_jax sweep`` on that grid once, into a fresh output folder
(``--out``, removed first), with the compilation cache in ``--cache`` (kept:
the first run fills it, later runs are warm; ``--cold`` empties it first).
``--processes 1`` runs one process pinned to the first ``--cores`` cores
(``taskset``); ``--processes P`` runs P processes, process i pinned to core i,
joined through a coordinator on a free loopback port, and waits for all of them.
Each process's own seconds (start to exit) are printed.  Time the whole command
from outside, e.g. with ``/usr/bin/time -v`` or a benchmark harness, runs
interleaved::

    python experiments/bench_processes.py --processes 1 --cores 2 --out /tmp/p1 --cache /tmp/c1
    python experiments/bench_processes.py --processes 2 --out /tmp/p2 --cache /tmp/c2

``--check FILE`` compares the merged ``results.csv`` with FILE byte for byte.
Results: docs/performance.md (Several processes on one machine).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

GRID = [
    "--formats", "bf16", "fp16",
    "--seq-lens", "128", "256", "512", "1024",
    "--blocks", "32x64", "64x32", "64x128",
    "--seeds", "0", "1", "2",
    "--variants", "fa2",
    "--policies", "paper_uniform",
    "--d", "64",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--cores", type=int, default=None, help="one process: its cores (all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--cold", action="store_true", help="empty the cache first")
    ap.add_argument("--check", default=None, help="a results.csv the run must equal")
    args = ap.parse_args(argv)
    out, cache = pathlib.Path(args.out), pathlib.Path(args.cache)
    shutil.rmtree(out, ignore_errors=True)
    if args.cold:
        shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "FA_JAX_CACHE_DIR": str(cache)}
    base = [sys.executable, "-m", "fa_jax", "sweep", *GRID, "--quiet", "--out", str(out)]
    cores = sorted(os.sched_getaffinity(0))
    if args.processes == 1:
        pins = [",".join(map(str, cores[: args.cores or len(cores)]))]
        cmds = [base]
    else:
        if args.processes > len(cores):
            raise ValueError(f"--processes: expected at most {len(cores)}, got {args.processes}")
        pins = [str(c) for c in cores[: args.processes]]
        coordinator = f"127.0.0.1:{free_port()}"
        join = ["--coordinator", coordinator, "--num-processes", str(args.processes)]
        cmds = [[*base, *join, "--process-id", str(i)] for i in range(args.processes)]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(["taskset", "-c", pin, *cmd], env=env) for pin, cmd in zip(pins, cmds)
    ]
    failed = 0
    for i, p in enumerate(procs):
        failed |= p.wait()
        print(f"process {i}: {time.perf_counter() - start:.2f} s (status {p.returncode})")
    if args.check is not None:
        same = (out / "results.csv").read_bytes() == pathlib.Path(args.check).read_bytes()
        print("results.csv:", "identical" if same else "DIFFERS", "to", args.check)
        failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
