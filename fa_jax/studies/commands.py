"""The ``fa-jax`` command's subcommands: what each does with its parsed flags.

One ``cmd_<name>(args) -> int`` per subcommand (``formats``, ``round``,
``sweep``, ``reproduce``, ``merge``, ``attribute``, ``kernels``, ``validate``,
``calibrate``), ``args`` the namespace :func:`fa_jax.cli.build_parser` parses
(any object with those attributes), the return value the exit status; and the
checks that turn a flag's text into the library's values (lists, integers,
seeds, tiles ``BRxBC`` or ``sramM``, policies and ``kernel:NAME`` entries, a
``HOST:PORT`` coordinator, features), each error a ``ValueError`` that names
the flag.  :mod:`fa_jax.cli` parses the arguments (the only module that does),
prints these errors as one line and maps them to exit status 2.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

from fa_jax._checks import non_negative_int, one_of, positive_int
from fa_jax.formats import get_format, registered_formats
from fa_jax.presets import PRESETS
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.sweep.grid import KERNEL_PREFIX
from fa_jax.studies.table import print_table

__all__ = [
    "MAX_SEED",
    "cmd_attribute",
    "cmd_calibrate",
    "cmd_formats",
    "cmd_kernels",
    "cmd_merge",
    "cmd_reproduce",
    "cmd_round",
    "cmd_sweep",
    "cmd_validate",
    "validation_features",
]


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

    if args.recording is not None:  # the model against a recording: no real kernel runs
        from fa_jax.studies.recorded import format_recorded, validate_recording

        recorded = validate_recording(args.kernel, args.recording)
        print(json.dumps(recorded.to_dict(), indent=1) if args.json else format_recorded(recorded))
        return 0
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
            features=validation_features(args),
        )
    print(json.dumps(result.to_dict(), indent=1) if args.json else format_validation(result))
    if args.profile:
        print(profile.table(time.perf_counter() - start), file=sys.stderr)
    return 0


def validation_features(args):
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
