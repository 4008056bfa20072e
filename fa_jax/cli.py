"""The ``fa-jax`` command: parses arguments, calls the library, prints.  No numerics here."""

from __future__ import annotations

import argparse
import math
import os
import sys

from fa_jax.formats import get_format, registered_formats
from fa_jax.rounding import ROUNDING_MODES


def _fmt_float(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args) -> int:
    cols = ("name", "bits", "e", "m", "bias", "specials", "emin", "emax", "max", "tiny",
            "min_subnormal", "eps", "carrier")
    rows = []
    for f in registered_formats():
        rows.append((f.name, f.bits, f.exp_bits, f.man_bits, f.bias, f.specials, f.emin, f.emax,
                     _fmt_float(f.max), _fmt_float(f.tiny), _fmt_float(f.smallest_subnormal),
                     _fmt_float(f.eps), f.carrier.name))
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    return 0


def cmd_round(args) -> int:
    import jax
    import numpy as np

    from fa_jax.encoding import encode, fields
    from fa_jax.rounding import round_to

    fmt = get_format(args.format)
    key = jax.random.key(args.seed) if args.mode == "stochastic" else None
    x = float(args.value)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)  # parse and round from float64, exactly
    try:
        r = float(round_to(np.float64(x), fmt, args.mode, key=key))
    finally:
        jax.config.update("jax_enable_x64", previous)
    code = encode(r, fmt)
    s, e, m = fields(code, fmt)
    hexw = (fmt.bits + 3) // 4
    bitstr = f"{s} {e:0{fmt.exp_bits}b} {m:0{fmt.man_bits}b}".rstrip()
    print(f"input      {x!r}  (parsed as float64)")
    print(f"format     {fmt.name}  (e{fmt.exp_bits}m{fmt.man_bits}, bias {fmt.bias}, {fmt.specials})")
    print(f"mode       {args.mode}")
    print(f"rounded    {r!r}")
    print(f"bits       {bitstr}  (0x{code:0{hexw}X}; sign exponent mantissa)")
    if math.isfinite(x) and not math.isfinite(r):
        print(f"overflow   |x| rounds past max = {fmt.max!r}; {fmt.name} overflows to {r!r}"
              + ("" if fmt.has_inf else " (it has no infinity)"))
    if math.isfinite(x) and math.isfinite(r):
        err = abs(r - x)
        print(f"abs error  {err:.6g}")
        if x != 0:
            rel = err / abs(x)
            print(f"rel error  {rel:.6g}  = {rel / fmt.unit_roundoff:.4g} u  "
                  f"(u = 2^-{fmt.man_bits + 1} = {fmt.unit_roundoff:.6g})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fa-jax",
        description="Bit-exact floating-point format emulation and FlashAttention numerics.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("formats", help="print the format registry")
    f.set_defaults(func=cmd_formats)
    r = sub.add_parser("round", help="round one value to a format and show its bits")
    r.add_argument("value", help="a decimal number, inf or nan (negative: put -- before it)")
    r.add_argument("--format", "-f", required=True, help="format name: bf16, fp16, e4m3fn, e5m4, ...")
    r.add_argument("--mode", default="nearest_even", choices=ROUNDING_MODES)
    r.add_argument("--seed", type=int, default=0, help="PRNG seed for --mode stochastic")
    r.set_defaults(func=cmd_round)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"fa-jax {args.command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `fa-jax formats | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
