"""The CPU lab: run a Python script as an AVX2 CPU on any host, so that a real
kernel's AVX2 code judges its model on AVX2 and AVX-512 hosts alike.

Natively where this host is an AVX2 CPU; on an AVX-512 host under qemu-user
(``qemu-x86_64 -cpu Haswell``: QEMU's TCG emulates AVX2, FMA and F16C but no
AVX-512, and the program's CPUID reads as a Haswell's).  A test that needs the
lab skips, saying why, where neither is possible (a CPU below AVX2, qemu-user
not installed).  ``FA_JAX_LAB=qemu`` runs it under qemu-user on an AVX2 host too
(to check qemu against the CPU, or to time the lab as an AVX-512 host runs it).
Instructions whose results differ between CPU makers
(RCPPS, RSQRTPS) are not faithful under qemu: a kernel path using them is not
for the lab.
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
        return [sys.executable]
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
