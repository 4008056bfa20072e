"""Record the GPU attention kernels' outputs, so that their models are built and checked on a CPU.

One run on a CUDA GPU (one ``device`` call of a few minutes) writes, compressed, into
``--out``:

* ``<kernel>.npz`` for each of ``torch-cuda-flash``, ``torch-cuda-mem-efficient`` and
  ``cudnn`` (``fa_jax.kernels.real``): every case's output as the format's bits
  (uint16), keyed by the case's name (:func:`cases`); a kernel that refuses a case
  records the refusal instead (``<case>.refused``, the error's text).
* ``ex2.npz``: PTX ``ex2.approx.ftz.f32``, the exp2 of FlashAttention-2/3's softmax,
  on every float32 in (-1, -1/2] (one binade: 2^23 inputs, the structure of the
  instruction's table and interpolation) and on 2^18 float32 drawn uniformly from
  (-126, 0] (``sample_x``, fixed seed): each result as its distance in float32
  units from RN(2^x) (``binade_ulps``, ``sample_ulps``, int8; RN from the float64
  exp2 rounded once: exact unless 2^x is within 2^-52 relative of a float32
  midpoint, which ``*_near_midpoint`` marks).
* ``recording.json``: the GPU, driver, CUDA, cuDNN, PyTorch, JAX and CuPy versions,
  the date, the command, every case's parameters and the SHA-256 of its inputs'
  bits (the inputs are not stored: :func:`inputs` draws them again from the case,
  and a loader checks the digest).

Cases (:func:`cases`), for bf16 and fp16, causal and not, one batch and head:

* ``random``: Q, K, V ~ N(0, 1) rounded to the format, head dims 64, 96, 128 and
  256 at (N, M) = (1, 1), (1, 77), (63, 129), (128, 128), (255, 256), and (513,
  1000) at d = 128: decode and prefill, odd and even, N below and equal to M
  (causal cases square, N = M = the larger: fa_jax.kernels asks where N != M
  how the mask is aligned, which these kernels do not declare);
* ``wide``: scores over about [-40, 40] (Q and K scaled by 2): a row's maximum
  moves across key tiles, so the rescale exp2(m_old - m_new) runs, and small
  exponentials flush;
* ``equal_scores``: every key the same, so every score of a row is equal and P
  is 1 after the max: O is V's column sums over M, and V's columns hold
  order-revealing patterns (a large 2^e at one key, -2^e at another, ones
  elsewhere: the ones added between them are lost or kept by the kernel's
  summation order, Xie et al. 2025, FPRev);
* ``one_key``: M = 1 (P = 1 exactly: O is V rounded through the output path).

``--dry-run`` runs fa_jax's models of the kernels instead (on any machine, with
``--quick`` on a few cases): it checks the script, the files and their sizes,
not the kernels.

    python experiments/record_gpu_kernels.py --out tests/data/gpu          # on a GPU
    python experiments/record_gpu_kernels.py --dry-run --quick --out /tmp/rec
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import shlex
import sys
import time

import ml_dtypes
import numpy as np

from fa_jax import kernels
from fa_jax.formats import get_format
from fa_jax.rounding import round_to

KERNELS = ("torch-cuda-flash", "torch-cuda-mem-efficient", "cudnn")
FORMATS = ("bfloat16", "float16")
HEAD_DIMS = (64, 96, 128, 256)
SHAPES = ((1, 1), (1, 77), (63, 129), (128, 128), (255, 256))
LARGE = (513, 1000, 128)  # (N, M, d): one long prefill
EX2_SAMPLE = 1 << 18
_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One recorded call: its inputs' kind, format, shape and mask."""

    kind: str
    fmt: str
    n: int
    m: int
    d: int
    causal: bool
    seed: int = 0

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.kind}-{self.fmt}-n{self.n}-m{self.m}-d{self.d}-{mask}-s{self.seed}"


def _square(n: int, m: int, causal: bool) -> tuple[int, int]:
    """A causal case's shape: N = M (fa_jax.kernels asks where N != M whether the mask is
    aligned top-left or bottom-right, which these kernels do not declare)."""
    return (max(n, m), max(n, m)) if causal else (n, m)


