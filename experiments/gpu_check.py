"""fa_jax on an accelerator: bit identity with the CPU, and sweep and attention timings.

Three checks, in one run, on the chosen device (``jax.devices()[0]``, or
``--device gpu|cpu|tpu``) with ``jax_enable_x64`` on:

1. ``round_to`` bit for bit: every registered format that fits a float64
   carrier, every rounding mode (stochastic with a fixed key), on a fixed float64
   array holding random values across the format's range and beyond, the
   format's midpoints (ties), its max, tiny and smallest subnormal and the
   midpoints beside them, float64 subnormals and extremes, ±inf, NaN and ±0 —
   the accelerator's results against the CPU's, as uint64 bit patterns.
2. Attention bit for bit: ``reference_attention`` and ``flash_attention`` (every
   variant) under every preset with bf16, fp16 and e4m3fn, and under golden;
   causal and not; forward O and lse, and the backward (``jax.vjp`` with unit
   cotangents, the gradient of the sum of O and lse) dQ, dK, dV; B=1, H=2, N=96,
   d=32, Blocks(32, 32).  The emulation rounds with integer operations on bit
   patterns, so the two devices should agree exactly; a difference points at an
   operation XLA evaluates differently there (a float64 dot or reduction order,
   a transcendental).
3. Timing, side by side in this run, first call (compiles included) and second
   call separately: ``run_sweep`` on experiments/bench_sweep.py's default grid
   against that script's numpy + ml_dtypes loop, and emulated ``flash_attention``
   under ``fa2_kernel(BF16)`` (exact and sequential accumulation) against
   experiments/bench_attention.py's native float32 attention.  The sweep's
   persistent compilation cache points at a fresh folder, so its first call
   compiles.

Each bit-identity case prints its elements, the share of identical float64 bit
patterns (it should be 100%) and the largest |difference|.  The exit status is 0
when every case is identical, 1 otherwise (the differing cases are listed last).

    python experiments/gpu_check.py                  # on the default device
    python experiments/gpu_check.py --skip-timing    # bit identity only
    python experiments/gpu_check.py --quick          # tiny sizes, a few cases

``--quick`` rounds to five formats (one per kind of special values, and TF32),
and runs each preset and each attention function once, with gradients for the
reference and fa2 only (the flash variants share FlashAttention-2's backward).

On a CPU-only machine both sides are the CPU, which checks the script itself.
Results: see docs/performance.md.
"""

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import os
import pathlib
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fa_jax import (
    BF16,
    E2M1FN,
    E4M3FN,
    E4M3FNUZ,
    EXACT,
    PRESETS,
    ROUNDING_MODES,
    SEQUENTIAL,
    TF32,
    Blocks,
    Format,
    Policy,
    fa2_kernel,
    flash_attention,
    golden,
    make_inputs,
    reference_attention,
    registered_formats,
    round_to,
)
from fa_jax._x64 import float64_enabled
from fa_jax.attention import VARIANTS

ATTENTION_FORMATS = ("bf16", "fp16", "e4m3fn")
# --quick: one format per kind of special values, and the one without a dtype.
QUICK_ROUNDING_FORMATS = (BF16, E4M3FN, E4M3FNUZ, E2M1FN, TF32)
OUTPUTS = ("O", "lse", "dQ", "dK", "dV")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One case's float64 results on the two devices, compared bit for bit."""

    case: str
    elements: int
    identical: int
    max_abs_diff: float  # over the differing elements; inf where one is not finite

    @property
    def ok(self) -> bool:
        return self.identical == self.elements

    @property
    def identical_pct(self) -> float:
        return 100.0 * self.identical / self.elements if self.elements else 100.0


