"""The sweep's numbers against stored CSVs, byte for byte (metadata aside).

The snapshots in tests/data were written by the sweep engine before its
compile-time work, and written again when the metrics' sums took their stated
pairwise order (mean, std and rmse moved by at most 3.2e-16 relative; nothing
else changed), and again when no square was contracted into its sum's first
addition any more (18 of 480 std and rmse values moved by 1 to 4 float64 ulps
to the numpy tree's; nothing else changed); any change to how programs are
built, batched or cached must leave every value unchanged.  ``sweep_snapshot.csv`` is the grid of
test_sweep.py (paper_uniform, fa1 and fa2, a custom format, SRAM tiles), compared
there against that module's sweep;
``sweep_causal_snapshot.csv`` covers causal masking, two other presets and a
second format with a different bias.
"""

import pathlib

from fa_jax.attention import Blocks
from fa_jax.studies.options import study_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep import Grid, run_sweep

DATA = pathlib.Path(__file__).parent / "data"

CAUSAL_GRID = Grid(
    formats=("bf16", "e5m2"),
    seq_lens=(12, 20),
    blocks=(Blocks(4, 8),),
    variants=("fa2",),
    policies=("fa2_kernel", "torch_math"),
    seeds=(3,),
    d=8,
    heads=2,
    causal=True,
)


def test_causal_grid_equals_its_snapshot_compiled_and_loaded_from_the_cache(tmp_path):
    """A fresh cache: every program compiled; a second run: every program loaded from
    the cache.  Both reproduce the snapshot."""
    want = (DATA / "sweep_causal_snapshot.csv").read_bytes()
    sources = []
    for run in ("first", "second"):
        profile = Profile()
        with study_options(cache=tmp_path / "cache", profile=profile):
            csv_path = run_sweep(CAUSAL_GRID, tmp_path / run, quiet=True)
        assert csv_path.read_bytes() == want, run
        sources.append({p.source for p in profile.programs.values()})
    assert sources == [{"compiled"}, {"loaded"}]


def test_without_the_cache_nothing_is_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_JAX_CACHE_DIR", str(tmp_path / "cache"))
    grid = Grid(formats=("bf16",), seq_lens=(12,), blocks=(Blocks(4, 8),), d=8)
    run_sweep(grid, tmp_path / "out", quiet=True, cache=False)
    assert not (tmp_path / "cache").exists()
