"""Run a sweep: a :class:`~fa_jax.studies.sweep.Grid` -> tidy ``results.csv``.

For each configuration the sweep computes ``flash`` (FlashAttention under the
policy), ``baseline`` (reference attention under the same policy) and
``golden`` (reference attention in FP64, :func:`~fa_jax.presets.golden`), all
on the same inputs: Q, K, V drawn in float64 (:func:`fa_jax.inputs.make_inputs`,
softmax scale 1/√d) and rounded to the swept format.  It compares them with the
metrics of :mod:`fa_jax.metrics`, as Golden et al. 2024 (§4, Figs 3-6) compare
FlashAttention and baseline attention against an FP64 golden value.

Execution, in brief:

* configurations are grouped by static signature: the shape of their policy
  (each stage's format kind and the policy's models, :mod:`.programs`), variant
  and key tile width Bc; the policy's widths are traced, so presets of one
  shape (paper_uniform, fa2_kernel, the golden) share compiled programs;
  tilings that differ only in Br share one flash run, because Br does not
  change flash's numbers;
* golden runs once per format batch and baseline once per (preset, batch), and
  both are reused by every variant and tiling;
* each program vmaps over a flat (format × seq_len × seed) axis, with lengths
  padded within buckets, memory-bounded pieces and the axis sharded over
  ``jax.devices()`` (:mod:`.batch`);
* metrics are computed per configuration on the unpadded output by the public
  metric functions, so direct calls reproduce the CSV bitwise;
* each program is compiled once and kept on disk
  (:mod:`.executables`, under :func:`fa_jax.studies.cache.cache_dir`), so a
  later run loads it instead of tracing and compiling it again.

Files in ``out_dir``: ``results.csv`` (:data:`~fa_jax.studies.sweep.COLUMNS`;
``value`` is ``repr(float)``, so it round-trips exactly), rewritten atomically
after every group, and ``metadata.json`` (:func:`fa_jax.studies.results.run_metadata`).
Before anything is computed, :func:`~fa_jax.studies.results.check_out_dir`
refuses an ``out_dir`` that is a file, lies under one, cannot be written or
holds a ``results.csv`` with other columns.
Resume: configurations whose rows are all in an existing ``results.csv`` are
skipped and kept; partial ones are computed again, so re-running after an
interruption completes the file without duplicates.  Under
:func:`~fa_jax.studies.interrupt.deferred_interrupts` (the ``fa-jax`` command), a
Ctrl-C stops the sweep at the next length bucket or group, once the rows computed
so far are written, never inside a compile.
"""

from __future__ import annotations

import pathlib
import time

from fa_jax._checks import positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.attention import Blocks
from fa_jax.studies.cache import compilation_cache
from fa_jax.studies.interrupt import check_interrupt, interrupt_requested
from fa_jax.studies.options import current_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.progress import track
from fa_jax.studies.results import (
    append_csv,
    check_out_dir,
    read_complete,
    run_metadata,
    write_csv,
    write_json,
)
from fa_jax.studies.sweep.batch import (
    MEMORY_BUDGET,
    FormatBatch,
    batch_key,
    host,
    length_buckets,
)
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.grid import COLUMNS, COMPARISONS, KEY_COLUMNS, METRICS, Grid, row_key
from fa_jax.studies.sweep.programs import metric_values

__all__ = ["MEMORY_BUDGET", "length_buckets", "run_sweep"]

PAD_SEQ_LENS = True  # pad within length buckets (False: one program per length)


def run_sweep(
    grid: Grid,
    out_dir,
    *,
    quiet: bool = False,
    memory_budget: int = MEMORY_BUDGET,
    cache=None,
    profile: Profile | None = None,
) -> pathlib.Path:
    """Run every configuration of ``grid`` not already in ``out_dir/results.csv``
    (module docstring); returns the CSV's path.  ``memory_budget`` (bytes) bounds
    the working memory of one compiled call.  ``quiet``: no progress bar.
    ``cache`` (True, a folder, or False) and ``profile`` (a
    :class:`~fa_jax.studies.profile.Profile` to fill): None takes them from
    :func:`~fa_jax.studies.options.study_options` (default: cache on, no profile).

    Enables ``jax_enable_x64`` while it runs (float64 carriers) and restores the
    previous setting when it returns.
    """
    return _run(
        grid,
        out_dir,
        quiet=quiet,
        pad=PAD_SEQ_LENS,
        memory_budget=memory_budget,
        cache=cache,
        profile=profile,
    )


