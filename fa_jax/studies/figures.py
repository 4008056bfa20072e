"""The figures of Golden et al. 2024, "Is Flash Attention Stable?", from the sweep engine.

One function per figure, ``figN(out_dir, *, quick, policies) -> dict``: it builds a
:class:`~fa_jax.studies.sweep.Grid`, runs :func:`~fa_jax.studies.sweep.run_sweep` into
``out_dir/figN/`` (resumable), averages each metric over the grid's seeds (rows
of other grids run into the same folder are left out), prints a table,
writes ``out_dir/figN/figN.png`` and returns::

    {"figure": "figN", "csv": path, "png": path, "grid": Grid.to_json(), "rows": [dict, ...]}

Every figure runs under each of ``policies`` (default ``paper_uniform`` and
``fa2_kernel``): under the paper's uniform low precision FlashAttention deviates
more from the FP64 golden output than baseline attention does; with FP32 softmax
statistics and accumulators (FlashAttention-2/3 kernels) it deviates less.

Grids (d=64, batch=heads=1, normal inputs, FA2 loop order; tiles follow FA1,
Bc = ceil(M/4d), Br = min(Bc, d), via :class:`~fa_jax.studies.sweep.SramBlocks`):

=====  ===========================================  ==========================================
fig    quick (2 seeds)                              full (3 seeds)
=====  ===========================================  ==========================================
fig3   bf16 fp16 tf32 fp32 + e8m2..e8m23; N=512;    same formats; N=4096
       M=8192 (32x32 tiles)
fig4   bf16 fp16 fp32; N=512; M=8192                N=4096
fig5   bf16; N=128..1024; M=8192                    N=128..8192
fig6   bf16; N=1024; M=32768 default/swap/square    N=8192; same tiles
       (64x128, 128x64, 128x128), 6c: M=4096..
       131072 (16x16 .. 64x512)
=====  ===========================================  ==========================================

Quick grids run as one sweep each; full grids run one sweep per sequence length
and per chunk of 4 formats (same CSV, resumable), which bounds peak memory.
``grid_overrides`` (any :class:`Grid` field) shrinks or grows any grid, e.g. an
N=16384 point for Fig 5 on a machine with the memory for N² float64 scores.
"""

from __future__ import annotations

import math

from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.figure_runs import (
    figure_grid,
    finish_figure,
    format_names,
    ratio,
    run_figure,
)
from fa_jax.studies.results import pyplot
from fa_jax.studies.sweep import SramBlocks
from fa_jax.studies.table import print_table

__all__ = ["DEFAULT_POLICIES", "FIGURES", "fig3", "fig4", "fig5", "fig6"]

_NAMED = ("bf16", "fp16", "tf32", "fp32")
_MANTISSAS = tuple(range(2, 24))


def _per_format(name, fmts, out_dir, quick, policies, grid_overrides, quiet):
    """Figs 3 and 4: each format at one N and one tiling; rows of max |out - golden|
    for flash and baseline, max |flash - baseline| and the flash/baseline ratio."""
    blocks = (SramBlocks(8192),)
    grid = figure_grid(
        quick,
        dict(formats=fmts, seq_lens=(512,), blocks=blocks, seeds=(0, 1)),
        dict(formats=fmts, seq_lens=(4096,), blocks=blocks, seeds=(0, 1, 2)),
        policies,
        grid_overrides,
    )
    out, csv_path, means, info = run_figure(name, grid, out_dir, quiet, split=not quick)
    n, blk = grid.seq_lens[0], grid.resolved_blocks()[0][0]
    rows = []
    for p in grid.policies:
        for f in format_names(grid):
            fl, bl, fb = (
                means[(p, f, n, blk, c, "max_abs_diff")]
                for c in ("flash_vs_golden", "baseline_vs_golden", "flash_vs_baseline")
            )
            rows.append(
                {
                    "policy": p,
                    "format": f,
                    "exp_bits": info[(f, blk)]["exp_bits"],
                    "man_bits": info[(f, blk)]["man_bits"],
                    "flash_vs_golden": fl,
                    "baseline_vs_golden": bl,
                    "flash_vs_baseline": fb,
                    "ratio": ratio(fl, bl),
                }
            )
    return grid, out, csv_path, rows, n, blk


