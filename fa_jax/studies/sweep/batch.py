"""How the sweep feeds its programs: length buckets, pieces, devices.

:class:`FormatBatch` holds the flat (format × seq_len × seed) axis of formats
whose policies share their shapes (:class:`~.programs.PolicyShape`), and gives
each program its inputs and each configuration's policy widths.  The rows
are written in fixed chunks of lengths (:func:`chunks_of`); the programs run
over buckets of lengths padded to the longest, which the planner chooses
(:meth:`FormatBatch.choose_buckets`, :mod:`.planner`) and which start as the
fixed ones: reference buckets whose longest length is at most
:data:`PAD_RATIO` times the shortest (:func:`length_buckets`), since padding a
short length to a much longer one costs the reference programs quadratically;
flash buckets :data:`FLASH_PAD_RATIO` wide, since flash programs visit only
the key blocks a configuration's length holds
(:func:`fa_jax.attention.flash_attention`) and padding costs them only the
padded query rows, linearly.  Where a policy depends on the length (kernel
models'), the flash buckets are the reference ones and neither is planned.
The inputs of each (seed, seq_len) are :func:`fa_jax.inputs.make_inputs`, so
every program sees the values a direct call would.

Pieces: each call runs over its configurations in pieces of
:data:`PIECE` configurations per device, the last one padded, so that a
program's executable depends on its static signature and padded length only,
not on how many configurations a grid has: the grids of different figures
share it.  Memory: the baseline and golden programs materialise (N, N) float64
scores, so a piece is smaller where its estimated working memory (3 · 8 · N²
bytes per configuration and head; 3 · 8 · N · (Bc + d) for flash) would pass
the memory budget (default :data:`MEMORY_BUDGET`).

Carriers: the golden and baseline programs compute on float64 carriers; the
flash programs on the batch's ``carrier``.  A float32 one (:mod:`fa_jax.carrier32.elementwise`,
the same bits, no 64-bit type in the program) reads Q, K, V rounded on the host
to each configuration's input format, and its outputs are widened back (exactly)
before the metrics.

Devices: the configuration axis is padded (repeating its last entry) to a
multiple of the process's device count (``jax.local_devices()``, all of
``jax.devices()`` in one process) and sharded over a 1-D
:class:`jax.sharding.Mesh` (axis ``"cfg"``).  Each configuration is computed
by one device, so the results equal a single-device run bitwise.  Under
``jax.distributed`` each process runs its own share of the configurations
(:mod:`.partition`) on its own devices: no program spans processes.

Kernels: a ``"kernel:NAME"`` entry's flash outputs are
:func:`fa_jax.kernels.emulate` of the kernel, one call per configuration on its
unpadded Q, K, V rounded to the format (:meth:`FormatBatch.kernel`): the model's
own program at that shape, not one of the sweep's; a model that does not cover
the shape raises ValueError.  Its baseline program reads the same rounded
inputs (:meth:`FormatBatch.rounded_inputs`), since the model's input stage may
be wider than the format (ggml's is FP32).

Shares: a batch given ``share`` (a set of (format name, seq_len, seed) units)
holds only those entries, in the same order, so a process's programs see the
inputs a one-process run would.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import numpy as np

from fa_jax import kernels
from fa_jax.inputs import make_inputs
from fa_jax.policy import STAGES
from fa_jax.rounding import round_to
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.features import PAPER, Features
from fa_jax.studies.sweep.grid import Grid, kernel_name, policy_for
from fa_jax.studies.sweep.planner import Call, Costs, best_buckets, bucket_seconds, wall_seconds
from fa_jax.studies.sweep.programs import (
    flash_program,
    golden_for,
    policy_shape,
    policy_widths,
    reference_program,
    stage_slots,
)

__all__ = [
    "FLASH_PAD_RATIO",
    "MEMORY_BUDGET",
    "METRIC_PAD_RATIO",
    "PAD_RATIO",
    "PIECE",
    "FormatBatch",
    "host",
    "length_buckets",
    "metric_sizes",
    "policies_follow_length",
    "shard",
]

PAD_RATIO = 2  # pad only within buckets whose longest length is <= 2x the shortest
FLASH_PAD_RATIO = 8  # flash's padded work is linear in the ratio, the reference's quadratic
METRIC_PAD_RATIO = 16  # a metric's padded work is linear, and small beside attention's
PIECE = 2  # configurations per device in one call
MEMORY_BUDGET = 4 * 2**30  # bytes of working memory per compiled call


def length_buckets(lens, ratio=PAD_RATIO):
    """Sorted lengths split greedily into buckets with max <= ratio * min: one padded
    program per bucket, whose padded score work is at most ratio**2 times a
    configuration's own."""
    buckets: list[list[int]] = []
    for n in sorted(lens):
        if buckets and n <= ratio * buckets[-1][0]:
            buckets[-1].append(n)
        else:
            buckets.append([n])
    return [tuple(b) for b in buckets]


