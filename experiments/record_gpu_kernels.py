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
  midpoint, which ``*_near_midpoint`` marks; a distance past int8, a flushed
  result say, is kept as its index and result, ``*_far`` and ``*_far_y``).
* ``recording.json``: the GPU, driver, CUDA, cuDNN, PyTorch, JAX and CuPy versions,
  the date, the command, every case's parameters and the SHA-256 of its inputs'
  bits (the inputs are not stored: :func:`inputs` draws them again from the case,
  and a loader checks the digest).

The cases and the recording's layout are :mod:`fa_jax.kernels.recording`'s (120 a
kernel: bf16 and fp16, causal and not, head dims 64–256, odd and even lengths, decode
and prefill, wide scores, equal scores with order-revealing values, one key), and
``fa-jax validate --kernel NAME --recording FOLDER`` judges a model against the
recording on any machine.

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
import pathlib
import shlex
import sys
import time

import numpy as np

from fa_jax import kernels
from fa_jax._x64 import float64_enabled
from fa_jax.formats import FP32
from fa_jax.kernels.recording import Case, cases, digest, inputs, to_bits
from fa_jax.rounding import round_to
from fa_jax.studies.results import write_json

KERNELS = ("torch-cuda-flash", "torch-cuda-mem-efficient", "cudnn")
EX2_SAMPLE = 1 << 18


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
        arrays[case.name] = to_bits(out, case.fmt)
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


def _rn32(exact: np.ndarray) -> np.ndarray:
    """float64 values rounded to nearest float32 (fa_jax's rounding), as float32."""
    with float64_enabled():
        return np.asarray(round_to(exact, FP32)).astype(np.float32)  # exact: FP32 values


def ulps_from_rounded(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y - RN(2^x) in float32 units, where 2^x is near a float32 midpoint)."""
    exact = np.exp2(x.astype(np.float64))
    rn = _rn32(exact)
    d = y.view(np.int32).astype(np.int64) - rn.view(np.int32).astype(np.int64)
    up = np.nextafter(rn, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(rn, np.float32(0)).astype(np.float64)
    mids = np.stack([(rn + up) / 2, (rn + down) / 2])
    near = np.asarray((np.abs(exact - mids) <= np.abs(exact) * 2.0**-52).any(axis=0))
    return d, near


def record_ex2(device_ex2) -> dict[str, np.ndarray]:
    """``ex2.npz``'s arrays from ``device_ex2(x) -> y`` (float32 arrays): the distances
    as int8, and where one does not fit (a flushed result, say) its index and the
    result itself (``*_far``, ``*_far_y``), so that no result is lost."""
    binade, sample = ex2_inputs()
    out = {"sample_x": sample}
    for name, x in (("binade", binade), ("sample", sample)):
        y = device_ex2(x)
        ulps, near = ulps_from_rounded(x, y)
        far = np.flatnonzero(np.abs(ulps) > 127)
        out[f"{name}_ulps"] = np.where(np.abs(ulps) > 127, 0, ulps).astype(np.int8)
        out[f"{name}_far"], out[f"{name}_far_y"] = far, y[far]
        out[f"{name}_near_midpoint"] = np.flatnonzero(near)
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
    y = _rn32(np.exp2(x.astype(np.float64)))
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
    write_json(args.out / "recording.json", meta)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}
    print(f"files: {sizes}, {sum(sizes.values()) / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