# -- Fig 3: deviation vs format (mantissa bits) ------------------------------------


def fig3(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """Max abs diff vs golden of flash and baseline per format: bf16, fp16, tf32,
    fp32 and the mantissa sweep e8m2..e8m23 (paper Fig 3: shrinks with mantissa bits)."""
    fmts = _NAMED + tuple((8, m) for m in _MANTISSAS)
    grid, out, csv_path, rows, n, blk = _per_format(
        "fig3", fmts, out_dir, quick, policies, grid_overrides, quiet
    )
    print_table(
        ("policy", "format", "man_bits", "flash_vs_golden", "baseline_vs_golden", "ratio"),
        rows,
        title=f"Fig 3: max |out - golden| by format (N={n}, tiles {blk}, mean over "
        f"{len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.figures: plotting")
    fig, axes = plt.subplots(
        1, len(grid.policies), figsize=(5.5 * len(grid.policies), 4), squeeze=False, sharey=True
    )
    for ax, p in zip(axes[0], grid.policies):
        sweep = sorted(
            (r for r in rows if r["policy"] == p and r["format"].startswith("e8m")),
            key=lambda r: r["man_bits"],
        )
        named = [r for r in rows if r["policy"] == p and not r["format"].startswith("e8m")]
        for comp, style in (("flash_vs_golden", "o-"), ("baseline_vs_golden", "s--")):
            if sweep:
                ax.semilogy(
                    [r["man_bits"] for r in sweep],
                    [max(r[comp], 1e-300) for r in sweep],
                    style,
                    label=comp.replace("_vs_", " vs "),
                    ms=4,
                )
            for r in named:
                ax.semilogy(r["man_bits"], max(r[comp], 1e-300), "k*" if comp[0] == "f" else "kx")
        for r in named:
            ax.annotate(
                r["format"],
                (r["man_bits"], max(r["flash_vs_golden"], 1e-300)),
                fontsize=7,
                xytext=(3, -10 if r["format"] == "tf32" else 3),
                textcoords="offset points",
            )
        ax.set_title(p)
        ax.set_xlabel("mantissa bits (8 exponent bits)")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("max |out - golden|")
    return finish_figure(
        fig,
        f"Fig 3: deviation vs mantissa bits (N={n}, tiles {blk})",
        out,
        "fig3",
        grid,
        csv_path,
        rows,
    )


# -- Fig 4: flash vs baseline against golden ---------------------------------------


def fig4(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """Per format, max abs diff vs golden of flash and baseline and their ratio
    (paper Fig 4: ~10x at BF16 under uniform low precision)."""
    grid, out, csv_path, rows, n, blk = _per_format(
        "fig4", ("bf16", "fp16", "fp32"), out_dir, quick, policies, grid_overrides, quiet
    )
    print_table(
        ("policy", "format", "flash_vs_golden", "baseline_vs_golden", "flash_vs_baseline", "ratio"),
        rows,
        title=f"Fig 4: max |out - golden|, ratio = flash / baseline (N={n}, tiles {blk}, "
        f"mean over {len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.figures: plotting")
    fmts_ = format_names(grid)
    fig, axes = plt.subplots(
        1, len(grid.policies), figsize=(5 * len(grid.policies), 4), squeeze=False, sharey=True
    )
    w = 0.38
    for ax, p in zip(axes[0], grid.policies):
        pr = [r for r in rows if r["policy"] == p]
        xs = range(len(fmts_))
        ax.bar(
            [x - w / 2 for x in xs],
            [max(r["flash_vs_golden"], 1e-300) for r in pr],
            w,
            label="flash vs golden",
        )
        ax.bar(
            [x + w / 2 for x in xs],
            [max(r["baseline_vs_golden"], 1e-300) for r in pr],
            w,
            label="baseline vs golden",
        )
        for x, r in zip(xs, pr):
            ax.annotate(
                f"{r['ratio']:.2g}x",
                (x, max(r["flash_vs_golden"], 1e-300)),
                ha="center",
                fontsize=8,
                xytext=(0, 3),
                textcoords="offset points",
            )
        ax.set_xticks(list(xs), fmts_)
        ax.set_yscale("log")
        ax.set_title(p)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("max |out - golden|")
    return finish_figure(
        fig,
        f"Fig 4: flash vs baseline deviation from FP64 golden (N={n}, tiles {blk})",
        out,
        "fig4",
        grid,
        csv_path,
        rows,
    )


# -- Fig 5: deviation vs sequence length ---------------------------------------------


def fig5(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """BF16 at fixed tiles, vs N: max, mean and std of |out - golden| for flash and
    baseline (paper Fig 5: grows with N)."""
    blocks = (SramBlocks(8192),)
    grid = figure_grid(
        quick,
        dict(formats=("bf16",), seq_lens=(128, 256, 512, 1024), blocks=blocks, seeds=(0, 1)),
        dict(
            formats=("bf16",),
            seq_lens=tuple(2**k for k in range(7, 14)),
            blocks=blocks,
            seeds=(0, 1, 2),
        ),
        policies,
        grid_overrides,
    )
    out, csv_path, means, _ = run_figure("fig5", grid, out_dir, quiet, split=not quick)
    blk = grid.resolved_blocks()[0][0]
    bc = grid.resolved_blocks()[0][1].bc
    f = format_names(grid)[0]
    rows = []
    for p in grid.policies:
        for n in sorted(grid.seq_lens):
            r = {"policy": p, "format": f, "seq_len": n, "kv_blocks": math.ceil(n / bc)}
            for comp, short in (("flash_vs_golden", "flash"), ("baseline_vs_golden", "baseline")):
                for m, ms in (
                    ("max_abs_diff", "max"),
                    ("mean_abs_diff", "mean"),
                    ("std_abs_diff", "std"),
                ):
                    r[f"{short}_{ms}"] = means[(p, f, n, blk, comp, m)]
            r["ratio_max"] = ratio(r["flash_max"], r["baseline_max"])
            rows.append(r)
    print_table(
        (
            "policy",
            "seq_len",
            "kv_blocks",
            "flash_max",
            "baseline_max",
            "ratio_max",
            "flash_mean",
            "baseline_mean",
            "flash_std",
            "baseline_std",
        ),
        rows,
        title=f"Fig 5: |out - golden| vs N ({f}, tiles {blk}, mean over {len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.figures: plotting")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for p, color in zip(grid.policies, ("C0", "C1", "C2", "C3", "C4")):
        pr = [r for r in rows if r["policy"] == p]
        ns = [r["seq_len"] for r in pr]
        for who, style in (("flash", "o-"), ("baseline", "s--")):
            axes[0][0].loglog(
                ns,
                [max(r[f"{who}_max"], 1e-300) for r in pr],
                style,
                color=color,
                label=f"{p}: {who}",
                base=2,
            )
            axes[0][1].errorbar(
                ns,
                [r[f"{who}_mean"] for r in pr],
                yerr=[r[f"{who}_std"] for r in pr],
                fmt=style,
                color=color,
                capsize=3,
                label=f"{p}: {who}",
            )
    axes[0][0].set_title("max |out - golden|")
    axes[0][1].set_title("mean ± std of |out - golden|")
    axes[0][1].set_xscale("log", base=2)
    axes[0][1].set_yscale("log")
    for ax in axes[0]:
        ax.set_xlabel("sequence length N")
        ax.legend(fontsize=7)
    return finish_figure(
        fig,
        f"Fig 5: deviation vs sequence length ({f}, tiles {blk})",
        out,
        "fig5",
        grid,
        csv_path,
        rows,
    )


# -- Fig 6: deviation vs tile sizes ---------------------------------------------------


def _config_name(label: str) -> str:
    if label.endswith("_swap"):
        return "swap (6a)"
    if label.endswith("_square"):
        return "square (6b)"
    return "default" if label.startswith("sram") else "explicit"


def fig6(
    out_dir, *, quick: bool, policies=DEFAULT_POLICIES, grid_overrides=None, quiet: bool = False
) -> dict:
    """BF16 at fixed N: FA1 tiles vs swapped (6a) vs square (6b) vs larger SRAM (6c);
    max |flash - golden| and the number of KV blocks ceil(N/Bc) per configuration."""
    m6 = 32768  # Bc = 128 > Br = 64 at d=64, so swap and square differ from the default
    blocks = (
        SramBlocks(m6),
        SramBlocks(m6, swap=True),
        SramBlocks(m6, square=True),
        SramBlocks(4096),
        SramBlocks(8192),
        SramBlocks(16384),
        SramBlocks(65536),
        SramBlocks(131072),
    )
    grid = figure_grid(
        quick,
        dict(formats=("bf16",), seq_lens=(1024,), blocks=blocks, seeds=(0, 1)),
        dict(formats=("bf16",), seq_lens=(8192,), blocks=blocks, seeds=(0, 1, 2)),
        policies,
        grid_overrides,
    )
    out, csv_path, means, _ = run_figure("fig6", grid, out_dir, quiet, split=not quick)
    n = grid.seq_lens[0]
    f = format_names(grid)[0]
    rows = []
    for p in grid.policies:
        for label, b in grid.resolved_blocks():
            fl = means[(p, f, n, label, "flash_vs_golden", "max_abs_diff")]
            bl = means[(p, f, n, label, "baseline_vs_golden", "max_abs_diff")]
            rows.append(
                {
                    "policy": p,
                    "blocks": label,
                    "config": _config_name(label),
                    "br": b.br,
                    "bc": b.bc,
                    "kv_blocks": math.ceil(n / b.bc),
                    "flash_vs_golden": fl,
                    "baseline_vs_golden": bl,
                    "ratio": ratio(fl, bl),
                }
            )
    print_table(
        (
            "policy",
            "blocks",
            "config",
            "br",
            "bc",
            "kv_blocks",
            "flash_vs_golden",
            "baseline_vs_golden",
            "ratio",
        ),
        rows,
        title=f"Fig 6: max |out - golden| by tiles ({f}, N={n}, mean over {len(grid.seeds)} seeds)",
    )

    plt = pyplot("fa_jax.studies.figures: plotting")
    fig, axes = plt.subplots(
        1, len(grid.policies), figsize=(6 * len(grid.policies), 4.5), squeeze=False
    )
    for ax, p in zip(axes[0], grid.policies):
        pr = [r for r in rows if r["policy"] == p]
        xs = range(len(pr))
        ax.bar(
            list(xs),
            [max(r["flash_vs_golden"], 1e-300) for r in pr],
            color="C0",
            label="flash vs golden",
        )
        ax.axhline(pr[0]["baseline_vs_golden"], color="C1", ls="--", label="baseline vs golden")
        ax.set_xticks(
            list(xs),
            [f"{r['blocks']}\n{r['br']}x{r['bc']}, {r['kv_blocks']} blk" for r in pr],
            fontsize=7,
            rotation=45,
            ha="right",
        )
        ax.set_title(p)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("max |out - golden|")
    return finish_figure(
        fig, f"Fig 6: deviation vs tile sizes ({f}, N={n})", out, "fig6", grid, csv_path, rows
    )


# -- all ------------------------------------------------------------------------------

FIGURES = {"fig3": fig3, "fig4": fig4, "fig5": fig5, "fig6": fig6}
