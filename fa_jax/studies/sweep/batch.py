"""How the sweep feeds its programs: length buckets, memory-bounded pieces, devices.

:class:`KindBatch` holds the flat (format × seq_len × seed) axis of one format
kind.  Lengths are padded only within buckets whose longest length is at most
:data:`PAD_RATIO` times the shortest (:func:`length_buckets`), one program per
bucket: padding a short length to a much longer one costs quadratically.  The
inputs of each (seed, seq_len) are :func:`fa_jax.inputs.make_inputs`, so every
program sees the values a direct call would.

Memory: the baseline and golden programs materialise (N, N) float64 scores,
so each call runs over its configurations in equal pieces whose estimated
working memory (3 · 8 · N² bytes per configuration and head; 3 · 8 · N ·
(Bc + d) for flash) fits the memory budget (default :data:`MEMORY_BUDGET`),
the last piece padded so that every piece reuses one compile.

Devices: the configuration axis is padded (repeating its last entry) to a
multiple of the device count and sharded over a 1-D
:class:`jax.sharding.Mesh` (axis ``"cfg"``).  Each configuration is computed
by one device, so the results equal a single-device run bitwise.
"""

from __future__ import annotations

import jax
import numpy as np

from fa_jax.inputs import make_inputs
from fa_jax.studies.sweep.executables import Executables
from fa_jax.studies.sweep.grid import Grid
from fa_jax.studies.sweep.programs import Kind, baseline_program, golden_program

__all__ = ["MEMORY_BUDGET", "PAD_RATIO", "KindBatch", "host", "length_buckets", "shard"]

PAD_RATIO = 2  # pad only within buckets whose longest length is <= 2x the shortest
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


def shard(args, n, *, pad_to=None):
    """Pad the leading (configuration) axis, repeating its last entry, to ``pad_to``
    entries and then to a multiple of the device count, and shard it over a 1-D
    mesh (no sharding on one device)."""
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


def _label(program, chunk, static) -> str:
    """A program's name for the profile: what it computes and its static signature."""
    parts = [program.__name__.removesuffix("_program")]
    parts += [str(static[k]) for k in ("preset", "variant") if k in static]
    if "blocks" in static:
        parts.append(f"Bc={static['blocks'].bc}")
    parts.append(f"{static['kind'][1]} formats")
    if static.get("causal"):
        parts.append("causal")
    parts.append(f"N<={max(chunk)}")
    return " ".join(parts)


def host(x):
    """A device value as a numpy array."""
    return np.asarray(jax.device_get(x))


class KindBatch:
    """The flat (format × seq_len × seed) axis of one format kind, its inputs
    (padded within length buckets, or one batch per length), and caches of the
    golden and baseline outputs that every variant and tiling reuses."""

    def __init__(self, grid: Grid, fmts, pad: bool, memory_budget: int, executables: Executables):
        self.grid, self.fmts, self.memory_budget = grid, fmts, memory_budget
        self.executables = executables
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
                    qkv = make_inputs(
                        s, n, batch=g.batch, heads=g.heads, d=g.d, distribution=g.distribution
                    )
                    pad = [(0, 0), (0, 0), (0, n_max - n), (0, 0)]
                    raw[(s, n)] = [np.pad(t, pad) for t in qkv]
            q, k, v = (np.stack([raw[(s, n)][i] for _, n, s in entries]) for i in range(3))
            widths = tuple(
                np.array([getattr(f, a) for f, _, _ in entries], np.int32)
                for a in ("exp_bits", "man_bits", "bias")
            )
            lengths = np.array([n for _, n, _ in entries], np.int32)
            self._inputs[chunk] = (q, k, v, widths, lengths)
        return self._inputs[chunk]

    def _per_config_bytes(self, chunk, tile_cols=None):
        """Estimated working memory of one configuration: the (N, N) float64 scores
        and their exponentials, or a flash tile's (N, Bc + d)."""
        g, n = self.grid, max(chunk)
        cols = n if tile_cols is None else tile_cols + g.d
        return 3 * 8 * g.batch * g.heads * n * cols

    def _pieces(self, program, chunk, tile_cols, static):
        """The chunk's configurations in pieces of equal size that fit
        ``self.memory_budget`` (the last one padded): (configurations in the piece,
        its sharded arguments), and the program's label."""
        args = self.inputs(chunk)
        total = len(args[-1])
        per = max(1, self.memory_budget // self._per_config_bytes(chunk, tile_cols))
        pieces = -(-total // min(per, total))
        size = -(-total // pieces)
        label = _label(program, chunk, static)
        for start in range(0, total, size):
            piece = jax.tree_util.tree_map(lambda x, i=start: x[i : i + size], args)
            n = len(piece[-1])
            yield n, shard(piece, n, pad_to=size), label

    def plan(self, program, chunk, *, tile_cols=None, **static):
        """What :meth:`run` will call, for :meth:`Executables.prepare`:
        ``(program, args, static, label)`` (every piece shares one compile)."""
        _, args, label = next(self._pieces(program, chunk, tile_cols, static))
        return program, args, static, label

    def run(self, program, chunk, *, tile_cols=None, **static):
        """``program`` over the chunk's configurations, piece by piece (one compile)."""
        outs = []
        for n, args, label in self._pieces(program, chunk, tile_cols, static):
            outs.append(host(self.executables.call(program, args, static, label=label))[:n])
        return np.concatenate(outs)

    def _golden_static(self, kind: Kind) -> dict:
        return dict(kind=kind, causal=self.grid.causal)

    def _baseline_static(self, preset, kind: Kind) -> dict:
        return dict(preset=preset, kind=kind, causal=self.grid.causal)

    def reference_plans(self, chunk, preset, kind: Kind) -> list:
        """The :meth:`plan` of :meth:`golden` and of :meth:`baseline`."""
        return [
            self.plan(golden_program, chunk, **self._golden_static(kind)),
            self.plan(baseline_program, chunk, **self._baseline_static(preset, kind)),
        ]

    def golden(self, chunk, kind: Kind):
        if chunk not in self._golden:
            self._golden[chunk] = self.run(golden_program, chunk, **self._golden_static(kind))
        return self._golden[chunk]

    def baseline(self, chunk, preset, kind: Kind):
        key = (chunk, preset)
        if key not in self._baseline:
            static = self._baseline_static(preset, kind)
            self._baseline[key] = self.run(baseline_program, chunk, **static)
        return self._baseline[key]