def compare(case: str, a, b) -> Comparison:
    """Compare two float64 arrays by their bit patterns (so -0 differs from +0 and
    NaN payloads count)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"compare {case}: expected equal shapes, got {a.shape} and {b.shape}")
    same = a.view(np.uint64) == b.view(np.uint64)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a[~same] - b[~same])
    diff = np.where(np.isfinite(diff), diff, np.inf)
    return Comparison(case, int(a.size), int(same.sum()), float(diff.max()) if diff.size else 0.0)


# -- running one program on a device ------------------------------------------------------


def resolve_device(name: str | None):
    """``jax.devices()[0]``, or the first device of platform ``name``."""
    if name is None:
        return jax.devices()[0]
    try:
        return jax.devices(name)[0]
    except RuntimeError as e:
        raise SystemExit(
            f"gpu_check: --device {name}: expected an available platform ({e})"
        ) from None


def run_on(device, fn: Callable, *args):
    """``fn(*args)`` with the inputs placed on ``device`` (jit follows committed
    inputs); the results as numpy arrays, checked to have been computed there."""
    with jax.default_device(device):
        out = jax.block_until_ready(fn(*jax.device_put(args, device)))
    for leaf in jax.tree.leaves(out):
        if leaf.devices() != {device}:
            raise RuntimeError(f"expected the result on {device}, got it on {leaf.devices()}")
    return jax.tree.map(np.asarray, out)


def check(case: str, device, reference, fn: Callable, *args, outputs=()) -> list[Comparison]:
    """``fn`` on ``device`` and on ``reference``, compared; ``outputs`` names the
    elements of a tuple result (cases "case name")."""
    got, want = run_on(device, fn, *args), run_on(reference, fn, *args)
    if outputs:
        return [compare(f"{case} {n}", g, w) for n, g, w in zip(outputs, got, want, strict=True)]
    return [compare(case, got, want)]


# -- 1. rounding --------------------------------------------------------------------------


def rounding_inputs(fmt: Format, size: int, seed: int = 0) -> np.ndarray:
    """Float64 inputs for ``fmt``: random values over its range and past both ends,
    its midpoints, its extremes and the midpoints beside them, and float64 specials."""
    rng = np.random.default_rng(seed)
    sign = rng.choice([-1.0, 1.0], size)
    exps = rng.integers(fmt.min_exponent - 4, fmt.emax + 3, size)
    with np.errstate(over="ignore"):
        values = sign * np.ldexp(rng.uniform(0.5, 1.0, size), exps)
        e = np.frexp(values)[1] - 1
        quantum = np.ldexp(1.0, np.maximum(e, fmt.emin) - fmt.man_bits)
        midpoints = (np.floor(values / quantum) + 0.5) * quantum
    half_ulp = 2.0 ** -(fmt.man_bits + 1)
    s, big = fmt.smallest_subnormal, np.finfo(np.float64)
    edges = [
        fmt.max,
        fmt.max * (1 + half_ulp),
        fmt.tiny,
        fmt.tiny * (1 - half_ulp),
        s,
        s / 2,
        s * 1.5,
        1.0,
        1.0 + half_ulp,
        1.0 + 3 * half_ulp,
        big.max,
        big.tiny,
        big.smallest_subnormal,
        big.tiny / 3,
        np.inf,
        np.nan,
        0.0,
    ]
    edges = np.array(edges + [-x for x in edges], np.float64)
    return np.concatenate([values, midpoints, edges])


def rounding_cases(formats: Sequence[Format], size: int, device, reference):
    for fmt in formats:
        x = rounding_inputs(fmt, size)
        for mode in ROUNDING_MODES:
            case = f"round_to {fmt.name} {mode}"
            if mode == "stochastic":
                key = jax.random.key(0)
                yield from check(case, device, reference, _stochastic(fmt), x, key)
            else:
                yield from check(case, device, reference, _rounding(fmt, mode), x)


def _rounding(fmt: Format, mode):
    return lambda x: round_to(x, fmt, mode)


def _stochastic(fmt: Format):
    return lambda x, key: round_to(x, fmt, "stochastic", key=key)


# -- 2. attention -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    n: int
    d: int
    blocks: Blocks


FULL_SHAPE = AttentionShape(1, 2, 96, 32, Blocks(32, 32))
QUICK_SHAPE = AttentionShape(1, 1, 16, 4, Blocks(8, 8))


def attention_program(
    policy: Policy, variant: str | None, causal: bool, blocks: Blocks, grads: bool = True
):
    """jit of (q, k, v) -> (O, lse, dQ, dK, dV), or (O, lse) without ``grads``:
    ``reference_attention`` when ``variant`` is None, else ``flash_attention``; the
    gradients are the vjp of unit cotangents for O and lse (the gradient of their sum)."""

    def forward(q, k, v):
        if variant is None:
            return reference_attention(q, k, v, policy, causal=causal, return_lse=True)
        return flash_attention(q, k, v, policy, blocks, variant=variant, causal=causal)

    def program(q, k, v):
        # flash_attention's jit wrapper hides its (O, lse) return type
        (o, lse), pullback = jax.vjp(forward, q, k, v)  # pyright: ignore[reportGeneralTypeIssues]
        return (o, lse, *pullback((jnp.ones_like(o), jnp.ones_like(lse))))

    return jax.jit(program if grads else forward)


def attention_configs(formats: Sequence[str], quick: bool):
    """(policy, variant or None, causal, grads): every combination, with gradients.

    With ``quick``, each policy and each function at least once, causal and not
    alternating, and gradients only for the reference and fa2: every flash variant
    shares FlashAttention-2's backward, and each program's compile dominates."""
    policies = [preset(f) for preset in PRESETS.values() for f in formats] + [golden()]
    functions: list[str | None] = [None, *VARIANTS]
    if not quick:
        return [(p, f, c, True) for p in policies for f in functions for c in (False, True)]
    count = max(len(policies), len(functions))
    chosen = [(policies[i % len(policies)], functions[i % len(functions)]) for i in range(count)]
    return [(p, f, i % 2 == 1, f in (None, "fa2")) for i, (p, f) in enumerate(chosen)]


def attention_cases(configs, shape: AttentionShape, device, reference):
    q, k, v = make_inputs(0, shape.n, batch=shape.batch, heads=shape.heads, d=shape.d)
    for policy, variant, causal, grads in configs:
        name = "reference" if variant is None else f"flash/{variant}"
        case = f"{policy.name} {name} {'causal' if causal else 'full'}"
        program = attention_program(policy, variant, causal, shape.blocks, grads)
        outputs = OUTPUTS if grads else OUTPUTS[:2]
        yield from check(case, device, reference, program, q, k, v, outputs=outputs)


# -- the table ----------------------------------------------------------------------------


def print_row(c: Comparison, width: int) -> None:
    pct = "100" if c.ok else f"{min(c.identical_pct, 99.9999):.4f}"
    print(f"{c.case:<{width}}  {c.elements:>9}  {pct:>10}  {c.max_abs_diff:>11.4g}", flush=True)


def print_table(title: str, rows: Iterator[Comparison], width: int) -> list[Comparison]:
    print(f"\n{title}")
    print(f"{'case':<{width}}  {'elements':>9}  {'identical%':>10}  {'max |diff|':>11}")
    done = []
    for c in rows:
        print_row(c, width)
        done.append(c)
    return done


def verdict(comparisons: Sequence[Comparison]) -> int:
    """Print which cases differ; 0 when all are bit-identical, else 1."""
    bad = [c for c in comparisons if not c.ok]
    if not bad:
        print(f"\nbit identity: all {len(comparisons)} cases identical")
        return 0
    print(f"\nbit identity: {len(bad)} of {len(comparisons)} cases NOT identical:")
    for c in bad:
        print(f"  {c.case}: {c.identical_pct:.4f}% identical, max |diff| {c.max_abs_diff:.4g}")
    return 1


# -- 3. timing ----------------------------------------------------------------------------


def load_experiment(name: str):
    """A sibling script of experiments/ as a module (its main is not run)."""
    path = pathlib.Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seconds(fn: Callable, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def cold_warm(fn: Callable, *args) -> tuple[float, float]:
    """Seconds of the first call (compiles included) and of the second."""
    return seconds(fn, *args), seconds(fn, *args)


@contextlib.contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


@dataclasses.dataclass(frozen=True)
class SweepSize:
    """A sweep grid's sizes (paper_uniform, fa2, as experiments/bench_sweep.py)."""

    formats: tuple
    seq_lens: tuple
    blocks: tuple  # (Br, Bc) pairs
    seeds: tuple
    d: int


