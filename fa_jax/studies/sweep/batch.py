"""How the sweep feeds its programs: length buckets, pieces, devices.

:class:`FormatBatch` holds the flat (format × seq_len × seed) axis of formats
whose policies share their shapes (:class:`~.programs.PolicyShape`), and gives
each program its inputs and each configuration's policy widths.  Lengths are
padded only within buckets whose longest length is at most :data:`PAD_RATIO`
times the shortest (:func:`length_buckets`), one program per bucket: padding
a short length to a much longer one costs the reference programs
quadratically.  Flash programs visit only the key blocks a configuration's
length holds (:func:`fa_jax.attention.flash_attention`), so padding costs them
only the padded query rows, linearly: they take wider buckets
(:data:`FLASH_PAD_RATIO`), and fewer programs, wherever the policies do not
depend on the length (kernel models' do).  The inputs of each (seed, seq_len)
are :func:`fa_jax.inputs.make_inputs`, so every program sees the values a
direct call would.

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
    "PAD_RATIO",
    "PIECE",
    "FormatBatch",
    "host",
    "length_buckets",
    "shard",
]

PAD_RATIO = 2  # pad only within buckets whose longest length is <= 2x the shortest
FLASH_PAD_RATIO = 8  # flash's padded work is linear in the ratio, the reference's quadratic
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


def shard(args, n, *, pad_to=None, lo=0):
    """Entries ``lo .. lo + n`` of the leading (configuration) axis, padded
    (repeating the last) to ``pad_to`` entries and then to a multiple of the
    process's device count, and sharded over a 1-D mesh of those devices (no
    sharding on one device)."""
    devices = jax.local_devices()
    extra = (pad_to or n) - n
    extra += -(n + extra) % len(devices)

    def pad(x):
        x = np.asarray(x)[lo : lo + n]
        if extra:
            x = np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])
        return x

    args = jax.tree_util.tree_map(pad, args)
    if len(devices) == 1:
        return args
    mesh = jax.sharding.Mesh(np.array(devices), ("cfg",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("cfg"))
    return jax.device_put(args, sharding)


def _label(program, chunk, static) -> str:
    """A program's name for the profile: what it computes and its static signature
    (one program serves every policy of its shape, the golden's too)."""
    parts = [program.__name__.removesuffix("_program")]
    parts += [str(static[k]) for k in ("variant",) if k in static]
    if "blocks" in static:
        parts.append(f"Bc={static['blocks'].bc}")
    if static.get("causal"):
        parts.append("causal")
    if static.get("features", PAPER) != PAPER:
        parts.append(static["features"].label())
    parts.append(f"N<={max(chunk)}")
    return " ".join(parts)


def host(x):
    """A device value as a numpy array."""
    return np.asarray(jax.device_get(x))


class FormatBatch:
    """The flat (format × seq_len × seed) axis of formats whose policies share
    their shapes, its inputs (padded within length buckets, or one batch per
    length), and caches of the golden and baseline outputs that every variant
    and tiling reuses.  A ``preset`` of None is the golden (:func:`golden_for`).
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
        # Split-KV's boundaries follow the key axis given, so its flash runs unpadded.
        unpadded = features.num_splits > 1
        self.flash_chunks = flash_chunks_of(grid, pad and not unpadded)
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
            flash_program: slots(grid.policies, self.flash_chunks),
        }
        self._inputs = {}
        self._narrow_inputs = {}
        self._policies = {}
        self._golden = {}
        self._baseline = {}
        self._flash: dict = {}  # one flash run's outputs by flash chunk
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

    def _per_config_bytes(self, chunk, tile_cols=None):
        """Estimated working memory of one configuration: the (N, N) float64 scores
        and their exponentials, or a flash tile's (N, Bc + d)."""
        g, n = self.grid, max(chunk)
        rows = n if self.features.queries is None else min(n, self.features.queries)
        cols = n if tile_cols is None else tile_cols + g.d
        return 3 * 8 * g.batch * g.heads * rows * cols

    def _pieces(self, program, chunk, preset, tile_cols, static):
        """The chunk's configurations in pieces (module docstring): (configurations
        in the piece, its sharded arguments), the full static arguments and the
        program's label."""
        q, k, v, lengths = self.inputs(chunk)
        if kernel_name(preset) is not None:  # its baseline reads what its model reads
            q, k, v = self.rounded_inputs(chunk)
        shape, widths = self.policies(chunk, preset, self.slots[program])
        if program is flash_program and self.carrier != "float64":
            shape = dataclasses.replace(shape, carrier=self.carrier)
            q, k, v = self.narrow_inputs(chunk, preset)
        static = {"features": self.features, **static, "shape": shape}
        per = max(1, self.memory_budget // self._per_config_bytes(chunk, tile_cols))
        size = min(per, PIECE * len(jax.local_devices()))
        label = _label(program, chunk, static)
        # One policy per call: a piece holds configurations of one format (entries
        # are grouped by format), its widths an argument beside them.
        first = 0
        for f, entries in itertools.groupby(f for f, _, _ in self.entries(chunk)):
            stop = first + len(list(entries))
            for start in range(first, stop, size):
                end = min(start + size, stop)
                q_p, k_p, v_p, n_p = shard((q, k, v, lengths), end - start, pad_to=size, lo=start)
                yield end - start, (q_p, k_p, v_p, widths[f], n_p), static, label
            first = stop

    def plan(self, program, chunk, preset, *, tile_cols=None, **static):
        """What :meth:`run` will call, for :meth:`Executables.prepare`:
        ``(program, args, static, label)`` (every piece shares one compile)."""
        _, args, static, label = next(self._pieces(program, chunk, preset, tile_cols, static))
        return program, args, static, label

    def run(self, program, chunk, preset, *, tile_cols=None, **static):
        """``program`` over the chunk's configurations, piece by piece (one compile)."""
        outs = []
        for n, args, full, label in self._pieces(program, chunk, preset, tile_cols, static):
            outs.append(host(self.executables.call(program, args, full, label=label))[:n])
        return np.concatenate(outs).astype(np.float64)  # a float32 carrier's: exact

    def reference_plans(self, chunk, preset) -> list:
        """The :meth:`plan` of :meth:`golden` and of :meth:`baseline`."""
        causal = self.grid.causal
        gold = self.features.for_golden()
        return [
            self.plan(reference_program, chunk, None, causal=causal, features=gold),
            self.plan(reference_program, chunk, preset, causal=causal),
        ]

    def _flash_chunks_for(self, chunk) -> list[tuple]:
        """The flash chunks that hold the lengths of the (reference) ``chunk``
        (those with entries: a share may leave one empty)."""
        return [fc for fc in self.flash_chunks if set(fc) & set(chunk) and self.entries(fc)]

    def flash_plans(self, chunk, preset, *, tile_cols, **static) -> list:
        """The :meth:`plan` of every flash chunk that :meth:`flash` runs for ``chunk``."""
        return [
            self.plan(flash_program, fc, preset, tile_cols=tile_cols, **static)
            for fc in self._flash_chunks_for(chunk)
        ]

    def flash(self, chunk, preset, *, tile_cols, **static):
        """The flash outputs of the (reference) ``chunk``'s entries, padded to its
        longest length: from runs over the flash chunks that hold them.  The runs
        of one (preset, static) are kept until another is asked for."""
        run = (preset, tile_cols, sorted(static.items()))
        if run != self._flash_run:
            self._flash, self._flash_run = {}, run
        where = {}  # entry -> (its flash chunk, its index there)
        for fc in self._flash_chunks_for(chunk):
            if fc not in self._flash:
                self._flash[fc] = self.run(flash_program, fc, preset, tile_cols=tile_cols, **static)
            where.update((e, (fc, i)) for i, e in enumerate(self.entries(fc)))
        rows = self.inputs(chunk)[0].shape[-2]  # the chunk's padded query rows

        def padded(x):  # a shorter flash chunk's rows, zero-padded (never read)
            x = x[..., :rows, :]
            return np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, 0)])

        return np.stack(
            [padded(self._flash[fc][i]) for fc, i in (where[e] for e in self.entries(chunk))]
        )

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
        q = self.inputs(chunk)[0]
        lead, d = q.shape[1] * q.shape[2], self.grid.d
        queries = self.features.queries
        return {
            lead * (n if queries is None else min(n, queries)) * d
            for _, n, _ in self.entries(chunk)
        }

    def golden(self, chunk):
        if chunk not in self._golden:
            self._golden[chunk] = self.run(
                reference_program,
                chunk,
                None,
                causal=self.grid.causal,
                features=self.features.for_golden(),
            )
        return self._golden[chunk]

    def baseline(self, chunk, preset):
        key = (chunk, preset)
        if key not in self._baseline:
            self._baseline[key] = self.run(
                reference_program, chunk, preset, causal=self.grid.causal
            )
        return self._baseline[key]


def chunks_of(grid: Grid, pad: bool, ratio: int = PAD_RATIO) -> list[tuple]:
    """The grid's lengths in padded buckets (``pad``), or one length each."""
    lens = sorted(grid.seq_lens)
    return length_buckets(lens, ratio) if pad else [(n,) for n in lens]


def flash_chunks_of(grid: Grid, pad: bool) -> list[tuple]:
    """The flash programs' buckets: :data:`FLASH_PAD_RATIO` wide where no policy of
    the grid changes with the length, else the reference programs' buckets (a
    configuration's policy is taken at its bucket's padded length)."""
    lens = grid.seq_lens
    by_length = any(
        len({policy_of(p, f, n, grid.d) for n in lens}) > 1
        for p in grid.policies
        for f in grid.resolved_formats()
    )
    return chunks_of(grid, pad, PAD_RATIO if by_length else FLASH_PAD_RATIO)


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
