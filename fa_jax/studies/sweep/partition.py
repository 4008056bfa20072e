"""Which process computes which configurations: the partition of a multi-process sweep.

The unit of the partition is a *unit* ``(format name, seq_len, seed)``: every
configuration of one unit (each policy, variant and tiling) goes to one
process, because they share that unit's golden output and, per policy, its
baseline (:mod:`.engine`), so no reference attention is computed twice.

The rule (:func:`partition`) depends only on the grid and the units still to
compute, never on timing, so every process derives the same partition on its
own: units are taken by estimated cost, largest first (ties in the grid's
canonical order, :func:`.engine.canonical_keys`), each to the process with the
least estimated work so far (ties to the lowest process index): the "longest
processing time first" rule.  A unit's cost (:func:`unit_cost`) counts the
score elements its programs compute: the golden and each policy's baseline
materialise (N, N) scores at the padded length N of the unit's length bucket,
and each flash run (policy × variant × key tile width) visits its own n keys
for the N query rows of its flash bucket (:mod:`.batch`).  A modulo rule
(unit index mod P) would ignore that a sequence length of 1024 costs 64 times
one of 128; contiguous chunks of the canonical order would give one process
all the long sequences of a format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fa_jax._checks import positive_int
from fa_jax.studies.sweep.batch import chunks_of, flash_chunks_of
from fa_jax.studies.sweep.grid import Grid

__all__ = ["partition", "unit_cost", "unit_of"]

Unit = tuple[str, int, int]  # (format name, seq_len, seed)


def unit_of(key: Mapping[str, str]) -> Unit:
    """The unit of a configuration, from its row key (:func:`.grid.row_key`)."""
    return key["format"], int(key["seq_len"]), int(key["seed"])


def unit_cost(grid: Grid, pad: bool) -> dict[int, int]:
    """Estimated cost of one unit per sequence length (module docstring), in
    score elements."""
    bucket = {n: max(c) for c in chunks_of(grid, pad) for n in c}
    flash_bucket = {n: max(c) for c in flash_chunks_of(grid, pad) for n in c}
    tile_widths = len({b.bc for _, b in grid.resolved_blocks()})
    runs = len(grid.policies) * len(grid.variants) * tile_widths
    return {
        n: (1 + len(grid.policies)) * bucket[n] ** 2 + runs * flash_bucket[n] * n
        for n in grid.seq_lens
    }


def partition(units: Sequence[Unit], cost: Mapping[int, int], processes: int) -> list[set[Unit]]:
    """``units`` (in canonical order) dealt to ``processes`` processes by the
    longest-processing-time-first rule (module docstring); ``cost`` maps a
    sequence length to its units' cost.  Returns one set per process."""
    positive_int(processes, "partition: processes")
    order = sorted(range(len(units)), key=lambda i: (-cost[units[i][1]], i))
    shares: list[set[Unit]] = [set() for _ in range(processes)]
    load = [0] * processes
    for i in order:
        p = min(range(processes), key=lambda j: (load[j], j))
        shares[p].add(units[i])
        load[p] += cost[units[i][1]]
    return shares
