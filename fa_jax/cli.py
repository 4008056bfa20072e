"""The ``fa-jax`` command: parses arguments, calls the library, prints.  No numerics here.

Subcommands: ``formats`` (the format registry), ``round`` (one value's rounding
and bits), ``sweep`` (a :class:`~fa_jax.studies.sweep.Grid` into tidy CSV),
``reproduce`` (Golden et al. 2024 Figs 3-6 and 8, FlashAttention-3 Table 3),
``merge`` (a multi-process sweep's part files into ``results.csv``) and
``attribute`` (per-stage error attribution).  ``sweep`` and ``reproduce`` run
on several processes under ``jax.distributed`` (``--coordinator``,
``--num-processes``, ``--process-id``, or a cluster JAX detects):
:mod:`fa_jax.studies.sweep.cluster`.  Errors in arguments are one line
on standard error naming the flag, with exit status 2.  Ctrl-C ends a command
with the one line ``interrupted; run the same command to resume`` and exit
status 130; sweeps stop at their next group (:mod:`fa_jax.studies.interrupt`),
and a second Ctrl-C exits at once.  This is the only module
of fa_jax that parses arguments; ``python -m fa_jax`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from typing import Any

import fa_jax
from fa_jax._checks import non_negative_int, one_of, positive_int
from fa_jax.formats import get_format, registered_formats
from fa_jax.presets import PRESETS
from fa_jax.rounding import ROUNDING_MODES
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.interrupt import deferred_interrupts
from fa_jax.studies.options import study_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep.cluster import ProcessFailed
from fa_jax.studies.sweep.grid import KERNEL_PREFIX
from fa_jax.studies.table import print_table


def _fmt_float(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args) -> int:
    cols = (
        "name",
        "bits",
        "e",
        "m",
        "bias",
        "specials",
        "emin",
        "emax",
        "max",
        "tiny",
        "min_subnormal",
        "eps",
        "carrier",
    )
    rows = []
    for f in registered_formats():
        rows.append(
            (
                f.name,
                f.bits,
                f.exp_bits,
                f.man_bits,
                f.bias,
                f.specials,
                f.emin,
                f.emax,
                _fmt_float(f.max),
                _fmt_float(f.tiny),
                _fmt_float(f.smallest_subnormal),
                _fmt_float(f.eps),
                f.carrier.name,
            )
        )
    print_table(cols, rows)
    return 0


def cmd_round(args) -> int:
    import jax
    import numpy as np

    from fa_jax._x64 import float64_enabled
    from fa_jax.encoding import encode, fields
    from fa_jax.rounding import round_to

    fmt = get_format(args.format)
    _seed("--seed", args.seed)
    key = jax.random.key(args.seed) if args.mode == "stochastic" else None
    x = float(args.value)
    with float64_enabled():  # parse and round from float64, exactly
        r = float(round_to(np.float64(x), fmt, args.mode, key=key))
    code = encode(r, fmt)
    s, e, m = fields(code, fmt)
    hexw = (fmt.bits + 3) // 4
    bitstr = f"{s} {e:0{fmt.exp_bits}b} {m:0{fmt.man_bits}b}".rstrip()
    print(f"input      {x!r}  (parsed as float64)")
    print(
        f"format     {fmt.name}  (e{fmt.exp_bits}m{fmt.man_bits}, bias {fmt.bias}, {fmt.specials})"
    )
    print(f"mode       {args.mode}")
    print(f"rounded    {r!r}")
    print(f"bits       {bitstr}  (0x{code:0{hexw}X}; sign exponent mantissa)")
    if math.isfinite(x) and not math.isfinite(r):
        print(
            f"overflow   |x| rounds past max = {fmt.max!r}; {fmt.name} overflows to {r!r}"
            + ("" if fmt.has_inf else " (it has no infinity)")
        )
    clamps = fmt.overflow == "saturate" or args.mode in ("toward_zero", "up", "down")
    if clamps and math.isfinite(x) and abs(x) > fmt.max and abs(r) == fmt.max:
        print(
            f"saturated  |x| > max = {fmt.max!r}; {fmt.name} in mode {args.mode} "
            f"gives {r!r} instead of overflowing"
        )
    if math.isfinite(x) and x != 0 and r == 0:
        print(
            f"underflow  nonzero x rounds to {r!r} (smallest subnormal of {fmt.name} "
            f"= {fmt.smallest_subnormal!r})"
        )
    elif x != 0 and 0 < abs(r) < fmt.tiny:
        print(
            f"underflow  x rounds to a subnormal (|r| < tiny = {fmt.tiny!r}), "
            f"with fewer than {fmt.man_bits} mantissa bits of precision"
        )
    if math.isfinite(x) and math.isfinite(r):
        err = abs(r - x)
        print(f"abs error  {err:.6g}")
        if x != 0:
            rel = err / abs(x)
            print(
                f"rel error  {rel:.6g}  = {rel / fmt.unit_roundoff:.4g} u  "
                f"(u = 2^-{fmt.man_bits + 1} = {fmt.unit_roundoff:.6g})"
            )
    return 0


def _items(flag: str, values) -> list[str]:
    """Values of a list option: space- and/or comma-separated; empty is an error."""
    out = [v for raw in (values or []) for v in raw.split(",") if v.strip()]
    if not out:
        raise ValueError(f"{flag}: expected at least one value")
    return [v.strip() for v in out]


def _features(flag: str, values) -> tuple:
    """Feature labels (:class:`~fa_jax.studies.sweep.Features`), space- or
    comma-separated."""
    from fa_jax.studies.sweep import Features

    labels = [v for raw in values for v in raw.replace(",", " ").split()]
    if not labels:
        raise ValueError(f"{flag}: expected at least one value")
    out = []
    for label in labels:
        try:
            out.append(Features.from_label(label))
        except (ValueError, TypeError) as err:
            msg = str(err)
            if msg.startswith("Features"):
                msg = msg.split(":", 1)[1].strip() if ":" in msg else msg
            raise ValueError(f"{flag}: {label}: {msg}") from None
    return tuple(out)


def _ints(flag: str, values) -> tuple[int, ...]:
    out = []
    for v in _items(flag, values):
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"{flag}: expected integers, got {v!r}") from None
        out.append(n)
    return tuple(out)


MAX_SEED = 2**63 - 1  # jax.random.key takes a signed 64-bit seed; numpy any int >= 0


def _seed(flag: str, n: int) -> int:
    if not 0 <= n <= MAX_SEED:
        raise ValueError(f"{flag}: expected seeds in 0 .. 2**63 - 1, got {n}")
    return n


def _seeds(flag: str, values) -> tuple[int, ...]:
    return tuple(_seed(flag, n) for n in _ints(flag, values))


def _block_spec(text: str):
    """``BRxBC`` -> Blocks; ``sramM``, ``sramM_swap``, ``sramM_square`` -> SramBlocks."""
    from fa_jax.attention import Blocks
    from fa_jax.studies.sweep import SramBlocks

    t = text.strip().lower()
    try:
        if t.startswith("sram"):
            body, _, mode = t[4:].partition("_")
            if mode not in ("", "swap", "square"):
                raise ValueError
            return SramBlocks(int(body), swap=mode == "swap", square=mode == "square")
        br, bc = t.split("x")
        br, bc = int(br), int(bc)
    except ValueError:
        raise ValueError(
            f"--blocks: expected BRxBC or sramM[_swap|_square], got {text!r}"
        ) from None
    if br < 1 or bc < 1:
        raise ValueError(f"--blocks: expected positive tile sizes, got {text!r}")
    return Blocks(br, bc)


_GRID_FLAGS = {
    "formats": "--formats",
    "seq_lens": "--seq-lens",
    "blocks": "--blocks",
    "variants": "--variants",
    "policies": "--policies",
    "seeds": "--seeds",
    "batch": "--batch",
    "heads": "--heads",
    "d": "--d",
    "distribution": "--distribution",
    "causal": "--causal",
    "features": "--features",
}


def _policies(flag: str, presets, kernel_names, default) -> tuple[str, ...]:
    """Preset names from ``flag`` and ``kernel:NAME`` entries from --kernel;
    ``default`` when neither is given."""
    if presets is None and kernel_names is None:
        return tuple(default)
    out = (
        [] if presets is None else [one_of(p, sorted(PRESETS), flag) for p in _items(flag, presets)]
    )
    if kernel_names is not None:
        out += [KERNEL_PREFIX + _kernel("--kernel", k) for k in _items("--kernel", kernel_names)]
    return tuple(out)


def _coordinator(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator: expected HOST:PORT (a port in 1 .. 65535), got {text!r}")
    return text


def _connect(args) -> int:
    """Join the processes of a multi-process run (``jax.distributed``) from the
    launch flags, or where JAX detects a cluster; nothing otherwise.  Returns
    the process count."""
    from fa_jax.studies.sweep.cluster import cluster_detected, connect

    given = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
    }
    if all(v is None for v in given.values()):
        if not cluster_detected():
            return 1
    elif any(v is None for v in given.values()) and not cluster_detected():
        named = ", ".join(f for f, v in given.items() if v is not None)
        raise ValueError(
            f"{', '.join(given)}: expected all three (or none, where JAX detects the "
            f"cluster), got {named} only"
        )
    coordinator = None if args.coordinator is None else _coordinator(args.coordinator)
    count = None
    if args.num_processes is not None:
        count = positive_int(_one_int("--num-processes", args.num_processes), "--num-processes")
    index = None
    if args.process_id is not None:
        index = non_negative_int(_one_int("--process-id", args.process_id), "--process-id")
        if count is not None and index >= count:
            raise ValueError(f"--process-id: expected 0 .. {count - 1}, got {index}")
    connect(coordinator, count, index)
    import jax

    return jax.process_count()


def cmd_sweep(args) -> int:
    from fa_jax.studies.results import check_out_dir
    from fa_jax.studies.sweep import COLUMNS, Grid, run_sweep

    formats = _items("--formats", args.formats)
    for name in formats:
        try:
            get_format(name)
        except ValueError as err:
            raise ValueError(f"--formats: {err}") from None
    kw: dict[str, Any] = dict(
        formats=tuple(formats),
        seq_lens=_ints("--seq-lens", args.seq_lens),
        blocks=tuple(_block_spec(b) for b in _items("--blocks", args.blocks)),
        variants=tuple(_items("--variants", args.variants)),
        policies=_policies("--policies", args.policies, args.kernel, ("paper_uniform",)),
        seeds=_seeds("--seeds", args.seeds),
        batch=args.batch,
        heads=args.heads,
        d=args.d,
        distribution=args.distribution,
        causal=args.causal,
        features=_features("--features", args.features),
    )
    try:
        grid = Grid(**kw)
    except (ValueError, TypeError) as err:
        msg = str(err)
        for field, flag in _GRID_FLAGS.items():
            if msg.startswith(f"Grid.{field}:"):
                msg = flag + msg[len(f"Grid.{field}") :]
                break
        if msg.startswith("Features."):  # a feature that does not fit the grid
            msg = "--features: " + msg[len("Features.") :]
        raise ValueError(msg) from None
    check_out_dir(args.out, {"results.csv": COLUMNS}, what="--out")
    _connect(args)
    path = run_sweep(grid, args.out, quiet=args.quiet)
    with open(path) as fh:
        n_rows = sum(1 for _ in fh) - 1
    print(f"wrote {path} ({n_rows} rows) and {path.parent / 'metadata.json'}")
    return 0


def cmd_reproduce(args) -> int:
    from fa_jax.studies.reproduce import reproduce
    from fa_jax.studies.results import check_out_dir

    if args.kernel is not None and args.figure in ("fig8", "fa3-table"):
        raise ValueError(
            f"--kernel: only fig3..fig6 and all run a kernel's model, got {args.figure}"
        )
    policies = _policies("--policy", args.policy, args.kernel, DEFAULT_POLICIES)
    check_out_dir(args.out, what="--out")  # each study checks its own subfolder too
    count = _connect(args)
    if count > 1 and args.figure in ("fig8", "fa3-table"):
        raise ValueError(
            f"--num-processes: only the sweeps (fig3..fig6, all) run on several processes, "
            f"got {args.figure} on {count}"
        )
    results = reproduce(
        args.figure, args.out, quick=args.quick, policies=policies, ablations=args.ablations
    )
    for name, res in results.items():
        print(f"{name}: " + "  ".join(str(res[k]) for k in ("csv", "png") if res.get(k)))
    return 0


def cmd_merge(args) -> int:
    from fa_jax.studies.sweep import merge_sweep

    report = merge_sweep(args.out)
    if not report:
        print(f"{args.out}: no part files to merge")
        return 0
    missing = 0
    for folder, merged, left in report:
        state = "complete; part files removed" if not left else f"{left} configurations missing"
        print(f"{folder}: {merged} configurations merged into results.csv ({state})")
        missing += left
    if missing:
        print("run the same sweep command again to compute the missing configurations")
        return 1
    return 0


_ATTRIBUTE_FLAGS = {
    "seq_len": "--n",
    "d": "--d",
    "variant": "--variant",
    "seeds": "--seeds",
    "distribution": "--distribution",
    "inputs": "--inputs",
    "kinds": "--kinds",
    "br": "--br",
    "bc": "--bc",
}


def _one_int(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag}: expected an integer, got {text!r}") from None


def cmd_attribute(args) -> int:
    from fa_jax.attention import Blocks
    from fa_jax.presets import get_policy
    from fa_jax.studies.attribution import (
        ATTRIBUTION_METRICS,
        CSV_COLUMNS,
        AttributionConfig,
        attribute,
        plot_attribution,
        write_csv,
    )
    from fa_jax.studies.results import check_out_dir

    one_of(args.metric, ATTRIBUTION_METRICS, "--metric")
    try:
        fmt = get_format(args.format)
    except ValueError as err:
        raise ValueError(f"--format: {err}") from None
    try:
        policy = get_policy(args.policy, fmt)
    except ValueError as err:
        raise ValueError(f"--policy: {err}") from None
    n, d, bc = (_one_int(f, v) for f, v in (("--n", args.n), ("--d", args.d), ("--bc", args.bc)))
    br = bc if args.br is None else _one_int("--br", args.br)
    positive_int(bc, "--bc")  # before Blocks, which would name Br when Br defaults to Bc
    try:
        config = AttributionConfig(
            policy,
            seq_len=n,
            d=d,
            blocks=Blocks(br, bc),
            variant=args.variant,
            seeds=_seeds("--seeds", args.seeds),
            distribution=args.distribution,
            kinds=tuple(_items("--kinds", args.kinds)),
            inputs=args.inputs,
        )
    except (ValueError, TypeError) as err:
        msg = str(err)
        if msg.startswith("AttributionConfig.blocks:"):  # name the tile that is too large
            msg = ("--bc" if bc > n else "--br") + msg[len("AttributionConfig.blocks") :]
        for field, flag in _ATTRIBUTE_FLAGS.items():
            for prefix in (f"AttributionConfig.{field}:", f"Blocks.{field}:"):
                if msg.startswith(prefix):
                    msg = flag + ":" + msg[len(prefix) :]
        raise ValueError(msg) from None
    check_out_dir(args.out, {"attribution.csv": CSV_COLUMNS}, what="--out")
    result = attribute(config)
    print(result.table(args.metric))
    out = os.path.join(args.out, "attribution")
    csv_path = write_csv(result, out + ".csv")
    written = [str(csv_path)]
    if not args.no_plot:
        written.append(str(plot_attribution(result, out + ".png", metric=args.metric)))
    print(f"\nwrote {'  '.join(written)}  ({result.seconds:.1f} s)")
    return 0


def cmd_kernels(args) -> int:
    from fa_jax import kernels

    rows, refused = [], []
    for name in kernels.names():
        try:
            k = kernels.get(name)
        except (RuntimeError, ImportError) as err:
            rows.append((name, "no", "", "", str(err)))
            continue
        reason = k.unmodelled()
        if reason is not None:
            refused.append(f"- {reason}")
        model = "modelled here" if reason is None else "refused (below)"
        rows.append((name, "yes", model, ", ".join(k.formats), k.description))
    print_table(("kernel", "runs here", "model here", "formats", "what / why not"), rows)
    if refused:
        print("\nWhere the real kernel runs code its model does not follow, the model raises:")
        print("\n".join(refused))
    return 0


def _kernel(flag: str, name: str) -> str:
    """A kernel name that runs here, else a one-line error naming the flag."""
    from fa_jax import kernels

    if name not in kernels.names():
        raise ValueError(f"{flag}: expected one of {kernels.names()}, got {name!r}")
    try:
        kernels.get(name)
    except (RuntimeError, ImportError) as err:
        raise ValueError(f"{flag}: {err}") from None
    return name


def cmd_validate(args) -> int:
    import json
    import time

    from fa_jax.kernels.registry import timed_calls
    from fa_jax.studies.profile import CallProfile
    from fa_jax.studies.validation import format_validation, validate

    kernel, fmt, shape = _kernel_args(args)
    profile, start = CallProfile(), time.perf_counter()
    with timed_calls(profile.call) if args.profile else contextlib.nullcontext():
        result = validate(
            kernel,
            fmt,
            shape=shape,
            causal=args.causal,
            seeds=_seeds("--seeds", args.seeds),
            presets=() if args.no_presets else _items("--presets", args.presets),
            features=_validation_features(args),
        )
    print(json.dumps(result.to_dict(), indent=1) if args.json else format_validation(result))
    if args.profile:
        print(profile.table(time.perf_counter() - start), file=sys.stderr)
    return 0


def _validation_features(args):
    """validate's feature flags as a Features."""
    from fa_jax.studies.validation import Features

    def count(flag, value):
        return None if value is None else positive_int(_one_int(flag, value), flag)

    window = None
    if args.window is not None:
        try:
            left, right = (int(w) for w in args.window.split(","))
        except ValueError:
            raise ValueError(
                f"--window: expected L,R (ints, -1 for unbounded), got {args.window!r}"
            ) from None
        window = (left, right)
    try:
        return Features(
            kv_heads=count("--kv-heads", args.kv_heads),
            q_len=count("--q-len", args.q_len),
            bias=args.bias,
            mask=None if args.mask == "none" else args.mask,
            window=window,
            kv_len=count("--kv-len", args.kv_len),
        )
    except ValueError as err:
        raise ValueError(f"validate: {err}") from None


