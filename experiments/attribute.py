"""Which rounding makes FlashAttention deviate more than baseline attention at BF16?

Runs :func:`fa_jax.studies.attribution.attribute` for paper_uniform(BF16) (the paper's
uniform low precision) and fa2_kernel(BF16), prints the raised / lowered tables
(max and mean |O - golden|), writes one CSV and the bar chart
``docs/figures/attribution.png``, and then checks the conclusion jointly: flash
under paper_uniform(BF16) with the two rescaled recurrences (``stats``: m_i,
l_i; ``o_acc``: o_i) kept in FP32 or FP64, against baseline attention under
paper_uniform(BF16).

    python experiments/attribute.py                        # N=4096, 32x32 tiles, seeds 0,1
    python experiments/attribute.py --n 1024 --figure /tmp/a.png

Results: see docs/results.md.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import numpy as np

from fa_jax import BF16, FP32, FP64, Blocks, fa2_kernel, golden, metrics, paper_uniform
from fa_jax.attention import flash_attention, reference_attention
from fa_jax.inputs import make_inputs
from fa_jax.rounding import round_to
from fa_jax.studies.attribution import AttributionConfig, attribute, plot_attribution, write_csv


def joint(n: int, d: int, blocks: Blocks, seeds) -> list[tuple[str, float]]:
    """max |O - golden| (mean over seeds) of flash under paper_uniform(BF16) with
    stats and o_acc raised together, beside the baseline's."""
    base = paper_uniform(BF16)
    runs = [
        ("reference, paper_uniform(bf16)", "reference", base),
        ("flash, paper_uniform(bf16)", "flash", base),
    ]
    for fmt in (FP32, FP64):
        runs.append(
            (f"flash, stats + o_acc in {fmt.name}", "flash", base.replace(stats=fmt, o_acc=fmt))
        )
    out = []
    jax.config.update("jax_enable_x64", True)
    for label, kind, pol in runs:
        devs = []
        for s in seeds:
            q, k, v = (round_to(np.asarray(t), BF16) for t in make_inputs(s, n, d=d))
            if kind == "flash":
                o = flash_attention(q, k, v, pol, blocks)[0]
                g = flash_attention(q, k, v, golden(), blocks)[0]
            else:
                o = reference_attention(q, k, v, pol)
                g = reference_attention(q, k, v, golden())
            devs.append(float(metrics.max_abs_diff(o, g)))
        out.append((label, sum(devs) / len(devs)))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096, help="sequence length N")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--bc", type=int, default=32, help="tile size (Br = Bc)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--policies",
        default="paper_uniform,fa2_kernel",
        help="presets to attribute, at BF16 (comma-separated)",
    )
    p.add_argument("--out", default="fa_jax_out/attribute", help="folder for the CSV")
    p.add_argument("--figure", default="docs/figures/attribution.png")
    args = p.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(","))
    blocks = Blocks(args.bc, args.bc)
    t0 = time.monotonic()
    results = []
    presets = {"paper_uniform": paper_uniform, "fa2_kernel": fa2_kernel}
    for name in args.policies.split(","):
        policy = presets[name](BF16)
        res = attribute(
            AttributionConfig(policy, seq_len=args.n, d=args.d, blocks=blocks, seeds=seeds)
        )
        for metric in ("max_abs_diff", "mean_abs_diff"):
            print(res.table(metric), end="\n\n")
        print(f"({res.seconds:.1f} s)\n")
        results.append(res)
    out = pathlib.Path(args.out)
    print("wrote", write_csv(results, out / f"attribution_n{args.n}.csv"))
    print("wrote", plot_attribution(results, args.figure))
    print(f"\njoint check, max |O - golden| (N={args.n}, Br=Bc={args.bc}, mean over seeds):")
    for label, dev in joint(args.n, args.d, blocks, seeds):
        print(f"  {label:<36} {dev:.3e}")
    print(f"\ntotal {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