QUICK_SWEEP = SweepSize(("bfloat16",), (32,), ((16, 16),), (0,), 8)


def time_sweep(device, quick: bool) -> None:
    """``run_sweep`` on ``device`` against experiments/bench_sweep.py's numpy loop."""
    from fa_jax.studies.sweep import Grid, run_sweep

    bench = load_experiment("bench_sweep")
    size = QUICK_SWEEP
    grid = bench.grid_of(bench.DEFAULT)
    if quick:
        grid = Grid(
            formats=size.formats,
            seq_lens=size.seq_lens,
            blocks=tuple(Blocks(br, bc) for br, bc in size.blocks),
            variants=("fa2",),
            policies=("paper_uniform",),
            seeds=size.seeds,
            d=size.d,
        )
    configs = bench.numpy_configs(grid)
    print(
        f"\nsweep: formats {list(grid.formats)}, seq_lens {list(grid.seq_lens)}, blocks "
        f"{[label for label, _ in grid.resolved_blocks()]}, seeds {list(grid.seeds)}, d {grid.d}; "
        f"paper_uniform, fa2; {len(configs)} configurations"
    )
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = pathlib.Path(tmp)
        # a fresh persistent compilation cache: the first call compiles everything
        with environment("FA_JAX_CACHE_DIR", str(out / "xla")), jax.default_device(device):
            sweep = [
                seconds(lambda i=i: run_sweep(grid, out / f"sweep{i}", quiet=True)) for i in (0, 1)
            ]
    loop = [seconds(lambda: bench.run_numpy(grid, configs, recompute=False)) for _ in (0, 1)]
    print(f"{'':<34}{'first call s':>14}{'second call s':>15}")
    print(f"{'fa_jax run_sweep (' + device.platform + ')':<34}{sweep[0]:>14.3f}{sweep[1]:>15.3f}")
    print(f"{'numpy + ml_dtypes loop (host)':<34}{loop[0]:>14.3f}{loop[1]:>15.3f}")
    print(f"{'speedup, numpy / sweep':<34}{loop[0] / sweep[0]:>13.3g}x{loop[1] / sweep[1]:>14.3g}x")