def cmd_calibrate(args) -> int:
    from fa_jax.studies.calibration import calibrate, format_calibration

    kernel, fmt, shape = _kernel_args(args)
    steps = non_negative_int(_one_int("--max-steps", args.max_steps), "--max-steps")
    result = calibrate(
        kernel,
        fmt,
        shape=shape,
        causal=args.causal,
        seeds=_seeds("--seeds", args.seeds),
        max_steps=steps,
        knobs=None if args.knobs is None else _items("--knobs", args.knobs),
    )
    print(format_calibration(result))
    return 0


def _kernel_args(args):
    """(kernel name, Format, Shape) from the flags of :func:`_add_kernel_flags`."""
    from fa_jax.studies.validation import Shape

    kernel = _kernel("--kernel", args.kernel)
    try:
        fmt = get_format(args.format)
    except ValueError as err:
        raise ValueError(f"--format: {err}") from None
    flags = (("--batch", args.batch), ("--heads", args.heads), ("--n", args.n), ("--d", args.d))
    return kernel, fmt, Shape(*(positive_int(_one_int(f, v), f) for f, v in flags))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fa-jax",
        description="Bit-exact floating-point format emulation and FlashAttention numerics.",
    )
    p.add_argument("--version", action="version", version=f"fa-jax {fa_jax.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("formats", help="print the format registry")
    f.set_defaults(func=cmd_formats)
    r = sub.add_parser("round", help="round one value to a format and show its bits")
    r.add_argument(
        "value",
        help="a decimal number, inf or nan.  Negative values: put -- after the options, "
        "as in 'fa-jax round --format bf16 -- -1.5' (any value: -1e3 and -inf too).  "
        "Without --, plain negative decimals such as -1.5 work in any position "
        "('fa-jax round -1.5 -f bf16'), but -1e3 and -inf do not.  Everything after -- "
        "is a value, so 'fa-jax round -- -1.5 --format bf16' fails",
    )
    r.add_argument(
        "--format", "-f", required=True, help="format name: bf16, fp16, e4m3fn, e5m4, ..."
    )
    r.add_argument("--mode", default="nearest_even", choices=ROUNDING_MODES)
    r.add_argument("--seed", type=int, default=0, help="PRNG seed for --mode stochastic")
    r.set_defaults(func=cmd_round)

    sw = sub.add_parser("sweep", help="run a grid of configurations; write results.csv")
    sw.add_argument(
        "--formats",
        nargs="*",
        required=True,
        help="format names (bf16 fp16 e5m4 ...); spaces or commas",
    )
    sw.add_argument("--seq-lens", nargs="*", required=True, help="sequence lengths")
    sw.add_argument(
        "--blocks",
        nargs="*",
        required=True,
        help="tiles: BRxBC (e.g. 64x64) or sramM[_swap|_square] (FA1 tiles)",
    )
    sw.add_argument("--variants", nargs="*", default=["fa2"], help="flash loop orders (fa1 fa2)")
    sw.add_argument(
        "--policies",
        nargs="*",
        default=None,
        help="policy presets (paper_uniform fa2_kernel torch_math; default paper_uniform "
        "unless --kernel is given)",
    )
    sw.add_argument(
        "--kernel",
        nargs="*",
        default=None,
        help="real kernels whose models to run, as policy 'kernel:NAME' (see 'fa-jax "
        "kernels'): the model's own steps (fa_jax.kernels.emulate), in formats the kernel "
        "runs natively",
    )
    sw.add_argument("--seeds", nargs="*", default=["0"], help="input seeds")
    sw.add_argument("--batch", type=int, default=1)
    sw.add_argument("--heads", type=int, default=1)
    sw.add_argument("--d", type=int, default=64, help="head dimension")
    sw.add_argument("--distribution", default="normal", help="normal, uniform or outliers")
    sw.add_argument("--causal", action="store_true")
    sw.add_argument(
        "--features",
        nargs="*",
        default=["none"],
        help="attention features, one entry each, space-separated: 'none' or parts among "
        "kv_heads=H, window=L:R, softcap=C, alibi, splits=S, queries=Q joined by '+' "
        "(e.g. none kv_heads=2+alibi queries=1+splits=4)",
    )
    sw.add_argument("--out", default="fa_jax_out/sweep", help="output folder")
    sw.add_argument("--quiet", action="store_true", help="no progress line")
    _add_run_flags(sw)
    _add_cluster_flags(sw)
    sw.set_defaults(func=cmd_sweep)

    rp = sub.add_parser("reproduce", help="Golden et al. 2024 figures: CSV, table and PNG")
    rp.add_argument(
        "figure",
        choices=(
            "fig3",
            "fig4",
            "fig5",
            "fig6",
            "all",
            "fig8",
            "fa3-table",
            "features",
            "decoding",
            "engines",
            "serving",
        ),
    )
    rp.add_argument("--quick", action="store_true", help="small grids (under a minute each on CPU)")
    rp.add_argument("--out", default="fa_jax_out", help="output folder (default fa_jax_out)")
    rp.add_argument(
        "--policy",
        nargs="*",
        default=None,
        help=f"policy presets (default {' '.join(DEFAULT_POLICIES)} unless --kernel is given)",
    )
    rp.add_argument(
        "--kernel",
        nargs="*",
        default=None,
        help="fig3..fig6: also run these real kernels' models ('kernel:NAME'); a figure "
        "with a format the kernel does not run natively is refused",
    )
    rp.add_argument(
        "--ablations",
        action="store_true",
        help="fa3-table only: add rows that locate the FP8 error (not in the paper)",
    )
    _add_run_flags(rp)
    _add_cluster_flags(rp)
    rp.set_defaults(func=cmd_reproduce)

    mg = sub.add_parser("merge", help="fold a multi-process sweep's part files into results.csv")
    mg.add_argument("out", help="the sweep's output folder (--out)")
    mg.set_defaults(func=cmd_merge)

    at = sub.add_parser("attribute", help="per-stage error attribution: table, CSV, bar chart")
    at.add_argument(
        "--policy",
        default="paper_uniform",
        help="policy preset: paper_uniform, fa2_kernel, torch_math or golden",
    )
    at.add_argument("--format", default="bf16", help="the preset's format (bf16, fp16, ...)")
    at.add_argument("--n", default="1024", help="sequence length N")
    at.add_argument("--d", default="64", help="head dimension")
    at.add_argument("--bc", default="32", help="key/value tile size Bc")
    at.add_argument("--br", default=None, help="query tile size Br (default: Bc)")
    at.add_argument("--seeds", nargs="*", default=["0,1"], help="input seeds")
    at.add_argument("--variant", default="fa2", help="flash loop order: fa1, fa2 or rowwise")
    at.add_argument(
        "--kinds",
        nargs="*",
        default=["flash,reference"],
        help="attention paths: flash and/or reference",
    )
    at.add_argument("--distribution", default="normal", help="normal, uniform or outliers")
    at.add_argument(
        "--inputs",
        default="rounded",
        help="rounded (Q, K, V rounded once for all runs, golden too) or exact",
    )
    at.add_argument(
        "--metric",
        default="max_abs_diff",
        help="table and chart metric: max_abs_diff or mean_abs_diff (CSV: both)",
    )
    at.add_argument(
        "--out",
        default="fa_jax_out/attribute",
        help="output folder for attribution.csv and attribution.png",
    )
    at.add_argument("--no-plot", action="store_true", help="skip the bar chart")
    at.set_defaults(func=cmd_attribute)

    kl = sub.add_parser("kernels", help="list the real attention kernels and where they run")
    kl.set_defaults(func=cmd_kernels)
    va = sub.add_parser(
        "validate", help="a real attention kernel vs fa_jax's model of it, bit for bit"
    )
    _add_kernel_flags(va)
    va.add_argument(
        "--presets",
        nargs="*",
        default=list(PRESETS),
        help=f"generic presets shown beside the model (default {' '.join(PRESETS)})",
    )
    va.add_argument(
        "--no-presets", action="store_true", help="only the kernel's model, not the generic presets"
    )
    va.add_argument("--kv-heads", help="K/V heads, dividing --heads (grouped-query attention)")
    va.add_argument("--q-len", help="queries (decoding shapes: --n is then the keys)")
    va.add_argument("--bias", choices=("alibi", "random"), help="an additive bias")
    va.add_argument(
        "--mask", choices=("random", "none"), default="none", help="a boolean mask (80%% kept)"
    )
    va.add_argument("--window", help="a local window L,R (-1: unbounded side)")
    va.add_argument("--kv-len", help="keys kept per sequence (key lengths)")
    va.add_argument("--json", action="store_true", help="print JSON instead of a table")
    va.add_argument(
        "--profile",
        action="store_true",
        help="print trace, compile and other seconds per kernel call at the end",
    )
    va.set_defaults(func=cmd_validate)
    ca = sub.add_parser(
        "calibrate", help="which modelling knobs make fa_jax reproduce a real kernel"
    )
    _add_kernel_flags(ca, heads="1", n="256")
    ca.add_argument("--max-steps", default="8", help="most knob changes in the search")
    ca.add_argument(
        "--knobs",
        nargs="*",
        default=None,
        help="only these knobs (stage names, exp_model, accumulation, scale, normalise, "
        "algorithm; default all)",
    )
    ca.set_defaults(func=cmd_calibrate)
    return p


def _add_kernel_flags(parser, *, heads: str = "2", n: str = "512") -> None:
    parser.add_argument("--kernel", required=True, help="kernel name (see 'fa-jax kernels')")
    parser.add_argument("--format", default="bf16", help="a format the kernel runs: bf16, fp16")
    parser.add_argument("--batch", default="1", help="batch size B")
    parser.add_argument("--heads", default=heads, help=f"heads H (default {heads})")
    parser.add_argument("--n", default=n, help=f"sequence length N (default {n})")
    parser.add_argument("--d", default="64", help="head dimension d")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seeds", nargs="*", default=["0"], help="input seeds")


def _add_run_flags(parser) -> None:
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="neither load nor store compiled programs (default cache: $FA_JAX_CACHE_DIR, "
        "else ~/.cache/fa_jax)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print compile (or cache load) and run seconds per program at the end",
    )
    parser.add_argument(
        "--carrier",
        choices=("float64", "float32"),
        default="float64",
        help="what the flash runs compute on (the same bits; float32 holds no 64-bit type; "
        "the FP64 golden and the baselines stay float64)",
    )


