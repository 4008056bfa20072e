"""fa_jax's sweep engine beside a plain numpy + ml_dtypes per-configuration loop.

Times the same grid two ways, in one run:

(a) ``fa_jax.studies.sweep.run_sweep(Grid(...), <fresh temp dir>, quiet=True)``: flash
    (``flash_attention``), baseline (``reference_attention`` under the same
    policy) and golden (``reference_attention`` under ``golden()``) for every
    configuration, and the four metrics of the three comparisons, written to a
    CSV.  Timed twice: *cold*, in this process with an empty compilation cache
    (every program traced and compiled), and *warm*, in a fresh process that
    finds the cache the cold run filled (fresh output folder).  Both exclude
    only ``import fa_jax`` (printed separately).

(b) The obvious numpy emulation a researcher would write without fa_jax: a
    Python loop over configurations; every op result computed in numpy float32
    (float64 for golden) and rounded to the format with
    ``.astype(<ml_dtypes/numpy dtype>).astype(np.float32)``.  paper_uniform
    policy (every stage in the format):

    * flash (FA2): loop over KV blocks of ``Bc`` columns, running max ``m``,
      running sum ``l``, unnormalised accumulator ``o``, rescale by
      ``alpha = exp(m_old - m_new)``, divide by ``l`` at the end;
    * baseline: the N x N scores materialised, safe softmax, P @ V;
    * golden: the same materialised attention in float64 with no rounding;
    * max/mean/std abs diff and RMSE (float64 numpy) for flash_vs_golden,
      baseline_vs_golden and flash_vs_baseline.

    Inputs are the sweep's own (``fa_jax.inputs.make_inputs``, same seeds); both
    sides draw them inside their timed region (the sweep internally, the loop
    per (format, seq_len, seed)).

    To do no more work than the sweep, the loop computes golden and baseline
    once per (format, seq_len, seed) and reuses them for every block
    configuration, as the sweep does (``--numpy-recompute`` recomputes them per
    configuration, the fully naive loop).  All query rows are processed at once
    (no Python loop over Br row tiles: FA2 row tiles are independent, and the
    sweep does not tile rows either), which is generous to numpy.  Results are
    not bit-identical to fa_jax (numpy float32 matmuls, float32 -> format double
    rounding), but the work per configuration is the same; a short agreement
    check against the sweep's CSV is printed.

Grids (``--full`` is very expensive on a small CPU)::

    default: formats bf16, fp16; seq_lens 128..1024; blocks 32x64, 64x32,
             64x128; seeds 0, 1, 2; d = 64  (72 configurations)
    --full:  formats bf16, fp16, float8_e5m2, float8_e4m3fn; seq_lens
             128..16384; blocks 32x64, 64x32, 64x128, 128x64, 32x128, 128x32;
             seeds 0, 1, 2; d = 64  (576 configurations)

``--floor`` times the same sweep once more (cold in a fresh process, then
warm in another) with the emulated ops replaced by plain float64 arithmetic
(no rounding, no error-free transforms, plain sums): the programs' structure
and float64 arithmetic without any of the emulation, a lower bound for an
exact float64 emulation of this grid (its numbers are not the emulation's, so
no agreement is checked).

``--max-numpy-configs K`` times the numpy loop on a subset of about K
configurations, stratified by sequence length, and extrapolates linearly (per
sequence length: mean shared golden+baseline time x number of (format, seed)
units, plus mean flash+metrics time x number of configurations); the output
says so.

    python experiments/bench_sweep.py
    python experiments/bench_sweep.py --full --max-numpy-configs 48
    python experiments/bench_sweep.py --floor

Goals on a 2-core CPU: cold at least as fast as the numpy loop, warm at least
3x faster (on a GPU: 30x).  Results: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import subprocess
import sys
import tempfile
import time

_t_import = time.perf_counter()
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from fa_jax import Blocks, make_inputs  # noqa: E402
from fa_jax.studies.options import study_options  # noqa: E402
from fa_jax.studies.profile import Profile  # noqa: E402
from fa_jax.studies.sweep import COMPARISONS, METRICS, Grid, run_sweep  # noqa: E402

_t_import = time.perf_counter() - _t_import

DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}
DEFAULT = dict(
    formats=("bfloat16", "float16"),
    seq_lens=(128, 256, 512, 1024),
    blocks=((32, 64), (64, 32), (64, 128)),
)
FULL = dict(
    formats=("bfloat16", "float16", "float8_e5m2", "float8_e4m3fn"),
    seq_lens=tuple(2**i for i in range(7, 15)),
    blocks=((32, 64), (64, 32), (64, 128), (128, 64), (32, 128), (128, 32)),
)


def grid_of(spec, *, batch: int = 1, heads: int = 1) -> Grid:
    """The bench's grid for a spec (DEFAULT or FULL): paper_uniform, fa2, seeds 0-2, d = 64."""
    return Grid(
        formats=spec["formats"],
        seq_lens=spec["seq_lens"],
        blocks=tuple(Blocks(br, bc) for br, bc in spec["blocks"]),
        variants=("fa2",),
        policies=("paper_uniform",),
        seeds=(0, 1, 2),
        batch=batch,
        heads=heads,
        d=64,
    )


