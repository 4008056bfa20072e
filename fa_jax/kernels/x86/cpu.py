"""This CPU as the real kernels' libraries see it: its vendor and its instruction-set
features read with the CPUID instruction, as MLAS, oneDNN, MKL, YNNPACK, LLVM (XLA's
target) and PyTorch's cpuinfo read them, and its ISA class (:func:`isa`).

CPUID, not ``/proc/cpuinfo``: under ``qemu-x86_64 -cpu Haswell`` the program sees
the emulated CPU's CPUID while ``/proc/cpuinfo`` is still the host's, and it is
CPUID that picks the libraries' code.  A feature counts only where the operating
system saves its registers (XGETBV's XCR0: YMM for AVX, opmask and ZMM for
AVX-512, tile data for AMX), as every dispatcher above checks.  The flags keep
Linux's names (Intel SDM Vol. 2A, CPUID; Vol. 1 §13.3 for XCR0).  Off x86-64
Linux, or where executable memory is refused, :func:`flags` falls back to
``/proc/cpuinfo`` (empty where there is none).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import platform as _platform

__all__ = ["AVX512", "ISAS", "cpuid", "cpuinfo", "describe", "flags", "isa", "vendor"]

# cpuid(leaf, subleaf, out[4]) and xgetbv(index), x86-64 System V: leaf in edi,
# subleaf in esi, out in rdx; rbx (callee-saved) kept.
_CPUID_CODE = bytes.fromhex(
    "53"  # push rbx
    "89f8"  # mov eax, edi
    "89f1"  # mov ecx, esi
    "4989d0"  # mov r8, rdx
    "0fa2"  # cpuid
    "418900"  # mov [r8], eax
    "41895804"  # mov [r8 + 4], ebx
    "41894808"  # mov [r8 + 8], ecx
    "4189500c"  # mov [r8 + 12], edx
    "5b"  # pop rbx
    "c3"  # ret
)
_XGETBV_CODE = bytes.fromhex(
    "89f9"  # mov ecx, edi
    "0f01d0"  # xgetbv
    "48c1e220"  # shl rdx, 32
    "4809d0"  # or rax, rdx
    "c3"  # ret
)

# (leaf, subleaf, register index in (eax, ebx, ecx, edx), bit) -> Linux's flag name.
_BITS = {
    (1, 0, 3, 25): "sse",
    (1, 0, 3, 26): "sse2",
    (1, 0, 2, 0): "pni",
    (1, 0, 2, 9): "ssse3",
    (1, 0, 2, 12): "fma",
    (1, 0, 2, 19): "sse4_1",
    (1, 0, 2, 20): "sse4_2",
    (1, 0, 2, 28): "avx",
    (1, 0, 2, 29): "f16c",
    (7, 0, 1, 5): "avx2",
    (7, 0, 1, 16): "avx512f",
    (7, 0, 1, 17): "avx512dq",
    (7, 0, 1, 21): "avx512ifma",
    (7, 0, 1, 28): "avx512cd",
    (7, 0, 1, 30): "avx512bw",
    (7, 0, 1, 31): "avx512vl",
    (7, 0, 2, 1): "avx512vbmi",
    (7, 0, 2, 11): "avx512_vnni",
    (7, 0, 3, 22): "amx_bf16",
    (7, 0, 3, 23): "avx512_fp16",
    (7, 0, 3, 24): "amx_tile",
    (7, 0, 3, 25): "amx_int8",
    (7, 1, 0, 4): "avx_vnni",
    (7, 1, 0, 5): "avx512_bf16",
    (7, 1, 0, 21): "amx_fp16",
}
# The XCR0 bits (state the OS saves) each group of flags needs.
_XCR0_AVX = 0b110  # SSE and YMM state
_XCR0_AVX512 = 0b1110_0110  # and opmask, ZMM_Hi256, Hi16_ZMM
_XCR0_AMX = 0b11 << 17  # XTILECFG, XTILEDATA
_OSXSAVE = (1, 0, 2, 27)

# AVX-512 as ATen's AVX512 capability, oneDNN's avx512_core and YNNPACK's kernels
# need it: Foundation, Byte/Word, Doubleword/Quadword and Vector Length.
AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
ISAS = ("AVX512", "AVX2", "SSE")  # the classes of :func:`isa`, widest first


_PAGES: list[mmap.mmap] = []  # the functions' pages, mapped for the process's life


def _function(code: bytes, restype, argtypes):
    """``code`` as a C function in a page of its own, mapped executable."""
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    _PAGES.append(page)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


@functools.cache
def _instructions():
    """(cpuid, xgetbv) as callables, or None off x86-64 or where no page may execute."""
    if _platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        raw = _function(
            _CPUID_CODE, None, (ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))
        )
        xgetbv = _function(_XGETBV_CODE, ctypes.c_uint64, (ctypes.c_uint32,))
    except (OSError, ValueError, PermissionError):
        return None

    def cpuid(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
        out = (ctypes.c_uint32 * 4)()
        raw(leaf, subleaf, out)
        return tuple(out)  # pyright: ignore[reportReturnType]

    return cpuid, xgetbv


def cpuid(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int] | None:
    """CPUID's (eax, ebx, ecx, edx) for ``leaf`` and ``subleaf``; None off x86-64."""
    found = _instructions()
    return None if found is None else found[0](leaf, subleaf)


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (empty where there is none):
    the model name a report prints; the features come from :func:`flags`."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


