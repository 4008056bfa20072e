"""The steps every sweep-backed figure shares: a grid from a figure's keywords,
the sweep into ``out_dir/NAME/`` (resumable; the full grids one length and a few
formats at a time, to bound peak memory), the means of each metric over the grid's
seeds, and the figure saved with its result dict (:mod:`fa_jax.studies.figures`,
:mod:`fa_jax.studies.feature_figures`)."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

from fa_jax.studies.results import check_out_dir, pyplot, read_csv, write_json
from fa_jax.studies.sweep import COLUMNS, KEY_COLUMNS, Grid, row_key, run_sweep

__all__ = [
    "BASE",
    "figure_grid",
    "finish_figure",
    "format_names",
    "load_means",
    "ratio",
    "run_figure",
]

# The paper's setting: d = 64, one head, N(0, 1) inputs, FlashAttention-2's loop.
BASE = dict(d=64, batch=1, heads=1, distribution="normal", variants=("fa2",))
_FORMAT_CHUNK = 4


def figure_grid(quick: bool, quick_kw: dict, full_kw: dict, policies, overrides) -> Grid:
    kw: dict[str, Any] = dict(BASE, **(quick_kw if quick else full_kw))
    kw["policies"] = tuple(policies)
    kw.update(overrides or {})
    return Grid(**kw)


def _keys(grid: Grid) -> set[tuple]:
    """The key-column tuples (as in the CSV) of every configuration of ``grid``."""
    return {
        tuple(row_key(grid, p, f, n, label, b, v, seed, feat).values())
        for feat in grid.features
        for p in grid.policies
        for f in grid.resolved_formats()
        for n in grid.seq_lens
        for label, b in grid.resolved_blocks()
        for v in grid.variants
        for seed in grid.seeds
    }


def load_means(csv_path, grid: Grid) -> tuple[dict, dict]:
    """Mean over ``grid``'s seeds: {(policy, format, seq_len, blocks, comparison,
    metric): value}, plus per-configuration info {(format, blocks): row}.  Only the
    rows of ``grid``'s own configurations count: other runs in the same CSV (more
    seeds, other lengths) are left out of its means."""
    keys = _keys(grid)
    sums: dict = {}
    info: dict = {}
    for r in read_csv(csv_path, COLUMNS):
        if tuple(r[c] for c in KEY_COLUMNS) not in keys:
            continue
        key = (
            r["policy"],
            r["format"],
            int(r["seq_len"]),
            r["blocks"],
            r["comparison"],
            r["metric"],
        )
        s = sums.setdefault(key, [0.0, 0])
        s[0] += float(r["value"])
        s[1] += 1
        info[(r["format"], r["blocks"])] = {
            "exp_bits": int(r["exp_bits"]),
            "man_bits": int(r["man_bits"]),
            "br": int(r["br"]),
            "bc": int(r["bc"]),
        }
    return {k: s / n for k, (s, n) in sums.items()}, info


def run_figure(name: str, grid: Grid, out_dir, quiet: bool, *, split: bool = False):
    """run_sweep into out_dir/name.  ``split`` (the full grids): one sweep per
    sequence length and per chunk of ``_FORMAT_CHUNK`` formats, into the same
    (resumable) CSV, so peak memory follows one length and a few formats rather
    than the whole vmapped, padded grid; metadata.json then holds the last
    sub-grid and ``grid.json`` always holds the whole one."""
    out = check_out_dir(pathlib.Path(out_dir) / name, {"results.csv": COLUMNS})
    out.mkdir(parents=True, exist_ok=True)
    fmts = grid.formats
    if split:
        chunks = [fmts[i : i + _FORMAT_CHUNK] for i in range(0, len(fmts), _FORMAT_CHUNK)]
        for n in sorted(grid.seq_lens):
            for c in chunks:
                sub = dataclasses.replace(grid, seq_lens=(n,), formats=c)
                csv_path = run_sweep(sub, out, quiet=quiet)
    else:
        csv_path = run_sweep(grid, out, quiet=quiet)
    write_json(out / "grid.json", grid.to_json())
    means, info = load_means(csv_path, grid)
    return out, csv_path, means, info


def _result(name, grid, csv_path, png, rows) -> dict:
    return {
        "figure": name,
        "csv": str(csv_path),
        "png": str(png),
        "grid": grid.to_json(),
        "rows": rows,
    }


def finish_figure(fig, title: str, out, name: str, grid, csv_path, rows) -> dict:
    """Title, lay out, save and close a figure; the figure function's result."""
    fig.suptitle(title)
    fig.tight_layout()
    png = out / f"{name}.png"
    fig.savefig(png, dpi=120)
    pyplot("fa_jax.studies.figures: plotting").close(fig)
    return _result(name, grid, csv_path, png, rows)


def format_names(grid: Grid):
    return [f.name for f in grid.resolved_formats()]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf
