"""The paper's question for the attention models run today: GQA, windows, softcap,
ALiBi (``features``) and split-KV decoding (``decoding``).

Both are sweeps (:class:`~fa_jax.studies.sweep.Grid` with a ``features`` axis,
:class:`~fa_jax.studies.sweep.Features`) run like :mod:`fa_jax.studies.figures`'
paper figures: into ``out_dir/NAME/`` (resumable), averaged over seeds, printed
as a table and drawn into ``NAME.png``; each returns the same dict.

* ``features``: per feature, max |flash − golden| and max |baseline − golden|
  and their ratio against N, in BF16 and FP16, under each policy (Golden et al.
  2024, Figs 4–5, asked of each feature): d = 64, 4 query heads, 64×64 tiles,
  entries ``none``, ``kv_heads=1`` (MQA), ``window=256:0`` (a causal-like sliding
  window), ``softcap=5``, ``alibi`` and FP8/int8 KV caches (``kv=e4m3fn/head``,
  ``kv=e5m2/head``, ``kv=int8/token``: the cache's error against a golden that
  reads K and V uncached).
* ``decoding``: one query row (``queries=1``) against 4k … 128k keys, d = 128,
  Bc = 128, flash as S = 1, 2, 4, … split-KV parts (FlashAttention-2's
  ``num_splits``, combined by their log-sum-exps): max |flash − golden| against
  S per key count, BF16, under each policy.

Grids (quick / full): ``features`` N = 256, 1024 / 1024, 2048, 4096 with 2 / 3
seeds (the baseline's N × N float64 scores of 4 heads bound N); ``decoding``
keys 4096, 16384 / 4096 … 131072 with S up to 8 / 16, 2 heads and 4 seeds.
"""

from __future__ import annotations

import math

from fa_jax.attention import Blocks
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.figure_runs import figure_grid, finish_figure, load_means, ratio, run_figure
from fa_jax.studies.results import pyplot
from fa_jax.studies.sweep import Features
from fa_jax.studies.table import print_table

__all__ = ["FEATURE_FIGURES", "decoding", "features"]

_FEATURES = (
    Features(),
    Features(kv_heads=1),
    Features(window=(256, 0)),
    Features(softcap=5.0),
    Features(alibi=True),
    Features(kv="e4m3fn", kv_scaling="head"),
    Features(kv="e5m2", kv_scaling="head"),
    Features(kv="int8", kv_scaling="token"),
)


def _means_by_feature(csv_path, grid):
    """{(policy, format, seq_len, features label, comparison, metric): mean over
    seeds} of ``grid``'s own rows, one grid per features entry."""
    import dataclasses

    out = {}
    for feat in grid.features:
        sub = dataclasses.replace(grid, features=(feat,))
        means, _ = load_means(csv_path, sub)
        for (p, f, n, _blk, comp, m), v in means.items():
            out[(p, f, n, feat.label(), comp, m)] = v
    return out