@functools.cache
def _cpuid_flags() -> frozenset[str] | None:
    found = _instructions()
    if found is None:
        return None
    read, xgetbv = found
    top = read(0, 0)[0]
    regs = {}
    for leaf, subleaf in {(leaf, sub) for leaf, sub, _, _ in _BITS}:
        regs[leaf, subleaf] = read(leaf, subleaf) if leaf <= top else (0, 0, 0, 0)
    on = {name for (leaf, sub, r, bit), name in _BITS.items() if regs[leaf, sub][r] >> bit & 1}
    leaf, sub, r, bit = _OSXSAVE
    xcr0 = xgetbv(0) if regs[leaf, sub][r] >> bit & 1 else 0
    if xcr0 & _XCR0_AVX != _XCR0_AVX:  # no YMM state: nothing of AVX is usable
        on -= {"avx", "avx2", "fma", "f16c", "avx_vnni"}
    if xcr0 & _XCR0_AVX512 != _XCR0_AVX512:
        on = {f for f in on if not f.startswith("avx512")}
    if xcr0 & _XCR0_AMX != _XCR0_AMX:
        on = {f for f in on if not f.startswith("amx")}
    return frozenset(on)


def flags() -> frozenset[str]:
    """The CPU's usable features by Linux's names (``avx2``, ``avx512f``,
    ``avx512_bf16``, ``amx_bf16``, ...): CPUID's, else ``/proc/cpuinfo``'s."""
    found = _cpuid_flags()
    if found is not None:
        return found
    return frozenset(cpuinfo().get("flags", "").split())


@functools.cache
def vendor() -> str:
    """The CPU's vendor: ``"GenuineIntel"``, ``"AuthenticAMD"``, ... (``""`` unknown)."""
    regs = cpuid(0)
    if regs is None:
        return cpuinfo().get("vendor_id", "")
    return b"".join(r.to_bytes(4, "little") for r in (regs[1], regs[3], regs[2])).decode(
        "ascii", "replace"
    )


def isa() -> str:
    """This CPU's ISA class: ``"AVX512"`` (:data:`AVX512`), ``"AVX2"`` (AVX2 with FMA
    and F16C), else ``"SSE"`` (x86-64's baseline; any other machine too)."""
    have = flags()
    if AVX512 <= have:
        return "AVX512"
    if {"avx2", "fma", "f16c"} <= have:
        return "AVX2"
    return "SSE"


def describe() -> str:
    """This CPU in a refusal's words: its ISA class, vendor and the vector features
    that tell the classes apart, e.g. ``"AVX2 (AuthenticAMD: avx2 f16c fma; no
    avx512f)"``."""
    have = flags()
    shown = sorted(f for f in have if f.startswith(("avx", "fma", "f16c", "amx")))
    missing = "" if "avx512f" in have else "; no avx512f"
    return f"{isa()} ({vendor() or _platform.machine()}: {' '.join(shown) or 'none'}{missing})"
