"""Golden et al. 2024, Fig 4, under the tensor-core accumulation model of Fasi,
Higham, Mikaitis & Pranesh (2021) instead of exact accumulation.

The Fig 4 setting of fa_jax.studies.figures.fig4: d=64, batch=heads=1, N(0, 1) inputs
(fa_jax.inputs.make_inputs), FA2 loop order, FA1 tiles for an SRAM of 8192
elements (Br = Bc = 32), formats bf16/fp16/fp32; quick: N=512, seeds (0, 1);
full: N=4096, seeds (0, 1, 2).  For each policy (paper_uniform, fa2_kernel) and
accumulation model (exact, tensor_core(v100), tensor_core(a100)) it prints,
averaged over seeds, max |out - golden| of flash and of baseline attention,
their ratio, the relative change of each against the exact model, and
max |out - out_exact| (how far the answer itself moves).

Notes on what the model covers: the policy's accumulation model applies to
every dot (Q Kᵀ, P V) and every row sum (l = Σ P̃).  Under fa2_kernel the
accumulators are FP32, as on the tensor cores; under paper_uniform they are the
swept format itself (bf16/fp16), a generalisation (the hardware accumulates in
FP32 or FP16).  Golden is reference attention in FP64 on the same rounded inputs.

One jitted program per (policy, accumulation), with the format widths traced
(vmap-free but format-generic), reused for every format and seed.

Usage: python experiments/tensor_core_fig4.py [--full] [--seq-len N] [--seeds S ...] [--csv PATH]

Results: see docs/results.md.
"""

from __future__ import annotations

import argparse
import csv
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import metrics
from fa_jax.accumulation import EXACT, tensor_core
from fa_jax.attention import blocks_from_sram, flash_attention, reference_attention
from fa_jax.formats import Format, get_format
from fa_jax.inputs import make_inputs
from fa_jax.presets import PRESETS, golden
from fa_jax.rounding import round_to

FORMATS = ("bf16", "fp16", "fp32")
POLICIES = ("paper_uniform", "fa2_kernel")
ACCUMULATIONS = (EXACT, tensor_core("v100"), tensor_core("a100"))
D, SRAM = 64, 8192


def _fmt(e, m, b) -> Format:
    return Format("traced", e, m, bias=b)


@jax.jit
def _golden(q, k, v, e, m, b):
    f = _fmt(e, m, b)
    q, k, v = (round_to(t, f) for t in (q, k, v))
    return reference_attention(q, k, v, golden())


@functools.partial(jax.jit, static_argnames=("preset", "accumulation", "blocks"))
def _attention(q, k, v, e, m, b, *, preset, accumulation, blocks):
    pol = PRESETS[preset](_fmt(e, m, b), accumulation=accumulation)
    flash = flash_attention(q, k, v, pol, blocks, variant="fa2")[0]
    return flash, reference_attention(q, k, v, pol)


def run(seq_len: int, seeds, csv_path=None) -> list[dict]:
    blocks = blocks_from_sram(SRAM, D)
    results = {}  # (policy, fmt, acc, seed) -> (flash, baseline, flash - exact, baseline - exact)
    for seed in seeds:
        q, k, v = (jnp.asarray(t) for t in make_inputs(seed, seq_len, d=D))
        for name in FORMATS:
            f = get_format(name)
            w = tuple(jnp.int32(x) for x in (f.exp_bits, f.man_bits, f.bias))
            gold = _golden(q, k, v, *w)
            for preset in POLICIES:
                exact_out = None
                for acc in ACCUMULATIONS:
                    fl, bl = _attention(q, k, v, *w, preset=preset, accumulation=acc, blocks=blocks)
                    if exact_out is None:
                        exact_out = (fl, bl)
                    results[(preset, name, str(acc), seed)] = tuple(
                        float(metrics.max_abs_diff(x, y))
                        for x, y in ((fl, gold), (bl, gold), (fl, exact_out[0]), (bl, exact_out[1]))
                    )
    rows = []
    for preset in POLICIES:
        for name in FORMATS:
            mean = {
                str(acc): np.mean([results[(preset, name, str(acc), s)] for s in seeds], axis=0)
                for acc in ACCUMULATIONS
            }
            fl0, bl0 = mean["exact"][:2]
            for acc in ACCUMULATIONS:
                fl, bl, dfl, dbl = mean[str(acc)]
                rows.append(
                    {
                        "policy": preset,
                        "format": name,
                        "accumulation": str(acc),
                        "flash_vs_golden": fl,
                        "baseline_vs_golden": bl,
                        "ratio": fl / bl if bl > 0 else float("inf"),
                        "flash_change_vs_exact": fl / fl0 - 1,
                        "baseline_change_vs_exact": bl / bl0 - 1,
                        "flash_vs_flash_exact": dfl,
                        "baseline_vs_baseline_exact": dbl,
                    }
                )
    if csv_path:
        with open(csv_path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(
                {k: repr(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows
            )
    return rows


def _print(rows, seq_len, seeds, blocks) -> None:
    cols = (
        "policy",
        "format",
        "accumulation",
        "flash_vs_golden",
        "baseline_vs_golden",
        "ratio",
        "flash_change_vs_exact",
        "baseline_change_vs_exact",
        "flash_vs_flash_exact",
        "baseline_vs_baseline_exact",
    )
    heads = (
        "policy",
        "format",
        "accumulation",
        "flash-gold",
        "base-gold",
        "ratio",
        "Δflash",
        "Δbase",
        "|fl-fl_ex|",
        "|bl-bl_ex|",
    )

    def cell(c, v):
        if c.endswith("change_vs_exact"):
            return f"{100 * v:+.1f}%"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    body = [[cell(c, r[c]) for c in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]
    print(
        f"Fig 4 setting under tensor-core accumulation: N={seq_len}, d={D}, tiles "
        f"{blocks.br}x{blocks.bc}, fa2, mean over seeds {tuple(seeds)}; max |out - golden|, "
        "ratio = flash / baseline, Δ = relative change vs the exact model"
    )
    print("  ".join(h.ljust(w) for h, w in zip(heads, widths)))
    for b in body:
        print("  ".join(v.ljust(w) for v, w in zip(b, widths)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="N=4096, seeds 0, 1, 2")
    parser.add_argument("--seq-len", type=int, help="override N")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    seq_len, seeds = (4096, (0, 1, 2)) if args.full else (512, (0, 1))
    seq_len, seeds = args.seq_len or seq_len, tuple(args.seeds or seeds)
    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    rows = run(seq_len, seeds, args.csv)
    _print(rows, seq_len, seeds, blocks_from_sram(SRAM, D))
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
