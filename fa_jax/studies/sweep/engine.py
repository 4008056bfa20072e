"""Parameter sweeps: a :class:`Grid` of configurations -> tidy CSV of deviations.

A configuration is (policy preset, format, sequence length, blocks, variant,
seed).  For each one the sweep computes

* ``flash``    ``flash_attention`` under the policy,
* ``baseline`` ``reference_attention`` under the same policy,
* ``golden``   ``reference_attention`` under :func:`~fa_jax.presets.golden`,

all on the *same* inputs: Q, K, V drawn in float64 and rounded to the policy's
input format (every preset's ``inputs`` stage is the swept format), so golden
sees exactly the values the emulated runs see.  Rows of ``results.csv`` are
tidy: one per (configuration, comparison, metric), comparisons
``flash_vs_golden``, ``baseline_vs_golden``, ``flash_vs_baseline`` and metrics
``max_abs_diff``, ``mean_abs_diff``, ``std_abs_diff``, ``rmse`` (from
:mod:`fa_jax.metrics`); ``value`` is ``repr(float)``, so it round-trips exactly.

Inputs
------
For each (seed, seq_len) the inputs come from
``numpy.random.default_rng([seed, seq_len])`` (a SeedSequence of both), drawn
independently of every other length, in the order q, k, v, each of shape
``(batch, heads, seq_len, d)``:

``"normal"``    N(0, 1);
``"uniform"``   U(-1, 1);
``"outliers"``  N(0, 1) + N(0, 10²)·Bernoulli(0.001), FlashAttention-3 §4.3
                (per tensor: the normal part, then the Bernoulli mask, then
                the outlier values).

See :func:`make_inputs`.  The softmax scale is the default ``1/sqrt(d)``.

Execution strategy
------------------
Configurations are grouped by their *static signature*: policy preset, format
kind ``(subnormals, specials, overflow)`` (static pytree data of
:class:`~fa_jax.formats.Format`), variant and resolved :class:`Blocks`.  The
formats of one kind differ only in their pytree leaves (exp_bits, man_bits,
bias), so one jitted program vmaps over a flat batch axis of
(format × seq_len × seed) with the widths as traced integers.  Sequence lengths
are padded to the grid's largest and masked with ``q_lengths``/``kv_lengths``
(bitwise equal to unpadded runs; ``tests/test_sweep.py`` checks the sweep's
numbers against direct unpadded calls).  Three programs per signature family:

* golden per format kind (reused by every policy, variant and blocks),
* baseline per (policy, format kind) (reused by every variant and blocks),
* flash per (policy, format kind, variant, Bc): one *group*.  Tilings that
  differ only in Br share it: flash_attention processes every query row at
  once, so Br does not change its numbers (only Bc, the number of rescalings,
  does); ``tests/test_sweep.py`` checks each tiling against its own direct call.

Block configurations are grouped, one compiled program per Bc, rather than
vmapped over a masked tile layout (every Bc scanned as ceil(N / min Bc) tiles
of max Bc columns, the unused columns masked: one program, bitwise the same
numbers, but len(Bc) · ceil(N / min Bc) · max Bc columns of work per row
against len(Bc) · N).  ``experiments/bench_block_layout.py`` times both on
the same configurations (paper_uniform BF16, d=64, Bc 32/64/128, 3 seeds,
compiles included; this 2-core CPU, shared with other jobs while measured)::

    N       128    512   1024   2048   4096
    masked / grouping wall time
           0.49   0.51   1.07   1.33   1.96

The layout wins only while compiles dominate (N < ~1024, runs of ~1-3 s);
grouping wins where sweeps spend their time, and its cost grows with the work,
not with max Bc / min Bc.

Metrics are computed per configuration on the unpadded slice by calling the
public metric functions eagerly: fusing them under one ``jax.jit`` changed the
last bit of ``rmse`` in a test, and the CSV must be reproducible by direct calls.

Measured on this 2-core CPU (jax 0.10.2; paper_uniform, formats bf16 and fp16,
seeds (0, 1), d=64, fa2, blocks Br=Bc=32 and Br=32/Bc=64 — 2 groups, 12
configurations per group; wall time of a whole fresh-process sweep, import and
compiles included)::

    seq_lens (64, 128, 256):    padded  8.3 s   per-length 19.9 s
    seq_lens (128, 256, 512):   padded  8.1 s   per-length 19.3 s
    seq_lens (256, 512, 1024):  padded  9.1 s   per-length 21.3 s

Compilation dominates at these sizes: per-length runs compile golden, baseline
and flash once per length (3× the programs), while the extra work on padding
is small next to a compile.  But padding *everything* to the longest length
costs quadratically on wide ranges: in ``experiments/bench_sweep.py``'s grid
(N = 128..1024) it made the sweep 3× slower than a numpy loop.  The sweep
therefore pads within buckets of lengths no more than ``PAD_RATIO`` = 2 apart
(:func:`length_buckets`), one program per bucket; ``PAD_SEQ_LENS = False``
runs one program per length.

Memory: the baseline and golden programs materialise (N, N) float64 scores,
about 2.1 · N² · 8 bytes of XLA temporaries per configuration (measured with
``compiled.memory_analysis()``).  Each program therefore runs over its
configurations in equal pieces whose estimated working memory (3 · 8 · N² bytes
per configuration and head; 3 · 8 · N · (Bc + d) for flash) fits
``memory_budget`` (default :data:`MEMORY_BUDGET`, 4 GiB), padding the last
piece so every piece reuses one compile.  N = 16384 then runs one configuration
at a time instead of asking for 4 GiB per configuration at once.

Multi-device: the flat configuration axis is sharded over ``jax.devices()``
with a 1-D :class:`jax.sharding.Mesh` (axis ``"cfg"``) and
``NamedSharding(mesh, PartitionSpec("cfg"))``; it is padded (repeating the last
configuration) to a multiple of the device count.  Every configuration is
computed by one device, so results equal a single-device run bitwise.

Files in ``out_dir``: ``results.csv``, rewritten atomically (temp file in
``out_dir``, flush, ``os.fsync``, ``os.replace``) after every group, and
``metadata.json`` (versions, backend, devices, the grid, start time).  Resume:
configurations whose rows are all present in an existing ``results.csv`` are
skipped (rows of other configurations already in the file are kept; partial
configurations are recomputed), so re-running after an interruption completes
the file without duplicates.

``run_sweep`` enables ``jax_enable_x64`` while it runs (float64 carriers are
required) and restores the previous setting when it returns.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import json
import pathlib
import sys
import time

import jax
import numpy as np

from fa_jax import metrics
from fa_jax._x64 import float64_enabled
from fa_jax.inputs import make_inputs
from fa_jax.studies.results import atomic_write
from fa_jax.studies.sweep.grid import COLUMNS, COMPARISONS, KEY_COLUMNS, METRICS, Grid, row_key
from fa_jax.attention import (
    VARIANTS,
    Blocks,
    blocks_from_sram,
    flash_attention,
    reference_attention,
)
from fa_jax.formats import Format, custom, get_format
from fa_jax.presets import PRESETS, golden
from fa_jax.rounding import round_to

__all__ = ["MEMORY_BUDGET", "length_buckets", "run_sweep"]

PAD_SEQ_LENS = True  # module docstring: measured faster on the grids we run
PAD_RATIO = 2  # pad only within buckets whose longest length is <= 2x the shortest
MEMORY_BUDGET = 4 * 2**30  # bytes of working memory per compiled call (module docstring)


def length_buckets(lens, ratio=PAD_RATIO):
    """Sorted lengths split greedily into buckets with max <= ratio * min: one padded
    program per bucket.  Padding everything to the longest length made a length
    of 128 do 64x its work beside 1024 (bench_sweep.py); within a bucket the
    padded score work is at most ratio**2 times a configuration's own."""
    buckets: list[list[int]] = []
    for n in sorted(lens):
        if buckets and n <= ratio * buckets[-1][0]:
            buckets[-1].append(n)
        else:
            buckets.append([n])
    return [tuple(b) for b in buckets]


