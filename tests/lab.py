"""The CPU lab: run a Python script as an AVX2 CPU on an AVX-512 host, so that a
real kernel's AVX2 code judges its model there too.

The script runs under qemu-user (``qemu-x86_64 -cpu Haswell``: QEMU's TCG
emulates AVX2, FMA and F16C but no AVX-512, and the program's CPUID reads as a
Haswell's).  On an AVX2 host the lab skips, saying why: each engine's own tests
judge its AVX2 model there natively; ``FA_JAX_LAB=qemu`` runs it under qemu all
the same (to check qemu against the CPU, or to time the lab as an AVX-512 host
runs it).  It skips too where it cannot run (a CPU below AVX2, qemu-user not
installed).  Instructions whose results differ between CPU makers (RCPPS,
RSQRTPS) are not faithful under qemu: a kernel path using them is not for the
lab.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from fa_jax.kernels.x86 import cpu

QEMU = shutil.which("qemu-x86_64")


def avx2_python() -> list[str]:
    """The command that runs this Python as an AVX2 CPU (skips where none can)."""
    isa = cpu.isa()
    if isa == "AVX2" and os.environ.get("FA_JAX_LAB") != "qemu":
        pytest.skip(
            "this host is an AVX2 CPU: each engine's own tests judge its AVX2 model here, "
            "natively (FA_JAX_LAB=qemu runs the lab under qemu all the same)"
        )
    if isa not in ("AVX2", "AVX512"):
        pytest.skip(f"the AVX2 lab needs an AVX2 or AVX-512 host; this CPU is {cpu.describe()}")
    if QEMU is None:
        pytest.skip(
            f"qemu-user is not installed (apt-get install qemu-user): this {isa} host "
            "cannot run the kernels' AVX2 code under it"
        )
    return [QEMU, "-cpu", "Haswell", sys.executable]


def run_as_avx2(code: str, *args: str, env: dict | None = None, timeout: float = 600) -> str:
    """Run ``python -c code args...`` as an AVX2 CPU; its standard output."""
    done = subprocess.run(
        [*avx2_python(), "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the AVX2 lab's script failed ({done.returncode}):\n{done.stderr}")
    return done.stdout