def _add_cluster_flags(parser) -> None:
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="several processes (jax.distributed): process 0's host and a free port; "
        "every process runs the same command (default: none, or what JAX detects "
        "under SLURM, Open MPI, a TPU pod or JAX_COORDINATOR_ADDRESS)",
    )
    parser.add_argument(
        "--num-processes", default=None, metavar="P", help="with --coordinator: how many"
    )
    parser.add_argument(
        "--process-id", default=None, metavar="I", help="with --coordinator: this one, 0 .. P-1"
    )


@contextlib.contextmanager
def _run_options(args):
    """The sweep options of ``--no-cache``, ``--profile`` and ``--carrier``; the
    profile's table goes to standard error when the command ends, interrupted or not."""
    if not hasattr(args, "no_cache"):
        yield
        return
    profile = Profile() if args.profile else None
    try:
        with study_options(cache=not args.no_cache, profile=profile, carrier=args.carrier):
            yield
    finally:
        if profile is not None:
            print(profile.table(), file=sys.stderr)


INTERRUPTED = "interrupted; run the same command to resume"


def _stops_between_groups(args) -> bool:
    """Whether the command's work is sweeps, which check for Ctrl-C between groups."""
    return args.command == "sweep" or (
        args.command == "reproduce" and args.figure not in ("fig8", "fa3-table")
    )


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # A sweep honours Ctrl-C between groups, after writing its rows (never inside
        # an XLA compile); elsewhere Ctrl-C raises at once.  Either way: one line.
        cooperative = _stops_between_groups(args)
        with deferred_interrupts(INTERRUPTED) if cooperative else contextlib.nullcontext():
            with _run_options(args):
                return args.func(args)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except ProcessFailed as err:  # another process of a multi-process run stopped
        print(f"fa-jax {args.command}: {err}; run the same command to resume", file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError, NotImplementedError) as err:
        # NotImplementedError: a kernel's model refusing a shape it does not cover.
        print(f"fa-jax {args.command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `fa-jax formats | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