def timed_sweep(grid: Grid, out: pathlib.Path, cache: pathlib.Path) -> tuple[float, Profile]:
    """Seconds of run_sweep(grid, out) with the compilation cache in ``cache``."""
    profile = Profile()
    t0 = time.perf_counter()
    with study_options(cache=cache, profile=profile):
        run_sweep(grid, out, quiet=True)
    return time.perf_counter() - t0, profile


def without_rounding() -> None:
    """This process's emulated ops replaced by plain float64 arithmetic (``--floor``):
    every rounding, error-free transform and ordered sum gone, the programs'
    structure (loops, masks, dots, padding) kept."""
    import fa_jax.attention_calls
    import fa_jax.ops as ops

    def identity(x, fmt, mode="nearest_even", *, key=None):
        return x

    def plain_sum(x, fmt, *, axis=-1, accumulation=None, initial=None):
        total = jnp.sum(x, axis=axis)
        return total if initial is None else total + initial

    ops.round_to = fa_jax.attention_calls.round_to = identity
    ops.add = lambda a, b, fmt: jnp.asarray(a) + b
    ops.sub = lambda a, b, fmt: jnp.asarray(a) - b
    ops.mul = lambda a, b, fmt: jnp.asarray(a) * b
    ops.div = lambda a, b, fmt: jnp.asarray(a) / b
    ops.fma = lambda a, b, c, fmt: jnp.asarray(a) * b + c
    ops.sum = plain_sum