def _run(
    grid: Grid,
    out_dir,
    *,
    quiet: bool,
    pad: bool,
    memory_budget: int = MEMORY_BUDGET,
    cache=None,
    profile: Profile | None = None,
) -> pathlib.Path:
    if not isinstance(grid, Grid):
        raise TypeError(f"run_sweep: expected a Grid, got {grid!r}")
    positive_int(memory_budget, "run_sweep: memory_budget (bytes)")
    options = current_options()
    cache = options.cache if cache is None else cache
    profile = options.profile if profile is None else profile
    with float64_enabled(), compilation_cache(cache) as folder:
        executables = Executables(None if folder is None else folder / "programs", profile)
        return _sweep(
            grid,
            pathlib.Path(out_dir),
            quiet=quiet,
            pad=pad,
            memory_budget=memory_budget,
            executables=executables,
            carrier=options.carrier,
        )


def _sweep(
    grid: Grid,
    out: pathlib.Path,
    *,
    quiet: bool,
    pad: bool,
    memory_budget: int,
    executables: Executables,
    carrier: str,
) -> pathlib.Path:
    check_out_dir(out, {"results.csv": COLUMNS})
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    write_json(out / "metadata.json", run_metadata(grid.to_json()))
    expected = [(c, m) for c in COMPARISONS for m in METRICS]
    rows, done = read_complete(csv_path, COLUMNS, KEY_COLUMNS, ("comparison", "metric"), expected)

    kinds: dict = {}  # formats by batch key (their policies' shapes)
    for f in grid.resolved_formats():
        kinds.setdefault(batch_key(grid, f, pad), []).append(f)
    by_bc: dict = {}  # Br does not change flash's numbers: one run per Bc
    for label, b in grid.resolved_blocks():
        by_bc.setdefault(b.bc, []).append((label, b))
    groups = [
        (kind, preset, variant, bc)
        for kind in kinds
        for preset in grid.policies
        for variant in grid.variants
        for bc in by_bc
    ]
    batches = {
        kind: FormatBatch(grid, fmts, pad, memory_budget, executables, carrier)
        for kind, fmts in kinds.items()
    }
    profile = executables.profile

    def flash_static(variant, bc):
        return dict(variant=variant, blocks=Blocks(bc, bc), causal=grid.causal)

    def keys_of(preset, variant, bc, entries):
        return [
            [row_key(grid, preset, f, n, lab, b, variant, s) for lab, b in by_bc[bc]]
            for f, n, s in entries
        ]

    todo = {}  # (group, chunk) with rows still to compute -> its row keys
    for kind, preset, variant, bc in groups:
        kb = batches[kind]
        for chunk in kb.chunks:
            keys = keys_of(preset, variant, bc, kb.entries(chunk))
            if not all(tuple(k.values()) in done for ks in keys for k in ks):
                todo[kind, preset, variant, bc, chunk] = keys
    plans = []
    for kind, preset, variant, bc, chunk in todo:
        kb = batches[kind]
        plans += kb.reference_plans(chunk, preset)
        plans += kb.flash_plans(chunk, preset, tile_cols=bc, **flash_static(variant, bc))
    executables.prepare(plans)

    for kind, preset, variant, bc in track(groups, desc="sweep", unit="group", quiet=quiet):
        kb = batches[kind]
        new_rows = []
        for chunk in kb.chunks:
            if interrupt_requested():
                break
            keys = todo.get((kind, preset, variant, bc, chunk))
            if keys is None:
                continue
            entries = kb.entries(chunk)
            gold = kb.golden(chunk)
            base = kb.baseline(chunk, preset)
            flash = kb.flash(chunk, preset, tile_cols=bc, **flash_static(variant, bc))
            for j, ((_, n, _), ks) in enumerate(zip(entries, keys)):
                outs = {
                    name: a[j, :, :, :n]
                    for name, a in (("flash", flash), ("baseline", base), ("golden", gold))
                }
                start = time.perf_counter()
                vals = {}
                for comp in COMPARISONS:
                    a, b = comp.split("_vs_")
                    vals[comp] = host(metric_values(outs[a], outs[b]))
                if profile is not None:
                    profile.add_phase("metrics (eager)", time.perf_counter() - start)
                for k in ks:
                    if tuple(k.values()) in done:
                        continue
                    done.add(tuple(k.values()))
                    for comp in COMPARISONS:
                        for m, val in zip(METRICS, vals[comp]):
                            new_rows.append(
                                {**k, "comparison": comp, "metric": m, "value": repr(float(val))}
                            )
        if new_rows:
            append_csv(csv_path, COLUMNS, rows, new_rows)
        check_interrupt()
    if not csv_path.exists():
        write_csv(csv_path, COLUMNS, rows)
    return csv_path
