"""How far the GPU's approximate exp2 and tanh are from correctly rounded, on every float32.

FlashAttention-2/3's CUDA kernels take the softmax exponential as ``exp2f`` compiled to
PTX ``ex2.approx.ftz.f32`` (and the softcap's tanh, in FA3, as ``tanh.approx.f32``);
fa_jax stands a correctly rounded exp2 (and tanh) in for them (docs/fidelity.md).  This
script measures, over every float32 bit pattern x (NaN excluded), the distance in units
in the last place between the instruction's result and the correctly rounded one, and
prints a histogram per input range:

* ``ex2.approx.ftz.f32``: against RN(2^x), RN the float32 rounding of the float64
  ``exp2`` (within 1 ulp of float64, so RN is the correctly rounded value except where
  2^x lies within 2^-52 relative of a float32 midpoint; such inputs are counted apart);
  a flushed result (an RN(2^x) that is subnormal, read as 0) is counted apart too.
* ``tanh.approx.f32``: likewise against RN(tanh x).

Needs a CUDA GPU and CuPy (which compiles the probe with NVRTC); prints the device and
the driver.  Results: docs/fidelity.md.

    python experiments/gpu_approx_probe.py
"""

from __future__ import annotations

import argparse
import datetime
import sys

import numpy as np

_SOURCE = r"""
extern "C" __device__ float approx(float x) {
    float y;
#if OP == 0
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
#else
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
#endif
    return y;
}

extern "C" __device__ double exact(double x) {
#if OP == 0
    return exp2(x);
#else
    return tanh(x);
#endif
}

// hist[range][bin], ranges: 0 x < -1, 1 -1 <= x < 0, 2 0 <= x < 1, 3 x >= 1;
// bins: 0..3 ulps, 4 more, 5 flushed subnormal, 6 near a midpoint, 7 non-finite mismatch.
extern "C" __global__ void probe(unsigned long long first, unsigned long long count,
                                 unsigned long long* hist, int* worst) {
    unsigned long long i = first + blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i >= first + count) return;
    unsigned int bits = (unsigned int)i;
    float x = __uint_as_float(bits);
    if (isnan(x)) return;
    int range = x < -1.0f ? 0 : (x < 0.0f ? 1 : (x < 1.0f ? 2 : 3));
    double e = exact((double)x);
    float r = (float)e;
    float a = approx(x);
    int bin;
    if (__float_as_uint(a) == __float_as_uint(r)) {
        bin = 0;
    } else if (isinf(r) || isinf(a) || isnan(a)) {
        bin = 7;
    } else if (r != 0.0f && fabsf(r) < 1.17549435e-38f && a == 0.0f) {
        bin = 5;
    } else {
        float inf = __int_as_float(0x7f800000);
        float lo = nextafterf(r, -inf), hi = nextafterf(r, inf);
        double mlo = 0.5 * ((double)lo + (double)r), mhi = 0.5 * ((double)hi + (double)r);
        double tol = fabs(e) * 2.220446049250313e-16;
        if (fabs(e - mlo) <= tol || fabs(e - mhi) <= tol) {
            bin = 6;
        } else {
            int ia = (int)__float_as_uint(a), ir = (int)__float_as_uint(r);
            if ((ia < 0) != (ir < 0)) {
                bin = 4;
            } else {
                int d = abs(ia - ir);
                bin = d > 3 ? 4 : d;
                atomicMax(&worst[range], d);
            }
        }
    }
    atomicAdd(&hist[range * 8 + bin], 1ULL);
}
"""

_RANGES = ("x < -1", "-1 <= x < 0", "0 <= x < 1", "x >= 1")
_BINS = ("0 ulp", "1 ulp", "2 ulp", "3 ulp", ">3 ulp", "flushed", "near mid", "non-finite")


def _histogram(cp, op: int):
    kernel = cp.RawKernel(_SOURCE, "probe", options=(f"-DOP={op}",))
    hist = cp.zeros(32, dtype=cp.uint64)
    worst = cp.zeros(4, dtype=cp.int32)
    threads, chunk = 256, 1 << 30
    for first in range(0, 1 << 32, chunk):
        kernel(
            ((chunk + threads - 1) // threads,),
            (threads,),
            (np.uint64(first), np.uint64(chunk), hist, worst),
        )
    cp.cuda.Device().synchronize()
    return hist.get().reshape(4, 8), worst.get()


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    argparse.ArgumentParser(description=doc.split("\n\n")[0]).parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("needs CuPy and a CUDA GPU")
        return 2
    props = cp.cuda.runtime.getDeviceProperties(0)
    rt = cp.cuda.runtime
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print("command: python experiments/gpu_approx_probe.py")
    print(
        f"device: {props['name'].decode()}, compute capability {props['major']}.{props['minor']}; "
        f"driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}"
    )
    for op, name in enumerate(("ex2.approx.ftz.f32 vs RN(2^x)", "tanh.approx.f32 vs RN(tanh x)")):
        hist, worst = _histogram(cp, op)
        print(f"\n{name}: inputs per range and ulp distance (every float32 but NaN)")
        print(f"{'range':>14} " + " ".join(f"{b:>12}" for b in _BINS) + f" {'max ulp':>8}")
        for r, label in enumerate(_RANGES):
            total = hist[r].sum()
            cells = " ".join(f"{int(c):>12}" for c in hist[r])
            print(f"{label:>14} {cells} {int(worst[r]):>8}   (of {int(total)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
