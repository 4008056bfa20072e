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
of fa_jax that parses arguments; ``python -m fa_jax`` runs it.  What each
subcommand does with its parsed flags: :mod:`fa_jax.studies.commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import fa_jax
from fa_jax.presets import PRESETS
from fa_jax.rounding import ROUNDING_MODES
from fa_jax.studies import DEFAULT_POLICIES
from fa_jax.studies.commands import (
    cmd_attribute,
    cmd_calibrate,
    cmd_formats,
    cmd_kernels,
    cmd_merge,
    cmd_reproduce,
    cmd_round,
    cmd_sweep,
    cmd_validate,
)
from fa_jax.studies.interrupt import deferred_interrupts
from fa_jax.studies.options import study_options
from fa_jax.studies.profile import Profile
from fa_jax.studies.sweep.cluster import ProcessFailed


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
    va.add_argument(
        "--recording",
        help="a folder recorded by experiments/record_gpu_kernels.py: the model against the "
        "real kernel's recorded outputs (its cases, not the shape flags), on any machine",
    )
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