def metric_sizes(sizes) -> dict[int, int]:
    """Each output size's padded size, the metric program's
    (:func:`.programs.metric_values`): sizes at most :data:`METRIC_PAD_RATIO` apart
    share one program."""
    return {s: max(b) for b in length_buckets(sizes, METRIC_PAD_RATIO) for s in b}


def _placed_count(n: int) -> int:
    """``n`` configurations padded to a multiple of the process's device count."""
    return n + -n % len(jax.local_devices())


def _placement():
    """The sharding of a call's configuration axis over the process's devices
    (None on one device: numpy arrays, placed by the call)."""
    devices = jax.local_devices()
    if len(devices) == 1:
        return None
    mesh = jax.sharding.Mesh(np.array(devices), ("cfg",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cfg"))


def shard(args, n, *, pad_to=None, lo=0):
    """Entries ``lo .. lo + n`` of the leading (configuration) axis, padded
    (repeating the last) to ``pad_to`` entries and then to a multiple of the
    process's device count, and sharded over a 1-D mesh of those devices (no
    sharding on one device)."""
    extra = _placed_count(pad_to or n) - n

    def pad(x):
        x = np.asarray(x)[lo : lo + n]
        if extra:
            x = np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])
        return x

    args = jax.tree_util.tree_map(pad, args)
    sharding = _placement()
    return args if sharding is None else jax.device_put(args, sharding)


def _label(program, bucket, static) -> str:
    """A program's name for the profile: what it computes, its static signature
    (one program serves every policy of its shape, the golden's too) and its
    padded length (the planner's family is the name without it)."""
    parts = [program.__name__.removesuffix("_program")]
    parts += [str(static[k]) for k in ("variant",) if k in static]
    if "blocks" in static:
        parts.append(f"Bc={static['blocks'].bc}")
    if static.get("causal"):
        parts.append("causal")
    if static.get("features", PAPER) != PAPER:
        parts.append(static["features"].label())
    parts.append(f"N<={max(bucket)}")
    return " ".join(parts)


def host(x):
    """A device value as a numpy array."""
    return np.asarray(jax.device_get(x))


