"""What this host is, for tests that assert a fact of one CPU or one library build.

A test asserts the property (a revealed order reproduces the real kernel bit
for bit) on every host; a fact that belongs to one CPU (which order OpenBLAS's
kernel for this core uses) only where :func:`cpu_flags` or
:func:`openblas_core` detected that CPU, and skips it with a reason elsewhere.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import numpy as np

from fa_jax.kernels.x86 import cpu


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernels' libraries read them (CPUID)."""
    return cpu.flags()


def vendor() -> str:
    """The CPU's vendor ("AuthenticAMD", "GenuineIntel"; "" where unknown): MKL, which
    PyTorch's GEMMs call, picks its kernels by vendor as well as by ISA."""
    return cpu.vendor()


def amd() -> bool:
    """Whether this CPU is AMD's: the GEMM and Eigen orders that some kernel tests
    pin were measured on AMD EPYCs, and Intel CPUs run other BLAS kernels."""
    return vendor() == "AuthenticAMD"


def isa() -> str:
    """ "avx512" (F, BW, VL and DQ: what ATen's and YNNPACK's AVX-512 kernels need),
    "avx2" (with FMA and F16C), else "other": :func:`fa_jax.kernels.x86.cpu.isa`."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(cpu.isa(), "other")


@functools.cache
def openblas_core() -> str | None:
    """The core OpenBLAS picked for NumPy's BLAS here (e.g. "Haswell", "Zen",
    "SkylakeX"), read from the library NumPy loaded; None where it is not OpenBLAS."""
    libs = pathlib.Path(np.__file__).parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")):
        lib = ctypes.CDLL(str(path))
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return None