# -- compiled programs ----------------------------------------------------------

_Kind = tuple  # (subnormals, specials, overflow)


def _kind(f: Format) -> _Kind:
    return (f.subnormals, f.specials, f.overflow)


def _fmt(widths, kind: _Kind) -> Format:
    e, m, b = widths
    return Format("sweep", e, m, bias=b, subnormals=kind[0], specials=kind[1], overflow=kind[2])


@functools.partial(jax.jit, static_argnames=("kind", "causal"))
def _golden_program(q, k, v, widths, lengths, *, kind, causal):
    def one(q, k, v, w, n):
        f = _fmt(w, kind)
        q, k, v = (round_to(t, f) for t in (q, k, v))
        return reference_attention(q, k, v, golden(), causal=causal, q_lengths=n, kv_lengths=n)

    return jax.vmap(one)(q, k, v, widths, lengths)


@functools.partial(jax.jit, static_argnames=("preset", "kind", "causal"))
def _baseline_program(q, k, v, widths, lengths, *, preset, kind, causal):
    def one(q, k, v, w, n):
        pol = PRESETS[preset](_fmt(w, kind))
        return reference_attention(q, k, v, pol, causal=causal, q_lengths=n, kv_lengths=n)

    return jax.vmap(one)(q, k, v, widths, lengths)


