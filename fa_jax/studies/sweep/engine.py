"""Run a sweep: a :class:`~fa_jax.studies.sweep.Grid` -> tidy ``results.csv``.

For each configuration the sweep computes ``flash`` (FlashAttention under the
policy), ``baseline`` (reference attention under the same policy) and
``golden`` (reference attention in FP64, :func:`~fa_jax.presets.golden`), all
on the same inputs: Q, K, V drawn in float64 (:func:`fa_jax.inputs.make_inputs`,
softmax scale 1/√d) and rounded to the swept format.  It compares them with the
metrics of :mod:`fa_jax.metrics`, as Golden et al. 2024 (§4, Figs 3-6) do.

Execution, in brief:

* configurations are grouped by static signature: the shape of their policy
  (each stage's format kind and the policy's models, :mod:`.programs`), variant
  and key tile width Bc; the policy's widths are traced, so presets of one
  shape (paper_uniform, fa2_kernel, the golden) share compiled programs;
  tilings that differ only in Br share one flash run, because Br does not
  change flash's numbers;
* golden runs once per format batch and baseline once per (preset, batch), and
  both are reused by every variant and tiling;
* a ``"kernel:NAME"`` entry's flash column is the kernel's model
  (:func:`fa_jax.kernels.emulate`, :meth:`.batch.FormatBatch.kernel`), run once
  per configuration and reused by every variant and tiling, which the kernel
  does not follow; a grid with such an entry runs unpadded (one length per
  bucket), so that its baseline takes the model's policy at each length;
* each program runs over a flat (format × seq_len × seed) axis, one policy per
  call, lengths padded in buckets planned from measured costs (:mod:`.planner`),
  memory-bounded pieces and the axis sharded over ``jax.devices()`` (:mod:`.batch`);
* a configuration's metrics come from one padded program that gives the
  public metric functions' bits (:func:`.programs.metric_values`);
* each program is compiled once and kept on disk (:mod:`.executables`), so a
  later run loads it instead of tracing and compiling it again.

Files in ``out_dir`` (checked first, :func:`~fa_jax.studies.results.check_out_dir`):
``results.csv`` (:data:`~fa_jax.studies.sweep.COLUMNS`; ``value`` is
``repr(float)``), rewritten atomically after every group, and ``metadata.json``.
Resume: configurations whose rows are all in an existing ``results.csv`` are
skipped and kept; partial ones are computed again, so re-running after an
interruption completes the file without duplicates.  Under
:func:`~fa_jax.studies.interrupt.deferred_interrupts` (the ``fa-jax`` command), a
Ctrl-C stops the sweep at the next length bucket or group, once the rows computed
so far are written, never inside a compile.

Several processes (``jax.distributed``, :mod:`.cluster`): every process runs
the same call.  They first agree that their grids and options are the same
(else all refuse, naming the difference, before any work); process 0 writes
``metadata.json`` and, in ``out/parts/<grid_id>/``, ``order.csv`` (every
configuration's key in the order above, :func:`canonical_keys`).  Then each
reads ``results.csv`` and every part file there, and takes its share of the
(format, seq_len, seed) units with a configuration still to compute
(:mod:`.partition`), computed on its own devices as above; its rows go,
after every group, into its own part file ``part-NNNNN.csv``, rewritten
atomically.  Once every process is done, process 0 merges the parts into
``results.csv`` in :func:`canonical_keys` order
(:func:`~fa_jax.studies.results.merge_parts`), so the file is the one process's
byte for byte, and removes the folder; the others return once it has.  A killed
process loses only its group in flight: the same command, on any number of
processes (one included: a one-process sweep that finds the grid's part folder
takes this path), resumes from the parts.  Without ``jax.distributed`` and
without a part folder, the sweep is the one-process sweep above, unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from fa_jax._checks import positive_int
from fa_jax._x64 import float64_enabled
from fa_jax.attention import Blocks
from fa_jax.studies.cache import compilation_cache
from fa_jax.studies.interrupt import check_interrupt, interrupt_requested
from fa_jax.studies.options import current_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.progress import follow, track
from fa_jax.studies.results import (
    ORDER,
    PARTS,
    append_csv,
    check_out_dir,
    merge_parts,
    part_path,
    read_complete,
    read_parts,
    run_metadata,
    write_csv,
    write_json,
)
from fa_jax.studies.sweep.batch import (
    MEMORY_BUDGET,
    FormatBatch,
    batch_key,
    chunks_of,
    length_buckets,
    metric_sizes,
)
from fa_jax.studies.sweep.cluster import Processes, ProcessFailed, processes
from fa_jax.studies.sweep.executables import Executables, device_label, usable_cores
from fa_jax.studies.sweep.grid import (
    COLUMNS,
    COMPARISONS,
    KEY_COLUMNS,
    METRICS,
    Grid,
    kernel_name,
    row_key,
)
from fa_jax.studies.sweep.partition import partition, unit_cost, unit_of
from fa_jax.studies.sweep.planner import Costs, load_costs, measured, save_costs
from fa_jax.studies.sweep.programs import metric_plans, metric_values

__all__ = [
    "MEMORY_BUDGET",
    "canonical_keys",
    "length_buckets",
    "merge_sweep",
    "parts_folder",
    "run_sweep",
]

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
        pad=pads(grid),
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
    profile = Profile() if profile is None else profile  # the planner measures every run
    with float64_enabled(), compilation_cache(cache) as folder, _own_cache_only():
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


def pads(grid: Grid) -> bool:
    """Whether a sweep of ``grid`` pads lengths within buckets: :data:`PAD_SEQ_LENS`,
    unless a policies entry is a kernel's (module docstring)."""
    return PAD_SEQ_LENS and not any(kernel_name(p) for p in grid.policies)


