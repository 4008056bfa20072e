"""The kernel table of docs/kernels.md: real kernels against fa_jax's models of them.

For each kernel, format, shape (B, H, N, d), causal flag and seed, the share of
output elements bit-identical to the real kernel, the largest distance in ulps
of the format and the histogram of distances (fa_jax.kernels.compare, through
fa_jax.studies.validation), printed as Markdown rows with the platform facts.

Usage: python experiments/kernels_table.py [--kernels xla torch-math torch-flash]
       [--formats bf16 fp16] [--quick] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import itertools

from fa_jax import kernels
from fa_jax.studies.validation import Shape, validate

SHAPES = (Shape(1, 2, 512, 64), Shape(2, 4, 1024, 128), Shape(1, 1, 4096, 64))
QUICK_SHAPES = (Shape(1, 2, 256, 64),)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="*", default=["xla", "torch-math", "torch-flash"])
    p.add_argument("--formats", nargs="*", default=["bf16", "fp16"])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    p.add_argument("--quick", action="store_true", help="one small shape")
    args = p.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    names = [k for k in args.kernels if k in kernels.available()]
    for name in sorted(set(args.kernels) - set(names)):
        print(f"skipped {name}: not available here")
    for name in names:
        facts = ", ".join(f"{k} {v}" for k, v in kernels.get(name).platform().items())
        print(f"\n{name}: {facts}\n")
        print("| format | (B, H, N, d) | causal | seeds | identical | max ulp | ulp 0/1/2/3-7/8+ |")
        print("|---|---|---|---|---|---|---|")
        for fmt, shape, causal in itertools.product(args.formats, shapes, (False, True)):
            if fmt not in kernels.get(name).formats:
                continue
            row = f"| {fmt} | ({shape.batch}, {shape.heads}, {shape.n}, {shape.d}) | "
            row += f"{'yes' if causal else 'no'} | {','.join(map(str, args.seeds))} | "
            try:
                v = validate(name, fmt, shape=shape, causal=causal, seeds=args.seeds, presets=())
            except NotImplementedError as err:  # the model does not cover this shape here
                print(f"{row}refused | | {err} |", flush=True)
                continue
            c = v.rows[0][1]
            hist = "/".join(str(n) for n in c.ulp_histogram.values())
            print(f"{row}{100 * c.identical_share:.4f}% | {c.max_ulp} | {hist} |", flush=True)


if __name__ == "__main__":
    main()
