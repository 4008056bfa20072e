"""fa_jax.kernels.x86.cpu: the CPU's features read with CPUID (masked by XCR0), as the
kernels' libraries read them, and the ISA class a refusal names."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from fa_jax.kernels.x86 import cpu

_NAMED = frozenset(cpu._BITS.values())


@pytest.fixture
def fresh(monkeypatch):
    """cpu's cached readings cleared before and after the test."""
    for fn in (cpu._cpuid_flags, cpu._instructions, cpu.vendor):
        fn.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    for fn in (cpu._cpuid_flags, cpu._instructions, cpu.vendor):
        fn.cache_clear()


def _linux_flags() -> frozenset[str]:
    return frozenset(cpu.cpuinfo().get("flags", "").split())


@pytest.mark.skipif(
    cpu.cpuid(0) is None or not _linux_flags(),
    reason="needs an x86-64 Linux host (CPUID and /proc/cpuinfo) to compare the two",
)
def test_cpuid_agrees_with_linux_on_every_named_feature():
    """Natively, Linux's flags are CPUID's masked by what the kernel saves (XCR0):
    the same names on and off (under qemu-user CPUID is the emulated CPU's, not
    /proc/cpuinfo's, which is why the libraries' CPUID is read)."""
    assert cpu.vendor() == cpu.cpuinfo().get("vendor_id")
    assert cpu.flags() & _NAMED == _linux_flags() & _NAMED


def _fake(regs: dict, xcr0: int):
    """(cpuid, xgetbv) answering ``regs[(leaf, subleaf)]`` (zeros elsewhere)."""

    def read(leaf, subleaf=0):
        return regs.get((leaf, subleaf), (0, 0, 0, 0))

    return read, lambda index: xcr0 if index == 0 else 0


def _bits(*names):
    """CPUID registers with the bits of ``names`` set, and OSXSAVE."""
    regs = {(0, 0): [7, 0, 0, 0], (1, 0): [0, 0, 1 << 27, 0]}
    for (leaf, sub, r, bit), name in cpu._BITS.items():
        if name in names:
            regs.setdefault((leaf, sub), [0, 0, 0, 0])[r] |= 1 << bit
    return {key: tuple(value) for key, value in regs.items()}


_ZEN4 = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
)


@pytest.mark.parametrize(
    ("xcr0", "isa", "kept"),
    [
        (0b1110_0111, "AVX512", set(_ZEN4)),
        # The OS saves YMM but not ZMM: no AVX-512, however CPUID reads.
        (0b0000_0111, "AVX2", {"avx", "avx2", "fma", "f16c"}),
        # No YMM state either: nothing of AVX.
        (0b0000_0011, "SSE", set()),
    ],
)
def test_features_count_only_where_the_os_saves_their_registers(fresh, xcr0, isa, kept):
    fresh.setattr(cpu, "_instructions", lambda: _fake(_bits(*_ZEN4), xcr0))
    assert cpu.flags() & set(_ZEN4) == kept
    assert cpu.isa() == isa


def test_isa_classes(fresh):
    cases = [
        (cpu.AVX512 | {"avx2", "fma", "f16c"}, "AVX512"),
        (frozenset({"avx", "avx2", "fma", "f16c"}), "AVX2"),
        (frozenset({"avx", "avx2"}), "SSE"),  # AVX2 without FMA: no engine's AVX2 code
        (frozenset(), "SSE"),
    ]
    for flags, isa in cases:
        fresh.setattr(cpu, "flags", lambda flags=flags: flags)
        assert cpu.isa() == isa
        assert cpu.describe().startswith(isa)
    assert "no avx512f" in cpu.describe()


def test_flags_fall_back_to_proc_cpuinfo(fresh):
    fresh.setattr(cpu, "_cpuid_flags", lambda: None)
    assert cpu.flags() == _linux_flags()


_QEMU = shutil.which("qemu-x86_64")


@pytest.mark.skipif(_QEMU is None, reason="qemu-user is not installed (apt-get install qemu-user)")
@pytest.mark.parametrize(("model", "isa"), [("Haswell", "AVX2"), ("Nehalem", "SSE")])
def test_an_emulated_cpu_reads_as_itself(model, isa):
    """Under ``qemu-x86_64 -cpu Haswell`` the program sees a Haswell (AVX2, Intel),
    whatever the host: the lab that runs the kernels' AVX2 code on any host.  The
    module is loaded on its own (it needs no jax), so the check takes a second."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('cpu', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.isa(), m.vendor(), 'avx512f' in m.flags())\n"
    )
    assert _QEMU is not None
    done = subprocess.run(
        [_QEMU, "-cpu", model, sys.executable, "-c", code, cpu.__file__],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.split() == [isa, "GenuineIntel", "False"]