def cases(quick: bool = False) -> list[Case]:
    """The recorded cases (module docstring); ``quick``: a few small ones."""
    if quick:
        small = (("random", (63, 129)), ("equal_scores", (16, 32)))
        return [
            Case(kind, fmt, *_square(n, m, causal), 64, causal)
            for kind, (n, m) in small
            for fmt in FORMATS
            for causal in (False, True)
        ] + [Case("one_key", "bfloat16", 8, 1, 64, False)]
    out = []
    for fmt in FORMATS:
        for causal in (False, True):
            out += [
                Case("random", fmt, *_square(n, m, causal), d, causal)
                for d in HEAD_DIMS
                for n, m in SHAPES
            ]
            n, m, d = LARGE
            out.append(Case("random", fmt, *_square(n, m, causal), d, causal))
            out += [
                Case("wide", fmt, *_square(n, m, causal), 128, causal)
                for n, m in ((128, 128), (255, 256))
            ]
            out += [
                Case("equal_scores", fmt, *_square(n, m, causal), d, causal)
                for d in (64, 128)
                for n, m in ((64, 64), (63, 129), (128, 512))
            ]
    out += [Case("one_key", fmt, 64, 1, d, False) for fmt in FORMATS for d in (64, 128)]
    return out


def _rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    return np.asarray(round_to(x, get_format(fmt)), np.float64)


@functools.cache
def inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The case's Q (1, N, d), K and V (1, M, d), float64 values exact in its format,
    drawn from ``numpy.random.default_rng([seed, N, M, d])``."""
    rng = np.random.default_rng([case.seed, case.n, case.m, case.d])
    q, k, v = (rng.standard_normal((1, s, case.d)) for s in (case.n, case.m, case.m))
    if case.kind == "wide":
        q, k = 2.0 * q, 2.0 * k
    if case.kind == "equal_scores":
        k = np.broadcast_to(k[:, :1], k.shape).copy()
        big = (
            24.0 if case.fmt == "bfloat16" else 15.0
        )  # 2^24 absorbs fp32's ones; fp16's max is 2^15
        v = np.ones_like(v)
        cols = np.arange(case.d)
        v[0, cols % case.m, cols] = 2.0**big
        v[0, (cols * 7 + 3) % case.m, cols] -= 2.0**big  # -2^big once rounded; 0 on one key
    q, k, v = (_rounded(t, case.fmt) for t in (q, k, v))
    return q, k, v


def digest(arrays) -> str:
    """SHA-256 of the arrays' float64 bits, in order."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, np.float64).tobytes())
    return h.hexdigest()


def _bits(out: np.ndarray, fmt: str) -> np.ndarray:
    """The output's values as the format's bits (it must hold them exactly)."""
    narrow = np.asarray(out, np.float64).astype(_DTYPES[fmt])
    if not np.array_equal(narrow.astype(np.float64), out, equal_nan=True):
        raise ValueError(f"record: expected outputs exact in {fmt}, got values that are not")
    return narrow.view(np.uint16)


def record_kernel(name: str, run_cases: list[Case], call) -> dict[str, np.ndarray]:
    """Every case's output bits from ``call(name, q, k, v, fmt=, causal=)``, or its refusal."""
    arrays: dict[str, np.ndarray] = {}
    for case in run_cases:
        q, k, v = inputs(case)
        try:
            out = call(name, q, k, v, fmt=case.fmt, causal=case.causal)
        except (NotImplementedError, ValueError, RuntimeError) as err:
            arrays[f"{case.name}.refused"] = np.array(f"{type(err).__name__}: {err}")
            continue
        arrays[case.name] = _bits(out, case.fmt)
    return arrays


# -- ex2.approx.ftz.f32 -----------------------------------------------------------------

_EX2 = r"""
extern "C" __global__ void ex2(const float* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x[i])); y[i] = r; }
}
"""