class FormatBatch:
    """The flat (format × seq_len × seed) axis of formats whose policies share
    their shapes, its inputs (padded within length buckets, or one batch per
    length), and caches of the golden and baseline outputs that every variant
    and tiling reuses.  ``chunks``: the lengths in the groups a sweep writes
    its rows in (:func:`chunks_of`, fixed by the grid); ``buckets`` and
    ``flash_buckets``: the lengths each reference and flash program is padded
    over (those of :func:`chunks_of` and :func:`flash_chunks_of` until
    :meth:`choose_buckets` plans them).  A ``preset`` of None is the golden
    (:func:`golden_for`).
    ``carrier``: the flash programs' ("float64" or "float32", module docstring).
    ``share``: the (format name, seq_len, seed) units this process computes
    (None: all of them; module docstring).  ``features``: the attention features
    every program of the batch runs with (:class:`~.features.Features`)."""

    def __init__(
        self,
        grid: Grid,
        fmts,
        pad: bool,
        memory_budget: int,
        executables: Executables,
        carrier: str = "float64",
        share: frozenset | None = None,
        features: Features = PAPER,
    ):
        self.grid, self.fmts, self.memory_budget = grid, fmts, memory_budget
        self.features = features
        self.share = share
        self.executables, self.carrier = executables, carrier
        self.chunks = chunks_of(grid, pad)
        self.buckets = list(self.chunks)
        # Split-KV's boundaries follow the key axis given, so its flash runs unpadded.
        unpadded = features.num_splits > 1
        self.flash_buckets = flash_chunks_of(grid, pad and not unpadded)
        # A bucket's policies are taken at its padded length: planned only where
        # no policy changes with the length, so that a plan cannot change a value.
        self.plannable = pad and not policies_follow_length(grid)
        self.flash_plannable = self.plannable and not unpadded
        if carrier == "float32":
            for preset in grid.policies:
                for f in fmts:  # the policy's own check, with its message
                    policy_of(preset, f, grid.seq_lens[0], grid.d).replace(carrier="float32")

        def slots(presets, chunks):
            ns = [max(c) for c in chunks]
            pols = [policy_of(p, f, n, grid.d) for p in presets for f in fmts for n in ns]
            return stage_slots(pols)

        # The reference program serves the golden too; flash programs the presets only.
        self.slots = {
            reference_program: slots((None, *grid.policies), self.chunks),
            flash_program: slots(grid.policies, self.flash_buckets),
        }
        self._inputs = {}
        self._narrow_inputs = {}
        self._policies = {}
        self._golden = {}
        self._baseline = {}
        self._flash: dict = {}  # one flash run's outputs by flash bucket
        self._flash_run = None  # (preset, static) of those outputs
        self._rounded: dict = {}  # inputs rounded to each configuration's format, by chunk
        self._kernel: dict = {}  # one kernel entry's outputs by chunk
        self._kernel_run = None  # its preset

    def entries(self, chunk):
        every = [(f, n, s) for f in self.fmts for n in chunk for s in self.grid.seeds]
        if self.share is None:
            return every
        return [(f, n, s) for f, n, s in every if (f.name, n, s) in self.share]

    def inputs(self, chunk):
        """Q, K, V ``[C, B, H, max(chunk), d]`` zero-padded (cut to the features'
        query rows and K/V heads), and the lengths ``[C]``."""
        if chunk not in self._inputs:
            g, entries = self.grid, self.entries(chunk)
            n_max = max(chunk)
            raw = {}
            for _, n, s in entries:
                if (s, n) not in raw:
                    qkv = make_inputs(
                        s, n, batch=g.batch, heads=g.heads, d=g.d, distribution=g.distribution
                    )
                    pad = [(0, 0), (0, 0), (0, n_max - n), (0, 0)]
                    raw[(s, n)] = self.features.inputs(*(np.pad(t, pad) for t in qkv))
            q, k, v = (np.stack([raw[(s, n)][i] for _, n, s in entries]) for i in range(3))
            lengths = np.array([n for _, n, _ in entries], np.int32)
            self._inputs[chunk] = (q, k, v, lengths)
        return self._inputs[chunk]

    def narrow_inputs(self, chunk, preset):
        """Q, K, V of :meth:`inputs` rounded on the host to each configuration's
        input format (``preset``'s), as float32: exact, for a float32-carrier program."""
        if (chunk, preset) not in self._narrow_inputs:
            n, d = max(chunk), self.grid.d
            by_format = {f: policy_of(preset, f, n, d).inputs for f in self.fmts}
            fmts = [by_format[f] for f, _, _ in self.entries(chunk)]

            def narrow(t):
                return np.stack([host(round_to(x, f)).astype(np.float32) for x, f in zip(t, fmts)])

            q, k, v, _ = self.inputs(chunk)
            self._narrow_inputs[chunk, preset] = tuple(narrow(t) for t in (q, k, v))
        return self._narrow_inputs[chunk, preset]

    def rounded_inputs(self, chunk):
        """Q, K, V of :meth:`inputs` rounded on the host to each configuration's
        format, float64: what a kernel entry's programs read (its model takes
        values exact in the format; its policy's input stage may be wider)."""
        if chunk not in self._rounded:
            fmts = [f for f, _, _ in self.entries(chunk)]
            q, k, v, _ = self.inputs(chunk)
            self._rounded[chunk] = tuple(
                np.stack([host(round_to(x, f)) for x, f in zip(t, fmts)]) for t in (q, k, v)
            )
        return self._rounded[chunk]

    def policies(self, chunk, preset, slots):
        """The shape every format's policy shares (in ``slots``) and each format's
        widths ``[slots, 3]``, by format."""
        if (chunk, preset, slots) not in self._policies:
            n, d = max(chunk), self.grid.d
            by_format = {f: policy_of(preset, f, n, d) for f in self.fmts}  # not per seed, length
            shapes = {policy_shape(p, slots) for p in by_format.values()}
            if len(shapes) != 1:
                raise ValueError(
                    f"FormatBatch: expected formats whose {preset} policies share one shape, "
                    f"got {len(shapes)} shapes for {[f.name for f in self.fmts]}"
                )
            widths = {f: policy_widths(p, slots) for f, p in by_format.items()}
            self._policies[chunk, preset, slots] = (shapes.pop(), widths)
        return self._policies[chunk, preset, slots]

    def _per_config_bytes(self, bucket, tile_cols=None):
        """Estimated working memory of one configuration: the (N, N) float64 scores
        and their exponentials, or a flash tile's (N, Bc + d)."""
        g, n = self.grid, max(bucket)
        cols = n if tile_cols is None else tile_cols + g.d
        return 3 * 8 * g.batch * g.heads * self._rows(n) * cols

    def _rows(self, n: int) -> int:
        """The query rows of a program padded to ``n``: n, or the features' queries."""
        return n if self.features.queries is None else min(n, self.features.queries)

    def _layout(self, program, bucket, preset, tile_cols, static):
        """``program``'s full static arguments on ``bucket`` for ``preset``, the
        widths of each format, the configurations per call and its label."""
        shape, widths = self.policies(bucket, preset, self.slots[program])
        if program is flash_program and self.carrier != "float64":
            shape = dataclasses.replace(shape, carrier=self.carrier)
        static = {"features": self.features, **static, "shape": shape}
        per = max(1, self.memory_budget // self._per_config_bytes(bucket, tile_cols))
        size = min(per, PIECE * len(jax.local_devices()))
        return static, widths, size, _label(program, bucket, static)

    def _spans(self, bucket, size):
        """(format, first, stop) of each call's entries: one policy per call, so a
        call holds configurations of one format (entries are grouped by format),
        at most ``size`` of them."""
        first = 0
        for f, entries in itertools.groupby(f for f, _, _ in self.entries(bucket)):
            stop = first + len(list(entries))
            for start in range(first, stop, size):
                yield f, start, min(start + size, stop)
            first = stop

    @staticmethod
    def _units(program, q_shape, lengths, bucket, static) -> float:
        """A call's units of work (:mod:`.planner`): its configurations × batch ×
        heads × query rows × key columns × d, where a reference call takes every
        key of its ``bucket``'s padded length and a flash call the key tiles up
        to its longest length."""
        *lead, d = q_shape
        keys = max(bucket)
        if program is flash_program:
            bc = static["blocks"].bc
            keys = -(-max(lengths) // bc) * bc
        return float(np.prod(lead)) * keys * d

    def _pieces(self, program, bucket, preset, tile_cols, static):
        """The bucket's configurations in calls (module docstring): (configurations
        in the call, its sharded arguments, the full static arguments, the
        program's label, its units of work)."""
        q, k, v, lengths = self.inputs(bucket)
        if kernel_name(preset) is not None:  # its baseline reads what its model reads
            q, k, v = self.rounded_inputs(bucket)
        if program is flash_program and self.carrier != "float64":
            q, k, v = self.narrow_inputs(bucket, preset)
        static, widths, size, label = self._layout(program, bucket, preset, tile_cols, static)
        for f, start, stop in self._spans(bucket, size):
            q_p, k_p, v_p, n_p = shard((q, k, v, lengths), stop - start, pad_to=size, lo=start)
            units = self._units(program, q_p.shape, lengths[start:stop], bucket, static)
            yield stop - start, (q_p, k_p, v_p, widths[f], n_p), static, label, units

    def calls(self, program, bucket, preset, *, tile_cols=None, **static) -> list[Call]:
        """The calls :meth:`run` would make on ``bucket``, from shapes alone (no
        inputs drawn): each program's key and label, its work, whether it is
        cached (what the planner weighs, :mod:`.planner`)."""
        static, widths, size, label = self._layout(program, bucket, preset, tile_cols, static)
        q_shape, k_shape = self._input_shapes(max(bucket))
        dtype = np.float32 if program is flash_program and self.carrier != "float64" else np.float64
        placed, sharding = _placed_count(size), _placement()

        def abstract(shape, dt):
            return jax.ShapeDtypeStruct((placed, *shape), dt, sharding=sharding)

        qkv = [abstract(s, dtype) for s in (q_shape, k_shape, k_shape)]
        n_p = abstract((), np.int32)
        lengths = [n for _, n, _ in self.entries(bucket)]
        out = []
        for f, start, stop in self._spans(bucket, size):
            args = (*qkv, widths[f], n_p)
            key = self.executables.key(program, args, static)
            units = self._units(program, qkv[0].shape, lengths[start:stop], bucket, static)
            out.append(Call(key, label, units, self.executables.holds(key)))
        return out

    def _input_shapes(self, n: int) -> tuple[tuple, tuple]:
        """One configuration's Q and K shapes padded to ``n`` (after the
        features' cuts), from zeros: what :meth:`inputs` stacks."""
        g = self.grid
        zeros = np.zeros((g.batch, g.heads, n, g.d))
        q, k, _ = self.features.inputs(zeros, zeros, zeros)
        return q.shape, k.shape

    def choose_buckets(self, lengths, presets, flash_runs, costs: Costs) -> None:
        """Plan the buckets of ``lengths`` (:mod:`.planner`): the reference
        programs' (the golden and each of ``presets``' baseline) and the flash
        programs' (each of ``flash_runs``: (preset, tile_cols, static)), each the
        partition of least predicted time where the batch may be planned; the
        plan and its predictions go to the executables' profile."""
        causal, gold = self.grid.causal, self.features.for_golden()

        @functools.cache  # a bucket's calls: weighed by the plan, then predicted
        def reference_calls(bucket):
            calls = self.calls(reference_program, bucket, None, causal=causal, features=gold)
            for preset in presets:
                calls += self.calls(reference_program, bucket, preset, causal=causal)
            return calls

        @functools.cache
        def flash_calls(bucket):
            return [
                call
                for preset, tile_cols, static in flash_runs
                for call in self.calls(flash_program, bucket, preset, tile_cols=tile_cols, **static)
            ]

        lengths = sorted(set(lengths))
        if self.plannable:
            self.buckets = best_buckets(lengths, lambda b: wall_seconds(reference_calls(b), costs))
        if self.flash_plannable and flash_runs:
            self.flash_buckets = best_buckets(
                lengths, lambda b: wall_seconds(flash_calls(b), costs)
            )
        profile = self.executables.profile
        if profile is None:
            return
        names = "+".join(f.name for f in self.fmts)
        kept = "planned" if self.plannable else "fixed (lengths change a policy)"
        profile.planned(
            f"{names} ({self.features.label()}): reference buckets {self.buckets}, "
            f"flash buckets {self.flash_buckets}, {kept}"
        )
        planned = [(b, reference_calls) for b in self.buckets]
        planned += [(b, flash_calls) for b in self.flash_buckets if flash_runs]
        for bucket, calls_of in planned:
            if not set(bucket) & set(lengths):
                continue
            for label, calls in itertools.groupby(
                sorted(calls_of(bucket), key=lambda c: c.label), key=lambda c: c.label
            ):
                profile.predict(label, *bucket_seconds(list(calls), costs))

    def plan(self, program, bucket, preset, *, tile_cols=None, **static):
        """What :meth:`run` will call, for :meth:`Executables.prepare`:
        ``(program, args, static, label)`` (every piece shares one compile)."""
        _, args, static, label, _ = next(self._pieces(program, bucket, preset, tile_cols, static))
        return program, args, static, label

    def run(self, program, bucket, preset, *, tile_cols=None, **static):
        """``program`` over the bucket's configurations, piece by piece (one compile)."""
        outs = []
        for n, args, full, label, units in self._pieces(program, bucket, preset, tile_cols, static):
            out = self.executables.call(program, args, full, label=label, units=units)
            outs.append(host(out)[:n])
        return np.concatenate(outs).astype(np.float64)  # a float32 carrier's: exact

    def _holding(self, buckets, chunk) -> list[tuple]:
        """The ``buckets`` that hold lengths of the (row) ``chunk`` (those with
        entries: a share may leave one empty)."""
        return [b for b in buckets if set(b) & set(chunk) and self.entries(b)]

    def _gather(self, chunk, buckets, outputs) -> list:
        """The outputs of ``chunk``'s entries, one array each (its rows padded to
        its bucket's length), from ``outputs(bucket)`` of the buckets holding them."""
        where = {}
        for b in self._holding(buckets, chunk):
            out = outputs(b)
            where.update((e, out[i]) for i, e in enumerate(self.entries(b)))
        return [where[e] for e in self.entries(chunk)]

    def reference_plans(self, chunk, preset) -> list:
        """The :meth:`plan` of :meth:`golden` and of :meth:`baseline`."""
        causal = self.grid.causal
        gold = self.features.for_golden()
        return [
            plan
            for b in self._holding(self.buckets, chunk)
            for plan in (
                self.plan(reference_program, b, None, causal=causal, features=gold),
                self.plan(reference_program, b, preset, causal=causal),
            )
        ]

    def flash_plans(self, chunk, preset, *, tile_cols, **static) -> list:
        """The :meth:`plan` of every flash bucket that :meth:`flash` runs for ``chunk``."""
        return [
            self.plan(flash_program, b, preset, tile_cols=tile_cols, **static)
            for b in self._holding(self.flash_buckets, chunk)
        ]

    def flash(self, chunk, preset, *, tile_cols, **static) -> list:
        """The flash outputs of the (row) ``chunk``'s entries (:meth:`_gather`):
        from runs over the flash buckets that hold them.  The runs of one
        (preset, static) are kept until another is asked for."""
        run = (preset, tile_cols, sorted(static.items()))
        if run != self._flash_run:
            self._flash, self._flash_run = {}, run

        def outputs(b):
            if b not in self._flash:
                self._flash[b] = self.run(flash_program, b, preset, tile_cols=tile_cols, **static)
            return self._flash[b]

        return self._gather(chunk, self.flash_buckets, outputs)

    def kernel(self, chunk, preset):
        """The outputs of ``preset`` ("kernel:NAME") for the chunk's entries, padded
        to its longest length: :func:`fa_jax.kernels.emulate` of the kernel on each
        configuration's own Q, K, V rounded to its format (module docstring).  The
        outputs of one preset are kept until another is asked for."""
        name = kernel_name(preset)
        if name is None:
            raise ValueError(f"FormatBatch.kernel: expected 'kernel:NAME', got {preset!r}")
        if preset != self._kernel_run:
            self._kernel, self._kernel_run = {}, preset
        if chunk not in self._kernel:
            q, k, v = self.rounded_inputs(chunk)
            rows = q.shape[-2]
            outs = []
            start = time.perf_counter()
            for j, (f, n, _) in enumerate(self.entries(chunk)):
                qkv = [t[j, ..., :n, :] for t in (q, k, v)]
                try:
                    out = kernels.emulate(name, *qkv, fmt=f, causal=self.grid.causal)
                except NotImplementedError as err:
                    raise ValueError(
                        f"sweep: {preset}: expected a format and shape the kernel's model "
                        f"covers, got {f.name} at N = {n}, d = {self.grid.d}: {err}"
                    ) from None
                pad = [(0, 0)] * (out.ndim - 2) + [(0, rows - n), (0, 0)]
                outs.append(np.pad(out, pad))
            profile = self.executables.profile
            if profile is not None:
                seconds = time.perf_counter() - start
                profile.ran(f"{name} emulate N<={max(chunk)}", seconds)
            self._kernel[chunk] = np.stack(outs)
        return self._kernel[chunk]

    def output_sizes(self, chunk) -> set[int]:
        """The element counts of the chunk's unpadded outputs, one configuration's
        (its rows: the length, or the features' queries), that its metrics read."""
        b, h, *_ = self._input_shapes(max(chunk))[0]
        return {b * h * self._rows(n) * self.grid.d for _, n, _ in self.entries(chunk)}

    def golden(self, chunk) -> list:
        """The golden outputs of the chunk's entries (:meth:`_gather`)."""

        def outputs(b):
            if b not in self._golden:
                gold = self.features.for_golden()
                causal = self.grid.causal
                self._golden[b] = self.run(reference_program, b, None, causal=causal, features=gold)
            return self._golden[b]

        return self._gather(chunk, self.buckets, outputs)

    def baseline(self, chunk, preset) -> list:
        """``preset``'s baseline outputs of the chunk's entries (:meth:`_gather`)."""

        def outputs(b):
            if (b, preset) not in self._baseline:
                causal = self.grid.causal
                self._baseline[b, preset] = self.run(reference_program, b, preset, causal=causal)
            return self._baseline[b, preset]

        return self._gather(chunk, self.buckets, outputs)


def chunks_of(grid: Grid, pad: bool, ratio: int = PAD_RATIO) -> list[tuple]:
    """The grid's lengths in padded buckets (``pad``), or one length each."""
    lens = sorted(grid.seq_lens)
    return length_buckets(lens, ratio) if pad else [(n,) for n in lens]


def flash_chunks_of(grid: Grid, pad: bool) -> list[tuple]:
    """The flash programs' buckets: :data:`FLASH_PAD_RATIO` wide where no policy of
    the grid changes with the length, else the reference programs' buckets (a
    configuration's policy is taken at its bucket's padded length)."""
    ratio = PAD_RATIO if policies_follow_length(grid) else FLASH_PAD_RATIO
    return chunks_of(grid, pad, ratio)


def policies_follow_length(grid: Grid) -> bool:
    """Whether a policy of the grid changes with the sequence length (a kernel
    model's may), so that a configuration's values depend on its bucket's length."""
    return any(
        len({policy_of(p, f, n, grid.d) for n in grid.seq_lens}) > 1
        for p in grid.policies
        for f in grid.resolved_formats()
    )


def policy_of(preset, f, n: int, d: int):
    """The policy of one configuration: ``preset``'s in format ``f``
    (:func:`~.grid.policy_for`, for lengths padded to ``n``), or None's, the golden."""
    return golden_for(f) if preset is None else policy_for(preset, f, n, d)


def batch_key(grid: Grid, f, pad: bool) -> tuple:
    """Formats with equal keys share a :class:`FormatBatch`: the shapes of their
    golden and of every preset's policy at every padded length, a slot per stage."""
    ns = sorted({max(c) for c in (*chunks_of(grid, pad), *flash_chunks_of(grid, pad))})
    every_stage = tuple(range(len(STAGES)))
    return tuple(
        policy_shape(policy_of(p, f, n, grid.d), every_stage)
        for p in (None, *grid.policies)
        for n in ns
    )