def _layout(grid: Grid, pad: bool):
    """The formats by batch key (their policies' shapes), the tilings by key tile
    width Bc (Br does not change flash's numbers: one run per Bc) and the groups
    (batch key, features, preset, variant, Bc), in the order a sweep runs them."""
    kinds: dict = {}
    for f in grid.resolved_formats():
        kinds.setdefault(batch_key(grid, f, pad), []).append(f)
    by_bc: dict = {}
    for label, b in grid.resolved_blocks():
        by_bc.setdefault(b.bc, []).append((label, b))
    groups = [
        (kind, feat, preset, variant, bc)
        for kind in kinds
        for feat in grid.features
        for preset in grid.policies
        for variant in grid.variants
        for bc in by_bc
    ]
    return kinds, by_bc, groups


def canonical_keys(grid: Grid, pad: bool | None = None) -> list[dict[str, str]]:
    """The row key of every configuration of ``grid``, in the order a one-process
    sweep writes them (group, length bucket, format, length, seed, tiling);
    ``pad`` None: :func:`pads`."""
    pad = pads(grid) if pad is None else pad
    kinds, by_bc, groups = _layout(grid, pad)
    return [
        row_key(grid, preset, f, n, label, b, variant, s, feat)
        for kind, feat, preset, variant, bc in groups
        for chunk in chunks_of(grid, pad)
        for f in kinds[kind]
        for n in chunk
        for s in grid.seeds
        for label, b in by_bc[bc]
    ]