def ex2_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Every float32 in (-1, -1/2], and the fixed sample of (-126, 0]."""
    binade = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0xBF000000)).view(
        np.float32
    )  # (-1, -1/2]
    rng = np.random.default_rng(2026)
    sample = (-rng.uniform(0.0, 126.0, EX2_SAMPLE)).astype(np.float32)
    return binade, sample


def ulps_from_rounded(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y - RN(2^x) in float32 units as int8, where 2^x is near a float32 midpoint)."""
    exact = np.exp2(x.astype(np.float64))
    rn = exact.astype(np.float32)
    d = y.view(np.int32).astype(np.int64) - rn.view(np.int32).astype(np.int64)
    if np.abs(d).max(initial=0) > 127:
        raise ValueError(
            f"ex2: expected results within 127 units of RN(2^x), got {np.abs(d).max()}"
        )
    up = np.nextafter(rn, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(rn, np.float32(0)).astype(np.float64)
    mids = np.stack([(rn + up) / 2, (rn + down) / 2])
    near = np.asarray((np.abs(exact - mids) <= np.abs(exact) * 2.0**-52).any(axis=0))
    return d.astype(np.int8), near


def record_ex2(device_ex2) -> dict[str, np.ndarray]:
    """``ex2.npz``'s arrays from ``device_ex2(x) -> y`` (float32 arrays)."""
    binade, sample = ex2_inputs()
    out = {"sample_x": sample}
    for name, x in (("binade", binade), ("sample", sample)):
        ulps, near = ulps_from_rounded(x, device_ex2(x))
        out[f"{name}_ulps"], out[f"{name}_near_midpoint"] = ulps, np.flatnonzero(near)
    return out


def _gpu_ex2():
    import cupy as cp  # pyright: ignore[reportMissingImports]

    kernel = cp.RawKernel(_EX2, "ex2")

    def run(x: np.ndarray) -> np.ndarray:
        x_d = cp.asarray(x)
        y_d = cp.empty_like(x_d)
        threads = 256
        kernel(((x.size + threads - 1) // threads,), (threads,), (x_d, y_d, np.uint64(x.size)))
        return cp.asnumpy(y_d)

    return run


def _rounded_ex2(x: np.ndarray) -> np.ndarray:
    """The dry run's stand-in: RN(2^x), flushed below float32's normals."""
    y = np.exp2(x.astype(np.float64)).astype(np.float32)
    return np.where(np.abs(y) < np.finfo(np.float32).tiny, np.float32(0), y)


# -- the run ---------------------------------------------------------------------------


def _versions(dry_run: bool) -> dict:
    import importlib.metadata as md
    import platform

    facts = {"python": platform.python_version(), "dry_run": dry_run}
    for package in ("numpy", "jax", "jaxlib", "torch", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            facts[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    for name in KERNELS:
        try:
            facts[name] = kernels.get(name).platform()
        except RuntimeError as err:  # not available here: the dry run's case
            facts[name] = str(err)
    try:
        import torch

        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            facts["torch_cuda"] = str(torch.version.cuda)
            facts["cudnn"] = str(torch.backends.cudnn.version())
    except ImportError:
        pass
    try:
        import cupy as cp  # pyright: ignore[reportMissingImports]

        facts["driver"] = cp.cuda.runtime.driverGetVersion()
        facts["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
    except ImportError:
        pass
    return facts


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for the files")
    ap.add_argument("--dry-run", action="store_true", help="fa_jax's models stand in (any machine)")
    ap.add_argument("--quick", action="store_true", help="a few small cases")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--no-ex2", action="store_true", help="skip ex2.approx")
    args = ap.parse_args(argv)
    if not args.dry_run:
        missing = []
        for name in args.kernels:
            try:
                kernels.get(name)
            except RuntimeError as err:  # not available here, and why
                missing.append(str(err))
        if missing:
            print(f"record: cannot run: {'; '.join(missing)} (--dry-run checks the script)")
            return 2
    call = kernels.emulate if args.dry_run else kernels.real
    args.out.mkdir(parents=True, exist_ok=True)
    run_cases = cases(args.quick)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", "experiments/record_gpu_kernels.py", *(argv or sys.argv[1:])]
        ),
        "versions": _versions(args.dry_run),
        "cases": {
            c.name: {**dataclasses.asdict(c), "inputs_sha256": digest(inputs(c))} for c in run_cases
        },
        "seconds": {},
    }
    for name in args.kernels:
        start = time.perf_counter()
        arrays = record_kernel(name, run_cases, call)
        np.savez_compressed(args.out / f"{name}.npz", **arrays)  # pyright: ignore[reportArgumentType]
        meta["seconds"][name] = round(time.perf_counter() - start, 2)
        refused = sum(key.endswith(".refused") for key in arrays)
        print(
            f"{name}: {len(arrays) - refused} cases, {refused} refused, {meta['seconds'][name]} s"
        )
    if not args.no_ex2:
        start = time.perf_counter()
        arrays = record_ex2(_rounded_ex2 if args.dry_run else _gpu_ex2())
        np.savez_compressed(args.out / "ex2.npz", **arrays)  # pyright: ignore[reportArgumentType]
        meta["seconds"]["ex2"] = round(time.perf_counter() - start, 2)
        differ = {k: float(np.mean(arrays[k] != 0)) for k in ("binade_ulps", "sample_ulps")}
        print(f"ex2: share differing from RN(2^x): {differ}")
    (args.out / "recording.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(f"files: {sizes}, {sum(sizes.values()) / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
