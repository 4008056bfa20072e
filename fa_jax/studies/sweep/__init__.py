"""Sweeps: a :class:`Grid` of configurations -> one compiled program per static
signature -> tidy ``results.csv`` (Golden et al. 2024, §4).

:mod:`.grid` says what is swept (:mod:`.features`: the attention features),
:mod:`.programs` what is computed per configuration, :mod:`.batch` how
configurations are batched over lengths, memory and devices, and
:mod:`.engine` runs it all into the CSV.  Under
``jax.distributed``, :mod:`.partition` says which process computes which
configurations and :mod:`.cluster` how the processes agree and wait.
"""

from fa_jax.studies.sweep.engine import (
    MEMORY_BUDGET,
    canonical_keys,
    length_buckets,
    merge_sweep,
    parts_folder,
    run_sweep,
)
from fa_jax.studies.sweep.features import Features
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
    "Features",
    "Grid",
    "SramBlocks",
    "canonical_keys",
    "length_buckets",
    "merge_sweep",
    "parts_folder",
    "row_key",
    "run_sweep",
]