@dataclasses.dataclass(frozen=True)
class AttentionTiming:
    """Sizes for timing flash_attention: exact accumulation at ``n``, sequential at ``seq_n``."""

    bh: int
    n: int
    seq_n: int
    d: int
    blocks: Blocks


QUICK_ATTENTION = AttentionTiming(2, 64, 64, 16, Blocks(16, 16))
FULL_ATTENTION = AttentionTiming(16, 4096, 1024, 64, Blocks(64, 128))


def time_attention(device, quick: bool) -> None:
    """Emulated ``flash_attention`` against experiments/bench_attention.py's native
    float32 attention, on ``device``."""
    bench = load_experiment("bench_attention")
    size = QUICK_ATTENTION if quick else FULL_ATTENTION
    print(
        f"\nattention: BH={size.bh}, d={size.d}, {size.blocks}; emulated fa2_kernel(bf16) "
        "flash_attention (float64 carriers) vs native float32 attention"
    )
    print(f"{'':<40}{'first call s':>14}{'second call s':>15}{'ratio first':>13}{'second':>9}")
    native = jax.jit(bench.native_attention)
    native_times: dict[int, tuple[float, float]] = {}
    for model, n in (("exact", size.n), ("sequential", size.seq_n)):
        with jax.default_device(device):
            q32, k32, v32 = jax.device_put(bench.inputs(size.bh, n, size.d, jnp.float32), device)
            q, k, v = (x.astype(jnp.float64) for x in (q32, k32, v32))
            if n not in native_times:
                native_times[n] = cold_warm(native, q32, k32, v32)
                label = f"N={n} native float32"
                print(f"{label:<40}{native_times[n][0]:>14.3f}{native_times[n][1]:>15.3f}")
            policy = fa2_kernel(BF16, accumulation=EXACT if model == "exact" else SEQUENTIAL)
            emulated = jax.jit(
                lambda q, k, v, p=policy: flash_attention(q, k, v, p, size.blocks)[0]  # pyright: ignore[reportIndexIssue]
            )
            t = cold_warm(emulated, q, k, v)
        r = (t[0] / native_times[n][0], t[1] / native_times[n][1])
        label = f"N={n} flash fa2_kernel(bf16) {model}"
        print(f"{label:<40}{t[0]:>14.3f}{t[1]:>15.3f}{r[0]:>12.3g}x{r[1]:>8.3g}x")


# -- main ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument(
        "--device",
        choices=("gpu", "cpu", "tpu"),
        default=None,
        help="platform to check against the CPU (default: jax.devices()[0])",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes; five formats; each preset and attention function once",
    )
    p.add_argument("--skip-timing", action="store_true", help="bit identity only (parts 1, 2)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)

    device = resolve_device(args.device)
    reference = jax.devices("cpu")[0]
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"command: {shlex.join(['python', 'experiments/gpu_check.py', *argv])}")
    print(
        f"jax {jax.__version__}; jax.devices()[0]: {jax.devices()[0].device_kind}; "
        f"checked: {device} ({device.device_kind}) against {reference} ({reference.device_kind})"
    )
    with float64_enabled():
        formats = QUICK_ROUNDING_FORMATS if args.quick else registered_formats()
        formats = [f for f in formats if f.fits(np.float64)]
        shape = QUICK_SHAPE if args.quick else FULL_SHAPE
        configs = attention_configs(
            ATTENTION_FORMATS[:1] if args.quick else ATTENTION_FORMATS, args.quick
        )
        width = 62
        results = print_table(
            "1. round_to, accelerator vs CPU",
            rounding_cases(formats, 64 if args.quick else 4096, device, reference),
            width,
        )
        results += print_table(
            f"2. attention, accelerator vs CPU (B={shape.batch}, H={shape.heads}, N={shape.n}, "
            f"d={shape.d}, {shape.blocks})",
            attention_cases(configs, shape, device, reference),
            width,
        )
        if not args.skip_timing:
            print("\n3. timing")
            time_sweep(device, args.quick)
            time_attention(device, args.quick)
    return verdict(results)


if __name__ == "__main__":
    raise SystemExit(main())