def grid_id(grid: Grid) -> str:
    """A name for ``grid``'s part folder: a hash of its JSON description."""
    text = json.dumps(grid.to_json(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parts_folder(out, grid: Grid) -> pathlib.Path:
    """The folder of ``grid``'s part files in ``out`` (``out/parts/<grid_id>``)."""
    return pathlib.Path(out) / PARTS / grid_id(grid)


EXPECTED = [(c, m) for c in COMPARISONS for m in METRICS]  # each configuration's rows
ROW_PART = ("comparison", "metric")  # what names a row within its configuration


def _read(csv_path: pathlib.Path):
    return read_complete(csv_path, COLUMNS, KEY_COLUMNS, ROW_PART, EXPECTED)


@contextlib.contextmanager
def _own_cache_only() -> Iterator[None]:
    """JAX's own persistent cache (the ``xla`` folder) is off while a sweep runs:
    the sweep keeps its programs, the metrics' too, in its own cache
    (:mod:`.executables`), and an executable that JAX loaded from its cache
    serializes incompletely: stored there and loaded by a later run, it fails
    with ``NOT_FOUND: Function ... not found`` (jax 0.10.2, XLA:CPU; what a
    ``lower().compile()`` returns is such an executable whenever JAX's cache
    holds the same program, as after an edit of fa_jax that leaves a program's
    HLO unchanged)."""
    name = "jax_enable_compilation_cache"
    before = getattr(jax.config, name)
    jax.config.update(name, False)
    _jax_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update(name, before)
        _jax_cache.reset_cache()


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
    group = processes()
    if group is not None or parts_folder(out, grid).is_dir():
        return _sweep_parts(
            grid,
            out,
            group,
            quiet=quiet,
            pad=pad,
            memory_budget=memory_budget,
            executables=executables,
            carrier=carrier,
        )
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    write_json(out / "metadata.json", run_metadata(grid.to_json()))
    rows, done = _read(csv_path)

    def flush(new_rows):
        append_csv(csv_path, COLUMNS, rows, new_rows)

    _compute(
        grid,
        done,
        flush,
        quiet=quiet,
        pad=pad,
        memory_budget=memory_budget,
        executables=executables,
        carrier=carrier,
    )
    if not csv_path.exists():
        write_csv(csv_path, COLUMNS, rows)
    return csv_path


def _sweep_parts(
    grid: Grid,
    out: pathlib.Path,
    group: Processes | None,
    *,
    quiet: bool,
    pad: bool,
    memory_budget: int,
    executables: Executables,
    carrier: str,
) -> pathlib.Path:
    """The sweep of one of several processes (``group``), or of one process that
    finds part files of an earlier multi-process run of ``grid`` (``group``
    None): its share into its part file, then process 0 merges (module
    docstring)."""
    if group is not None:  # the same command everywhere, or no one starts
        group.agree(
            "command",
            {
                **{f"Grid.{k}": v for k, v in grid.to_json().items()},
                "out": str(out),
                "carrier": carrier,
                "memory_budget": memory_budget,
                "pad": pad,
            },
        )
    try:
        return _share(
            grid,
            out,
            group,
            quiet=quiet,
            pad=pad,
            memory_budget=memory_budget,
            executables=executables,
            carrier=carrier,
        )
    except BaseException as err:  # the others stop too, rather than wait
        if group is not None and not isinstance(err, ProcessFailed):
            group.fail(str(err) or type(err).__name__)
        raise


def _share(
    grid: Grid,
    out: pathlib.Path,
    group: Processes | None,
    *,
    quiet: bool,
    pad: bool,
    memory_budget: int,
    executables: Executables,
    carrier: str,
) -> pathlib.Path:
    """:func:`_sweep_parts` once the processes agree: read what is done, compute
    this process's share, wait for the others, merge (process 0)."""
    index, count = (0, 1) if group is None else (group.index, group.count)
    csv_path, folder = out / "results.csv", parts_folder(out, grid)
    keys = canonical_keys(grid, pad)
    if index == 0:
        folder.mkdir(parents=True, exist_ok=True)
        meta = run_metadata(grid.to_json(), processes=count)
        write_json(out / "metadata.json", meta)
        write_json(folder / "metadata.json", meta)
        write_csv(folder / ORDER, KEY_COLUMNS, keys)
    if group is not None:
        group.wait_all("ready")
        if not (folder / ORDER).is_file():
            raise ValueError(
                f"run_sweep: process {index} of {count} does not see {folder / ORDER}, "
                f"which process 0 wrote; expected {out} to be one folder shared by every process"
            )
    # Every process reads the same files: nobody writes a part before all have read.
    _, done = _read(csv_path)
    _, part_done = read_parts(folder, COLUMNS, KEY_COLUMNS, ROW_PART, EXPECTED)
    done |= part_done
    mine, _ = _read(part_path(folder, index))
    todo_units: dict = {}  # units with a configuration to compute, in canonical order
    for k in keys:
        if tuple(k.values()) not in done:
            todo_units.setdefault(unit_of(k), 0)
            todo_units[unit_of(k)] += 1
    units = list(todo_units)
    if group is not None:
        seen = hashlib.sha256(repr(units).encode()).hexdigest()
        group.agree(
            f"view of {out}",
            {"configurations to compute (a hash)": seen},
            hint="expected one folder shared by every process (and no other run writing there)",
        )
    share = partition(units, unit_cost(grid, pad), count)[index]
    part = part_path(folder, index)
    job = sum(todo_units.values())

    def flush(new_rows):
        mine.extend(new_rows)
        _write_part(part, mine)
        if group is not None:
            group.add("configurations done", len(new_rows) // len(EXPECTED))

    def job_done():
        return 0 if group is None else group.count_of("configurations done")

    with (
        follow(
            f"sweep, {count} processes",
            job,
            job_done,
            unit="config",
            quiet=quiet or index != 0 or group is None,
        ),
        executables.shared_with(group),
    ):
        _compute(
            grid,
            done,
            flush,
            quiet=quiet,
            pad=pad,
            memory_budget=memory_budget,
            executables=executables,
            carrier=carrier,
            share=frozenset(share),
            desc="sweep" if group is None else f"sweep, process {index} of {count}",
        )
        if group is not None:
            group.wait_all("computed")
    if index == 0:
        try:
            _, missing = merge_parts(csv_path, folder, COLUMNS, KEY_COLUMNS, ROW_PART, EXPECTED)
            outcome = (
                ""
                if not missing
                else (
                    f"run_sweep: {missing} configurations of {len(keys)} are in no part file "
                    f"of {folder} after every process finished; expected {out} to be one "
                    "folder shared by every process"
                )
            )
        except Exception as err:
            outcome = f"run_sweep: process 0 could not merge {folder}: {err}"
        if group is not None:
            group.publish("merged", outcome or "ok")
    else:
        assert group is not None
        outcome = group.receive("merged")
        outcome = "" if outcome == "ok" else outcome
    if outcome:
        raise ValueError(outcome)
    return csv_path


def merge_sweep(out) -> list[tuple[pathlib.Path, int, int]]:
    """Fold every part folder in ``out`` (``out/parts/*``) into ``out/results.csv``
    and ``out/metadata.json``, as process 0 does at the end of a multi-process
    sweep (:func:`fa_jax.studies.results.merge_parts`): for a run whose process 0
    did not get there.  Returns (folder, configurations merged, configurations
    still missing) per folder; a folder with none missing is removed."""
    out = check_out_dir(out, {"results.csv": COLUMNS}, what="merge: out")
    root = out / PARTS
    report = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if (folder / ORDER).is_file():
            merged, missing = merge_parts(
                out / "results.csv", folder, COLUMNS, KEY_COLUMNS, ROW_PART, EXPECTED
            )
            report.append((folder, merged, missing))
    return report


def _write_part(path: pathlib.Path, rows: list) -> None:
    """This process's rows, all of them, into its part file (atomically)."""
    write_csv(path, COLUMNS, rows)


def _compute(
    grid: Grid,
    done: set,
    flush,
    *,
    quiet: bool,
    pad: bool,
    memory_budget: int,
    executables: Executables,
    carrier: str,
    share: frozenset | None = None,
    desc: str = "sweep",
) -> None:
    """Compute the configurations of ``grid`` (of the units in ``share``; None:
    all) whose keys are not in ``done``; ``flush(rows)`` receives each group's
    new rows (and ``done`` their keys) before the next group starts."""
    kinds, by_bc, groups = _layout(grid, pad)
    batches = {
        (kind, feat): FormatBatch(grid, fmts, pad, memory_budget, executables, carrier, share, feat)
        for kind, fmts in kinds.items()
        for feat in grid.features
    }

    def flash_static(variant, bc):
        return dict(variant=variant, blocks=Blocks(bc, bc), causal=grid.causal)

    def keys_of(feat, preset, variant, bc, entries):
        return [
            [row_key(grid, preset, f, n, lab, b, variant, s, feat) for lab, b in by_bc[bc]]
            for f, n, s in entries
        ]

    todo = {}  # (group, chunk) with rows still to compute -> its row keys
    for kind, feat, preset, variant, bc in groups:
        kb = batches[kind, feat]
        for chunk in kb.chunks:
            keys = keys_of(feat, preset, variant, bc, kb.entries(chunk))
            if not all(tuple(k.values()) in done for ks in keys for k in ks):
                todo[kind, feat, preset, variant, bc, chunk] = keys
    _plan(batches, todo, executables, flash_static)
    plans, sizes = [], set()
    for kind, feat, preset, variant, bc, chunk in todo:
        kb = batches[kind, feat]
        plans += kb.reference_plans(chunk, preset)
        if kernel_name(preset) is None:
            plans += kb.flash_plans(chunk, preset, tile_cols=bc, **flash_static(variant, bc))
        sizes |= kb.output_sizes(chunk)
    padded = metric_sizes(sizes)
    for size in sorted(set(padded.values())):
        plans += metric_plans(size)
    executables.prepare(plans)

    for kind, feat, preset, variant, bc in track(groups, desc=desc, unit="group", quiet=quiet):
        kb = batches[kind, feat]
        new_rows = []
        for chunk in kb.chunks:
            if interrupt_requested():
                break
            keys = todo.get((kind, feat, preset, variant, bc, chunk))
            if keys is None:
                continue
            entries = kb.entries(chunk)
            gold = kb.golden(chunk)
            base = kb.baseline(chunk, preset)
            if kernel_name(preset) is None:
                flash = kb.flash(chunk, preset, tile_cols=bc, **flash_static(variant, bc))
            else:
                flash = kb.kernel(chunk, preset)
            for j, ((_, n, _), ks) in enumerate(zip(entries, keys)):
                rows = n if feat.queries is None else min(n, feat.queries)
                outs = {
                    name: a[j][:, :, :rows]
                    for name, a in (("flash", flash), ("baseline", base), ("golden", gold))
                }
                values = metric_values(outs, padded[outs["golden"].size], executables)
                vals = dict(zip(COMPARISONS, values))
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
            flush(new_rows)
        check_interrupt()
    _keep_costs(executables)


def _costs(executables: Executables) -> Costs:
    """This device's planner costs, from the cache the executables are kept in."""
    platform = jax.local_devices()[0].platform
    return load_costs(executables.folder, device_label(), platform, usable_cores())


def _plan(batches: dict, todo: dict, executables: Executables, flash_static) -> None:
    """Each batch's buckets for the lengths, presets and flash runs it still has
    to compute (:meth:`.batch.FormatBatch.choose_buckets`)."""
    costs = _costs(executables)
    jobs: dict = {}  # (kind, feat) -> (lengths, presets, flash runs)
    for kind, feat, preset, variant, bc, chunk in todo:
        lengths, presets, runs = jobs.setdefault((kind, feat), (set(), [], []))
        lengths.update(n for _, n, _ in batches[kind, feat].entries(chunk))
        if preset not in presets:
            presets.append(preset)
        run = (preset, bc, flash_static(variant, bc))
        if kernel_name(preset) is None and run not in runs:
            runs.append(run)
    for key, (lengths, presets, runs) in jobs.items():
        batches[key].choose_buckets(lengths, presets, runs, costs)


def _keep_costs(executables: Executables) -> None:
    """The planner's costs updated with this run's measurements, kept with the cache."""
    assert executables.profile is not None  # _run gives every sweep one
    costs = measured(executables.profile, _costs(executables))
    save_costs(executables.folder, device_label(), costs)