def features(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """Flash and baseline deviation from golden per attention feature (module docstring)."""
    base = dict(formats=("bf16", "fp16"), blocks=(Blocks(64, 64),), heads=4, features=_FEATURES)
    grid = figure_grid(
        quick,
        dict(base, seq_lens=(256, 1024), seeds=(0, 1)),
        dict(base, seq_lens=(1024, 2048, 4096), seeds=(0, 1, 2)),
        policies,
        grid_overrides,
    )
    out, csv_path, _, _ = run_figure("features", grid, out_dir, quiet, split=not quick)
    means = _means_by_feature(csv_path, grid)
    rows = []
    for p in grid.policies:
        for f in (x.name for x in grid.resolved_formats()):
            for feat in grid.features:
                for n in sorted(grid.seq_lens):
                    key = (p, f, n, feat.label())
                    fl = means[(*key, "flash_vs_golden", "max_abs_diff")]
                    bl = means[(*key, "baseline_vs_golden", "max_abs_diff")]
                    rows.append(
                        {
                            "policy": p,
                            "format": f,
                            "features": feat.label(),
                            "seq_len": n,
                            "flash_vs_golden": fl,
                            "baseline_vs_golden": bl,
                            "ratio": ratio(fl, bl),
                        }
                    )
    print_table(
        (
            "policy",
            "format",
            "features",
            "seq_len",
            "flash_vs_golden",
            "baseline_vs_golden",
            "ratio",
        ),
        rows,
        title=f"Features: max |out - golden|, ratio = flash / baseline (d={grid.d}, "
        f"heads={grid.heads}, tiles 64x64, mean over {len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.feature_figures: plotting")
    fmts = [x.name for x in grid.resolved_formats()]
    fig, axes = plt.subplots(
        len(fmts),
        len(grid.policies),
        figsize=(5.5 * len(grid.policies), 3.8 * len(fmts)),
        squeeze=False,
        sharex=True,
    )
    for row, f in zip(axes, fmts):
        for ax, p in zip(row, grid.policies):
            for i, feat in enumerate(grid.features):
                pr = [
                    r
                    for r in rows
                    if (r["policy"], r["format"], r["features"]) == (p, f, feat.label())
                ]
                ax.semilogx(
                    [r["seq_len"] for r in pr],
                    [r["ratio"] for r in pr],
                    "o-",
                    color=f"C{i}",
                    label=feat.label(),
                    base=2,
                )
            ax.axhline(1.0, color="k", lw=0.6)
            ax.set_title(f"{p}, {f}")
            ax.set_ylabel("flash / baseline (max |out - golden|)")
            ax.legend(fontsize=7)
        for ax in row:
            ax.set_xlabel("sequence length N")
    return finish_figure(
        fig,
        "Flash vs baseline deviation per attention feature",
        out,
        "features",
        grid,
        csv_path,
        rows,
    )


def decoding(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """Split-KV decoding: deviation from golden against the number of splits (module docstring)."""
    quick_splits, full_splits = (1, 2, 4, 8), (1, 2, 4, 8, 16)

    def entries(splits):
        return tuple(Features(queries=1, num_splits=s) for s in splits)

    base = dict(formats=("bf16",), blocks=(Blocks(1, 128),), d=128, heads=2, seeds=(0, 1, 2, 3))
    grid = figure_grid(
        quick,
        dict(base, seq_lens=(4096, 16384), features=entries(quick_splits)),
        dict(base, seq_lens=(4096, 16384, 65536, 131072), features=entries(full_splits)),
        policies,
        grid_overrides,
    )
    out, csv_path, _, _ = run_figure("decoding", grid, out_dir, quiet, split=not quick)
    means = _means_by_feature(csv_path, grid)
    f = grid.resolved_formats()[0].name
    rows = []
    for p in grid.policies:
        for n in sorted(grid.seq_lens):
            for feat in grid.features:
                key = (p, f, n, feat.label())
                rows.append(
                    {
                        "policy": p,
                        "keys": n,
                        "splits": feat.num_splits,
                        "keys_per_split": math.ceil(n / feat.num_splits),
                        "flash_max": means[(*key, "flash_vs_golden", "max_abs_diff")],
                        "flash_rmse": means[(*key, "flash_vs_golden", "rmse")],
                        "baseline_max": means[(*key, "baseline_vs_golden", "max_abs_diff")],
                    }
                )
    print_table(
        ("policy", "keys", "splits", "keys_per_split", "flash_max", "flash_rmse", "baseline_max"),
        rows,
        title=f"Split-KV decoding: |out - golden| of one query row ({f}, d={grid.d}, "
        f"Bc=128, {grid.heads} heads, mean over {len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.feature_figures: plotting")
    fig, axes = plt.subplots(
        1, len(grid.policies), figsize=(5.5 * len(grid.policies), 4), squeeze=False
    )
    for ax, p in zip(axes[0], grid.policies):
        for i, n in enumerate(sorted(grid.seq_lens)):
            pr = [r for r in rows if (r["policy"], r["keys"]) == (p, n)]
            ax.semilogx(
                [r["splits"] for r in pr],
                [r["flash_max"] for r in pr],
                "o-",
                color=f"C{i}",
                label=f"{n} keys",
                base=2,
            )
            ax.axhline(pr[0]["baseline_max"], color=f"C{i}", ls=":", lw=0.8)
        ax.set_title(p)
        ax.set_xlabel("split-KV parts S")
        ax.set_ylabel("max |flash - golden| (dotted: baseline)")
        ax.legend(fontsize=7)
    return finish_figure(
        fig, f"Split-KV decoding, one query row ({f})", out, "decoding", grid, csv_path, rows
    )


FEATURE_FIGURES = {"features": features, "decoding": decoding}
