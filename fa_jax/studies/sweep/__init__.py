"""Sweeps: a :class:`Grid` of configurations -> one vmapped program per static
signature -> tidy ``results.csv`` (:mod:`.grid` what is swept, :mod:`.engine`
how it runs)."""

from fa_jax.studies.sweep.engine import MEMORY_BUDGET, length_buckets, run_sweep
from fa_jax.studies.sweep.grid import (
    COLUMNS,
    COMPARISONS,
    KEY_COLUMNS,
    METRICS,
    Grid,
    SramBlocks,
    row_key,
)

__all__ = [
    "COLUMNS",
    "COMPARISONS",
    "KEY_COLUMNS",
    "MEMORY_BUDGET",
    "METRICS",
    "Grid",
    "SramBlocks",
    "length_buckets",
    "row_key",
    "run_sweep",
]