def warm_in_fresh_process(
    args, cache: pathlib.Path, out: pathlib.Path, *, floor: bool = False
) -> float:
    """The sweep's seconds in a new Python process that finds ``cache`` filled, or
    fills it (the import of fa_jax is not counted, as in this process); ``floor``:
    without rounding (:func:`without_rounding`)."""
    cmd = [sys.executable, __file__, "--warm-run", str(cache), str(out)]
    cmd += ["--full"] if args.full else []
    cmd += ["--floor"] if floor else []
    cmd += ["--batch", str(args.batch), "--heads", str(args.heads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


# -- the numpy + ml_dtypes peer ------------------------------------------------------


def rounder(dtype):
    def c(x):
        return np.asarray(x, np.float32).astype(dtype).astype(np.float32)

    return c


def np_golden(q, k, v, scale):
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    return p @ v


def np_baseline(q, k, v, scale, c):
    s = c(c(q @ np.swapaxes(k, -1, -2)) * scale)
    m = c(s.max(-1, keepdims=True))
    e = c(np.exp(c(s - m)))
    l = c(e.sum(-1, keepdims=True, dtype=np.float64))
    p = c(e / l)
    return c(p @ v)


def np_flash_fa2(q, k, v, scale, c, bc):
    mk = k.shape[-2]
    m = np.full(q.shape[:-1], -np.inf, np.float32)
    l = np.zeros(q.shape[:-1], np.float32)
    o = np.zeros((*q.shape[:-1], v.shape[-1]), np.float32)
    for j0 in range(0, mk, bc):
        kj, vj = k[..., j0 : j0 + bc, :], v[..., j0 : j0 + bc, :]
        s = c(c(q @ np.swapaxes(kj, -1, -2)) * scale)
        m_new = c(np.maximum(m, s.max(-1)))
        # alpha = exp(m_old - m_new); 0 on the first block (m_old = -inf, which
        # formats without infinities cannot hold)
        alpha = c(np.exp(c(m - m_new))) if j0 else np.zeros_like(m)
        e = c(np.exp(c(s - m_new[..., None])))
        l = c(c(l * alpha) + c(e.sum(-1, dtype=np.float64)))
        pv = c(c(e) @ vj)
        o = c(c(o * alpha[..., None]) + pv)
        m = m_new
    return c(o / l[..., None])


def np_metrics(a, b):
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return (float(d.max()), float(d.mean()), float(d.std()), float(np.sqrt(np.mean(d * d))))


def numpy_configs(grid: Grid):
    """(format, seq_len, seed, label, Blocks), grouped so that each (format,
    seq_len, seed) unit is contiguous."""
    out = []
    for f in grid.resolved_formats():
        for n in grid.seq_lens:
            for s in grid.seeds:
                for label, b in grid.resolved_blocks():
                    out.append((f.name, n, s, label, b))
    return out


def run_numpy(grid: Grid, configs, *, recompute: bool):
    """Run ``configs``; returns (results dict, per-unit shared times, per-config times)."""
    results = {}
    shared_t: dict = {}  # (fmt, n, seed) -> golden+baseline+inputs seconds
    flash_t: dict = {}  # config -> flash+metrics seconds (+ shared if recompute)
    cache = {}
    for fname, n, seed, label, b in configs:
        unit = (fname, n, seed)
        c = rounder(DTYPES[fname])
        if recompute or unit not in cache:
            t0 = time.perf_counter()
            q, k, v = make_inputs(
                seed,
                n,
                batch=grid.batch,
                heads=grid.heads,
                d=grid.d,
                distribution=grid.distribution,
            )
            q64, k64, v64 = (t.astype(DTYPES[fname]).astype(np.float64) for t in (q, k, v))
            q, k, v = (t.astype(np.float32) for t in (q64, k64, v64))
            scale = np.float32(c(np.float32(1.0 / math.sqrt(grid.d))))
            gold = np_golden(q64, k64, v64, 1.0 / math.sqrt(grid.d))
            base = np_baseline(q, k, v, scale, c)
            cache = {unit: (q, k, v, scale, gold, base)}  # one unit alive at a time
            if not recompute:
                shared_t[unit] = time.perf_counter() - t0
            t_shared = time.perf_counter() - t0
        else:
            t_shared = 0.0
        t0 = time.perf_counter()
        q, k, v, scale, gold, base = cache[unit]
        flash = np_flash_fa2(q, k, v, scale, c, b.bc)
        outs = {"flash": flash, "baseline": base, "golden": gold}
        for comp in COMPARISONS:
            a, r = comp.split("_vs_")
            for m, val in zip(METRICS, np_metrics(outs[a], outs[r])):
                results[(fname, n, seed, label, comp, m)] = val
        flash_t[(fname, n, seed, label)] = (
            time.perf_counter() - t0 + (t_shared if recompute else 0.0)
        )
    return results, shared_t, flash_t


def pick_subset(configs, k: int):
    """About k configurations, stratified by seq_len, whole (format, seed) units first."""
    by_n: dict = {}
    for cfg in configs:
        by_n.setdefault(cfg[1], []).append(cfg)
    per_n = max(1, math.ceil(k / len(by_n)))
    return [cfg for n in by_n for cfg in by_n[n][:per_n]]


def extrapolate(configs, shared_t, flash_t, recompute: bool) -> float:
    total = 0.0
    for n in sorted({cfg[1] for cfg in configs}):
        cfgs = [cfg for cfg in configs if cfg[1] == n]
        units = {cfg[:3] for cfg in cfgs}
        ft = [t for key, t in flash_t.items() if key[1] == n]
        total += np.mean(ft) * len(cfgs)
        if not recompute:
            st = [t for key, t in shared_t.items() if key[1] == n]
            total += np.mean(st) * len(units)
    return float(total)


# -- main -------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the full 4x8x6x3 grid")
    ap.add_argument(
        "--max-numpy-configs",
        type=int,
        default=None,
        metavar="K",
        help="time the numpy loop on ~K configurations (stratified by seq_len) "
        "and extrapolate linearly",
    )
    ap.add_argument(
        "--numpy-recompute",
        action="store_true",
        help="numpy loop recomputes golden and baseline per configuration",
    )
    ap.add_argument("--skip-sweep", action="store_true", help="time the numpy loop only")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the sweep in plain float64 arithmetic (no emulation): a floor",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--warm-run", nargs=2, metavar=("CACHE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    spec = FULL if args.full else DEFAULT
    grid = grid_of(spec, batch=args.batch, heads=args.heads)
    if args.warm_run:  # the child of warm_in_fresh_process: print the seconds only
        cache, out = (pathlib.Path(p) for p in args.warm_run)
        if args.floor:
            without_rounding()
        print(timed_sweep(grid, out, cache)[0])
        return 0
    configs = numpy_configs(grid)
    print(
        f"grid: {'full' if args.full else 'default (reduced)'}; formats "
        f"{list(spec['formats'])}; seq_lens {list(grid.seq_lens)}; blocks "
        f"{[lab for lab, _ in grid.resolved_blocks()]}; seeds {list(grid.seeds)}; "
        f"batch {grid.batch}, heads {grid.heads}, d {grid.d}; paper_uniform, fa2; "
        f"{len(configs)} configurations"
    )
    print(f"import numpy, ml_dtypes, fa_jax (jax): {_t_import:.2f} s (not in either time)")

    t_sweep = t_warm = None
    csv_path = None
    tmp = tempfile.TemporaryDirectory(prefix="bench_sweep_")
    root = pathlib.Path(tmp.name)
    if not args.skip_sweep:
        t_sweep, profile = timed_sweep(grid, root / "cold", root / "cache")
        csv_path = root / "cold" / "results.csv"
        prepare = sum(p.prepare_s for p in profile.programs.values())
        print(
            f"fa_jax sweep, cold (empty compilation cache, fresh out_dir): {t_sweep:.2f} s, "
            f"of which {prepare:.2f} s tracing and compiling {len(profile.programs)} programs "
            "(summed over compile threads)"
        )
        t_warm = warm_in_fresh_process(args, root / "cache", root / "warm")
        print(f"fa_jax sweep, warm (fresh process, cache kept, fresh out_dir): {t_warm:.2f} s")
    floor = None
    if args.floor and not args.skip_sweep:
        floor = [
            warm_in_fresh_process(args, root / "floor-cache", root / f"floor-{run}", floor=True)
            for run in ("cold", "warm")
        ]
        print(
            f"the same sweep in plain float64 (a floor), fresh processes: cold {floor[0]:.2f} s, "
            f"warm {floor[1]:.2f} s"
        )

    if args.max_numpy_configs is not None and args.max_numpy_configs < len(configs):
        subset = pick_subset(configs, args.max_numpy_configs)
    else:
        subset = configs
    t0 = time.perf_counter()
    results, shared_t, flash_t = run_numpy(grid, subset, recompute=args.numpy_recompute)
    t_timed = time.perf_counter() - t0
    mode = (
        "golden+baseline recomputed per configuration"
        if args.numpy_recompute
        else "golden+baseline once per (format, seq_len, seed), as the sweep"
    )
    if subset is configs:
        t_np = t_timed
        print(
            f"numpy+ml_dtypes loop ({mode}): {t_np:.2f} s, measured on all "
            f"{len(configs)} configurations"
        )
        np_label = f"{t_np:.2f} s"
    else:
        t_np = extrapolate(configs, shared_t, flash_t, args.numpy_recompute)
        print(
            f"numpy+ml_dtypes loop ({mode}): {t_timed:.2f} s measured on {len(subset)} of "
            f"{len(configs)} configurations ({len(subset) // len(grid.seq_lens)} per seq_len); "
            f"EXTRAPOLATED linearly per configuration (per seq_len) to all: {t_np:.2f} s"
        )
        np_label = f"{t_np:.2f} s (extrapolated from {len(subset)} configs)"

    if csv_path is not None:
        # agreement check: same metrics, different (non-bit-exact) arithmetic
        ratios = {comp: [] for comp in COMPARISONS}
        with open(csv_path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["metric"] != "rmse":
                    continue
                key = (
                    row["format"],
                    int(row["seq_len"]),
                    int(row["seed"]),
                    row["blocks"],
                    row["comparison"],
                    row["metric"],
                )
                if key in results and float(row["value"]) > 0:
                    ratios[row["comparison"]].append(results[key] / float(row["value"]))
        parts = [
            f"{comp} median {np.median(r):.3f} (range {np.min(r):.3f}..{np.max(r):.3f})"
            for comp, r in ratios.items()
            if r
        ]
        print(
            "agreement, numpy rmse / fa_jax rmse over the numpy-computed configurations: "
            + "; ".join(parts)
        )
        print(
            f"numpy+ml_dtypes loop: {np_label}; fa_jax sweep cold {t_sweep:.2f} s, "
            f"warm {t_warm:.2f} s; speedup (numpy / sweep): cold {t_np / t_sweep:.2f} x "
            f"(goal >= 1 x), warm {t_np / t_warm:.2f} x (goal >= 3 x)"
        )
        if floor is not None:
            print(
                f"plain float64, no emulation (floor): cold {t_np / floor[0]:.2f} x, "
                f"warm {t_np / floor[1]:.2f} x"
            )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