@functools.partial(jax.jit, static_argnames=("preset", "kind", "variant", "blocks", "causal"))
def _flash_program(q, k, v, widths, lengths, *, preset, kind, variant, blocks, causal):
    def one(q, k, v, w, n):
        pol = PRESETS[preset](_fmt(w, kind))
        return flash_attention(q, k, v, pol, blocks, variant=variant, causal=causal,
                               q_lengths=n, kv_lengths=n)[0]

    return jax.vmap(one)(q, k, v, widths, lengths)


def _metric_values(a, b):
    """The public metric functions, called as a user would (not fused under one
    jit: fusing changes rmse's last bit), so direct calls reproduce the CSV."""
    return [getattr(metrics, m)(a, b) for m in METRICS]


# -- the batch of one format kind -----------------------------------------------


class _KindBatch:
    """The flat (format × seq_len × seed) axis of one format kind, its inputs
    (padded to the largest length, or one batch per length), and caches of golden
    and baseline outputs."""

    def __init__(self, grid: Grid, fmts, pad: bool, memory_budget: int):
        self.grid, self.fmts, self.memory_budget = grid, fmts, memory_budget
        lens = sorted(grid.seq_lens)
        self.chunks = length_buckets(lens, PAD_RATIO) if pad else [(n,) for n in lens]
        self._inputs = {}
        self._golden = {}
        self._baseline = {}

    def entries(self, chunk):
        return [(f, n, s) for f in self.fmts for n in chunk for s in self.grid.seeds]

    def inputs(self, chunk):
        if chunk not in self._inputs:
            g, entries = self.grid, self.entries(chunk)
            n_max = max(chunk)
            raw = {}
            for _, n, s in entries:
                if (s, n) not in raw:
                    qkv = make_inputs(s, n, batch=g.batch, heads=g.heads, d=g.d,
                                      distribution=g.distribution)
                    pad = [(0, 0), (0, 0), (0, n_max - n), (0, 0)]
                    raw[(s, n)] = [np.pad(t, pad) for t in qkv]
            q, k, v = (np.stack([raw[(s, n)][i] for _, n, s in entries]) for i in range(3))
            widths = tuple(np.array([getattr(f, a) for f, _, _ in entries], np.int32)
                           for a in ("exp_bits", "man_bits", "bias"))
            lengths = np.array([n for _, n, _ in entries], np.int32)
            self._inputs[chunk] = (q, k, v, widths, lengths)
        return self._inputs[chunk]

    def _per_config_bytes(self, chunk, tile_cols=None):
        """Estimated working memory of one configuration: the materialised
        (N, N) float64 scores and their exponentials (measured: about 2.1
        N² · 8 bytes of XLA temporaries; 3 allowed), or a flash tile's (N, Bc + d)."""
        g, n = self.grid, max(chunk)
        cols = n if tile_cols is None else tile_cols + g.d
        return 3 * 8 * g.batch * g.heads * n * cols

    def run(self, program, chunk, *, tile_cols=None, **static):
        """``program`` over the chunk's configurations, in pieces of equal size that
        fit ``self.memory_budget`` (one compile; the last piece is padded)."""
        args = self.inputs(chunk)
        total = len(args[-1])
        per = max(1, self.memory_budget // self._per_config_bytes(chunk, tile_cols))
        pieces = -(-total // min(per, total))
        size = -(-total // pieces)
        outs = []
        for start in range(0, total, size):
            piece = jax.tree_util.tree_map(lambda x, i=start: x[i:i + size], args)
            n = len(piece[-1])
            outs.append(_host(program(*_shard(piece, n, pad_to=size), **static))[:n])
        return np.concatenate(outs)

    def golden(self, chunk, kind):
        if chunk not in self._golden:
            self._golden[chunk] = self.run(_golden_program, chunk, kind=kind,
                                           causal=self.grid.causal)
        return self._golden[chunk]

    def baseline(self, chunk, preset, kind):
        key = (chunk, preset)
        if key not in self._baseline:
            self._baseline[key] = self.run(_baseline_program, chunk, preset=preset, kind=kind,
                                           causal=self.grid.causal)
        return self._baseline[key]


def _shard(args, n, *, pad_to=None):
    """Pad the leading (configuration) axis, repeating its last entry, to
    ``pad_to`` entries and then to a multiple of the device count, and shard it
    over a 1-D mesh (no sharding on one device)."""
    devices = jax.devices()
    extra = (pad_to or n) - n
    extra += -(n + extra) % len(devices)

    def pad(x):
        x = np.asarray(x)
        if extra:
            x = np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])
        return x

    args = jax.tree_util.tree_map(pad, args)
    if len(devices) == 1:
        return args
    mesh = jax.sharding.Mesh(np.array(devices), ("cfg",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cfg"))
    return jax.device_put(args, sharding)


def _host(x):
    return np.asarray(jax.device_get(x))


# -- files --------------------------------------------------------------------


def _write_csv(path, rows):
    def write(fh):
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)

    atomic_write(path, write)


def _read_existing(path: pathlib.Path):
    """Rows of complete configurations (as str dicts) and their keys."""
    if not path.exists():
        return [], set()
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    want = {(c, m) for c in COMPARISONS for m in METRICS}
    by_key: dict = {}
    for r in rows:
        by_key.setdefault(tuple(r[c] for c in KEY_COLUMNS), {})[(r["comparison"], r["metric"])] = r
    done = {k for k, got in by_key.items() if set(got) == want}
    kept = [r for r in rows if tuple(r[c] for c in KEY_COLUMNS) in done]
    return kept, done


def _metadata(grid: Grid) -> dict:
    import jaxlib
    import ml_dtypes

    import fa_jax

    devices = jax.devices()
    return {
        "fa_jax": fa_jax.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "ml_dtypes": ml_dtypes.__version__, "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind, "device_count": len(devices),
        "grid": grid.to_json(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


# -- the sweep -----------------------------------------------------------------


def run_sweep(grid: Grid, out_dir, *, quiet: bool = False,
              memory_budget: int = MEMORY_BUDGET) -> pathlib.Path:
    """Run every configuration of ``grid`` not already in ``out_dir/results.csv``
    (module docstring); returns the CSV's path.  ``memory_budget`` (bytes) bounds
    the working memory of one compiled call (module docstring)."""
    return _run(grid, out_dir, quiet=quiet, pad=PAD_SEQ_LENS, memory_budget=memory_budget)


def _run(grid: Grid, out_dir, *, quiet: bool, pad: bool,
         memory_budget: int = MEMORY_BUDGET) -> pathlib.Path:
    if not isinstance(grid, Grid):
        raise TypeError(f"run_sweep: expected a Grid, got {grid!r}")
    if not isinstance(memory_budget, int) or isinstance(memory_budget, bool) or memory_budget < 1:
        raise ValueError(f"run_sweep: memory_budget: expected a positive number of bytes, "
                         f"got {memory_budget!r}")
    with float64_enabled():
        return _sweep(grid, out_dir, quiet=quiet, pad=pad, memory_budget=memory_budget)


def _sweep(grid: Grid, out_dir, *, quiet: bool, pad: bool, memory_budget: int) -> pathlib.Path:
    start = time.monotonic()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    meta = _metadata(grid)
    atomic_write(out / "metadata.json", lambda fh: json.dump(meta, fh, indent=2))
    rows, done = _read_existing(csv_path)

    kinds: dict = {}
    for f in grid.resolved_formats():
        kinds.setdefault(_kind(f), []).append(f)
    by_bc: dict = {}  # Br does not change flash's numbers (module docstring): one run per Bc
    for label, b in grid.resolved_blocks():
        by_bc.setdefault(b.bc, []).append((label, b))
    groups = [(kind, preset, variant, bc) for kind in kinds for preset in grid.policies
              for variant in grid.variants for bc in by_bc]
    batches = {kind: _KindBatch(grid, fmts, pad, memory_budget) for kind, fmts in kinds.items()}
    progress = not quiet and sys.stderr.isatty()

    for i, (kind, preset, variant, bc) in enumerate(groups):
        kb = batches[kind]
        new_rows = []
        for chunk in kb.chunks:
            entries = kb.entries(chunk)
            keys = [[row_key(grid, preset, f, n, lab, b, variant, s) for lab, b in by_bc[bc]]
                    for f, n, s in entries]
            if all(tuple(k.values()) in done for ks in keys for k in ks):
                continue
            gold = kb.golden(chunk, kind)
            base = kb.baseline(chunk, preset, kind)
            flash = kb.run(_flash_program, chunk, tile_cols=bc, preset=preset, kind=kind,
                           variant=variant, blocks=Blocks(bc, bc), causal=grid.causal)
            for j, ((f, n, s), ks) in enumerate(zip(entries, keys)):
                outs = {name: a[j, :, :, :n] for name, a in
                        (("flash", flash), ("baseline", base), ("golden", gold))}
                vals = {}
                for comp in COMPARISONS:
                    a, b = comp.split("_vs_")
                    vals[comp] = _host(_metric_values(outs[a], outs[b]))
                for k in ks:
                    if tuple(k.values()) in done:
                        continue
                    done.add(tuple(k.values()))
                    for comp in COMPARISONS:
                        for m, val in zip(METRICS, vals[comp]):
                            new_rows.append({**k, "comparison": comp, "metric": m,
                                             "value": repr(float(val))})
        if new_rows:
            rows.extend(new_rows)
            _write_csv(csv_path, rows)
        if progress:
            print(f"\rfa_jax.studies.sweep: {i + 1}/{len(groups)} groups, "
                  f"{time.monotonic() - start:.1f} s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    if not csv_path.exists():
        _write_csv(csv_path, rows)
    return csv_path
